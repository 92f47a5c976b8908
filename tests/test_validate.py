"""Validation during training: the held-out split, acceptance counting, the best checkpoint, acceptance.json."""

import json
import random
import types

import pytest
import torch
from conftest import tiny_drafter
from safetensors.torch import load_file

from dominospec import DominoError
from dominospec.decode.result import expected_tokens
from dominospec.train import validate
from dominospec.train.blocks import anchor_candidates, teacher_forced_blocks
from dominospec.train.trainer import TrainConfig, Trainer
from dominospec.train.validate import (
    BestSoFar,
    Validator,
    ValResult,
    acceptance_counts,
    greedy_hits,
    split_validation,
    validation_anchors,
)


def fake_samples(n, parts_every=3):
    """n samples; every `parts_every`-th conversation also has a second part "<id>/2" (a split conversation)."""
    out = []
    for i in range(n):
        out.append({"id": f"src:{i}", "input_ids": [1, 2, 3 + i % 50], "loss_mask": [0, 1, 1]})
        if i % parts_every == 0:
            out.append({"id": f"src:{i}/2", "input_ids": [1, 4, 3 + i % 50], "loss_mask": [0, 1, 1]})
    return out


def ids(samples):
    return sorted(s["id"] for s in samples)


# ----- the split -----


def test_off_policy_samples_always_train_and_leave_the_on_policy_split_as_it_was():
    on = fake_samples(300)
    off = [{**s, "id": s["id"].replace("src:", "pydoc:"), "labels": "target-argmax"} for s in fake_samples(300)]
    train, val = split_validation(on + off, 0.1)
    assert val and all(s.get("labels", "on-policy") == "on-policy" for s in val)
    assert ids(val) == ids(split_validation(on, 0.1)[1])  # adding off-policy data moves nothing
    assert len([s for s in train if s.get("labels") == "target-argmax"]) == len(off)
    assert split_validation(off, 0.1)[1]  # a purely off-policy set still validates (on itself)


def test_split_is_disjoint_by_conversation_and_the_same_in_every_run():
    samples = fake_samples(300)
    train, val = split_validation(samples, 0.1)
    assert len(train) + len(val) == len(samples) and not set(ids(train)) & set(ids(val))
    conv = validate.conversation_of
    assert not {conv(s) for s in train} & {conv(s) for s in val}  # the parts of a conversation stay together
    assert 0.05 < len(val) / len(samples) < 0.15
    shuffled = list(samples)
    random.Random(0).shuffle(shuffled)
    assert ids(split_validation(shuffled, 0.1)[1]) == ids(val)  # depends on ids, not on order
    # membership is a property of the id: a smaller data set holds out the same conversations it still has
    fewer = [s for s in samples if int(conv(s).split(":")[1]) < 150]
    assert set(ids(split_validation(fewer, 0.1)[1])) == {
        i for i in ids(val) if int(i.split(":")[1].split("/")[0]) < 150
    }


def test_split_sizes_at_the_edges():
    plain = [{"id": f"p:{i}", "input_ids": [1, 2], "loss_mask": [1, 1]} for i in range(40)]
    assert len(split_validation(plain[:20], 0.05)[1]) >= 1  # from 20 samples on, at least one
    assert split_validation(plain[:19], 0.05)[1] == []  # below that, the default holds out nothing
    assert split_validation(plain, 0.0)[1] == []
    with pytest.raises(DominoError, match="val-fraction"):
        split_validation(plain, 1.0)
    with pytest.raises(DominoError, match="holds out all"):
        split_validation(plain[:3], 0.9999)


# ----- counting -----


def test_acceptance_counts_are_conditional_on_the_accepted_prefix():
    hit = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    has = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    judged, passed = acceptance_counts(hit & has, has)
    # position 1: all 4 judged, 3 pass; 2: blocks 0, 2, 3 reached it, 2 pass; 3: block 0 (block 2 has no label)
    assert judged.tolist() == [4, 3, 1, 0] and passed.tolist() == [3, 2, 0, 0]
    res = ValResult(judged.tolist(), passed.tolist())
    assert res.conditional == [0.75, pytest.approx(2 / 3), 0.0, None]
    assert res.tau == pytest.approx(expected_tokens([0.75, 2 / 3, 0.0, 0.0], 4)) == pytest.approx(1.75 + 0.5)


