"""Training: block layout, teacher forcing = rollout, learning, exact resume, 1 vs 2 processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import synthetic_samples, tiny_drafter
from safetensors.torch import load_file

from dominospec import DominoError, Drafter, generate_autoregressive, generate_speculative
from dominospec.export.plan import plan_export
from dominospec.train.blocks import IGNORE, anchor_candidates, make_blocks, simulated_tau
from dominospec.train.run import TrainJob, training_subset
from dominospec.train.samples import validate_samples
from dominospec.train.trainer import TrainConfig, Trainer

HERE = Path(__file__).parent


def test_block_labels_follow_the_shift_convention():
    """Slot k of the block anchored at a reads x_{a+k} and is labelled x_{a+1+k}."""
    ids = torch.arange(100, 112)  # token value = 100 + position
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1])
    assert anchor_candidates(mask).tolist() == [3, 4, 5, 6, 7, 8]
    tokens, labels = make_blocks(ids, mask, torch.tensor([3, 8]), 4)
    assert tokens.tolist() == [[103, 104, 105, 106], [108, 109, 110, 111]]
    # position 10 is unsupervised, 12 is past the end
    assert labels.tolist() == [[104, 105, 106, 107], [109, IGNORE, 111, IGNORE]]


def test_simulated_tau_counts_the_accepted_prefix():
    logits = torch.full((2, 3, 5), -1.0)
    labels = torch.tensor([[1, 2, 3], [1, 2, 3]])
    for k, tok in enumerate([1, 2, 0]):  # block 0: two hits then a miss -> tau 3
        logits[0, k, tok] = 1
    for k, tok in enumerate([0, 2, 3]):  # block 1: first miss -> tau 1
        logits[1, k, tok] = 1
    greedy, _ = simulated_tau(logits, labels)
    assert greedy == pytest.approx(2.0)
    same = torch.softmax(logits, -1)
    _, sampled = simulated_tau(logits, labels, target_probs=same)  # identical distributions accept all
    assert sampled == pytest.approx(4.0)


@pytest.mark.parametrize("head", ["domino", "markov", "rnn", "path"])
def test_teacher_forced_head_equals_the_left_to_right_rollout(head, qwen3_target):
    """Training's parallel teacher-forced logits equal inference's step-by-step logits on the same tokens."""
    d = tiny_drafter(qwen3_target, head=head, block_size=5)
    torch.manual_seed(0)
    z = torch.randn(2, 5, qwen3_target.hidden_size, dtype=torch.float64)
    tokens = torch.randint(0, qwen3_target.vocab_size, (2, 5))
    with torch.no_grad():
        base = torch.randn(2, 5, qwen3_target.vocab_size, dtype=torch.float64)
        tf = d.head.teacher_forced(z, d.embed(tokens), tokens, base)
        for n in range(2):
            state = d.head.init_state(z[n : n + 1])
            for k in range(5):
                delta, state = d.head.step(
                    k, z[n, k : k + 1], d.embed(tokens[n, k : k + 1]), tokens[n, k : k + 1], state, base[n, k : k + 1]
                )
                want = torch.zeros_like(tf[n, k]) if delta is None else delta[0]
                assert torch.allclose(tf[n, k], want, atol=1e-10), (head, n, k)
    if head in ("domino", "path"):
        assert torch.all(tf[:, 0] == 0)  # slot 0 stays uncorrected
    if head == "path":  # only the top-m base candidates of a slot move, and they do
        moved = tf[:, 1:] != 0
        assert moved.sum(-1).max() <= d.head.m and moved.any()
        top = base[:, 1:].topk(d.head.m, dim=-1).indices
        assert torch.all(moved.gather(-1, top) | (tf[:, 1:].gather(-1, top) == 0))
        assert not (moved & ~torch.zeros_like(moved).scatter(-1, top, True)).any()


@pytest.mark.slow
@pytest.mark.parametrize("head", ["domino", "none", "rnn"])
def test_training_raises_acceptance(head, tmp_path, qwen3_target):
    target = qwen3_target
    samples = synthetic_samples(target, n=12, answer_len=32)
    d = tiny_drafter(target, head=head, block_size=4, randomize_head=False, confidence=head == "rnn").float()
    before = [
        generate_speculative(target, d.to(target.dtype), s["input_ids"][:5], 32, eos_ids=[]).tau for s in samples[:4]
    ]
    trainer = Trainer(
        target,
        d,
        samples,
        tmp_path,
        TrainConfig(max_steps=60, batch_size=4, anchors=12, lr=3e-3, save_every=1000),
        progress=False,
    )
    last = trainer.fit()
    assert last["tau_greedy"] > 2.0
    d.eval().to(target.dtype)
    after = [generate_speculative(target, d, s["input_ids"][:5], 32, eos_ids=[]).tau for s in samples[:4]]
    assert sum(after) / 4 > sum(before) / 4 + 0.5, (before, after)
    assert (tmp_path / "config.json").exists() and (tmp_path / "metrics.jsonl").exists()
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 61))
    if head == "domino":  # the base-anchored curriculum: lambda falls linearly from 1 to 0
        assert recs[0]["lambda"] == pytest.approx(1.0) and recs[-1]["lambda"] < 0.05


def _run_worker(out, steps, stop_after=None, resume=False, procs=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    args = [
        str(HERE / "train_worker.py"),
        str(out),
        str(steps),
        str(stop_after) if stop_after else "-",
        "resume" if resume else "fresh",
    ]
    if procs == 1:
        cmd = [sys.executable] + args
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(procs),
            "--master_port",
            "29533",
        ] + args
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_resume_after_kill_reaches_the_same_weights(tmp_path):
    """A run killed hard after step 5 (checkpoint at 4) and resumed ends exactly like an uninterrupted one."""
    full, broken = tmp_path / "full", tmp_path / "broken"
    r = _run_worker(full, 8)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run_worker(broken, 8, stop_after=5)
    assert r.returncode == 137, r.stderr[-3000:]
    assert not (broken / "model.safetensors").exists()
    r = _run_worker(broken, 8, resume=True)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(str(full / "model.safetensors")), load_file(str(broken / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recs = [json.loads(l) for l in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") != "val"] == list(range(1, 9))
    assert [r["step"] for r in recs if r.get("kind") == "val"] == [3, 6, 8]
    assert (full / "acceptance.json").read_text() == (broken / "acceptance.json").read_text()


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """torchrun with 2 gloo processes computes the same updates as 1 process (global loss normalisation)."""
    one, two = tmp_path / "one", tmp_path / "two"
    r = _run_worker(one, 4)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run_worker(two, 4, procs=2)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst
    la = [json.loads(l) for l in (one / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l) for l in (two / "metrics.jsonl").read_text().splitlines()]
    la, lb = [r for r in la if r.get("kind") != "val"], [r for r in lb if r.get("kind") != "val"]
    assert [r["ce_final"] for r in la] == pytest.approx([r["ce_final"] for r in lb], rel=1e-5)
    assert [r["tokens"] for r in la] == [r["tokens"] for r in lb]  # the batch was split, not repeated


def test_bad_training_data_is_refused_before_anything_is_written(qwen3_target):
    good = {"id": "x:0", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}
    with pytest.raises(DominoError, match="no samples"):
        validate_samples([], qwen3_target, 100, "data")
    with pytest.raises(DominoError, match=r"x:1 has token id 70 outside the target's vocabulary \(64\)"):
        validate_samples([good, {"id": "x:1", "input_ids": [1, 70], "loss_mask": [1, 1]}], qwen3_target, 100, "d")
    with pytest.raises(DominoError, match="every sample is fully masked"):
        validate_samples([dict(good, loss_mask=[0, 1, 0, 1])], qwen3_target, 100, "d")
    with pytest.raises(DominoError, match="4 tokens but 3 loss-mask entries"):
        validate_samples([dict(good, loss_mask=[0, 1, 1])], qwen3_target, 100, "d")


def test_draft_vocabulary_takes_the_most_frequent_answer_tokens():
    from dominospec.train.samples import frequent_tokens

    samples = [
        {"input_ids": [5, 5, 5, 7, 7, 9, 1], "loss_mask": [1, 1, 1, 1, 1, 0, 1]},
        {"input_ids": [9, 9, 9, 3], "loss_mask": [0, 0, 0, 1]},
    ]  # 9 is only ever in prompts
    assert frequent_tokens(samples, 3, 12, always=[11]).tolist() == [5, 7, 11]
    assert frequent_tokens(samples, 5, 12, always=[11]).tolist() == [1, 3, 5, 7, 11]


@pytest.mark.parametrize(
    "field, value, message",
    [("val_every", 0, "--val-every must be an integer >= 1, got 0"), ("val_anchors", -1, "--val-anchors must be")],
)
def test_validation_intervals_are_range_checked_from_python(field, value, message):
    # val_every=0 used to reach `step % 0` deep in the training loop
    with pytest.raises(DominoError, match=message):
        TrainConfig(**{field: value})


def test_val_anchors_zero_means_all_anchors():
    from dominospec.train.validate import validation_anchors

    assert TrainConfig(val_anchors=0).val_anchors == 0
    mask = torch.tensor([0, 0] + [1] * 20)
    assert validation_anchors(mask, 0).numel() == validation_anchors(mask, 10_000).numel() > 3


def test_train_flags_default_to_the_library_dataclasses():
    """`dominospec train` restates no default: each flag's default is the field's in TrainConfig, TrainJob,
    DrafterConfig."""
    import dataclasses

    from dominospec.cli import build_parser
    from dominospec.drafter import DrafterConfig
    from dominospec.train.run import TrainJob

    args = vars(build_parser().parse_args(["train", "--data", "d", "--out", "o"]))
    pairs = [(TrainConfig, f.name, f.name) for f in dataclasses.fields(TrainConfig) if f.name in args]
    pairs += [(TrainJob, name, name) for name in ("val_fraction", "draft_vocab", "memory_gb")]
    pairs += [(DrafterConfig, name, name) for name in ("block_size", "gru_hidden_size", "rank")]
    assert args["head"] is None  # chosen by --serve-with (markov for vllm), else DrafterConfig's default
    assert args["layers"] is None  # DrafterConfig's default for a fresh drafter; with --init, DIR's own count
    assert len(pairs) >= 16, pairs  # control: the flags were found at all
    for cls, field, flag in pairs:
        assert args[flag] == {f.name: f for f in dataclasses.fields(cls)}[field].default, (cls.__name__, field)


def test_train_job_refuses_contradictory_starts_before_any_work(tmp_path):
    from dominospec.train.run import TrainJob

    with pytest.raises(DominoError, match="--init-from-layer starts a fresh drafter"):
        TrainJob(data=tmp_path, out=tmp_path / "o", init="somewhere", init_from_layer=3)
    with pytest.raises(DominoError, match="--val-fraction must be in"):
        TrainJob(data=tmp_path, out=tmp_path / "o", val_fraction=1.0)
    with pytest.raises(DominoError, match="--memory-gb must be a finite number >= 0, got -1"):
        TrainJob(data=tmp_path, out=tmp_path / "o", memory_gb=-1)
    assert not (tmp_path / "o").exists()


def test_training_subset_takes_a_prefix_of_one_labels_kind():
    """--train-labels / --train-samples pick the first N training samples of a kind, in data set order."""
    samples = [{"id": f"a:{i}", "labels": "on-policy" if i % 3 else "target-argmax"} for i in range(12)]
    samples.append({"id": "old:0"})  # a sample written before labels were recorded is on-policy
    on = training_subset(samples, "on-policy", None, "D", 0)
    assert [s["id"] for s in on] == ["a:1", "a:2", "a:4", "a:5", "a:7", "a:8", "a:10", "a:11", "old:0"]
    assert training_subset(samples, "on-policy", 3, "D", 0) == on[:3]
    assert [s["id"] for s in training_subset(samples, "off-policy", 2, "D", 0)] == ["a:0", "a:3"]
    assert training_subset(samples, "all", None, "D", 0) == samples
    with pytest.raises(DominoError, match=r"--train-samples 10: D has only 9 training samples \(on-policy"):
        training_subset(samples, "on-policy", 10, "D", 5)
    with pytest.raises(DominoError, match="--train-labels off-policy: D holds no off-policy training sample"):
        training_subset(samples[-1:], "off-policy", None, "D", 0)
    mix = training_subset(samples, "all", (2, 1), "D", 0)  # the first 2 on-policy and the first off-policy one
    assert [s["id"] for s in mix] == ["a:0", "a:1", "a:2"]
    with pytest.raises(DominoError, match="--train-labels must be one of"):
        TrainJob(data="D", out="O", train_labels="mixed")
    with pytest.raises(DominoError, match="N,M counts on- and off-policy samples"):
        TrainJob(data="D", out="O", train_labels="on-policy", train_samples=(2, 1))


class Killed(Exception):
    pass


def test_resume_from_a_kept_checkpoint_takes_the_uninterrupted_step(tmp_path, qwen3_target):
    """A run's train_state copied away (as into a repository) and continued in a new --out on another
    drafter object, with no feature cache and nothing else of the first run: the step after the resume
    is the uninterrupted run's step, bit for bit (loss terms, learning rate, every weight)."""
    target = qwen3_target
    samples = synthetic_samples(target, n=6)
    start = tiny_drafter(target, block_size=4, confidence=True, randomize_head=False).float()
    cfg = TrainConfig(max_steps=6, batch_size=4, anchors=6, distill=0.5, lr=3e-3, save_every=1000)
    run = Trainer(target, start, samples, tmp_path / "day1", cfg, feature_cache=tmp_path / "cache", progress=False)
    run.train_step(), run.train_step()  # into the second epoch: a new anchor draw, a cosine schedule under way
    run.save_checkpoint()
    kept = tmp_path / "repo" / "checkpoints" / "run"
    shutil.copytree(tmp_path / "day1" / "train_state", kept)
    want = run.train_step()
    want_w = {n: p.detach().clone() for n, p in start.named_parameters()}

    other = tiny_drafter(target, block_size=4, confidence=True).float()  # other weights: the checkpoint's must win
    again = Trainer(target, other, samples, tmp_path / "day2", cfg, progress=False)
    assert again.load_checkpoint(kept) and again.step == 2
    got = again.train_step()
    for key in ("ce_final", "ce_base", "kl", "bce", "lr", "grad_norm"):
        assert got[key] == want[key], key
    got_w = dict(other.named_parameters())
    assert want_w.keys() == got_w.keys() and all(torch.equal(want_w[n], got_w[n]) for n in want_w)
    # control: without the checkpoint the same step on those weights differs
    fresh = Trainer(target, tiny_drafter(target, block_size=4, confidence=True).float(), samples, tmp_path / "x", cfg)
    assert fresh.train_step()["kl"] != want["kl"]


