"""The packed training step: the same blocks, loss and gradients as the per-sequence step, only faster."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from conftest import synthetic_samples, tiny_drafter

from dominospec.train import trainer as trainer_mod
from dominospec.train.blocks import anchor_candidates, dense_or_sampled_anchors
from dominospec.train.trainer import TrainConfig, Trainer


@pytest.mark.parametrize("fuse", [False, True])
def test_forward_packed_equals_forward_blocks_per_sequence(fuse, qwen3_target):
    d = tiny_drafter(qwen3_target, block_size=4, fuse_context=fuse).double()
    torch.manual_seed(0)
    lengths, counts = [13, 9], [3, 3]
    feats = [torch.randn(n, d.fc.in_features, dtype=torch.float64) for n in lengths]
    anchor_pos = [torch.tensor([0, 5, 11]), torch.tensor([0, 3, 8])]  # anchor 0 of the second: no row before it
    tokens = [torch.randint(0, qwen3_target.vocab_size, (n,)) for n in counts]
    packed = d.forward_packed(torch.cat(feats), lengths, torch.cat(anchor_pos), torch.cat(tokens), counts)
    apart = torch.cat([d.forward_blocks(f.unsqueeze(0), a, t) for f, a, t in zip(feats, anchor_pos, tokens)])
    assert torch.allclose(packed, apart, atol=1e-10)
    # each block sees its own sequence only: changing sequence 0's context moves its blocks past the
    # first row (control: the change is visible) and leaves sequence 1's blocks as they were
    bumped = [feats[0].clone(), feats[1]]
    bumped[0][0] += 1.0
    moved = d.forward_packed(torch.cat(bumped), lengths, torch.cat(anchor_pos), torch.cat(tokens), counts)
    assert not torch.allclose(moved[1:3], packed[1:3], atol=1e-6)
    assert torch.allclose(moved[3:], packed[3:], atol=1e-12)


def test_dense_anchors_deterministic_per_seed_and_epoch():
    mask = torch.tensor([0, 0] + [1] * 30)
    assert torch.equal(dense_or_sampled_anchors(mask, 0, 0, 0, 7), anchor_candidates(mask))  # dense: all of them
    again = [dense_or_sampled_anchors(mask, 4, 3, 1, k) for k in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(again, [dense_or_sampled_anchors(mask, 4, 3, 1, k) for k in range(5)]))
    # controls: another epoch or seed draws other anchors
    assert any(not torch.equal(a, dense_or_sampled_anchors(mask, 4, 3, 2, k)) for k, a in enumerate(again))
    assert any(not torch.equal(a, dense_or_sampled_anchors(mask, 4, 4, 1, k)) for k, a in enumerate(again))


@pytest.mark.parametrize("chunk, greedy", [(128, False), (5, False), (5, True)])  # 5: blocks split over micro-batches
def test_packed_step_matches_per_sequence_step(chunk, greedy, qwen3_target, tmp_path, monkeypatch):
    """fp32, the same features (both through the fp16 cache), dense anchors so both draw the same blocks."""
    monkeypatch.setattr(trainer_mod, "PACKED_BLOCKS", chunk)
    target = qwen3_target
    samples = synthetic_samples(target, n=4, answer_len=12)
    runs = {}
    for packed in (False, True):
        d = tiny_drafter(target, block_size=4, confidence=True, draft_vocab=32).float()
        cfg = TrainConfig(
            max_steps=2, batch_size=3, anchors=0, distill=0.5, lr=1e-3, packed=packed, greedy_labels=greedy
        )
        t = Trainer(target, d, samples, tmp_path / str(packed), cfg, feature_cache=tmp_path / "cache", progress=False)
        (tmp_path / "cache").mkdir(exist_ok=True)
        t.features(list(range(len(samples))))  # both steps read the fp16 cache
        rec = t.train_step()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        runs[packed] = rec, grads, t.positions
    (old, old_g, old_n), (new, new_g, new_n) = runs[False], runs[True]
    assert old_n == new_n > 0
    for key in ("ce_final", "ce_base", "kl", "bce", "tau_greedy", "grad_norm"):
        assert new[key] == pytest.approx(old[key], rel=1e-4, abs=1e-6), key
    assert old_g.keys() == new_g.keys()
    for name in old_g:
        assert torch.allclose(new_g[name], old_g[name], rtol=1e-4, atol=1e-6), name


def test_bf16_autocast_trains(qwen3_target, tmp_path):
    samples = synthetic_samples(qwen3_target, n=8, answer_len=24)
    d = tiny_drafter(qwen3_target, head="none", block_size=4, randomize_head=False).float()
    cfg = TrainConfig(max_steps=30, batch_size=4, anchors=8, lr=3e-3, bf16=True, save_every=1000)
    t = Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False)
    ce = [t.train_step()["ce"] for _ in range(30)]
    assert all(math.isfinite(x) for x in ce)
    assert sum(ce[-5:]) / 5 < 0.8 * sum(ce[:5]) / 5, ce


def test_bf16_steps_agree_with_fp32_steps(qwen3_target, tmp_path):
    """Ten packed steps under bf16 autocast against the same ten in fp32 (same drafter, features, blocks).
    Stated tolerance: every step's loss terms agree to 2% relative (measured: within 0.5%), and the first
    step's gradient of every parameter points the same way (cosine >= 0.995, measured >= 0.9998) with a norm
    within 3% (measured 1.1%). The weights themselves are not compared: Adam's first steps move a weight by
    about lr whatever its gradient's size, so a near-zero gradient's rounding decides its direction."""
    target = qwen3_target
    samples = synthetic_samples(target, n=4, answer_len=16)
    start = tiny_drafter(target, block_size=4, confidence=True, draft_vocab=32).float()
    runs = {}
    for bf16 in (False, True):
        d = copy.deepcopy(start)
        cfg = TrainConfig(max_steps=10, batch_size=4, anchors=0, distill=0.5, lr=1e-3, bf16=bf16, save_every=1000)
        t = Trainer(target, d, samples, tmp_path / str(bf16), cfg, progress=False)
        records = [t.train_step()]
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        records += [t.train_step() for _ in range(9)]
        runs[bf16] = records, grads
    (ref, ref_g), (got, got_g) = runs[False], runs[True]
    for step, (a, b) in enumerate(zip(ref, got)):
        for key in ("ce_final", "ce_base", "kl", "bce"):
            assert b[key] == pytest.approx(a[key], rel=2e-2), (step, key)
    assert any(b["kl"] != a["kl"] for a, b in zip(ref, got))  # control: bf16 really ran (not fp32's bits)
    assert ref_g.keys() == got_g.keys() and ref_g
    for name, g in ref_g.items():
        if g.norm() < 1e-8:
            continue
        cos = torch.nn.functional.cosine_similarity(got_g[name].flatten(), g.flatten(), dim=0)
        assert cos >= 0.995, (name, float(cos))
        assert got_g[name].norm() == pytest.approx(float(g.norm()), rel=3e-2), name


def test_bf16_needs_the_packed_step():
    from dominospec.errors import DominoError

    with pytest.raises(DominoError, match="bf16"):
        TrainConfig(bf16=True, packed=False)


def test_checkpoint_from_before_the_packed_step_resumes_only_as_it_ran(qwen3_target, tmp_path):
    """A checkpoint written before --packed/--bf16/--val-walk existed ran per-sequence, spread validation:
    resuming it with the new defaults is refused naming the flag; with the old values it continues."""
    from dominospec.errors import DominoError

    samples = synthetic_samples(qwen3_target, n=4, answer_len=12)
    old = TrainConfig(max_steps=3, batch_size=2, anchors=4, packed=False, val_walk=False)
    t = Trainer(qwen3_target, tiny_drafter(qwen3_target).float(), samples, tmp_path, old, progress=False)
    t.train_step()
    t.save_checkpoint()
    state = torch.load(tmp_path / "train_state" / "trainer.pt", weights_only=False)
    for key in ("packed", "bf16", "val_walk"):
        del state["train_config"][key]
    torch.save(state, tmp_path / "train_state" / "trainer.pt")
    new = TrainConfig(max_steps=3, batch_size=2, anchors=4)
    fresh = Trainer(qwen3_target, tiny_drafter(qwen3_target).float(), samples, tmp_path, new, progress=False)
    with pytest.raises(DominoError, match="--packed: True now, False in the checkpoint"):
        fresh.load_checkpoint()
    again = Trainer(qwen3_target, tiny_drafter(qwen3_target).float(), samples, tmp_path, old, progress=False)
    assert again.load_checkpoint() and again.step == 1


def test_the_packed_cpu_step_gives_free_heap_back_every_few_steps(tmp_path, qwen3_target, monkeypatch):
    """Protects: with every block kept on the heap (the packed CPU step), the trainer hands the heap's free pages
    back every TRIM_EVERY steps (a run over the full data set grew to 16 GB resident without it)."""
    trainer_module = trainer_mod
    calls = []
    monkeypatch.setattr(trainer_module, "TRIM_EVERY", 2)
    monkeypatch.setattr(trainer_module, "return_free_heap", lambda: calls.append(1) or True)
    samples = synthetic_samples(qwen3_target, n=4, answer_len=16)
    d = tiny_drafter(qwen3_target, head="domino", block_size=4, randomize_head=False).float()
    cfg = trainer_module.TrainConfig(max_steps=5, batch_size=2, anchors=4, save_every=1000)
    t = trainer_module.Trainer(qwen3_target, d, samples, tmp_path, cfg, progress=False)
    assert t._on_heap == (sys.platform.startswith("linux"))
    t.fit()
    assert len(calls) == (2 if t._on_heap else 0)  # after steps 2 and 4


def test_the_feature_memory_budget_bounds_what_the_packed_step_keeps(tmp_path, qwen3_target):
    """Protects: train --memory-gb: the packed step keeps samples' fp16 features in memory only within the budget
    (0 keeps none; they are read or recomputed each epoch), and the default keeps them."""
    samples = synthetic_samples(qwen3_target, n=4, answer_len=16)
    for budget, kept in ((0.0, 0), (4.0, 4)):
        d = tiny_drafter(qwen3_target, head="domino", block_size=4, randomize_head=False).float()
        cfg = TrainConfig(max_steps=1, batch_size=4, anchors=4, save_every=1000)
        t = Trainer(qwen3_target, d, samples, tmp_path / str(budget), cfg, progress=False, memory_gb=budget)
        t.train_step()
        assert len(t._in_memory) == kept