def test_validation_anchors_are_fixed_and_evenly_spread():
    mask = torch.tensor([0] * 5 + [1] * 100)
    cand = anchor_candidates(mask)
    got = validation_anchors(mask, 10)
    assert got.tolist() == sorted(set(got.tolist())) and len(got) == 10
    assert got[0] == cand[0] and got[-1] == cand[-1]
    assert torch.equal(validation_anchors(mask, 0), cand) and torch.equal(validation_anchors(mask, 500), cand)


def test_validator_equals_per_sample_teacher_forcing(qwen3_target, monkeypatch):
    """Batched, padded, chunked evaluation counts exactly what each sample gives on its own."""
    target = qwen3_target
    d = tiny_drafter(target, head="domino", block_size=4, draft_vocab=40)
    rng = random.Random(0)
    samples = [
        {"id": f"v:{i}", "input_ids": [rng.randrange(1, 63) for _ in range(n)], "loss_mask": [0] * 3 + [1] * (n - 3)}
        for i, n in enumerate((9, 17, 12))
    ]
    monkeypatch.setattr(validate, "ANCHOR_CHUNK", 3)
    res = Validator(target, samples, max_anchors=0, batch_size=2).evaluate(d)
    judged = torch.zeros(4, dtype=torch.long)
    passed = torch.zeros(4, dtype=torch.long)
    for s in samples:
        seq = torch.tensor([s["input_ids"]])
        feats = target.forward(seq, target.new_cache(), layer_ids=d.config.target_layer_ids).features[0]
        mask = torch.tensor(s["loss_mask"])
        with torch.no_grad():
            tf = teacher_forced_blocks(d, feats, seq[0], mask, anchor_candidates(mask))
        j, p = acceptance_counts(*greedy_hits(d, tf))
        judged, passed = judged + j, passed + p
    assert res.judged == judged.tolist() and res.passed == passed.tolist()
    assert res.blocks == sum(len(anchor_candidates(torch.tensor(s["loss_mask"]))) for s in samples)
    assert res.samples == 3


# ----- the best checkpoint -----


class ScriptedValidator:
    """Validation tau 1 + score[step] / 100, whatever the drafter: decides which step is best."""

    def __init__(self, scores):
        self.scores, self.samples, self.trainer = scores, [None], None

    def evaluate(self, drafter, dist=None):
        k = self.scores[self.trainer.step]
        return ValResult([100, 0, 0, 0], [k, 0, 0, 0], samples=1)


class Crash(Exception):
    pass


def scripted_run(target, out, scores, crash_at=None, resume=False, keep=None):
    torch.manual_seed(0)
    sample = {"id": "t:0", "input_ids": [5, 9, 11, 2, 7, 8, 30, 4, 4, 17, 3, 3], "loss_mask": [0] * 3 + [1] * 9}
    d = tiny_drafter(target, head="domino", block_size=4, randomize_head=False).float()
    val = ScriptedValidator(scores)
    trainer = Trainer(
        target,
        d,
        [sample],
        out,
        TrainConfig(max_steps=4, batch_size=1, anchors=3, lr=1e-2, save_every=1, val_every=1),
        progress=False,
        validator=val,
    )
    val.trainer = trainer
    if resume:
        assert trainer.load_checkpoint()

    def on_step(step):
        if keep is not None and step == keep[0]:
            keep.append({k: v.clone() for k, v in d.state_dict().items()})
        if step == crash_at:
            raise Crash

    try:
        trainer.fit(on_step=on_step)
    except Crash:
        pass
    return trainer


def test_best_drafter_is_exported_and_survives_a_resume(qwen3_target, tmp_path):
    """The exported drafter is the one with the best validation tau (step 2 here, the last step ties it),
    also when the run died after step 3 and resumed from its checkpoint."""
    scores = {1: 20, 2: 50, 3: 10, 4: 50}
    keep = [2]
    scripted_run(qwen3_target, tmp_path, scores, crash_at=3, keep=keep)
    assert not (tmp_path / "model.safetensors").exists()
    trainer = scripted_run(qwen3_target, tmp_path, scores, resume=True)
    assert trainer.best.step == 2
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(exported[k], keep[1][k]) for k in keep[1])
    last = trainer.drafter.state_dict()
    assert any(not torch.equal(exported[k], last[k]) for k in exported)  # not simply the last step
    acc = json.loads((tmp_path / "acceptance.json").read_text())
    assert acc["conditional"] == [0.5, 0.0, 0.0, 0.0] and acc["tau"] == 1.5 and acc["step"] == 2
    assert acc["measured_by"] == "train validation"
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in recs if r.get("kind") == "val"]
    assert [r["step"] for r in vals] == [1, 2, 3, 4] and [r["best_step"] for r in vals] == [1, 2, 2, 2]
    assert vals[1]["val_tau"] == 1.5 and vals[1]["val_accept"] == [0.5, None, None, None]


