"""One speculative step for any number of rows: the batch-1 loop runs it for one, the engine for many.

A row (`SeqState`) is everything one sequence carries between steps: its prompt, budget, sampling
settings and generator, EOS ids, committed tokens and per-cycle records, its cache slot. One `step`:

  1. plan      rooms (drafts that fit the context), the policy's skip decision (earlier steps only), the
               proposer's proposals, the policy's verify lengths k: a `StepPlan`, before the target runs
  2. verify    ONE target forward over [anchor, d_1..d_k] of every row (ragged: row r appends k_r + 1)
  3. accept    sampling.accept_drafts over the flattened drafts: greedy rows read one argmax over the
               batch; sampled rows are rejection-sampled, each with its own generator, in row order
  4. roll back each row's cache keeps its context, anchor and accepted drafts
  5. commit    accepted drafts + the target's token, cut at EOS / budget; the proposer and the policy
               observe the outcome

Plain decoding is the same step with a proposer that proposes nothing (k = 0): accepting zero drafts
samples the target's token from warp_probs(logits[0]) with the same generator draw as a plain loop.
The target side is a `TargetSide`: `OneCache` (one sequence, any backend) or `RowCache` (the slots of
one preallocated cache, where the target supports rows).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig, accept_drafts, accept_rejection, sample, warp_probs
from ..targets.context import fit_request
from .lookup import PromptLookup
from .result import GenerationResult
from .rollout import Proposal


def make_generator(seed: int | None, device) -> torch.Generator:
    """A row's own random stream. seed None (everywhere: API, engine, server, transformers hook): a seed
    drawn from torch's global generator, so torch.manual_seed makes a run repeatable."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def first_token(logits_row: torch.Tensor, s: SamplingConfig, gen) -> int:
    """The token after the prompt: logits_row [V]."""
    if s.greedy:
        return int(logits_row.argmax(-1))
    return int(sample(warp_probs(logits_row, s), gen))


def truncate(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) and at the token budget; says whether generation ends."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: min(i + 1, room)], True
    return tokens[:room], len(tokens) >= room


def check_request(prompt: Sequence[int], max_new_tokens: int, vocab_size: int, context: int | None, cap: bool):
    """The one check of a request's tokens and budget (the batch-1 loop and Engine.submit): a DominoError for an
    empty prompt, a token outside the vocabulary or max_new_tokens < 1, then its fit to `context`
    (targets/context.py fit_request; cap: lower a budget that does not fit), for the caller to phrase."""
    if len(prompt) == 0:
        raise DominoError("the prompt is empty (0 tokens)")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise DominoError(f"prompt token id {bad[0]} is outside the target's vocabulary of {vocab_size}")
    if max_new_tokens < 1:
        raise DominoError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return fit_request(len(prompt), max_new_tokens, context, cap=cap)


@dataclass(eq=False)  # a row is itself (hashable by identity): a policy keeps per-row state keyed by it
class SeqState:
    """One row between steps. tokens[-1] is the anchor: committed, not yet in the target cache."""

    prompt: list[int]
    budget: int  # max new tokens
    sampling: SamplingConfig
    gen: torch.Generator
    eos: set[int]
    res: GenerationResult = None  # tokens and per-cycle records
    lookup: PromptLookup | None = None  # this row's own lookup index (lookup / hybrid)
    slot: int = 0  # its row in the target (and drafter) cache
    prefilled: int = 0  # prompt tokens already in the target cache
    draft_cache: object = None  # this row's drafter cache (drafter / hybrid)
    speculative: bool = True  # False: this row proposes nothing (plain decoding in any batch)
    done: bool = False

    def __post_init__(self):
        if self.res is None:
            self.res = GenerationResult(tokens=[], prompt_len=len(self.prompt))

    @property
    def tokens(self) -> list[int]:
        return self.res.tokens

    @property
    def committed_len(self) -> int:
        """Prompt + committed tokens; the anchor sits at position committed_len - 1."""
        return self.res.prompt_len + len(self.res.tokens)

    @property
    def anchor(self) -> int:
        return self.res.tokens[-1]

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt) and not self.done

    def room(self, block_size: int, limit: int | None) -> int:
        """Drafts this step may propose: the verify block must stay inside the context `limit`."""
        if not self.speculative:
            return 0
        return block_size if limit is None else max(0, min(block_size, limit - self.committed_len))


