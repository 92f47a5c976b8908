"""A drafter can fit what it trains on: the set-up (model, features, labels) has no cap of its own (issue 53)."""

import torch
from conftest import synthetic_samples, tiny_drafter

from dominospec.train.trainer import TrainConfig, Trainer
from dominospec.train.validate import Validator


def test_a_drafter_fits_a_handful_of_sequences(tmp_path, qwen3_target):
    """On four of the target's own greedy answers, trained on every position for 60 steps, the first
    draft equals the target's token at nearly every anchor: a drafter whose features, labels or block layout
    were wrong (an off-by-one, a feature row from the wrong position) would stay far below."""
    target = qwen3_target
    samples = synthetic_samples(target, n=4, answer_len=24)
    torch.manual_seed(0)
    d = tiny_drafter(target, block_size=4, randomize_head=False).float()
    judge = Validator(target, samples, max_anchors=0)  # every anchor, teacher-forced
    before = judge.evaluate(d).conditional[0]
    cfg = TrainConfig(max_steps=60, batch_size=4, anchors=0, lr=3e-3, save_every=10**6, log_every=10**6)
    Trainer(target, d, samples, tmp_path, cfg, progress=False).fit()
    after = judge.evaluate(d.eval())
    assert after.conditional[0] >= 0.95, (before, after.conditional)
    assert after.tau > 3.0, after.conditional  # of the block's 5 tokens (4 drafts and the bonus)