def test_best_so_far_round_trips_through_its_state():
    best = BestSoFar()
    assert best.state_dict() is None
    drafter = torch.nn.Linear(2, 2)
    assert best.offer(3, ValResult([4, 2], [2, 1], samples=5), drafter)
    assert not best.offer(4, ValResult([4, 2], [2, 1], samples=5), drafter)  # a tie keeps the earlier one
    again = BestSoFar()
    again.load_state_dict(best.state_dict())
    assert again.step == 3 and again.result == best.result and again.acceptance() == best.acceptance()
    assert all(torch.equal(again.state[k], v) for k, v in drafter.state_dict().items())


# ----- the feature cache, now that the training list depends on the split -----


def test_feature_cache_is_keyed_by_sample_content(qwen3_target, tmp_path):
    """Two runs sharing a cache see their own samples' features, whatever the order or split of their data."""
    target = qwen3_target
    rng = random.Random(3)
    samples = [
        {"id": f"c:{i}", "input_ids": [rng.randrange(1, 63) for _ in range(6 + i)], "loss_mask": [0, 0] + [1] * (4 + i)}
        for i in range(3)
    ]
    d = tiny_drafter(target, head="none", block_size=4)
    (tmp_path / "cache").mkdir()
    first = Trainer(target, d, samples, tmp_path / "a", TrainConfig(), feature_cache=tmp_path / "cache", progress=False)
    first.features([0, 1, 2])
    second = Trainer(
        target, d, samples[::-1][:2], tmp_path / "b", TrainConfig(), feature_cache=tmp_path / "cache", progress=False
    )
    plain = Trainer(target, d, samples[::-1][:2], tmp_path / "c", TrainConfig(), progress=False)
    for (cached, _), (fresh, _) in zip(second.features([0, 1]), plain.features([0, 1])):
        assert cached.shape == fresh.shape and torch.allclose(cached, fresh, atol=1e-2)  # fp16 on disk


def test_features_only_fills_the_cache_once_and_trainings_then_read_it(qwen3_target, tmp_path, monkeypatch):
    """Protects `train --features-only`: one pass stores every training sample's features with the final
    state and the log-normaliser of its logits (what a distilling objective needs), a second pass computes
    nothing, and a training on the same cache then runs its steps without asking the target for features or
    its full LM head; without a cache it says which flag."""
    target = qwen3_target
    rng = random.Random(5)
    samples = [
        {"id": f"c:{i}", "input_ids": [rng.randrange(1, 63) for _ in range(8 + i)], "loss_mask": [0, 0] + [1] * (6 + i)}
        for i in range(5)
    ]
    cache = tmp_path / "cache"
    cache.mkdir()
    d = tiny_drafter(target, head="domino", block_size=4)
    cfg = TrainConfig(batch_size=2, max_steps=3, distill=0.5, save_every=1000, val_every=1000)
    warm = Trainer(target, d, samples, tmp_path / "w", cfg, feature_cache=cache, progress=False)
    assert warm.needs_target_probs and warm.fill_feature_cache() == (5, 0)
    assert warm.fill_feature_cache() == (0, 5)
    warm._cache_path(2).write_bytes(b"cut short")  # a damaged file is not counted as there: computed again
    assert warm.fill_feature_cache() == (1, 4)
    assert all(warm._cache_read(i)[1] is not None for i in range(5))
    for i in range(5):  # the stored normaliser is that of the stored (fp16) final state, which every reader gets
        final = warm._cache_read(i)[1]
        want = torch.logsumexp(target.lm_head(final).float(), -1)
        assert torch.allclose(warm._cache_lse(i), want, atol=1e-5)
    older = warm._cache_read(3)  # a file written before the normaliser was stored gets it, its features kept
    warm._cache_write(3, older)
    assert warm.fill_feature_cache() == (1, 4) and warm._cache_lse(3) is not None

    def no_target(*a, **k):
        raise AssertionError("features were computed again")

    monkeypatch.setattr(target, "sequence_features", no_target)
    monkeypatch.setattr(Trainer, "_log_normaliser", no_target)  # nor the full LM head of the log-normaliser
    trainer = Trainer(target, d, samples, tmp_path / "t", cfg, feature_cache=cache, progress=False)
    assert trainer.fit()["step"] == 3
    with pytest.raises(DominoError, match="--features-only fills a feature cache: pass --feature-cache DIR"):
        Trainer(target, d, samples, tmp_path / "x", cfg, progress=False).fill_feature_cache()
    from dominospec.train.run import TrainJob

    with pytest.raises(DominoError, match="--features-only fills a feature cache"):
        TrainJob(data=tmp_path, out=tmp_path / "o", features_only=True)


