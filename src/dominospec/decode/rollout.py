"""The drafter's rollout: its backbone pass and its head's left-to-right walk over a block.

A `Proposal` is what travels from a proposer to the verifier: the draft tokens, the
distributions they were really drawn from (needed for lossless rejection sampling) and, when
the drafter has a confidence head, its per-slot confidence logits (for a verify-length policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, pick_per_row


@dataclass
class Proposal:
    drafts: torch.Tensor  # [b] target token ids
    draft_probs: torch.Tensor | None = None  # [b, V] when sampling: zero outside a draft vocabulary
    confidence_logits: torch.Tensor | None = None  # [b] logit of P(draft k survives | drafts < k did)
    source: str = "drafter"  # "drafter" | "lookup"
    # [b] the largest draft probability at each slot: a confidence for drafters without a head. It
    # reads only the drafts before the slot (never which token was drawn there), so a policy may use it
    draft_top: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.drafts.shape[0])


def draft_block(
    drafter, cache, anchor: torch.Tensor, b: int, sampling: SamplingConfig, gen, use_head: bool = True, top=False
) -> Proposal:
    """Backbone pass, then the head's left-to-right rollout over the first b slots.

    anchor: [1] the last committed token; the drafter cache holds the context before it.
    """
    z = drafter.backbone_block(cache, anchor)  # [1, B, H]
    return rollout(drafter, z, anchor, [b], [sampling], [gen], use_head, top)[0]


def draft_rows(
    drafter, rows, slots: list[int], anchors: torch.Tensor, bs: list[int], samplings, gens, use_head=True, top=False
):
    """One backbone pass for many sequences in draft-cache slots, then one batched rollout.

    anchors [R]; row r proposes bs[r] drafts with its own sampling settings and generator.
    """
    z = drafter.backbone_rows(rows, slots, anchors)  # [R, B, H]
    return rollout(drafter, z, anchors, bs, samplings, gens, use_head, top)


def rollout(drafter, z: torch.Tensor, anchors: torch.Tensor, bs: list[int], samplings, gens, use_head=True, top=False):
    """The head's left-to-right rollout for R blocks at once: z [R, B, H], anchors [R] -> R Proposals.

    top: also give each slot's largest (unwarped) draft probability (Proposal.draft_top).
    On CPU fp32 the drafter's packed path (drafter/fast.py) runs it; elsewhere the library path.
    """
    R, b = z.shape[0], max(bs)
    fast = drafter.fast() if hasattr(drafter, "fast") else None
    if fast is not None:
        drafts, dists, confidence, tops = fast.rollout(z[:, :b], anchors, samplings, gens, use_head, top)
    else:
        drafts, dists, confidence, tops = _rollout_library(drafter, z[:, :b], anchors, samplings, gens, use_head, top)
    out = []
    for r in range(R):
        n = bs[r]
        probs = None if dists[r] is None else drafter.to_target_probs(dists[r][:n])
        conf_r = confidence[r, :n] if confidence is not None else None
        out.append(Proposal(drafts[r, :n], probs, conf_r, draft_top=None if tops is None else tops[r, :n]))
    return out


def _rollout_library(drafter, z, anchors, samplings, gens, use_head, top):
    """The rollout on library ops, slot by slot: z [R, b, H] -> (drafts [R, b], per-row [b, V'] distributions
    or None, confidence logits [R, b] or None, top probabilities [R, b] or None)."""
    R, b = z.shape[:2]
    base = drafter.base_logits(z.reshape(R * b, -1)).view(R, b, -1)  # [R, b, V'] (V' = draft vocabulary)
    head, conf = drafter.head, drafter.confidence
    if not use_head or not head.corrects:
        picks, dists = pick_per_row(base, samplings, gens)  # [R, b]
        drafts = drafter.to_target_ids(picks)
        confidence = None
        if conf is not None:  # slot k reads the token before it: the anchor, then the drafts
            prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)  # [R, b]
            confidence = conf(z, drafter.embed(prev).to(z.dtype))  # [R, b]
        tops = torch.softmax(base.float(), -1).amax(-1) if top else None  # [R, b]
        return drafts, dists, confidence, tops
    steps, confidence, prev, tops = [], [], anchors, []  # prev [R] target ids
    state = head.init_state(z[:, 0])
    for k in range(b):
        prev_emb = drafter.embed(prev)
        if conf is not None:
            confidence.append(conf(z[:, k], prev_emb.to(z.dtype)))  # [R]
        delta, state = head.step(k, z[:, k], prev_emb, prev, state, base[:, k])
        logits = base[:, k] if delta is None else base[:, k] + delta  # [R, V']
        if top:
            tops.append(torch.softmax(logits.float(), -1).amax(-1))  # [R]
        picks, dists = pick_per_row(logits[:, None], samplings, gens)  # [R, 1]
        prev = drafter.to_target_ids(picks[:, 0])
        steps.append((prev, dists))
    drafts = torch.stack([t for t, _ in steps], dim=1)  # [R, b]
    dists = [None if s.greedy else torch.cat([d[r] for _, d in steps]) for r, s in enumerate(samplings)]
    confidence = torch.stack(confidence, dim=1) if confidence else None
    tops = torch.stack(tops, dim=1) if top else None
    return drafts, dists, confidence, tops
