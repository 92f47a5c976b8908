"""scripts/: every script imports and parses its options; where_lost.py's counts agree with the walk."""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import tiny_drafter

from dominospec.train.validate import Validator, greedy_answer_samples

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """Run scripts/NAME as a module (scripts/ is no package); a script that parses at import exits here."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(name).stem}", SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def where_lost():
    return load_script("where_lost.py")


def test_rank_class_by_hand(where_lost):
    rank = torch.tensor([1, 2, 3, 4, 5, 16, 17, 1, 40])
    in_vocab = torch.tensor([True] * 7 + [False, False])
    cls = where_lost.rank_class(rank, in_vocab).tolist()
    assert cls == [1, 2, 3, 3, 4, 4, 5, 0, 0]
    assert [where_lost.RANKS[c] for c in cls[:3]] == ["rank 1", "rank 2", "rank 3-4"]


@pytest.mark.parametrize("draft_vocab", [0, 24])
def test_counts_agree_with_the_walk(where_lost, qwen3_target, draft_vocab):
    target = qwen3_target
    d = tiny_drafter(target, block_size=4, draft_vocab=draft_vocab)
    with torch.no_grad():  # drafts near the target's own head, so blocks pass and the walk skips positions
        d.layers[-1].o_proj.weight.mul_(0.1)
    samples = greedy_answer_samples(target, [[1, 2, 3], [5, 9, 11, 2, 7]], 32, "eval-a")
    samples += greedy_answer_samples(target, [[4, 8, 15, 16]], 32, "eval-b")
    layers = list(d.config.target_layer_ids)
    out = [target.sequence_features([s["input_ids"]], layers) for s in samples]
    feats, finals = [f[0] for f, _ in out], [fin[0] for _, fin in out]
    with torch.no_grad():
        by_set = where_lost.judge(d, target, samples, finals, feats)
    assert set(by_set) == {"eval-a", "eval-b"}
    counts = where_lost.merged(by_set)

    walk = where_lost.walked(counts, "walk")
    val = Validator(target, samples, walk=True).evaluate(d)
    assert walk.judged == val.judged and walk.passed == val.passed  # the same walk as validation's
    assert walk.passed[0] > 0  # control: drafts were accepted

    first, every = counts["first"], counts["all"]
    assert sum(first["band_reached"]) == walk.judged[0]
    assert sum(first["band_accepted"]) == walk.passed[0]
    assert sum(every["band_reached"]) == sum(walk.judged)
    assert sum(every["band_accepted"]) == sum(walk.passed)
    for c in (first, every):
        assert sum(c["rank"]) == sum(c["band_reached"])  # each slot reached has one rank class
        assert c["rank"][1] == sum(c["band_accepted"])  # rank 1 is what greedy verification accepts
        assert c["seen"][0] <= c["rank"][0]
    ctx = where_lost.walked(counts, "walk_context_vocab")
    if draft_vocab:
        assert first["rank"][0] > 0  # labels the drafter cannot propose are counted outside the vocabulary
    else:  # a drafter over the whole vocabulary has nothing to add from the context
        assert first["rank"][0] == 0
        assert (ctx.judged, ctx.passed) == (walk.judged, walk.passed)
    text = where_lost.table("d", counts) + "\n" + where_lost.set_line("eval-a", by_set["eval-a"])
    assert f"walked tau {walk.tau:.3f}" in text and "eval-a" in text


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_every_script_imports_and_answers_help(script, monkeypatch, capsys):
    """Each measurement script still imports against the package and parses its options (`--help`),
    without changing this process's threads: a renamed function breaks the script here, not in a session."""
    threads = torch.get_num_threads()
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as when run: scripts/ is on the path for its siblings
    monkeypatch.setattr("sys.argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        load_script(script).main()
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script}")
    assert torch.get_num_threads() == threads
