"""Training blocks: anchors, labels and teacher-forced inputs (the one place these layouts live).

A block anchored at position a reads x_a (the anchor) in slot 0 and MASK after it; slot k
predicts x_{a+1+k} (the shift-label rule). Teacher forcing feeds the head the true tokens
x_{a+k}, so every slot trains in parallel.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..sampling import acceptance_rate

IGNORE = -100


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-k / gamma): early slots matter more, since a late draft counts only if all before it do."""
    return torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with the token at a and at a+1 both supervised (assistant tokens)."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).squeeze(-1)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block: int):
    """For anchors [N]: block input tokens x_{a+k} [N, B] and labels x_{a+1+k} [N, B].

    Slot k reads x_{a+k} (teacher forcing; slot 0 is the anchor) and predicts x_{a+1+k}; labels
    past the sequence end or on unsupervised tokens are IGNORE.
    """
    s = input_ids.shape[0]
    offs = torch.arange(block)
    pos_in = anchors.unsqueeze(1) + offs  # [N, B]
    pos_lab = pos_in + 1
    tokens = input_ids[pos_in.clamp(max=s - 1)]
    labels = input_ids[pos_lab.clamp(max=s - 1)].clone()
    valid = (pos_lab < s) & loss_mask[pos_lab.clamp(max=s - 1)].bool()
    labels[~valid] = IGNORE
    return tokens, labels


def sample_anchors(loss_mask: torch.Tensor, n: int, rng: random.Random) -> torch.Tensor:
    """n anchors drawn without replacement from the candidates (all of them when n is 0 or covers them)."""
    cand = anchor_candidates(loss_mask).tolist()
    if 0 < n < len(cand):
        cand = sorted(rng.sample(cand, n))
    return torch.tensor(cand, dtype=torch.long)


def first_misses(final_logits: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> list[int]:
    """Where a greedy verify of each block rejects its first draft: position a + k for a block anchored at a
    whose slots before k hit and whose slot k (with a label) misses. Blocks that hit to their last label
    reject nothing. Anchoring a block there puts the rejected token in slot 0 (on-policy replay)."""
    valid = labels != IGNORE
    hit = (final_logits.argmax(-1) == labels) & valid  # [N, B]
    k = hit.long().cumprod(-1).sum(-1)  # [N] leading hits
    B = labels.shape[1]
    missed = (k < B) & valid.gather(1, k.clamp(max=B - 1)[:, None])[:, 0]
    return (anchors + k)[missed].tolist()


def replay_anchors(
    loss_mask: torch.Tensor, n: int, missed: list[int], share: float, rng: random.Random
) -> torch.Tensor:
    """n anchors of which up to round(share * n) are drawn from `missed` (positions where the drafter's draft was
    last rejected, still anchor candidates) and the rest uniformly from the other candidates; sorted."""
    cand = anchor_candidates(loss_mask).tolist()
    if n == 0 or n >= len(cand):
        return torch.tensor(cand, dtype=torch.long)
    allowed = set(cand)
    pool = sorted({m for m in missed if m in allowed})
    hard = rng.sample(pool, min(len(pool), round(share * n)))
    taken = set(hard)
    rest = rng.sample([c for c in cand if c not in taken], n - len(hard))
    return torch.tensor(sorted(hard + rest), dtype=torch.long)


@dataclass
class TeacherForced:
    """One sequence's blocks run the training way. Shapes: N blocks of B slots, H hidden, V' draft vocabulary."""

    tokens: torch.Tensor  # [N, B] x_{a+k}: what slot k reads (slot 0: the anchor)
    labels: torch.Tensor  # [N, B] x_{a+1+k} as target ids, IGNORE where there is none
    z: torch.Tensor  # [N, B, H] backbone output
    prev_emb: torch.Tensor  # [N, B, H] embeddings of tokens
    base: torch.Tensor  # [N, B, V'] frozen LM head on z
    final: torch.Tensor  # [N, B, V'] base + the head's teacher-forced correction


def teacher_forced_blocks(
    drafter, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor
) -> TeacherForced:
    """All blocks of one sequence in one drafter forward, the head fed the true tokens (training and validation).

    features: [S, n*H] target features of the whole sequence; anchors: [N] block anchor positions.
    """
    tokens, labels = make_blocks(input_ids, loss_mask, anchors, drafter.config.block_size)
    z = drafter.forward_blocks(features.unsqueeze(0), anchors, tokens[:, 0])
    base = drafter.base_logits(z)
    prev_emb = drafter.embed(tokens).to(z.dtype)
    delta = drafter.head.teacher_forced(z, prev_emb, tokens, base)
    return TeacherForced(tokens, labels, z, prev_emb, base, base if delta is None else base + delta)


def teacher_forced_packed(drafter, features: list[torch.Tensor], blocks: list[tuple]) -> TeacherForced:
    """`teacher_forced_blocks` for several sequences in one drafter forward (training's fast path).

    features: per sequence [S_r, n*H]; blocks: per sequence (anchors [N_r], tokens [N_r, B], labels
    [N_r, B]) from `make_blocks`. The result's rows are the blocks of all sequences in order.
    """
    lengths = [f.shape[0] for f in features]
    counts = [a.shape[0] for a, _, _ in blocks]
    anchors = torch.cat([a for a, _, _ in blocks])
    tokens = torch.cat([t for _, t, _ in blocks])
    labels = torch.cat([lab for _, _, lab in blocks])
    z = drafter.forward_packed(torch.cat(features), lengths, anchors, tokens[:, 0], counts)
    base = drafter.base_logits(z)
    prev_emb = drafter.embed(tokens).to(z.dtype)
    delta = drafter.head.teacher_forced(z, prev_emb, tokens, base)
    return TeacherForced(tokens, labels, z, prev_emb, base, base if delta is None else base + delta)


def dense_or_sampled_anchors(loss_mask: torch.Tensor, n: int, seed: int, epoch: int, key) -> torch.Tensor:
    """A sample's anchors for one epoch: every candidate when n is 0 (dense), else n of them drawn
    anew each epoch; a pure function of (seed, epoch, key), so resumed and multi-process runs agree."""
    return sample_anchors(loss_mask, n, random.Random(f"{seed}-epoch{epoch}-{key}"))


def simulated_tau(
    final_logits: torch.Tensor, labels: torch.Tensor, target_probs: torch.Tensor | None = None
) -> tuple[float, float | None]:
    """Expected tokens per cycle if these blocks were verified: greedy and (with p_t) sampling.

    greedy: 1 + sum_k prod_{i<=k} [argmax == label]; sampling: 1 + sum_k prod_{i<=k} (1 - TV_i).
    """
    valid = labels != IGNORE
    acc = ((final_logits.argmax(-1) == labels) & valid).float()
    greedy = float((1 + acc.cumprod(-1).sum(-1)).mean())
    sampled = None
    if target_probs is not None:
        p_d = torch.softmax(final_logits.float(), -1)
        keep = acceptance_rate(p_d, target_probs)
        keep = keep * valid.float()
        sampled = float((1 + keep.cumprod(-1).sum(-1)).mean())
    return greedy, sampled