# ----- what a step reads: a proposer, a verify policy, a target side -----


class Proposer(Protocol):
    """Who drafts for a row, and what it learns from the outcome (proposers.py: plain, drafter, lookup, hybrid)."""

    block_size: int  # drafts per cycle at most
    needs_features: bool  # the target forward computes features for it
    drafter_pass: bool  # a policy's skip decision applies to it
    counts_cycles: bool  # its steps are draft cycles (tau)

    def claim(self, seq: SeqState) -> None: ...
    def release(self, seq: SeqState) -> None: ...
    def extend(self, seq: SeqState, features) -> None: ...
    def propose(self, seqs: Sequence[SeqState], rooms: Sequence[int], draft: bool = True) -> list: ...
    def observe(self, seq: SeqState, proposal, verified: int, accepted: int, features) -> None: ...


class Policy(Protocol):
    """How many drafts to verify (schedule.py VerifyPolicy and its family)."""

    def start(self) -> None: ...
    def wants_draft(self, rows: Sequence[SeqState]) -> bool: ...
    def verify_lengths(self, proposals: Sequence, rows: Sequence[SeqState]) -> list[int]: ...
    def observe(self, proposal, verified: int, accepted: int, row=None) -> None: ...


class TargetSide(Protocol):
    """The target as a step sees it: OneCache or RowCache below."""

    target: object

    def forward(self, ids, num_new=None, start=0, logits="all", layer_ids=None, with_features=False): ...
    def set_length(self, slot: int, length: int) -> None: ...


# ----- the target side: one sequence, or the rows of one cache -----


class OneCache:
    """One sequence in one cache, through target.forward / crop_cache (any backend): the batch-1 loop's."""

    def __init__(self, target, max_len: int):
        self.target, self.cache = target, target.new_cache(max_len=max_len)

    def forward(self, ids, num_new=None, start=0, logits="all", layer_ids=None, with_features=False):
        """ids [1, S] after the cached prefix -> logits [1, S, V] ("all") or [1, 1, V] ("last", "none")."""
        return self.target.forward(
            ids, self.cache, last_logits_only=logits != "all", layer_ids=layer_ids, with_features=with_features
        )

    def set_length(self, slot: int, length: int) -> None:
        self.target.crop_cache(self.cache, length)


class RowCache:
    """Sequences in the fixed slots of one preallocated cache (targets with `supports_rows`): the engine's."""

    def __init__(self, target, slots: int, max_len: int):
        self.target, self.cache = target, target.new_row_cache(slots, max_len)  # DominoError without rows

    def forward(self, ids, num_new=None, start=0, logits="all", layer_ids=None, with_features=False):
        """ids [R, S] over slots start..start+R-1, row r appending its first num_new[r] -> logits [R, S, V]."""
        return self.target.forward_rows(ids, self.cache, num_new, start, logits, layer_ids, with_features)

    def set_length(self, slot: int, length: int) -> None:
        self.target.set_row_length(self.cache, slot, length)


# ----- prefill: a prompt chunk, and the first token when the prompt is in -----


def prefill(seq: SeqState, side: TargetSide, proposer: Proposer, n: int, layer_ids=None) -> torch.Tensor | None:
    """The next n prompt tokens of `seq` into its cache slot; when that completes the prompt, the logits
    after it ([V], for `commit_first`), else None."""
    dev = side.target.device
    last = seq.prefilled + n == len(seq.prompt)
    ids = torch.tensor([seq.prompt[seq.prefilled : seq.prefilled + n]], device=dev)  # [1, n]
    feats = proposer.needs_features and seq.speculative  # a plain request's prompt feeds no drafter
    out = side.forward(ids, start=seq.slot, logits="last" if last else "none", layer_ids=layer_ids, with_features=feats)
    if feats:
        proposer.extend(seq, out.features)
    seq.prefilled += n
    return out.logits[0, -1] if last else None


