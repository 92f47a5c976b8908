"""Proposers: who drafts for a sequence, and what each learns from the outcome.

The protocol (as transformers' candidate generators: propose, then be told what happened):

  claim(seq, slot)     a new sequence; `slot` is its row in a per-row cache (0 at batch 1)
  extend(seq, feats)   the target's features of the prompt, chunk by chunk: [1, S, n*H]
  propose(seqs, rooms) -> one Proposal (or None: nothing to propose) per sequence, all at once
  observe(seq, proposal, verified, accepted, feats)
                       the cycle's outcome; feats [1, n+1, n*H] of the newly committed positions
  release(seq, slot)   the sequence ended

Three proposers: the drafter (one backbone pass for every sequence, one batched head rollout),
prompt lookup (each sequence copies from its own history; its running acceptance is its
confidence), and the hybrid (the lookup where its suffix match is long enough, the drafter for
the rest, in the same call). A sequence's lookup index lives on its SeqState.
"""

from __future__ import annotations

import torch

from ..drafter.model import DraftCache
from ..errors import DominoError
from .lookup import LOOKUP_BLOCK_SIZE
from .propose import Proposal, draft_block, draft_rows
from .step import SeqState

PENDING = "draft_pending"  # SeqState.extra: target features not yet in the drafter's cache


class DrafterProposer:
    def __init__(self, drafter, block_size: int, rows=None, use_head: bool = True, draft_one=None):
        """rows: a per-row draft cache (drafter.new_row_cache) for many sequences; None at batch 1.
        draft_one: how one sequence's block is drafted (default propose.draft_block)."""
        self.drafter, self.block_size, self.rows, self.use_head = drafter, block_size, rows, use_head
        self.draft_one = draft_one or draft_block
        # without a confidence head, the engine's policies read the draft's own top probability
        self.top = rows is not None and getattr(drafter, "confidence", None) is None

    @property
    def bytes_per_row(self) -> int:
        return self.rows.bytes_per_row if self.rows is not None else 0

    def claim(self, seq: SeqState, slot: int = 0) -> None:
        if self.rows is None:
            seq.draft_cache = self.drafter.new_cache()
        else:
            self.rows.claimed[slot], self.rows.lengths[slot] = True, 0
            seq.draft_cache = DraftCache(self.rows, slot)

    def release(self, seq: SeqState, slot: int = 0) -> None:
        if self.rows is not None:
            self.rows.release(slot)
        seq.draft_cache = None
        seq.extra.pop(PENDING, None)

    def extend(self, seq: SeqState, features: torch.Tensor) -> None:
        """Queue committed positions' target features; they enter the drafter's cache before its next
        proposal, all at once (a cycle without drafting then costs no drafter work at all)."""
        seq.extra.setdefault(PENDING, []).append(features)

    def _flush(self, seq: SeqState) -> None:
        pending = seq.extra.pop(PENDING, None)
        if pending:
            self.drafter.extend_cache(seq.draft_cache, pending[0] if len(pending) == 1 else torch.cat(pending, 1))

    def propose(self, seqs: list[SeqState], rooms: list[int]) -> list[Proposal | None]:
        live = [i for i, b in enumerate(rooms) if b > 0]
        out: list[Proposal | None] = [None] * len(seqs)
        if not live:
            return out
        for i in live:
            self._flush(seqs[i])
        dev = self.drafter.fc.weight.device if hasattr(self.drafter, "fc") else None
        if len(live) == 1:  # one sequence: the batch-1 path (no mask, no gather)
            i = live[0]
            s = seqs[i]
            anchor = torch.tensor([s.anchor], device=dev)
            out[i] = self.draft_one(
                self.drafter, s.draft_cache, anchor, rooms[i], s.sampling, s.gen, self.use_head, self.top
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
            top=self.top,
        )
        for i, p in zip(live, props):
            out[i] = p
        return out

    def observe(self, seq: SeqState, proposal, verified: int, accepted: int, features: torch.Tensor) -> None:
        self.extend(seq, features)  # the anchor and the accepted drafts


class LookupProposer:
    """Each sequence copies the continuation of its own latest earlier n-gram match (seq.lookup)."""

    bytes_per_row = 0

    def __init__(self, vocab_size: int, block_size: int = LOOKUP_BLOCK_SIZE, device=None):
        self.vocab_size, self.block_size, self.device = vocab_size, block_size, device

    def claim(self, seq: SeqState, slot: int = 0) -> None:
        if seq.lookup is None:
            raise DominoError("a lookup sequence needs its PromptLookup (SeqState.lookup)")

    def release(self, seq: SeqState, slot: int = 0) -> None:
        pass

    def extend(self, seq: SeqState, features) -> None:
        pass  # the prompt is indexed when the first token is committed (step.start)

    def propose(self, seqs: list[SeqState], rooms: list[int]) -> list[Proposal | None]:
        return [s.lookup.propose(b, self.vocab_size, s.sampling, self.device)[0] for s, b in zip(seqs, rooms)]

    def matches(self, seqs: list[SeqState], rooms: list[int]) -> list[tuple[Proposal | None, int]]:
        return [s.lookup.propose(b, self.vocab_size, s.sampling, self.device) for s, b in zip(seqs, rooms)]

    def observe(self, seq, proposal, verified, accepted, features) -> None:
        pass  # step.commit records the outcome and extends the index


class HybridProposer:
    """The lookup's copy where its suffix match has at least lookup.min_match tokens, else the drafter."""

    def __init__(self, drafter: DrafterProposer, lookup: LookupProposer):
        self.drafter, self.lookup, self.block_size = drafter, lookup, drafter.block_size

    @property
    def bytes_per_row(self) -> int:
        return self.drafter.bytes_per_row

    def claim(self, seq, slot=0):
        self.lookup.claim(seq, slot)
        self.drafter.claim(seq, slot)

    def release(self, seq, slot=0):
        self.drafter.release(seq, slot)

    def extend(self, seq, features):
        self.drafter.extend(seq, features)

    def copies(self, seqs, rooms) -> list[Proposal | None]:
        """The lookup's proposals alone (None where its match is too short): a cycle without the drafter."""
        found = self.lookup.matches(seqs, rooms)
        return [p if p is not None and n >= s.lookup.min_match else None for s, (p, n) in zip(seqs, found)]

    def propose(self, seqs, rooms):
        take = self.copies(seqs, rooms)
        rest = [i for i, p in enumerate(take) if p is None]
        if rest:
            drafted = self.drafter.propose([seqs[i] for i in rest], [rooms[i] for i in rest])
            for i, p in zip(rest, drafted):
                take[i] = p
        return take

    def observe(self, seq, proposal, verified, accepted, features):
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
    block_size: int | None,
    rows: int | None = None,
    max_len: int = 0,
    use_head: bool = True,
    vocab_size: int | None = None,
    device=None,
    draft_one=None,
):
    """The proposer for a drafter, lookup, or both; rows = slots of a per-row draft cache (None: batch 1)."""
    if drafter is None and not lookup:
        raise DominoError("speculative decoding needs a drafter, prompt lookup, or both")
    b = block_size_for(drafter, block_size)
    dp = None
    if drafter is not None:
        cache = drafter.new_row_cache(rows, max_len) if rows is not None else None
        dp = DrafterProposer(drafter, b, cache, use_head, draft_one)
        vocab_size = vocab_size or drafter.config.vocab_size
    if not lookup:
        return dp
    lp = LookupProposer(vocab_size, b, device)
    return lp if dp is None else HybridProposer(dp, lp)
