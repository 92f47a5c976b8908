"""Faster data: answers through refilled cache rows (--sampler slots) and off-policy texts (pydoc:N)."""

import gzip
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import CONVERSATIONS, CharCodec, run_cli, tiny_drafter, tiny_target, write_prompts
from conftest import PREPARE as CFG

from dominospec import DominoError
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.extend import add_part
from dominospec.data.offpolicy import ARGMAX, TEXT, label_texts, pydoc_texts
from dominospec.data.prepare import ChatCodec, FeatureCapture, prepare_data
from dominospec.data.prompts import read_prompt_file
from dominospec.data.sampler import AnswerJob, sample_in_slots
from dominospec.data.sources import load_prompts
from dominospec.data.store import dataset_prompts, read_manifest
from dominospec.sampling import SamplingConfig
from dominospec.targets import Target
from dominospec.targets.features import FeatureCache
from dominospec.train.trainer import TrainConfig, Trainer

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[0, 1, 5, 9, 63, 2], [0, 1, 7, 63, 2], [0, 1, 30, 31, 32, 33, 34, 63, 2], [0, 1, 12, 63, 2], [0, 2, 8]]


@pytest.fixture(scope="module")
def hf_target():
    return tiny_target("llama", vocab=64)


@pytest.fixture(scope="module")
def target(hf_target):
    """The same float64 model on the native forward (what --sampler slots runs on)."""
    return Target(hf_target.model, name="tiny-llama", backend="native")


def run_slots(target, prompts, slots, sampling, budget=10, seed=0):
    jobs = [AnswerJob(i, p, budget, seed + i) for i, p in enumerate(prompts)]
    waiting, done = list(jobs), {}
    steps = sample_in_slots(
        target, lambda: waiting.pop(0) if waiting else None, lambda j: done.setdefault(j.key, j.answer), slots, sampling
    )
    assert sorted(done) == list(range(len(prompts)))  # every job answered exactly once
    return [done[i] for i in range(len(prompts))], steps


# ----- the slot sampler -----


def test_slot_sampler_at_t0_equals_plain_greedy_for_each_row(target):
    answers, steps = run_slots(target, PROMPTS, slots=2, sampling=SamplingConfig())
    for prompt, answer in zip(PROMPTS, answers):
        assert answer == target.hf_generate(prompt, 10)  # transformers' batch-1 greedy, EOS included
    assert len({tuple(a) for a in answers}) > 2  # control: the rows really differ
    assert steps < sum(len(a) for a in answers)  # rows shared decode steps: more than one ran at a time


def test_slot_sampler_at_t1_is_reproducible_per_seed_and_independent_of_batch_mates(target):
    hot = SamplingConfig(temperature=1.0)
    one, _ = run_slots(target, PROMPTS, slots=1, sampling=hot)
    assert run_slots(target, PROMPTS, slots=1, sampling=hot)[0] == one
    assert run_slots(target, PROMPTS, slots=3, sampling=hot)[0] == one  # each answer has its own stream
    assert run_slots(target, PROMPTS, slots=3, sampling=hot, seed=100)[0] != one  # control: seeds matter


def test_slots_run_writes_what_the_batch_run_writes_at_t0(target, tmp_path):
    """Multi-turn conversations too: every turn's prompt is the render of the answers so far."""
    greedy = replace(CFG, temperature=0.0, max_new_tokens=8)
    codec = CharCodec().codec()
    prepare_data(target, CONVERSATIONS, tmp_path / "batch", greedy, codec=codec, progress=False)
    meta = prepare_data(
        target, CONVERSATIONS, tmp_path / "slots", replace(greedy, sampler="slots"), codec=codec, progress=False
    )
    assert meta["sampler"] == "slots"
    old, new = load_dataset_dir(tmp_path / "batch")[1], load_dataset_dir(tmp_path / "slots")[1]
    assert sorted(map(json.dumps, new)) == sorted(map(json.dumps, old))
    assert any(s["id"] == "t:3" and sum(s["loss_mask"]) > 8 for s in new)  # control: a later turn was answered