def commit_first(seq: SeqState, logits_row: torch.Tensor, proposer: Proposer) -> list[int]:
    """After the prompt: draw and commit the first token (logits_row [V]); the proposer observes it."""
    tok = first_token(logits_row, seq.sampling, seq.gen)
    seq.res.tokens.append(tok)
    seq.res.sources.append("target")
    seq.done = tok in seq.eos or seq.budget <= 1
    proposer.observe(seq, None, 0, 0, None)  # the first token is committed (prompt lookup indexes it)
    return [tok]


# ----- one step -----


@dataclass
class StepPlan:
    """What one step does, decided before the target runs."""

    rows: list[SeqState]  # [R] decoding rows, in slot order
    rooms: list[int]  # [R] drafts each row may propose (its verify block stays inside the context)
    draft: bool  # the drafter runs this step (the policy's skip decision, from earlier steps only)
    proposals: list[Proposal | None]  # [R] None: nothing proposed, a plain decode step for that row
    verify: list[int]  # [R] k_r: drafts the target checks

    @property
    def num_new(self) -> list[int]:
        """[R] tokens each row's forward appends: the anchor and k_r drafts."""
        return [k + 1 for k in self.verify]


@dataclass
class StepResult:
    plan: StepPlan
    accepted: list[int]  # [R] n_r: drafts the target accepted (before any EOS / budget cut)
    new: list[list[int]]  # [R] tokens committed per row
    errors: list[Exception | None]  # [R] a row whose sampling failed: nothing committed, its cache rolled back
    draft_s: float = 0.0  # proposing, choosing k, the proposer's observe (timed steps only)
    verify_s: float = 0.0  # the target forward, acceptance and rollback (timed steps only)


def plan_step(rows: Sequence[SeqState], proposer: Proposer, policy: Policy, limit: int | None) -> StepPlan:
    """Rooms, the skip decision, proposals and verify lengths for these rows: everything but the forward."""
    rooms = [0 if policy.resting(r) else r.room(proposer.block_size, limit) for r in rows]  # [R]; resting: none
    draft = not proposer.drafter_pass or policy.wants_draft(rows)
    proposals = proposer.propose(rows, rooms, draft)  # [R]
    if not draft:
        for r, p in zip(rows, proposals):
            if p is None:
                r.res.draft_skipped += 1
    verify = policy.verify_lengths(proposals, rows)  # [R], never from the target's verdict
    return StepPlan(list(rows), rooms, draft, proposals, verify)


def block_tokens(seq: SeqState, proposal: Proposal | None, k: int, device) -> torch.Tensor:
    """[anchor, d_1..d_k]: [k+1] token ids the target verifies."""
    anchor = torch.tensor([seq.anchor], device=device)
    return anchor if proposal is None or k == 0 else torch.cat([anchor, proposal.drafts[:k].to(device)])


