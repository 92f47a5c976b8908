"""Proposers: who drafts for a row, and what each learns from the outcome.

The protocol (as transformers' candidate generators: propose, then be told what happened):

  claim(seq)                  a new row (seq.slot: its row in a per-row cache, 0 at batch 1)
  extend(seq, feats)          the target's features of the prompt, chunk by chunk: [1, S, n*H]
  propose(seqs, rooms, draft) -> one Proposal (or None: nothing to propose) per row, all at once;
                              draft=False: the policy skips the drafter pass this step (copies still go)
  observe(seq, proposal, verified, accepted, feats)
                              the outcome, after the commit (also once after the first token, with no
                              proposal); feats [1, n+1, n*H] of the newly committed positions
  release(seq)                the row ended

and what the step reads: block_size, needs_features (the target forward computes features for it),
drafter_pass (a skip decision applies), counts_cycles (its steps are draft cycles, for tau).

Four proposers: plain (proposes nothing: plain decoding), the drafter (one backbone pass for every
row, one batched head rollout), prompt lookup (each row copies from its own history; its running
acceptance is its confidence), and the hybrid (the lookup where its suffix match is long enough, the
drafter for the rest, in the same call). A row's lookup index lives on its SeqState.
"""

from __future__ import annotations

import torch

from ..drafter.model import DraftCache
from ..errors import DominoError
from .lookup import HYBRID_MIN_MATCH, LOOKUP_BLOCK_SIZE, PromptLookup
from .rollout import Proposal, draft_block, draft_rows
from .step import SeqState


class PlainProposer:
    """Proposes nothing: every step is one plain decode step (k = 0)."""

    block_size = 0
    bytes_per_row = 0
    needs_features = drafter_pass = counts_cycles = False

    def claim(self, seq: SeqState) -> None:
        pass

    def release(self, seq: SeqState) -> None:
        pass

    def extend(self, seq: SeqState, features) -> None:
        pass

    def propose(self, seqs, rooms, draft: bool = True) -> list[Proposal | None]:
        return [None] * len(seqs)

    def observe(self, seq, proposal, verified, accepted, features) -> None:
        pass


class DrafterProposer:
    needs_features = drafter_pass = counts_cycles = True

    def __init__(self, drafter, block_size: int, rows=None, use_head: bool = True):
        """rows: a per-row draft cache (drafter.new_row_cache) for many sequences; None at batch 1."""
        self.drafter, self.block_size, self.rows, self.use_head = drafter, block_size, rows, use_head
        self.pending: dict[int, list[torch.Tensor]] = {}  # slot -> target features not yet in its draft cache

    @property
    def bytes_per_row(self) -> int:
        return self.rows.bytes_per_row if self.rows is not None else 0

    def claim(self, seq: SeqState) -> None:
        self.pending.pop(seq.slot, None)
        if self.rows is None:
            seq.draft_cache = self.drafter.new_cache()
        else:
            self.rows.claimed[seq.slot], self.rows.lengths[seq.slot] = True, 0
            seq.draft_cache = DraftCache(self.rows, seq.slot)

    def release(self, seq: SeqState) -> None:
        if self.rows is not None:
            self.rows.release(seq.slot)
        seq.draft_cache = None
        self.pending.pop(seq.slot, None)

    def extend(self, seq: SeqState, features: torch.Tensor) -> None:
        """Queue committed positions' target features; they enter the drafter's cache before its next
        proposal, all at once (a cycle without drafting then costs no drafter work at all)."""
        self.pending.setdefault(seq.slot, []).append(features)

    def _flush(self, seq: SeqState) -> None:
        pending = self.pending.pop(seq.slot, None)
        if pending:
            self.drafter.extend_cache(seq.draft_cache, pending[0] if len(pending) == 1 else torch.cat(pending, 1))

    def propose(self, seqs: list[SeqState], rooms: list[int], draft: bool = True) -> list[Proposal | None]:
        live = [i for i, b in enumerate(rooms) if b > 0]
        out: list[Proposal | None] = [None] * len(seqs)
        if not live or not draft:
            return out
        for i in live:
            self._flush(seqs[i])
        dev = self.drafter.fc.weight.device if hasattr(self.drafter, "fc") else None
        if len(live) == 1:  # one sequence: the batch-1 path (no mask, no gather)
            i = live[0]
            s = seqs[i]
            anchor = torch.tensor([s.anchor], device=dev)
            # this module's draft_block, looked up per call (tests wrap it)
            out[i] = draft_block(
                self.drafter, s.draft_cache, anchor, rooms[i], s.sampling, s.gen, self.use_head, top=True
            )
            return out
        anchors = torch.tensor([seqs[i].anchor for i in live], device=dev)
        props = draft_rows(
            self.drafter,
            self.rows,
            [seqs[i].draft_cache.slot for i in live],
            anchors,
            [rooms[i] for i in live],
            [seqs[i].sampling for i in live],
            [seqs[i].gen for i in live],
            self.use_head,
            top=True,  # the draft's top probability, always: the cost policy's estimate (schedule.ConfidenceChoice)
        )
        for i, p in zip(live, props):
            out[i] = p
        return out

    def observe(self, seq: SeqState, proposal, verified: int, accepted: int, features: torch.Tensor) -> None:
        if features is not None:
            self.extend(seq, features)  # the anchor and the accepted drafts