def test_slots_need_the_native_forward(hf_target, tmp_path):
    with pytest.raises(DominoError, match="--sampler slots needs the native forward"):
        prepare_data(hf_target, CONVERSATIONS, tmp_path / "d", replace(CFG, sampler="slots"), codec=CharCodec().codec())


class CrashingRows:
    """The target, its row forward raising after `calls` passes: a run killed in the middle of a shard."""

    def __init__(self, target, calls):
        self.target, self.left = target, calls

    def forward_rows(self, *args, **kwargs):
        if self.left == 0:
            raise RuntimeError("simulated crash")
        self.left -= 1
        return self.target.forward_rows(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_slots_run_resumes_after_a_crash_exactly_as_an_uninterrupted_one(target, tmp_path):
    cfg, codec = replace(CFG, sampler="slots"), CharCodec().codec()
    prepare_data(target, CONVERSATIONS, tmp_path / "ref", cfg, codec=codec, progress=False)
    crashing = CrashingRows(target, 20)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_data(crashing, CONVERSATIONS, tmp_path / "run", cfg, codec=codec, progress=False)
    done = sorted(p.name for p in (tmp_path / "run").glob("samples-*.jsonl"))
    assert 0 < len(done) < 4  # control: the crash came between shards' completion
    prepare_data(target, CONVERSATIONS, tmp_path / "run", cfg, codec=codec, progress=False)
    files = {p.name: p.read_bytes() for p in sorted((tmp_path / "ref").glob("samples-*"))}
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "run").glob("samples-*"))} == files


# ----- off-policy texts -----


class TextCodec:
    """CharCodec's chat layout for any text: each character maps to one of the tiny target's ids 4..62."""

    def ids(self, text):
        return [4 + ord(ch) % 59 for ch in text]

    def encode(self, messages):
        ids = [0]
        for m in messages:
            ids += [CharCodec.ROLES[m["role"]]] + self.ids(m["content"]) + [CharCodec.EOS]
        return ids + [CharCodec.ROLES["assistant"]]

    def codec(self):
        return ChatCodec(self.encode, CharCodec().decode, tokenizer_sha256="text-codec", encode_text=self.ids)


def test_off_policy_labels_are_exactly_the_targets_greedy_agreement(target):
    import torch

    texts = pydoc_texts(3, seed=1)
    codec = TextCodec().codec()
    samples, stats = label_texts(target, codec, texts, batch_size=2, max_answer_tokens=40)
    by_id = {s["id"]: s for s in samples}
    for conv in texts:
        prompt = codec.encode([{"role": "user", "content": conv.turns[0]}])
        ids = prompt + TextCodec().ids(conv.turns[1])[:40]
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0]  # a separate plain transformers pass
        greedy = logits.argmax(-1).tolist()
        agree = [int(ids[t] == greedy[t - 1]) for t in range(len(prompt), len(ids))]
        if any(agree):
            assert by_id[conv.id]["input_ids"] == ids
            assert by_id[conv.id]["loss_mask"] == [0] * len(prompt) + agree
        else:
            assert conv.id not in by_id  # nothing to learn from it: no sample
    assert samples  # control: some text agreed somewhere
    assert stats["text_tokens"] == 3 * 40 and stats["agreeing_tokens"] == sum(sum(s["loss_mask"]) for s in samples)


def test_off_policy_text_is_supervised_where_the_target_agrees_and_nowhere_else(target):
    """Control for the test above: a text that is the target's own greedy answer is supervised throughout."""
    from dominospec.data.prompts import Conversation

    codec = TextCodec().codec()
    prompt = codec.encode([{"role": "user", "content": "q"}])
    own = [t for t in target.hf_generate(prompt, 12) if 4 <= t < 63]
    text = "".join(chr(next(c for c in range(32, 127) if 4 + c % 59 == t)) for t in own)
    samples, _ = label_texts(target, codec, [Conversation(("q", text), "x:0", kind=ARGMAX)], 1, 50)
    mask = samples[0]["loss_mask"][len(prompt) :]
    assert len(mask) >= 3 and mask[: len(mask)] == [1] * len(mask)