def test_resume_from_a_finished_run_exports_it_in_the_new_out(tmp_path, qwen3_target):
    """A kept checkpoint of a run's last step, continued in a new --out: nothing left to train, the drafter is
    exported there (the new OUT has no metrics to plot; that once raised FileNotFoundError)."""
    samples = synthetic_samples(qwen3_target, n=4)
    cfg = TrainConfig(max_steps=2, batch_size=4, anchors=4, lr=3e-3)
    Trainer(qwen3_target, tiny_drafter(qwen3_target, block_size=4).float(), samples, tmp_path / "a", cfg).fit()
    again = Trainer(qwen3_target, tiny_drafter(qwen3_target, block_size=4).float(), samples, tmp_path / "b", cfg)
    again.load_checkpoint(tmp_path / "a" / "train_state")
    again.fit()
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_refuses_an_out_that_has_its_own_checkpoint(tmp_path):
    (tmp_path / "out" / "train_state").mkdir(parents=True)
    job = TrainJob(data=tmp_path / "d", out=tmp_path / "out", resume_from=tmp_path / "kept")
    with pytest.raises(DominoError, match="already holds a training checkpoint: continue it with --resume"):
        job.check_outputs()
    job = TrainJob(data=tmp_path / "d", out=tmp_path / "new", resume_from=tmp_path / "kept")
    with pytest.raises(DominoError, match="holds no trainer.pt"):
        job.check_outputs()