class LookupProposer:
    """Each row copies the continuation of its own latest earlier n-gram match (seq.lookup), and learns
    from each outcome: the index takes the committed tokens, the running acceptance the verdict."""

    bytes_per_row = 0
    needs_features = drafter_pass = False
    counts_cycles = True

    def __init__(self, vocab_size: int, block_size: int = LOOKUP_BLOCK_SIZE, device=None, min_match: int | None = None):
        self.vocab_size, self.block_size, self.device = vocab_size, block_size, device
        self.min_match = HYBRID_MIN_MATCH if min_match is None else min_match

    def claim(self, seq: SeqState) -> None:
        if seq.lookup is None:
            seq.lookup = PromptLookup(min_match=self.min_match)
        seq.lookup.start([])

    def release(self, seq: SeqState) -> None:
        pass

    def extend(self, seq: SeqState, features) -> None:
        pass  # the prompt is indexed when the first token is committed (observe)

    def propose(self, seqs: list[SeqState], rooms: list[int], draft: bool = True) -> list[Proposal | None]:
        return [p for p, _ in self.matches(seqs, rooms)]

    def matches(self, seqs: list[SeqState], rooms: list[int]) -> list[tuple[Proposal | None, int]]:
        return [
            s.lookup.propose(b, self.vocab_size, s.sampling, self.device) if b > 0 else (None, 0)
            for s, b in zip(seqs, rooms)
        ]

    def observe(self, seq: SeqState, proposal, verified, accepted, features) -> None:
        if proposal is not None and proposal.source == "lookup":
            seq.lookup.record(verified, accepted)
            seq.res.lookup_cycles += 1
        lookup, seen, P = seq.lookup, len(seq.lookup.history), len(seq.prompt)  # index what was committed since
        if seen < P:
            lookup.extend(seq.prompt[seen:])
            seen = P
        lookup.extend(seq.tokens[seen - P :])


class HybridProposer:
    """The lookup's copy where its suffix match has at least lookup.min_match tokens, else the drafter."""

    needs_features = drafter_pass = counts_cycles = True

    def __init__(self, drafter: DrafterProposer, lookup: LookupProposer):
        self.drafter, self.lookup, self.block_size = drafter, lookup, drafter.block_size

    @property
    def bytes_per_row(self) -> int:
        return self.drafter.bytes_per_row

    def claim(self, seq):
        self.lookup.claim(seq)
        self.drafter.claim(seq)

    def release(self, seq):
        self.drafter.release(seq)

    def extend(self, seq, features):
        self.drafter.extend(seq, features)

    def propose(self, seqs, rooms, draft: bool = True):
        """The lookup's copies, and the drafter's blocks for the rest (none while the policy skips it)."""
        found = self.lookup.matches(seqs, rooms)
        take = [p if p is not None and n >= s.lookup.min_match else None for s, (p, n) in zip(seqs, found)]
        rest = [i for i, p in enumerate(take) if p is None]
        if rest and draft:
            drafted = self.drafter.propose([seqs[i] for i in rest], [rooms[i] for i in rest])
            for i, p in zip(rest, drafted):
                take[i] = p
        return take

    def observe(self, seq, proposal, verified, accepted, features):
        self.lookup.observe(seq, proposal, verified, accepted, features)
        self.drafter.observe(seq, proposal, verified, accepted, features)


def block_size_for(drafter, block_size: int | None) -> int:
    """The drafts per cycle: the asked size, capped by the drafter's block (lookup alone: 8 by default)."""
    b = (
        int(block_size)
        if block_size is not None
        else (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
    )
    top = drafter.config.block_size if drafter is not None else b
    if not 1 <= b <= top:
        raise DominoError(f"block size {b} must be between 1 and the drafter's {top}")
    return b


def make_proposer(
    drafter,
    lookup: bool,
    block_size: int | None = None,
    rows: int | None = None,
    max_len: int = 0,
    use_head: bool = True,
    vocab_size: int | None = None,
    device=None,
    min_match: int | None = None,
):
    """The proposer for a drafter, lookup, both, or neither (plain decoding); rows = slots of a per-row
    draft cache (None: batch 1); min_match: the hybrid's lookup minimum match (a row's own PromptLookup,
    given at batch 1, keeps its own)."""
    if drafter is None and not lookup:
        return PlainProposer()
    b = block_size_for(drafter, block_size)
    dp = None
    if drafter is not None:
        cache = drafter.new_row_cache(rows, max_len) if rows is not None else None
        dp = DrafterProposer(drafter, b, cache, use_head)
        vocab_size = vocab_size or drafter.config.vocab_size
    if not lookup:
        return dp
    lp = LookupProposer(vocab_size, b, device, min_match)
    return lp if dp is None else HybridProposer(dp, lp)
