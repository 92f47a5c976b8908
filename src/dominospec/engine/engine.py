"""The batched engine: requests join and leave a running batch of fixed cache slots.

One `step()`:
  1. reap     cancelled requests leave (their slots are freed)
  2. admit    waiting requests claim free slots (lowest first)
  3. prefill  up to `prefill_chunk` prompt tokens, one row at a time, unpadded (a long prompt takes
              several steps, so running rows are never stalled for long); a finished prompt draws
              its first token
  4. decode   proposals for every running row in one proposer call (none for "plain"), the policy's
              verify length per row, ONE ragged target forward over [anchor, d_1..d_k] of every row,
              acceptance per row with that request's own generator, commit, per-row rollback, free
              finished rows

A request's output never depends on the batch: each row's block is causal over its own cache row
only, and every random draw comes from the request's own torch.Generator (in the same order as the
batch-1 loops, so one request through the engine reproduces them).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

import torch

from ..decode.lookup import PromptLookup
from ..decode.proposers import make_proposer
from ..decode.schedule import make_batch_policy
from ..decode.step import SeqState, accept, block_tokens, commit, pad_blocks, rollback_length, start
from ..devices import release_openmp_workers
from ..errors import DominoError
from .memory import check_slots_fit
from .request import EngineFull, EngineRequest, RequestHandle, RequestResult

POLICIES = ("plain", "fixed", "static", "cost")
DEFAULT_MAX_LEN = 2048


class _Row:
    """The engine's record of one admitted request."""

    def __init__(self, handle: RequestHandle, req: EngineRequest, seq: SeqState, submitted: float):
        self.handle, self.req, self.seq = handle, req, seq
        self.slot = -1
        self.prefilled = 0  # prompt tokens already in the target cache
        self.submitted, self.admitted, self.first = submitted, None, None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.seq.prompt) and not self.seq.done