def test_resume_on_a_grown_data_set_trains_on_every_sample_and_survives_another_kill(tmp_path, llama_target):
    """Data grown from 6 to 10 samples after step 3: the run resumes its optimizer and step, the next epoch
    draws all 10, what is left of --epochs counts over 10; killed again and resumed, it ends identically."""
    samples = synthetic_samples(llama_target, n=10, answer_len=12)
    cfg = TrainConfig(batch_size=2, epochs=2, save_every=1, anchors=4)

    def trainer(out, data):
        return Trainer(llama_target, tiny_drafter(llama_target), data, out, cfg, progress=False)

    def kill_at(step):
        def on_step(s):
            if s == step:
                raise Killed

        return on_step

    first = trainer(tmp_path / "a", samples[:6])
    with pytest.raises(Killed):
        first.fit(kill_at(3))
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    grown = trainer(tmp_path / "a", samples)
    assert grown.load_checkpoint() and grown.step == 3
    assert grown.phases == [(0, 6, 0), (3, 10, 1)]
    assert grown.total == 3 + 5  # 1 of 2 epochs done over 6 samples; the other over 10, 2 per step
    assert sorted(i for step in range(3, 8) for i in grown.batch_indices(step)) == list(range(10))
    assert all(i < 6 for step in range(3) for i in grown.batch_indices(step))  # the steps already run: unchanged
    grown.fit()

    again = trainer(tmp_path / "b", samples)
    assert again.load_checkpoint()
    with pytest.raises(Killed):
        again.fit(kill_at(5))
    last = trainer(tmp_path / "b", samples)
    assert last.load_checkpoint() and last.step == 5 and last.phases == grown.phases and last.total == 8
    last.fit()
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    changed = [dict(samples[0], input_ids=samples[0]["input_ids"][::-1])] + samples[1:]
    with pytest.raises(DominoError, match="grown data set resumes only where its first samples are unchanged"):
        trainer(tmp_path / "b", changed + samples[:1]).load_checkpoint()  # grown, but not from the same start
    with pytest.raises(DominoError, match="the first 10 training samples differ"):
        trainer(tmp_path / "b", changed).load_checkpoint()


