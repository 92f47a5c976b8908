"""The training-recipe options measured in the drafter A/B: soft-label distillation, dense anchors,
a draft layer started from a target layer."""

import json
import random

import pytest
import torch
from conftest import synthetic_samples, tiny_drafter, tiny_target

from dominospec import DominoError, Drafter, DrafterConfig
from dominospec.train.blocks import anchor_candidates, sample_anchors
from dominospec.train.samples import init_from_target_layer
from dominospec.train.trainer import TrainConfig, Trainer


def test_distillation_fits_the_targets_distribution(tmp_path, qwen3_target):
    """Protects: --distill trains on KL(target || draft) (logged as kl, falling) and still learns the greedy tokens."""
    samples = synthetic_samples(qwen3_target, n=8, answer_len=24)
    d = tiny_drafter(qwen3_target, block_size=4, randomize_head=False, confidence=True).float()
    cfg = TrainConfig(max_steps=40, batch_size=4, anchors=12, lr=3e-3, distill=1.0, save_every=1000)
    last = Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False).fit()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in r and "tau_sampled" in r for r in recs)
    assert recs[-1]["kl"] < 0.6 * recs[0]["kl"], (recs[0]["kl"], recs[-1]["kl"])
    assert last["tau_greedy"] > 1.8


def test_distill_weight_is_checked():
    with pytest.raises(DominoError, match="--distill"):
        TrainConfig(distill=1.5)


@pytest.mark.parametrize("packed", [True, False])
def test_dense_anchors_take_every_supervised_position(packed, tmp_path, qwen3_target):
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    assert sample_anchors(mask, 0, random.Random(0)).tolist() == anchor_candidates(mask).tolist() == [2, 3, 6, 7, 8]
    assert sample_anchors(mask, 2, random.Random(0)).numel() == 2
    samples = synthetic_samples(qwen3_target, n=4, answer_len=16)
    d = tiny_drafter(qwen3_target, block_size=4, randomize_head=False).float()
    cfg = TrainConfig(max_steps=1, batch_size=4, anchors=0, packed=packed)
    trainer = Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False)
    seen = []
    if packed:
        real_packed = trainer._packed_terms

        def counting_packed(batch, den, lam):
            seen.extend(piece[0].numel() for _, piece in batch)
            return real_packed(batch, den, lam)

        trainer._packed_terms = counting_packed
    else:
        real = trainer.sequence_terms

        def counting(i, f, fin, anchors, lam):
            seen.append(anchors.numel())
            return real(i, f, fin, anchors, lam)

        trainer.sequence_terms = counting
    trainer.train_step()
    assert seen == [15] * 4  # 16 supervised tokens: 15 positions whose next token is supervised too


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_draft_layer_starts_from_the_target_layer(family):
    """Protects: --init-from-layer copies projections and norms by name (q/k norm only where the target has them)."""
    target = tiny_target(family)
    d = Drafter(DrafterConfig.for_target(target, num_layers=2, block_size=4)).attach(target)
    copied = init_from_target_layer(d, target, 1)
    for i in range(2):
        src = target.decoder_layer_weights(1 + i)
        layer = d.layers[i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_norm"):
            assert torch.equal(getattr(layer, name).weight, src[name].to(layer.q_proj.weight.dtype)), (i, name)
        assert ("q_norm" in src) == (family == "qwen3")
        assert (f"layers.{i}.q_norm" in copied) == (family == "qwen3")
    with pytest.raises(DominoError, match="out of range"):
        init_from_target_layer(d, target, 3)  # layers 3 and 4 of a 4-layer target
