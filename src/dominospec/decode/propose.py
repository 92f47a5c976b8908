"""Proposing a block: the drafter's backbone pass and its head's left-to-right rollout.

A `Proposal` is what travels from a proposer to the verifier: the draft tokens, the
distributions they were really drawn from (needed for lossless rejection sampling) and, when
the drafter has a confidence head, its per-slot confidence logits (for a verify-length policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, sample, warp_probs


@dataclass
class Proposal:
    drafts: torch.Tensor  # [b] target token ids
    draft_probs: torch.Tensor | None = None  # [b, V] when sampling: zero outside a draft vocabulary
    confidence_logits: torch.Tensor | None = None  # [b] logit of P(draft k survives | drafts < k did)
    source: str = "drafter"  # "drafter" | "lookup"

    def __len__(self) -> int:
        return int(self.drafts.shape[0])


def draft_block(
    drafter, cache, anchor: torch.Tensor, b: int, sampling: SamplingConfig, gen, use_head: bool = True
) -> Proposal:
    """Backbone pass, then the head's left-to-right rollout over the first b slots.

    anchor: [1] the last committed token; the drafter cache holds the context before it.
    """
    z = drafter.backbone_block(cache, anchor)[0, :b]  # [b, H]
    base = drafter.base_logits(z)  # [b, V'] (V' = draft vocabulary)
    head = drafter.head
    conf = drafter.confidence
    if not use_head or not head.corrects:
        if sampling.greedy:
            drafts, dists = drafter.to_target_ids(base.argmax(-1)), None
        else:
            probs = warp_probs(base, sampling)
            drafts, dists = drafter.to_target_ids(sample(probs, gen)), drafter.to_target_probs(probs)
        confidence = None
        if conf is not None:  # slot k reads the token before it: the anchor, then the drafts
            prev = torch.cat([anchor, drafts[:-1]])
            confidence = conf(z, drafter.embed(prev).to(z.dtype))
        return Proposal(drafts, dists, confidence)
    drafts, dists, confidence = [], [], []
    prev = anchor  # [1] target id
    state = head.init_state(z[:1])
    for k in range(b):
        prev_emb = drafter.embed(prev)
        if conf is not None:
            confidence.append(conf(z[k : k + 1], prev_emb.to(z.dtype)))
        delta, state = head.step(k, z[k : k + 1], prev_emb, prev, state)
        logits = base[k : k + 1] if delta is None else base[k : k + 1] + delta
        if sampling.greedy:
            pick = logits.argmax(-1)
        else:
            p = warp_probs(logits, sampling)
            pick = sample(p, gen)
            dists.append(p)
        prev = drafter.to_target_ids(pick)
        drafts.append(prev)
    return Proposal(
        torch.cat(drafts),
        drafter.to_target_probs(torch.cat(dists)) if dists else None,
        torch.cat(confidence) if confidence else None,
    )