def test_mixed_run_records_off_policy_source_and_labels_in_the_manifest(target, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["what is 2+2?", "hello there"])
    convs, sources = load_prompts([str(prompts), "pydoc:3"], seed=4)
    assert [s["labels"] for s in sources] == ["on-policy", ARGMAX]
    assert sources[1]["kind"] == "off-policy" and sources[1]["text"] == "pydoc"
    cfg = replace(CFG, sampler="slots", max_new_tokens=30)
    codec = TextCodec().codec()
    meta = prepare_data(target, convs, tmp_path / "run", cfg, sources=sources, codec=codec, progress=False)
    assert meta["counts"]["text_tokens"] == 3 * 30 and meta["counts"]["conversations"] == 5
    entry = add_part(tmp_path / "ds", tmp_path / "run", convs)
    part = read_manifest(tmp_path / "ds")["parts"][0]
    assert part == entry and part["prompt_sources"][1]["labels"] == ARGMAX
    assert part["settings"]["sampler"] == "slots"
    with gzip.open(tmp_path / "ds" / "part-000" / "prompts.jsonl.gz", "rt") as f:
        stored = [json.loads(line) for line in f]
    assert [r.get("kind", "chat") for r in stored] == ["chat", "chat", ARGMAX, ARGMAX, ARGMAX]
    loaded = load_dataset_dir(tmp_path / "ds", target)[1]
    kinds = {s["id"].split(":", 1)[1].split("/")[0]: s.get("labels", "on-policy") for s in loaded}
    texts = {c.id for c in convs if c.kind == ARGMAX}
    assert texts & set(kinds)  # off-policy samples made it into the data set, still marked as such
    assert all(kinds[i] == (ARGMAX if i in texts else "on-policy") for i in kinds)
    assert {"p:1", "p:2"} <= set(kinds)


class NoTargetPass:
    """A target that refuses to run: what `text` labels must never need."""

    def __init__(self, target):
        self.target = target

    def sequence_features(self, *args, **kwargs):
        raise AssertionError("a target pass for text labels")

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_text_labels_supervise_every_answer_token_without_a_target_pass(target):
    convs, sources = load_prompts(["pydoc:3:text"], seed=2)
    assert sources[0]["labels"] == TEXT and all(c.kind == TEXT for c in convs)
    assert [c.turns for c in convs] == [c.turns for c in pydoc_texts(3, seed=2)]  # same texts, other labels
    codec = TextCodec().codec()
    samples, stats = label_texts(NoTargetPass(target), codec, convs, batch_size=2, max_answer_tokens=25)
    for sample, conv in zip(samples, convs):
        prompt = codec.encode([{"role": "user", "content": conv.turns[0]}])
        assert sample["input_ids"] == prompt + TextCodec().ids(conv.turns[1])[:25]
        assert sample["loss_mask"] == [0] * len(prompt) + [1] * 25 and sample["labels"] == TEXT
    assert len(samples) == 3 and stats["text_tokens"] == 75


@pytest.mark.parametrize("spec", ["pydoc:x", "pydoc:0", "pydoc:3:soft", "pydoc:3:text:more"])
def test_bad_pydoc_specs_are_refused(spec):
    from dominospec.data.sources import check_prompt_specs

    with pytest.raises(DominoError, match="pydoc"):
        check_prompt_specs([spec])


def test_pydoc_texts_are_deterministic_and_hold_no_eval_prompt():
    a = pydoc_texts(50, seed=3)
    assert a == pydoc_texts(50, seed=3) and a != pydoc_texts(50, seed=4)
    assert len({c.id for c in a}) == 50 and all(c.kind == ARGMAX and len(c.turns) == 2 for c in a)
    pool = pydoc_texts(10**6)
    assert len(pool) > 1000  # the standard library gives thousands of pieces
    held = [c.turns[0] for f in sorted((REPO / "prompts").glob("eval-*.jsonl")) for c in read_prompt_file(f)]
    assert held
    normal = [" ".join(" ".join(c.turns).lower().split()) for c in pool]
    for h in held:
        probe = " ".join(h.lower().split())[:60]
        assert not any(probe in t for t in normal), h