def test_validation_reads_the_feature_cache_and_gives_the_same_result_from_it(qwen3_target, tmp_path, monkeypatch):
    """Protects the validator's feature cache: the first evaluation computes and stores the held-out features,
    every later one (and another process's, e.g. the next training) reads them and measures the same counts,
    since a fresh feature is rounded to the cache's fp16 before use; `fill_cache` stores only what is missing."""
    from dominospec.targets.features import FeatureCache

    target = qwen3_target
    rng = random.Random(7)
    samples = [
        {
            "id": f"c:{i}",
            "input_ids": [rng.randrange(1, 63) for _ in range(10 + i)],
            "loss_mask": [0, 0] + [1] * (8 + i),
        }
        for i in range(4)
    ]
    d = tiny_drafter(target, head="domino", block_size=4).eval()
    cache = FeatureCache(tmp_path / "cache", target)
    v = Validator(target, samples, walk=True, batch_size=3, feature_cache=cache)
    assert v.fill_cache(d.config.target_layer_ids) == 4 and v.fill_cache(d.config.target_layer_ids) == 0
    (tmp_path / "cache").joinpath(cache.path(d.config.target_layer_ids, samples[1]["input_ids"]).name).unlink()
    first = v.evaluate(d)  # sample 1 computed again, the rest read

    def no_target(*a, **k):
        raise AssertionError("features were computed again")

    monkeypatch.setattr(target, "sequence_features", no_target)
    again = Validator(target, samples, walk=True, feature_cache=cache).evaluate(d)
    assert (again.judged, again.passed) == (first.judged, first.passed) and first.blocks > 0


def test_training_plot_draws_validation(tmp_path):
    pytest.importorskip("matplotlib")
    from dominospec.train.plots import plot_metrics

    recs = [{"step": s, "ce": 1.0 / s, "tau_greedy": 1 + s / 10} for s in (1, 2, 3)]
    recs.insert(2, {"kind": "val", "step": 2, "val_tau": 1.3, "val_accept": [0.3, None]})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size > 0


# ----- the command line -----