def pad_blocks(blocks: Sequence[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Ragged blocks -> (ids [R, S] right-padded, lengths [R])."""
    lens = [int(b.shape[0]) for b in blocks]
    if len(blocks) == 1:  # one row (the batch-1 loop): nothing to pad
        return blocks[0][None], lens
    ids = torch.full((len(blocks), max(lens)), pad, dtype=torch.long, device=blocks[0].device)
    for r, b in enumerate(blocks):
        ids[r, : lens[r]] = b
    return ids, lens


def accept_rows(
    plan: StepPlan, logits: torch.Tensor, first_slot: int, rule=accept_rejection
) -> tuple[list, list, list]:
    """(n [R], next token [R], error [R]) for every row of the plan; logits [R', S, V] over slots first_slot...

    The plan's drafts flattened for sampling.accept_drafts (greedy and sampled rows in one call, each sampled row
    with its own generator); rule: the sampled rows' rejection sampler (the reference, unless a test passes one)."""
    R, S, V = logits.shape
    drafts, cu, first, draft_probs = [], [0], [], []
    for r, p, k in zip(plan.rows, plan.proposals, plan.verify):
        if k:
            drafts.append(p.drafts[:k])
        cu.append(cu[-1] + k)
        first.append((r.slot - first_slot) * S)
        draft_probs.append(p.draft_probs[:k] if k and not r.sampling.greedy else None)
    flat = torch.cat(drafts) if drafts else logits.new_zeros(0, dtype=torch.long)  # [N]
    samplings, gens = [r.sampling for r in plan.rows], [r.gen for r in plan.rows]
    return accept_drafts(flat, cu, logits.reshape(R * S, V), first, draft_probs, samplings, gens, rule)


def commit(seq: SeqState, proposal: Proposal | None, k: int, n: int, nxt: int, cycle: bool = True) -> list[int]:
    """Commit accepted drafts + the target's token (cut at EOS / budget); `cycle`: record it as a draft cycle
    (a plain proposer's steps are not cycles: its tau stays None)."""
    drafts = proposal.drafts[:n].tolist() if proposal is not None else []
    new, seq.done = truncate(drafts + [nxt], seq.eos, seq.budget - len(seq.res.tokens))
    res = seq.res
    if cycle:
        res.cycles += 1
        res.accepted.append(n)
        res.verified.append(k)
        res.committed.append(len(new))
    res.tokens.extend(new)
    res.sources.extend(([proposal.source] * n if proposal is not None else []) + ["target"])
    del res.sources[len(res.tokens) :]  # the cut at EOS / budget
    return new


def step(
    rows: Sequence[SeqState],
    proposer: Proposer,
    policy: Policy,
    side: TargetSide,
    limit: int | None,
    layer_ids: Sequence[int] | None = None,
    timed: bool = False,
    rule=accept_rejection,
) -> StepResult:
    """One step of every row in `rows` (decoding, in slot order): see the module doc.

    side: OneCache (one row) or RowCache; limit: the context no verify block may pass (None: unknown);
    timed: synchronize the device around the phases and report draft_s / verify_s; rule: the sampled rows'
    rejection sampler (sampling.accept_rejection; a test passes a wrong one)."""
    dev = side.target.device
    t0 = _clock(dev, timed)
    plan = plan_step(rows, proposer, policy, limit)
    t1 = _clock(dev, timed)
    lo = plan.rows[0].slot
    blocks = [torch.zeros(1, dtype=torch.long, device=dev)] * (plan.rows[-1].slot + 1 - lo)  # idle slots: 0 new
    num_new = [0] * len(blocks)  # [R'] over slots lo..hi
    for r, p, k in zip(plan.rows, plan.proposals, plan.verify):
        blocks[r.slot - lo] = block_tokens(r, p, k, dev)
        num_new[r.slot - lo] = k + 1
    ids, _ = pad_blocks(blocks)  # [R', S]
    feats = proposer.needs_features and any(r.speculative for r in plan.rows)  # rows that decode plainly need none
    out = side.forward(ids, num_new, start=lo, layer_ids=layer_ids, with_features=feats)  # logits [R', S, V]
    accepted, nxts, errors = accept_rows(plan, out.logits, lo, rule)
    for r, n in zip(plan.rows, accepted):  # keep the context, the anchor and the accepted drafts
        side.set_length(r.slot, r.committed_len + (n or 0))
    t2 = _clock(dev, timed)
    new = []
    for r, p, k, n, nxt in zip(plan.rows, plan.proposals, plan.verify, accepted, nxts):
        if n is None:  # its sampling failed: nothing committed
            new.append([])
            continue
        new.append(commit(r, p, k, n, nxt, proposer.counts_cycles))
        if not r.speculative:  # a plain row never drafts: the proposer needs nothing from it
            continue
        i = r.slot - lo
        proposer.observe(r, p, k, n, out.features[i : i + 1, : n + 1] if feats else None)  # [1, n+1, F]
        if p is not None:
            policy.observe(p, k, n, r)  # the request's own acceptance, and the pooled one
    t3 = _clock(dev, timed)
    # the running check of each request's measured rate
    policy.observe_step(plan.rows, t3 - t0, [len(x) for x in new], t2 - t1, sum(num_new))
    return StepResult(plan, accepted, new, errors, (t1 - t0) + (t3 - t2), t2 - t1)


def _clock(device, timed: bool) -> float:
    if timed:
        synchronize(device)
    return time.perf_counter()
