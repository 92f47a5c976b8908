"""One speculative step over explicit per-sequence state, shared by the batch-1 loop and the engine.

A `SeqState` is everything one sequence carries between steps: its prompt, budget, sampling
settings and generator, EOS ids, committed tokens and per-cycle records. The step around it:

  1. propose   a Proposer (proposers.py) drafts for some sequences at once
  2. cut       the verify-length policy picks k <= len(proposal) from drafts and confidences only
  3. verify    the caller runs the target over [anchor, d_1..d_k] (batch 1, or one ragged forward)
  4. accept    `accept`: greedy exact match, or rejection sampling with the sequence's own generator
  5. commit    `commit`: cut at EOS / budget, record the cycle, tell the proposer; the caller rolls its
               target cache back to `rollback_length` (anchor + accepted drafts kept)

Plain decoding is the same step with k = 0: accepting zero drafts samples the target's token from
warp_probs(logits[0]) with the same generator draw as `generate_autoregressive`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingConfig, accept_greedy, accept_rejection, sample, warp_probs
from .lookup import PromptLookup
from .propose import Proposal
from .result import GenerationResult


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(0 if seed is None else int(seed))
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


@dataclass
class SeqState:
    """One sequence between steps. tokens[-1] is the anchor: committed, not yet in the target cache."""

    prompt: list[int]
    budget: int  # max new tokens
    sampling: SamplingConfig
    gen: torch.Generator
    eos: set[int]
    res: GenerationResult = None  # tokens and per-cycle records
    lookup: PromptLookup | None = None  # this sequence's own lookup index (lookup / hybrid)
    draft_cache: object = None  # this sequence's drafter cache row (drafter / hybrid)
    done: bool = False
    extra: dict = field(default_factory=dict)  # the caller's own per-sequence data

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

    def room(self, block_size: int, limit: int | None) -> int:
        """Drafts this cycle may propose: the verify block must stay inside the context `limit`."""
        return block_size if limit is None else max(0, min(block_size, limit - self.committed_len))


def start(seq: SeqState, logits_row: torch.Tensor) -> list[int]:
    """After the prompt's forward: draw and commit the first token (logits_row [V])."""
    tok = first_token(logits_row, seq.sampling, seq.gen)
    if seq.lookup is not None:
        seq.lookup.start(seq.prompt)
        seq.lookup.extend([tok])
    seq.res.tokens.append(tok)
    seq.res.sources.append("target")
    seq.done = tok in seq.eos or seq.budget <= 1
    return [tok]


def accept(
    seq: SeqState, proposal: Proposal | None, k: int, logits: torch.Tensor, rejection=accept_rejection
) -> tuple[int, int]:
    """(accepted drafts n, the target's next token) for the first k drafts; logits [k+1, V].
    rejection: the sampling rule (tests swap in a wrong one to show the distribution tests catch it)."""
    drafts = proposal.drafts[:k] if proposal is not None else logits.new_zeros(0, dtype=torch.long)
    if seq.sampling.greedy:
        return accept_greedy(drafts, logits)
    draft_probs = proposal.draft_probs[:k] if proposal is not None else logits[:0]
    return rejection(drafts, draft_probs, warp_probs(logits, seq.sampling), seq.gen)


def commit(seq: SeqState, proposal: Proposal | None, k: int, n: int, nxt: int) -> list[int]:
    """Commit accepted drafts + the target's token (cut at EOS / budget) and record the cycle."""
    drafts = proposal.drafts[:n].tolist() if proposal is not None else []
    new, seq.done = truncate(drafts + [nxt], seq.eos, seq.budget - len(seq.res.tokens))
    res = seq.res
    if proposal is not None and proposal.source == "lookup":
        seq.lookup.record(k, n)
        res.lookup_cycles += 1
    res.cycles += 1
    res.accepted.append(n)
    res.verified.append(k)
    res.committed.append(len(new))
    res.tokens.extend(new)
    res.sources.extend(([proposal.source] * n if proposal is not None else []) + ["target"])
    del res.sources[len(res.tokens) :]  # the cut at EOS / budget
    if seq.lookup is not None:
        seq.lookup.extend(new)
    return new


def rollback_length(committed_len_before: int, n: int) -> int:
    """Target cache length after a cycle: the context, the anchor and the n accepted drafts."""
    return committed_len_before + n


def block_tokens(seq: SeqState, proposal: Proposal | None, k: int, device) -> torch.Tensor:
    """[anchor, d_1..d_k]: [k+1] token ids the target verifies."""
    anchor = torch.tensor([seq.anchor], device=device)
    return anchor if proposal is None or k == 0 else torch.cat([anchor, proposal.drafts[:k].to(device)])


def pad_blocks(blocks: Sequence[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Ragged blocks -> (ids [R, S] right-padded, lengths [R])."""
    lens = [int(b.shape[0]) for b in blocks]
    ids = torch.full((len(blocks), max(lens)), pad, dtype=torch.long, device=blocks[0].device)
    for r, b in enumerate(blocks):
        ids[r, : lens[r]] = b
    return ids, lens