class Engine:
    def __init__(
        self,
        target,
        drafter=None,
        *,
        lookup: bool = False,
        policy: str = "plain",
        block_size: int | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: int | None = None,
        prefill_chunk: int = 512,
        costs=None,
        threshold: float | None = None,
    ):
        if policy not in POLICIES:
            raise DominoError(f"engine policy {policy!r}: choose from {', '.join(POLICIES)}")
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise DominoError(
                f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be >= 1, "
                f"max_queue ({max_queue}) >= 0"
            )
        if policy != "plain" and drafter is None and not lookup:
            raise DominoError(f"engine policy {policy!r} drafts: give a drafter, lookup=True, or both")
        self.target, self.drafter, self.policy_name = target, drafter if policy != "plain" else None, policy
        limit = target.max_positions
        self.max_len = int(max_len or min(limit or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN))
        if limit is not None and self.max_len > limit:
            raise DominoError(f"engine max_len {self.max_len} exceeds the target's context of {limit} positions")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        check_slots_fit(target, self.drafter, max_batch, self.max_len)  # before allocating: say what fits
        self.cache = target.new_row_cache(max_batch, self.max_len)  # DominoError off the native backend
        self.use_lookup = lookup and policy != "plain"
        self.proposer = None
        self.block_size = 0
        if policy != "plain":
            self.proposer = make_proposer(
                self.drafter,
                self.use_lookup,
                block_size,
                max_batch,
                self.max_len,
                vocab_size=target.vocab_size,
                device=target.device,
            )
            self.block_size = self.proposer.block_size
        if self.max_len < self.block_size + 3:  # a prompt token, the anchor, the drafts and one more
            raise DominoError(
                f"engine max_len {self.max_len} leaves no room for a request: a cycle needs a prompt token, the "
                f"anchor and {self.block_size} draft positions ({self.block_size + 3} positions at least)"
            )
        self.policy = (
            make_batch_policy(policy, self.drafter, target, self.block_size, costs, self.use_lookup, threshold)
            if policy != "plain"
            else None
        )
        self.layers = self.drafter.config.target_layer_ids if self.drafter is not None else None

        self._lock = threading.Condition()
        self._step_lock = threading.Lock()
        self._queue: deque[_Row] = deque()
        self._rows: list[_Row | None] = [None] * max_batch  # slot -> row
        self._ids = itertools.count(1)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats = {"steps": 0, "tokens_out": 0, "requests_finished": 0, "cycles": 0, "committed": 0}
        self._stats["draft_skipped"] = 0  # steps the cost policy ran without a drafter pass
        self._accept_by_position = [0] * self.block_size
        self._verified_total = 0

    # ----- the caller's side -----
    def submit(self, req: EngineRequest) -> RequestHandle:
        """Queue a request (thread-safe). DominoError for a bad one, EngineFull when the queue is full."""
        prompt = [int(t) for t in req.prompt_ids]
        if not prompt:
            raise DominoError("the prompt is empty (0 tokens)")
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise DominoError(f"prompt token id {bad[0]} is outside the target's vocabulary of {vocab}")
        if int(req.max_new_tokens) < 1:
            raise DominoError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = len(prompt) + int(req.max_new_tokens) + self.block_size + 1
        if need > self.max_len:
            extra = f" + {self.block_size} draft positions" if self.block_size else ""
            raise DominoError(
                f"the prompt ({len(prompt)} tokens) + max_new_tokens ({req.max_new_tokens}){extra} + 1 "
                f"exceed the engine's context of {self.max_len} positions per slot"
            )
        eos = set(self.target.eos_ids if req.eos_ids is None else req.eos_ids)
        gen = torch.Generator(device=self.target.device)
        if req.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(req.seed))
        seq = SeqState(prompt, int(req.max_new_tokens), req.sampling, gen, eos)
        if self.use_lookup:
            seq.lookup = PromptLookup()
        with self._lock:
            if self._closed:
                raise DominoError("the engine is shut down and takes no new requests")
            if len(self._queue) >= self.max_queue:
                raise EngineFull(f"the engine's queue is full ({self.max_queue} requests wait); retry later")
            handle = RequestHandle(next(self._ids), self._wake)
            self._queue.append(_Row(handle, req, seq, time.perf_counter()))
            self._lock.notify_all()
        return handle

    def stats(self) -> dict:
        with self._lock:
            st = dict(self._stats)
            cycles = st.pop("cycles")
            committed = st.pop("committed")
            return {
                "queue_depth": len(self._queue),
                "active_rows": sum(r is not None for r in self._rows),
                "max_batch": self.max_batch,
                **st,
                "tau": committed / cycles if cycles else None,
                "accept_by_position": [a / cycles for a in self._accept_by_position] if cycles else [],
                "verified_per_cycle": self._verified_total / cycles if cycles else None,
                "cycles": cycles,  # running totals, for rates over a window
                "drafts_verified": self._verified_total,
                "policy": self.policy_name,
                "slot_bytes": self.slot_bytes,
            }

    @property
    def slot_bytes(self) -> int:
        """Memory one slot holds (target + drafter K/V), preallocated."""
        n = self.cache.bytes_per_row
        if self.proposer is not None:
            n += self.proposer.bytes_per_row
        return n

    # ----- running -----
    def run_until_idle(self) -> None:
        while self.step():
            pass

    def start(self) -> None:
        """Step in a background thread while there is work (it sleeps when there is none).

        The caller's idle OpenMP workers are released first: left parked, they throttle the wake-ups of
        the engine thread's own workers (see devices.release_openmp_workers)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            release_openmp_workers()
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="dominospec-engine", daemon=True)
            self._thread.start()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; drain=True finishes the running and queued ones, else cancels them."""
        with self._lock:
            self._closed = True
            if not drain:
                for row in itertools.chain(self._queue, (r for r in self._rows if r is not None)):
                    row.handle.cancelled = True
            self._stop = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        else:
            self.run_until_idle()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _has_work(self) -> bool:
        return bool(self._queue) or any(r is not None for r in self._rows)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._has_work() and not self._stop:
                    self._lock.wait()
                if not self._has_work():
                    return
            try:
                self.step()
            except Exception as exc:  # a failed forward must not strand the waiting callers
                self._fail_all(f"{type(exc).__name__}: {exc}")

    def _fail_all(self, why: str) -> None:
        with self._step_lock:
            for row in list(r for r in self._rows if r is not None):
                self._finish(row, "error", why)

    # ----- one step -----
    @torch.inference_mode()
    def step(self) -> bool:
        """One engine step; False when nothing waited or ran."""
        with self._step_lock:
            self._reap()
            self._admit()
            prefilled = self._prefill()
            decoded = self._decode()
            if prefilled or decoded:
                with self._lock:
                    self._stats["steps"] += 1
            return prefilled or decoded

    def _reap(self) -> None:
        with self._lock:
            waiting = [r for r in self._queue if r.handle.cancelled]
            for r in waiting:
                self._queue.remove(r)
        for r in waiting:
            self._finish(r, "cancelled")
        for r in [r for r in self._rows if r is not None and r.handle.cancelled]:
            self._finish(r, "cancelled")

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                slot = self.cache.claim()
                if slot is None:
                    return
                row = self._queue.popleft()
            row.slot, row.admitted = slot, time.perf_counter()
            self._rows[slot] = row
            if self.proposer is not None:
                self.proposer.claim(row.seq, slot)

    def _prefill(self) -> bool:
        """Up to prefill_chunk prompt tokens, oldest admission first; each row alone, unpadded."""
        budget, did = self.prefill_chunk, False
        waiting = sorted((r for r in self._rows if r is not None and r.prefilled < len(r.seq.prompt)), key=_age)
        dev = self.target.device
        for row in waiting:
            if budget <= 0:
                break
            prompt = row.seq.prompt
            n = min(len(prompt) - row.prefilled, budget)
            last = row.prefilled + n == len(prompt)
            ids = torch.tensor([prompt[row.prefilled : row.prefilled + n]], device=dev)
            out = self.target.forward_rows(
                ids,
                self.cache,
                start=row.slot,
                logits="last" if last else "none",
                layer_ids=self.layers,
                with_features=self.drafter is not None,
            )
            if self.proposer is not None:
                self.proposer.extend(row.seq, out.features)
            row.prefilled += n
            budget -= n
            did = True
            if last:
                try:
                    first = start(row.seq, out.logits[0, -1])
                except Exception as exc:  # this row's sampling failed: it ends, the batch goes on
                    self._finish(row, "error", f"sampling failed: {type(exc).__name__}: {exc}")
                    continue
                self._emit(row, first)
        return did

    def _decode(self) -> bool:
        rows = [r for r in self._rows if r is not None and r.decoding]
        if not rows:
            return False
        dev = self.target.device
        proposals = [None] * len(rows)
        ks = [0] * len(rows)
        if self.proposer is not None:
            # a request that asked for plain decoding gets no room to draft in
            rooms = [r.seq.room(self.block_size, self.max_len - 1) if r.req.speculative else 0 for r in rows]
            seqs = [r.seq for r in rows]
            # decided from earlier steps only (lossless); the hybrid's lookup copies cost nothing and stay
            if self.drafter is not None and not self.policy.wants_draft(len(rows), self.block_size):
                with self._lock:
                    self._stats["draft_skipped"] += 1
                proposals = self.proposer.copies(seqs, rooms) if self.use_lookup else [None] * len(rows)
            else:
                proposals = self.proposer.propose(seqs, rooms)
            proposals = [p if r.req.speculative else None for r, p in zip(rows, proposals)]
            ks = self.policy.verify_lengths(proposals, [s.committed_len - 1 for s in seqs])
        lo, hi = min(r.slot for r in rows), max(r.slot for r in rows) + 1
        blocks = [torch.zeros(1, dtype=torch.long, device=dev)] * (hi - lo)  # idle slots: 0 new tokens
        num_new = [0] * (hi - lo)
        for r, p, k in zip(rows, proposals, ks):
            blocks[r.slot - lo] = block_tokens(r.seq, p, k, dev)
            num_new[r.slot - lo] = k + 1
        ids, _ = pad_blocks(blocks)
        out = self.target.forward_rows(
            ids, self.cache, num_new, start=lo, layer_ids=self.layers, with_features=self.drafter is not None
        )
        for r, p, k in zip(rows, proposals, ks):
            seq, i = r.seq, r.slot - lo
            before = seq.committed_len
            try:
                n, nxt = accept(seq, p, k, out.logits[i, : k + 1])
            except Exception as exc:  # this row's sampling failed: it ends, the batch goes on
                self.target.set_row_length(self.cache, r.slot, rollback_length(before, 0))
                self._finish(r, "error", f"sampling failed: {type(exc).__name__}: {exc}")
                continue
            self.target.set_row_length(self.cache, r.slot, rollback_length(before, n))
            new = commit(seq, p, k, n, nxt)
            # a plain request's rows never draft: the drafter needs none of their features, and their
            # steps are not the engine's speculation
            if self.proposer is not None and r.req.speculative:
                feats = out.features[i : i + 1, : n + 1] if out.features is not None else None
                self.proposer.observe(seq, p, k, n, feats)
                self.policy.observe(p, k, n)
                self._record_cycle(k, n, len(new))
            self._emit(r, new, k)
        return True

    def _record_cycle(self, k: int, n: int, committed: int) -> None:
        with self._lock:
            self._stats["cycles"] += 1
            self._stats["committed"] += committed
            self._verified_total += k
            for j in range(min(n, len(self._accept_by_position))):
                self._accept_by_position[j] += 1

    # ----- leaving -----
    def _emit(self, row: _Row, new: list[int], verified: int = 0) -> None:
        if row.first is None:
            row.first = time.perf_counter()
        with self._lock:
            self._stats["tokens_out"] += len(new)
        if row.req.on_tokens is not None and new:
            try:
                if row.req.marks:
                    row.req.on_tokens(list(new), row.seq.res.sources[-len(new) :], verified)
                else:
                    row.req.on_tokens(list(new))
            except Exception as exc:  # the caller's callback failed: end its request, not the batch
                self._finish(row, "error", f"on_tokens raised {type(exc).__name__}: {exc}")
                return
        if row.seq.done:
            self._finish(row, "stop" if row.seq.tokens[-1] in row.seq.eos else "length")

    def _finish(self, row: _Row, reason: str, error: str | None = None) -> None:
        if row.handle.done:
            return
        if row.slot >= 0 and self._rows[row.slot] is row:
            self._rows[row.slot] = None
            self.cache.release(row.slot)
            if self.proposer is not None:
                self.proposer.release(row.seq, row.slot)
        now = time.perf_counter()
        res = row.seq.res
        spec = self.proposer is not None
        result = RequestResult(
            request_id=row.handle.id,
            tokens=list(res.tokens),
            prompt_len=res.prompt_len,
            finish_reason=reason,
            error=error,
            cycles=res.cycles if spec else 0,
            accepted=list(res.accepted) if spec else [],
            verified=list(res.verified) if spec else [],
            sources=list(res.sources),
            queued_s=(row.admitted or now) - row.submitted,
            ttft_s=None if row.first is None else row.first - row.submitted,
            total_s=now - row.submitted,
        )
        with self._lock:
            self._stats["requests_finished"] += 1
        row.seq.done = True
        if row.req.on_finish is not None:
            try:
                row.req.on_finish(result)
            except Exception:  # nothing left to tell the caller; the engine goes on
                pass
        row.handle._finish(result)


def _age(row: _Row) -> float:
    return row.admitted