def test_stored_prompts_of_an_off_policy_part_are_read_back_for_the_exclusion_check(target, tmp_path):
    """dataset_prompts (what test_extend's held-out check reads) sees both turns of every text."""
    convs, sources = load_prompts(["pydoc:2"], seed=0)
    prepare_data(target, convs, tmp_path / "run", CFG, sources=sources, codec=TextCodec().codec(), progress=False)
    add_part(tmp_path / "ds", tmp_path / "run", convs)
    stored = dataset_prompts(tmp_path / "ds")
    assert [tuple(r["turns"]) for r in stored] == [c.turns for c in convs]


def test_builtin_runs_keep_their_prompt_fingerprint():
    """Adding Conversation.kind changed nothing for chats: the shipped part's stored prompts still hash to
    its recorded fingerprint. (Regenerating them with builtin_prompts is not the check: its man-page topics
    come from this machine's /usr/share/man, which installing a package such as chromium changes.)"""
    from dominospec.data.prompts import Conversation, prompts_fingerprint
    from dominospec.data.store import dataset_prompts

    dataset = REPO / "data" / "smollm2-135m"
    part = read_manifest(dataset)["parts"][0]
    stored = [r for r in dataset_prompts(dataset) if r["part"] == part["name"]]
    convs = [Conversation(tuple(r["turns"]), r["id"], r.get("kind", "chat")) for r in stored]
    assert len(convs) == part["settings"]["conversations_total"]
    assert prompts_fingerprint(convs) == part["settings"]["prompts_sha256"]


@pytest.mark.integration
@pytest.mark.slow
def test_prepare_data_cli_mixes_builtin_and_pydoc_on_smollm2_and_extends(tmp_path, cli_smollm, capsys):
    """The real target: slots by default on the native forward, pydoc texts tokenized as plain text after the
    template's assistant opening, and the run added to a data set whose manifest records both kinds of labels."""
    target = cli_smollm
    args = ["prepare-data", "--prompts", "builtin:3", "--prompts", "pydoc:2", "--max-new-tokens", "16"]
    args += ["--batch-size", "2", "--seed", "1", "--out", tmp_path / "run", "--extend", tmp_path / "ds"]
    rc, err = run_cli(capsys, *args)
    assert rc == 0, err
    part = read_manifest(tmp_path / "ds")["parts"][0]
    assert part["settings"]["sampler"] == "slots"
    assert [s["labels"] for s in part["prompt_sources"]] == ["on-policy", ARGMAX]
    samples = load_dataset_dir(tmp_path / "ds", target)[1]
    texts = [s for s in samples if s.get("labels") == ARGMAX]
    assert len(texts) == 2 and len(samples) == 5
    stored = {r["id"]: r for r in dataset_prompts(tmp_path / "ds")}
    for s in texts:
        question, text = stored[s["id"].split(":", 1)[1]]["turns"]
        prompt = target.encode_chat([{"role": "user", "content": question}])
        assert s["input_ids"] == prompt + target.encode_raw(text)[:16]  # the text after the assistant opening
    rc, err = run_cli(capsys, *args)  # the same command again: nothing regenerated, the part not added twice
    assert rc == 0 and len(read_manifest(tmp_path / "ds")["parts"]) == 1


# ----- features captured while generating -----


