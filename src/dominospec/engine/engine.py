"""The batched engine: requests join and leave a running batch of fixed cache slots.

One `step()`:
  1. reap     cancelled requests leave (their slots are freed)
  2. admit    waiting requests claim free slots (lowest first)
  3. prefill  up to `prefill_chunk` prompt tokens, one row at a time, unpadded (a long prompt takes
              several steps, so running rows are never stalled for long); a finished prompt draws
              its first token
  4. decode   the shared step (decode/step.py) over every decoding row: proposals in one proposer call
              (a plain proposer proposes nothing), the policy's verify lengths, ONE ragged target forward,
              acceptance with each request's own generator, per-row rollback, commit; finished rows leave

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

from ..decode.schedule import DEFAULT_THRESHOLD
from ..decode.step import RowCache, SeqState, check_request, commit_first, make_generator, prefill, step
from ..devices import release_openmp_workers
from ..errors import DominoError
from ..tune.spec import DRAFTS, SpecConfig, bind, build, parse_spec
from .memory import check_slots_fit
from .request import EngineFull, EngineRequest, RequestHandle, RequestResult

DEFAULT_MAX_LEN = 2048


class _Row:
    """The engine's record of one admitted request."""

    def __init__(self, handle: RequestHandle, req: EngineRequest, seq: SeqState, submitted: float):
        self.handle, self.req, self.seq = handle, req, seq
        self.slot = -1
        self.submitted, self.admitted, self.first = submitted, None, None


class Engine:
    def __init__(
        self,
        target,
        drafter=None,
        *,
        spec: SpecConfig | None = None,
        lookup: bool = False,
        policy: str | None = None,
        block_size: int | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: int | None = None,
        prefill_chunk: int = 512,
        costs=None,
        threshold: float | None = None,
    ):
        """spec: the decoding configuration (tune/spec.py); without it, one is parsed from drafter (a Drafter),
        lookup, policy (a verify mode, or "plain"), block_size and threshold by the engine's row of
        SURFACE_DEFAULTS. costs: a cost table to use instead of the device profile."""
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1:
            raise DominoError(
                f"max_batch ({max_batch}) and prefill_chunk ({prefill_chunk}) must be >= 1, "
                f"max_queue ({max_queue}) >= 0"
            )
        if spec is None:
            plain = policy == "plain"
            spec = parse_spec(
                "engine",
                drafter="none" if plain else drafter if drafter is not None else "lookup" if lookup else "none",
                lookup=lookup,
                verify=None if plain else policy,
                block_size=block_size,
                threshold=DEFAULT_THRESHOLD if threshold is None else threshold,
                flags=False,
            )
        self.spec = spec = bind(spec, target)
        self.target, self.policy_name = target, spec.verify or "plain"
        self.drafter = spec.drafter if spec.proposer in DRAFTS else None
        limit = target.max_positions
        self.max_len = int(max_len or min(limit or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN))
        if limit is not None and self.max_len > limit:
            raise DominoError(f"engine max_len {self.max_len} exceeds the target's context of {limit} positions")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        check_slots_fit(target, self.drafter, max_batch, self.max_len)  # before allocating: say what fits
        self.side = RowCache(target, max_batch, self.max_len)  # DominoError without target.supports_rows
        self.cache = self.side.cache
        self.proposer, self.policy = build(spec, target, rows=max_batch, max_len=self.max_len, costs=costs)
        self.block_size = self.proposer.block_size
        if self.max_len < self.block_size + 3:  # a prompt token, the anchor, the drafts and one more
            raise DominoError(
                f"engine max_len {self.max_len} leaves no room for a request: a cycle needs a prompt token, the "
                f"anchor and {self.block_size} draft positions ({self.block_size + 3} positions at least)"
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
        if check_request(prompt, int(req.max_new_tokens), self.target.vocab_size, self.context, cap=False).refused:
            extra = f" + {self.block_size} draft positions" if self.block_size else ""
            raise DominoError(
                f"the prompt ({len(prompt)} tokens) + max_new_tokens ({req.max_new_tokens}){extra} + 1 "
                f"exceed the engine's context of {self.max_len} positions per slot"
            )
        eos = set(self.target.eos_ids if req.eos_ids is None else req.eos_ids)
        seq = SeqState(prompt, int(req.max_new_tokens), req.sampling, make_generator(req.seed, self.target.device), eos)
        seq.speculative = req.speculative
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
    def context(self) -> int:
        """Prompt + answer tokens one request may hold: its slot, less the draft positions a step appends
        past the last committed token (block_size + 1). The server's 400 reads the same number."""
        return self.max_len - self.block_size - 1

    @property
    def slot_bytes(self) -> int:
        """Memory one slot holds (target + drafter K/V), preallocated."""
        return self.cache.bytes_per_row + self.proposer.bytes_per_row

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
            row.slot = row.seq.slot = slot
            row.admitted = time.perf_counter()
            self._rows[slot] = row
            self.proposer.claim(row.seq)

    def _prefill(self) -> bool:
        """Up to prefill_chunk prompt tokens, oldest admission first; each row alone, unpadded."""
        waiting = sorted((r for r in self._rows if r is not None and r.seq.prefilled < len(r.seq.prompt)), key=_age)
        chunks = prefill_chunks([len(r.seq.prompt) - r.seq.prefilled for r in waiting], self.prefill_chunk)
        for row, n in zip(waiting, chunks):
            logits = prefill(row.seq, self.side, self.proposer, n, self.layers)
            if logits is None:
                continue
            try:
                first = commit_first(row.seq, logits, self.proposer)
            except Exception as exc:  # this row's sampling failed: it ends, the batch goes on
                self._finish(row, "error", f"sampling failed: {type(exc).__name__}: {exc}")
                continue
            self._emit(row, first)
        return bool(chunks)

    def _decode(self) -> bool:
        rows = [r for r in self._rows if r is not None and r.seq.decoding]
        if not rows:
            return False
        out = step([r.seq for r in rows], self.proposer, self.policy, self.side, self.max_len - 1, self.layers)
        if not out.plan.draft:
            with self._lock:
                self._stats["draft_skipped"] += 1
        for r, k, n, new, err in zip(rows, out.plan.verify, out.accepted, out.new, out.errors):
            if err is not None:  # this row's sampling failed: it ends, the batch goes on
                self._finish(r, "error", f"sampling failed: {type(err).__name__}: {err}")
                continue
            if self.proposer.counts_cycles and r.seq.speculative:  # a plain request's steps are not speculation
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
            self.proposer.release(row.seq)
        now = time.perf_counter()
        res = row.seq.res
        spec = self.proposer.counts_cycles
        result = RequestResult(
            request_id=row.handle.id,
            tokens=list(res.tokens),
            prompt_len=res.prompt_len,
            finish_reason=reason,
            error=error,
            cycles=res.cycles if spec else 0,
            accepted=list(res.accepted) if spec else [],
            verified=list(res.verified) if spec else [],
            committed=list(res.committed) if spec else [],
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


def prefill_chunks(remaining: list[int], budget: int) -> list[int]:
    """Prompt tokens each waiting row prefills this step, oldest first, `budget` in all: [rows served]."""
    out = []
    for left in remaining:
        if budget <= 0:
            break
        out.append(min(left, budget))
        budget -= out[-1]
    return out