def test_a_new_head_on_a_trained_backbone_keeps_everything_else(qwen3_target):
    """`with_head` (train --init DIR --head H): backbone, confidence head and draft vocabulary kept, the new
    head untrained, so its drafts are the backbone's own until it learns."""
    d = tiny_drafter(qwen3_target, head="domino", confidence=True, draft_vocab=40).eval()
    p = d.with_head("path", path_candidates=4).attach(qwen3_target)
    assert p.config.head == "path" and p.config.path_candidates == 4 and p.head.m == 4
    mine, theirs = d.state_dict(), p.state_dict()
    for k, v in mine.items():
        if not k.startswith("head."):
            assert torch.equal(theirs[k], v), k
    assert not set(theirs) - set(mine) - {k for k in theirs if k.startswith("head.")}
    assert torch.all(p.head.w2.weight == 0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    with torch.no_grad():
        new = generate_speculative(qwen3_target, p, prompt, 12, eos_ids=[])
        off = generate_speculative(qwen3_target, d, prompt, 12, eos_ids=[], use_head=False)
    assert new.tokens == off.tokens and new.accepted == off.accepted
    with pytest.raises(DominoError, match="head 'nope'"):
        d.with_head("nope")


def test_a_grown_drafter_drafts_as_before_until_it_trains(qwen3_target):
    """`with_layers` (train --init DIR --layers N): every trained weight kept, each new layer a copy of the one
    below with its residual outputs zeroed, so the grown drafter's logits and drafts are the old one's; one
    optimiser step moves the new layers; a drafter is never cut."""
    d = tiny_drafter(qwen3_target, head="domino", confidence=True, draft_vocab=40).eval()
    g = d.with_layers(4).attach(qwen3_target)
    assert g.config.num_layers == 4 and len(g.layers) == 4
    mine, theirs = d.state_dict(), g.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in mine.items())
    for i in (2, 3):
        for name, v in g.layers[i].state_dict().items():
            zero = name in ("o_proj.weight", "down_proj.weight")
            assert torch.equal(v, torch.zeros_like(v) if zero else mine[f"layers.1.{name}"]), (i, name)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    with torch.no_grad():
        old = generate_speculative(qwen3_target, d, prompt, 12, eos_ids=[])
        new = generate_speculative(qwen3_target, g, prompt, 12, eos_ids=[])
    assert new.tokens == old.tokens and new.accepted == old.accepted
    g.train()
    ctx = torch.randn(1, 6, len(d.config.target_layer_ids) * d.config.hidden_size)
    z = g.forward_blocks(ctx, torch.tensor([4, 6]), torch.tensor([3, 5]))
    z.pow(2).sum().backward()
    moved = [n for n, p in g.layers[2].named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert {"o_proj.weight", "down_proj.weight"} <= set(moved)
    with pytest.raises(DominoError, match="cannot be cut to 1"):
        d.with_layers(1)


def test_a_drafter_given_the_fused_context_row_drafts_as_before_until_it_trains(qwen3_target, tmp_path):
    """`with_fusion` (train --init DIR --fuse-context): every weight kept, the new projection at zero, so the
    drafts are the old ones; it gets gradients; it saves and loads; export refuses it by name."""
    d = tiny_drafter(qwen3_target, head="domino", confidence=True, draft_vocab=40).eval()
    f = d.with_fusion().attach(qwen3_target)
    assert f.config.fuse_context and torch.count_nonzero(f.fuse.weight) == 0
    assert all(torch.equal(f.state_dict()[k], v) for k, v in d.state_dict().items())
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    with torch.no_grad():
        old = generate_speculative(qwen3_target, d, prompt, 12, eos_ids=[])
        new = generate_speculative(qwen3_target, f, prompt, 12, eos_ids=[])
    assert new.tokens == old.tokens and new.accepted == old.accepted
    f.train()
    ctx = torch.randn(1, 6, len(d.config.target_layer_ids) * d.config.hidden_size)
    f.forward_blocks(ctx, torch.tensor([0, 4, 6]), torch.tensor([2, 3, 5])).pow(2).sum().backward()
    assert f.fuse.weight.grad.abs().sum() > 0
    with torch.no_grad():
        f.fuse.weight.normal_()
    f.save_pretrained(tmp_path / "fused")
    back = Drafter.from_pretrained(tmp_path / "fused", target=qwen3_target)
    assert back.config.fuse_context and torch.allclose(back.fuse.weight, f.fuse.weight, atol=1e-6)
    with pytest.raises(DominoError, match="fuses the last context row already"):
        f.with_fusion()
    with pytest.raises(DominoError, match="fuse_context"):
        plan_export(f.config, "sglang", mask_token_id=3, allow_approx=True)


@pytest.mark.parametrize("head", ["domino", "path"])
def test_a_new_draft_vocabulary_moves_the_head_rows_with_their_tokens(qwen3_target, head):
    """`with_draft_vocab` (train --init DIR --draft-vocab N): the backbone is kept, each kept token's head
    row moves to its new slot, a new token's row is the mean of the old rows, the full vocabulary scatters
    the rows; the drafter stays lossless, and a malformed vocabulary is refused."""
    d = tiny_drafter(qwen3_target, head=head, confidence=True, draft_vocab=40).eval()
    old = d.draft_vocab.tolist()
    outside = sorted(set(range(qwen3_target.vocab_size)) - set(old))
    ids = torch.tensor(sorted(old[::2] + outside[:10]))  # half the old tokens and 10 new ones
    n = d.with_draft_vocab(ids).attach(qwen3_target)
    assert n.config.draft_vocab_size == 30 and n.draft_vocab.tolist() == ids.tolist()
    mine, theirs = d.state_dict(), n.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in mine.items() if k not in ("draft_vocab", "head.w2.weight"))
    w_old, w_new = d.head.w2.weight, n.head.w2.weight
    for slot, tok in enumerate(ids.tolist()):
        want = w_old[old.index(tok)] if tok in old else w_old.mean(0)
        assert torch.allclose(w_new[slot], want), tok
    full = d.with_draft_vocab(None).attach(qwen3_target)
    assert full.config.draft_vocab_size == 0 and full.head.w2.weight.shape[0] == qwen3_target.vocab_size
    assert torch.equal(full.head.w2.weight[d.draft_vocab], w_old)
    others = torch.ones(qwen3_target.vocab_size, dtype=torch.bool)
    others[d.draft_vocab] = False
    assert torch.allclose(full.head.w2.weight[others], w_old.mean(0).expand(int(others.sum()), -1))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    with torch.no_grad():
        plain = generate_autoregressive(qwen3_target, prompt, 12, eos_ids=[]).tokens
        for drafter in (n, full):
            assert generate_speculative(qwen3_target, drafter, prompt, 12, eos_ids=[]).tokens == plain
    for bad in ([3, 3], [qwen3_target.vocab_size], []):
        with pytest.raises(DominoError, match="distinct token ids"):
            d.with_draft_vocab(torch.tensor(bad, dtype=torch.long))


