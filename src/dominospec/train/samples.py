"""What the trainer checks and derives from a data set before the first step."""

from __future__ import annotations

import torch

from ..errors import DominoError
from ..log import log


def frequent_tokens(samples: list[dict], n: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The n most frequent supervised tokens (plus `always`, e.g. EOS), sorted: a draft vocabulary.

    Ties and unseen slots are filled by ascending id (BPE ids roughly follow merge frequency).
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        ids = torch.tensor(s["input_ids"])
        counts.index_add_(0, ids, torch.tensor(s["loss_mask"], dtype=torch.float64))
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # ties: lower id first
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(n).indices.sort().values


def validate_samples(samples: list[dict], target, max_len: int, source: str, report=None) -> list[dict]:
    """The samples to train on, checked before anything is written (vocabulary, masks).

    A sample longer than the context limit (--max-seq-len, or the target's positions if fewer)
    is cut to it; one left with no two consecutive supervised tokens is dropped. Both are
    counted in one log line rather than refusing the data set.
    """
    report = report or log
    if not samples:
        raise DominoError(f"{source}: no samples to train on")
    limit = min(max_len, target.max_positions or max_len)
    kept, cut, dropped, usable = [], 0, 0, 0
    for n, s in enumerate(samples):
        ids, mask = s["input_ids"], s["loss_mask"]
        where = s.get("id", f"sample {n}")
        if len(ids) != len(mask):
            raise DominoError(f"{source}: {where}: {len(ids)} tokens but {len(mask)} loss-mask entries")
        if ids and max(ids) >= target.vocab_size:
            raise DominoError(
                f"{source}: {where} has token id {max(ids)} outside the target's vocabulary "
                f"({target.vocab_size}); was the data made for another target?"
            )
        if len(ids) > limit:
            cut += 1
            s = {**s, "input_ids": ids[:limit], "loss_mask": mask[:limit]}
            if not _has_anchor(s["loss_mask"]):
                dropped += 1
                continue
        usable += _has_anchor(s["loss_mask"])
        kept.append(s)
    if cut:
        report(
            f"{source}: {cut} sample(s) longer than the context limit {limit} (--max-seq-len / the target's "
            f"max_position_embeddings) cut to it; {dropped} of them dropped, no answer left within the limit"
        )
    if usable == 0:
        raise DominoError(f"{source}: every sample is fully masked (no two consecutive supervised tokens)")
    return kept


def _has_anchor(mask: list[int]) -> bool:
    return any(a and b for a, b in zip(mask[:-1], mask[1:]))


def fresh_drafter(target, samples: list[dict], arch: dict, draft_vocab: int, seed: int):
    """A new drafter for training: shaped by `arch`, its draft vocabulary (if any) the data's most
    frequent supervised tokens plus EOS."""
    from ..drafter import Drafter

    torch.manual_seed(seed)
    drafter = Drafter.for_target(target, **arch, draft_vocab_size=draft_vocab)
    if draft_vocab:
        with torch.no_grad():
            drafter.draft_vocab.copy_(frequent_tokens(samples, draft_vocab, target.vocab_size, target.eos_ids))
        drafter.refresh_head_rows()
    return drafter


def draft_vocab_coverage(drafter, samples: list[dict]) -> float:
    """Share of the supervised tokens that the drafter's draft vocabulary can propose."""
    if not drafter.config.draft_vocab_size:
        return 1.0
    dv = set(drafter.draft_vocab.tolist())
    sup = [t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
    return sum(t in dv for t in sup) / max(1, len(sup))


def init_from_target_layer(drafter, target, first: int) -> list[str]:
    """Copy target decoder layers first, first+1, ... into the draft layers (a warm start); returns what was copied.

    Draft layers are Llama/Qwen3-shaped, so every projection and norm maps by name; a weight the
    target family lacks (q/k norm on Llama) keeps its fresh value (identity norm).
    """
    n, total = len(drafter.layers), target.num_layers
    if first < 0 or first + n > total:
        raise DominoError(
            f"--init-from-layer {first} is out of range: the drafter's {n} layer(s) would copy target layers "
            f"{first}..{first + n - 1}, but the target has layers 0..{total - 1} (use at most {total - n})"
        )
    copied = []
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            src = target.decoder_layer_weights(first + i)
            for name, weight in src.items():
                mine = getattr(getattr(layer, name, None), "weight", None)
                if mine is None:
                    continue
                if mine.shape != weight.shape:
                    raise DominoError(
                        f"--init-from-layer {first + i}: target weight {name} has shape "
                        f"{tuple(weight.shape)}, the draft layer's has {tuple(mine.shape)}"
                    )
                mine.copy_(weight.to(mine.dtype))
                copied.append(f"layers.{i}.{name}")
    return copied