def test_features_captured_while_generating_equal_a_separate_pass(target, tmp_path):
    """The feature cache prepare-data fills from its own passes holds what the trainer's feature pass computes
    (fp16), for single- and multi-turn samples, and the trainer then runs no target pass on them."""
    cache = FeatureCache(tmp_path / "cache", target)
    capture = FeatureCapture(cache, list(target.layer_ids))
    cfg = replace(CFG, sampler="slots", max_new_tokens=8)
    prepare_data(target, CONVERSATIONS, tmp_path / "d", cfg, codec=CharCodec().codec(), progress=False, capture=capture)
    samples = load_dataset_dir(tmp_path / "d")[1]
    assert any(sum(s["loss_mask"]) > 8 for s in samples)  # control: a multi-turn sample is among them
    for s in samples:
        cached = cache.read(capture.layer_ids, s["input_ids"])
        assert cached is not None, s["id"]
        feats, final = target.sequence_features([s["input_ids"]], capture.layer_ids)
        for got, want in zip(cached, (feats[0], final[0])):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want.to(torch.float16).to(got.dtype), rtol=2e-3, atol=2e-3)
        # the log-normaliser of the logits the generating passes computed: from the last prompt token on (the
        # answer's predicting positions), equal to a separate pass's to fp32 rounding; NaN before it
        lse = cache.read_lse(capture.layer_ids, s["input_ids"])
        want_lse = torch.logsumexp(target.lm_head(final[0]).double(), -1)
        answer_from = len(s["input_ids"]) - _last_answer_length(s["loss_mask"]) - 1
        assert torch.isnan(lse[:answer_from]).all() and not torch.isnan(lse[answer_from:]).any(), s["id"]
        torch.testing.assert_close(lse[answer_from:].double(), want_lse[answer_from:], rtol=1e-6, atol=1e-5)
    assert len(list((tmp_path / "cache").iterdir())) == len(samples)  # one file per sample, no stray turns

    def no_pass(*args, **kwargs):
        raise AssertionError("the trainer ran a target pass on captured samples")

    d = tiny_drafter(target, head="domino", block_size=3)
    d.config.target_layer_ids = capture.layer_ids
    trainer = Trainer(target, d, samples, tmp_path / "t", TrainConfig(distill=0.5), progress=False)
    trainer.feature_cache = cache
    target.sequence_features, kept = no_pass, target.sequence_features
    try:
        assert len(trainer.features(list(range(len(samples))))) == len(samples)
        trainer.cfg.anchors = 0  # every supervised position: blocks read an earlier turn's answer too
        assert math.isfinite(trainer.train_step()["kl"])
    finally:
        target.sequence_features = kept
    filled = 0
    for i, lse in trainer._lse.items():  # the gaps a block read were filled from the stored final state
        filled += int((~torch.isnan(lse[: len(lse) - _last_answer_length(samples[i]["loss_mask"]) - 1])).sum())
        final16 = cache.read(capture.layer_ids, samples[i]["input_ids"])[1]
        full = torch.logsumexp(target.lm_head(final16).double(), -1)
        read = ~torch.isnan(lse)
        assert read[len(lse) - _last_answer_length(samples[i]["loss_mask"]) - 1 :].all()
        torch.testing.assert_close(lse[read].double(), full[read], rtol=1e-3, atol=1e-3)
    assert filled > 0  # control: the multi-turn sample's earlier answer was read and filled


def _last_answer_length(mask: list[int]) -> int:
    """How many supervised tokens end the sample (its last turn's answer)."""
    n = 0
    for m in reversed(mask):
        if not m:
            break
        n += 1
    return n


def test_capture_needs_the_slots_sampler(target, tmp_path, capsys):
    capture = FeatureCapture(FeatureCache(tmp_path / "cache", target), list(target.layer_ids))
    with pytest.raises(DominoError, match="captured by the slots sampler only"):
        prepare_data(target, CONVERSATIONS, tmp_path / "d", CFG, codec=CharCodec().codec(), capture=capture)
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    argv = ["prepare-data", "--target", "smollm2-135m", "--prompts", prompts, "--out", tmp_path / "o"]
    rc, err = run_cli(capsys, *argv, "--backend", "hf", "--feature-cache", tmp_path / "c")
    assert rc != 0 and "--feature-cache" in err and "slots sampler" in err