def write_data_dir(path, samples, vocab, target="tiny"):
    path.mkdir()
    (path / "meta.json").write_text(
        json.dumps({"format": "dominospec-data/1", "target": target, "vocab_size": vocab, "complete": True})
    )
    (path / "samples-00000.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


@pytest.mark.slow
def test_cli_train_validates_exports_the_best_and_writes_acceptance(tmp_path, capsys):
    from conftest import tiny_target

    from dominospec.cli import main

    target = tiny_target("llama", dtype=torch.float32)
    target.model.save_pretrained(str(tmp_path / "target"))
    rng = random.Random(0)
    samples = [
        {"id": f"t:{i}", "input_ids": [rng.randrange(1, 63) for _ in range(14)], "loss_mask": [0] * 4 + [1] * 10}
        for i in range(10)
    ]
    write_data_dir(tmp_path / "data", samples, 64, target=str(tmp_path / "target"))
    common = [
        "train",
        "--target",
        str(tmp_path / "target"),
        "--data",
        str(tmp_path / "data"),
        "--layers",
        "1",
        "--block-size",
        "3",
        "--intermediate-size",
        "32",
        "--gru-hidden-size",
        "8",
        "--rank",
        "4",
        "--max-steps",
        "3",
        "--batch-size",
        "2",
        "--anchors",
        "4",
        "--val-every",
        "2",
    ]
    assert main(common + ["--out", str(tmp_path / "split"), "--val-fraction", "0.2"]) == 0
    err = capsys.readouterr().err
    held = split_validation(samples, 0.2)[1]
    assert f"validation: {len(held)} samples (held out by conversation id hash" in err
    assert f"on {len(samples) - len(held)} samples" in err and "exported the best drafter by validation" in err
    recs = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") == "val"] == [2, 3]
    acc = json.loads((tmp_path / "split" / "acceptance.json").read_text())
    assert len(acc["conditional"]) == 3 and acc["measured_by"] == "train validation" and acc["samples"] == len(held)
    # a separate validation directory; these samples overlap the training data, which is reported
    write_data_dir(tmp_path / "val", samples[:2], 64, target=str(tmp_path / "target"))
    assert main(common + ["--out", str(tmp_path / "sep"), "--val-data", str(tmp_path / "val")]) == 0
    err = capsys.readouterr().err
    assert f"validation: 2 samples ({tmp_path / 'val'})" in err and "2 of the 2 samples" in err
    assert (tmp_path / "sep" / "acceptance.json").exists()
    # too little data for the default fraction: no validation, the last step is exported, as before
    assert main(common + ["--out", str(tmp_path / "none")]) == 0
    assert "validation: none" in capsys.readouterr().err and not (tmp_path / "none" / "acceptance.json").exists()


# ----- validation that walks the text as decoding does -----


def test_walked_anchors_are_the_anchors_of_live_greedy_decoding(qwen3_target):
    """On the target's own greedy answer, the walk visits exactly the anchors generate_speculative
    used, and counts the same accepted drafts; it is what `bench` measures, cycle by cycle."""
    from dominospec import generate_speculative
    from dominospec.train.validate import accepted_lengths, walked_rows

    target = qwen3_target
    d = tiny_drafter(target, head="none", block_size=4)
    with torch.no_grad():  # a drafter that copies the target's own head, so whole runs of drafts pass
        d.layers[0].o_proj.weight.zero_()
    live_anchors, live_accepted, walked = [], [], []
    for prompt in ([1, 2, 3], [5, 9, 11, 2, 7]):
        res = generate_speculative(target, d, prompt, 40, eos_ids=[])
        seq = prompt + res.tokens
        mask = torch.tensor([0] * len(prompt) + [1] * len(res.tokens))
        feats = target.sequence_features([seq], d.config.target_layer_ids)[0][0]
        cand = anchor_candidates(mask)
        with torch.no_grad():
            hit, _ = greedy_hits(d, teacher_forced_blocks(d, feats, torch.tensor(seq), mask, cand))
        rows = walked_rows(cand, hit)
        sample = {"id": "w", "input_ids": seq, "loss_mask": mask.tolist()}
        assert Validator(target, [sample], walk=True).evaluate(d).judged[0] == len(rows)  # the validator's walk
        anchors = [len(prompt) + sum(res.committed[:i]) for i in range(res.cycles)]
        k = len(rows) - 1  # the walk's last block and the run's last cycles may be cut by the text's end
        live_anchors += anchors[:k]
        live_accepted += res.accepted[:k]
        walked += [(int(cand[r]), int(accepted_lengths(hit[r : r + 1]))) for r in rows[:k]]
    assert walked == list(zip(live_anchors, live_accepted))
    assert max(live_accepted) >= 1  # control: drafts were accepted, so the walk skipped positions


def test_walk_skips_by_accepted_drafts_and_restarts_at_the_next_answer():
    from dominospec.train.validate import walked_rows

    anchors = torch.tensor([2, 3, 4, 5, 10, 11, 12])  # two answers: 2..6 and 10..13
    hit = torch.zeros(7, 3, dtype=torch.bool)
    hit[0, :1] = True  # at 2: one draft accepted -> next anchor 4
    hit[2, :2] = True  # at 4: two accepted -> 7, past the first answer -> 10
    hit[4, :3] = True  # at 10: three accepted -> 14, past the end
    assert walked_rows(anchors, hit) == [0, 2, 4]
    assert walked_rows(anchors, torch.zeros(7, 3, dtype=torch.bool)) == list(range(7))  # control: no skips


@pytest.mark.parametrize(
    ("total", "every", "steps"),
    [(1383, 460, [460, 920, 1383]), (1500, 460, [460, 920, 1380, 1500]), (4, 1, [1, 2, 3, 4]), (7, 3, [3, 6, 7])],
)
def test_validation_steps_skip_an_interval_just_before_the_last(total, every, steps):
    """Step 1380 of 1383 is not validated (the final validation, 3 steps later, would nearly repeat it);
    an interval's step further from the end is, and the last step always is."""
    run = types.SimpleNamespace(total=total, cfg=types.SimpleNamespace(val_every=every))
    chosen = []
    for step in range(1, total + 1):
        run.step = step
        if Trainer._validate_now(run):
            chosen.append(step)
    assert chosen == steps