def test_bf16_where_it_is_emulated_is_warned_about(monkeypatch):
    """--bf16 on a CPU without native bf16 matmuls (an AVX2 EPYC: a step ~5x slower than fp32) says so."""
    from dominospec import devices

    monkeypatch.setattr(devices, "native_bf16", lambda: False)
    text = devices.bf16_warning(torch.device("cpu"))
    assert "--bf16" in text and "emulated" in text and "drop --bf16" in text
    assert devices.bf16_warning(torch.device("cuda")) is None  # GPUs decide for themselves
    monkeypatch.setattr(devices, "native_bf16", lambda: True)
    assert devices.bf16_warning(torch.device("cpu")) is None


def test_init_refuses_shape_flags_it_would_ignore(qwen3_target, tmp_path, capsys):
    """train --init DIR keeps DIR's shape: a shape flag asking for another is refused by name, before anything
    loads; flags equal to DIR's (a recipe that repeats them) and a new head's own sizes pass."""
    from dominospec.cli import main

    d = tiny_drafter(qwen3_target, head="domino", confidence=False)
    d.save_pretrained(tmp_path / "d")
    base = ["train", "--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "out"), "--init", str(tmp_path / "d")]
    assert main([*base, "--layers", "1", "--confidence-head", "--rank", "5"]) == 2
    err = capsys.readouterr().err
    assert "--layers 1 (it has 2; a drafter can grow, not shrink)" in err and "--confidence-head (it has none)" in err
    assert "--rank 5 (it has rank 8)" in err and "train a fresh drafter without --init" in err
    # the same shape, more layers, or a new head's rank: past the shape check, stopped at the missing data directory
    assert main([*base, "--layers", "3", "--block-size", "4", "--head", "path", "--rank", "5"]) == 2
    err = capsys.readouterr().err
    assert "keeps the drafter's own shape" not in err and "nodata" in err
