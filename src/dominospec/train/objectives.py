"""Training objectives beside the token cross-entropy (issue 32 item 3), each a TrainConfig option.

- D-PACE position weights (`--position-weights dpace`): slot j of a block weighs
  0.5 + 0.5 * S_j, where S_j = prod_{i<j} q_i(y_i) is the chance the current drafter's draft
  survives to slot j (q_i(y_i): its probability of the label at slot i, teacher forced, no
  gradient). Slots a draft rarely reaches weigh about half; slot 0 always 1.
- Acceptance-aligned loss, LK-style (`--accept-loss W`): -log sum_v min(p_t(v), q(v)) per slot,
  the log of the chance speculative sampling keeps the drafter's token (on a draft vocabulary the
  target's mass outside it counts as rejection), mixed in with weight W.
- Token selection by target entropy (`--entropy-keep F`): of each micro-batch's supervised slots,
  only the fraction F where the target is least certain (highest entropy) are trained on, their
  weights scaled by 1/F so the loss keeps its size.
- Greedy labels (`--greedy-labels`): the token loss (and the confidence head's hit) at each supervised
  slot takes the target's most likely token of the draft vocabulary, the one greedy verification
  keeps, instead of the data's token (on-policy answers are sampled at T > 0, so some of their tokens
  are not the target's greedy choice). The blocks' inputs stay the data's tokens.
"""

from __future__ import annotations

import torch

from ..sampling import acceptance_rate

POSITION_WEIGHTS = ("decay", "dpace")


def dpace_factors(final: torch.Tensor, labels: torch.Tensor, ignore: int) -> torch.Tensor:
    """[N, B] 0.5 + 0.5 * (chance the draft survives to each slot). final: [N, B, V] logits, labels [N, B]."""
    with torch.no_grad():
        q = torch.softmax(final.float(), -1)  # [N, B, V]
        hit = q.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [N, B]
        hit = torch.where(labels == ignore, torch.zeros_like(hit), hit)  # an unlabelled slot ends the block
        survive = torch.cumprod(torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], 1), 1)  # S_0 = 1
        return 0.5 + 0.5 * survive


def acceptance_loss(final: torch.Tensor, p_t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over slots of weights * -log(expected acceptance of the draft). final [N, B, V] logits,
    p_t [N, B, V] the target's probabilities (on the draft vocabulary, possibly summing below 1)."""
    accept = acceptance_rate(torch.softmax(final.float(), -1), p_t.float())  # [N, B]
    return (-torch.log(accept.clamp_min(1e-6)) * weights).sum()


def entropy_selection(p_t: torch.Tensor, weights: torch.Tensor, keep: float) -> torch.Tensor:
    """weights [N, B] with only the `keep` fraction of weighted slots of highest target entropy left, scaled by 1/keep.

    p_t: [N, B, V] the target's probabilities, renormalised here (a draft vocabulary leaves some out).
    """
    if keep >= 1:
        return weights
    with torch.no_grad():
        p = p_t.float() / p_t.float().sum(-1, keepdim=True).clamp_min(1e-12)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)  # [N, B]
        live = weights > 0
        n = int(live.sum())
        if n == 0:
            return weights
        k = max(1, round(keep * n))
        threshold = entropy[live].topk(k).values[-1]
        chosen = live & (entropy >= threshold)
    return torch.where(chosen, weights / keep, torch.zeros_like(weights))


def greedy_labels(labels: torch.Tensor, p_t: torch.Tensor, ignore: int) -> torch.Tensor:
    """[N, B] the target's most likely draft-vocabulary token where `labels` is supervised, `ignore` elsewhere.
    p_t: [N, B, V'] its probabilities on the draft vocabulary."""
    return torch.where(labels == ignore, labels, p_t.argmax(-1))
