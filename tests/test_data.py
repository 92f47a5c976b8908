"""prepare-data: prompt sources, the assistant-only loss mask, exactly-once resume, and loading back."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, SMOL_LIKE, CharCodec, char_level_target, tiny_target
from conftest import PREPARE as CFG

from dominospec import DominoError
from dominospec.data.builtin import builtin_prompts
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.prepare import ChatCodec, PrepareConfig, SampleBuilder, prepare_data, regenerate_batch
from dominospec.data.prompts import Conversation, load_hf_dataset, read_prompt_file
from dominospec.data.sources import load_prompts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=64)


def check_on_policy_layout(samples, conversation, codec, eos_ids, max_new_tokens):
    """Every supervised run is one whole answer, preceded by exactly the template render of the chat so far."""
    history, turn = [], 0
    for sample in samples:
        ids, mask = sample["input_ids"], sample["loss_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1} and any(mask)
        runs, pos = [], 0
        while pos < len(mask):
            if mask[pos]:
                end = pos
                while end < len(mask) and mask[end]:
                    end += 1
                runs.append((pos, end))
                pos = end
            else:
                pos += 1
        for start, end in runs:
            history.append({"role": "user", "content": conversation.turns[turn]})
            assert ids[:start] == codec.encode(history), f"{sample['id']} turn {turn}: context is not the render"
            answer = ids[start:end]
            assert answer[-1] in eos_ids or len(answer) == max_new_tokens
            history.append({"role": "assistant", "content": codec.decode(answer)})
            turn += 1
        assert runs[-1][1] == len(ids), "a sample ends with its last answer"


def by_conversation(samples):
    groups = {}
    for s in samples:
        groups.setdefault(s["id"].split("/")[0], []).append(s)
    return groups


# ----- prompt files -----


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_file_layouts_give_user_turns_in_order(tmp_path):
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"turns": ["one", "two"]}),
            json.dumps(
                {
                    "conversations": [
                        {"from": "system", "value": "be nice"},
                        {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "hello"},
                        {"from": "human", "value": "bye"},
                    ]
                }
            ),
            json.dumps({"conversations": [{"role": "user", "content": "role/content keys"}]}),
            "",
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                        {"role": "assistant", "content": "ignored"},
                        {"role": "user", "content": "x"},
                    ]
                }
            ),
            json.dumps({"prompt": "just a prompt"}),
        ],
    )
    convs = read_prompt_file(path)
    assert [c.turns for c in convs] == [
        ("one", "two"),
        ("hi", "bye"),
        ("role/content keys",),
        ("parts", "x"),
        ("just a prompt",),
    ]
    assert [c.id for c in convs] == ["mixed:1", "mixed:2", "mixed:3", "mixed:5", "mixed:6"]


BAD_LINES = [
    '{"prompt": "fine"}',
    "{not json",
    '{"text": "unknown layout"}',
    '{"prompt": "   "}',
    '{"turns": ["ok", ""]}',
    '{"conversations": [{"from": "gpt", "value": "no user"}]}',
    "[1, 2]",
    '{"prompt": "also fine"}',
]


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    messages = []
    convs = read_prompt_file(path, report=messages.append)
    assert [c.turns[0] for c in convs] == ["fine", "also fine"]
    for lineno in range(2, 8):
        assert any(m.startswith(f"{path}:{lineno}: ") for m in messages), lineno
    assert "skipped 6 malformed line(s), kept 2" in messages[-1]


def test_malformed_line_is_fatal_with_on_error_fatal(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(DominoError, match=rf"{path}:2: bad JSON"):
        read_prompt_file(path, on_error="fatal")


def test_prompt_file_with_no_usable_line_is_an_error(tmp_path):
    with pytest.raises(DominoError, match="no usable prompts"):
        read_prompt_file(write_lines(tmp_path / "x.jsonl", ["{}"]), report=lambda m: None)
    with pytest.raises(DominoError, match="no such file"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_hf_dataset_without_datasets_or_hub_fails_clearly():
    with pytest.raises(DominoError, match="hf:|dataset"):
        load_hf_dataset("openai/gsm8k")


def test_load_prompts_mixes_sources_with_unique_ids_and_limit(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_lines(tmp_path / "a" / "p.jsonl", ['{"prompt": "x"}', '{"prompt": "y"}'])
    b = write_lines(tmp_path / "b" / "p.jsonl", ['{"prompt": "z"}'])
    convs, sources = load_prompts([str(a), str(b), "builtin:3"])
    assert [c.id for c in convs][:3] == ["p:1", "p:2", "p-2:1"]
    assert len(convs) == 6 and len({c.id for c in convs}) == 6
    assert [s["conversations"] for s in sources] == [2, 1, 3]
    assert len(load_prompts([str(a), "builtin:3"], limit=4)[0]) == 4
    with pytest.raises(DominoError, match="builtin:N"):
        load_prompts(["builtin:many"])


# ----- the built-in offline source -----


def test_builtin_prompts_are_deterministic_and_prefix_stable():
    first = builtin_prompts(300, seed=0)
    assert first == builtin_prompts(300, seed=0)
    assert builtin_prompts(120, seed=0) == first[:120]
    assert [c.turns for c in builtin_prompts(300, seed=1)] != [c.turns for c in first]


@pytest.mark.slow
def test_builtin_prompts_are_identical_across_processes():
    """Protects resume: prompts must not embed anything process-specific (object addresses in
    stdlib signatures, hash order), or a restarted prepare-data refuses its own output."""
    script = (
        "import hashlib, json; from dominospec.data.builtin import builtin_prompts; "
        "print(hashlib.sha256(json.dumps([c.turns for c in builtin_prompts(3000)]).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert len(digests) == 1


def test_builtin_prompts_are_distinct_short_and_mixed_40_35_25():
    convs = builtin_prompts(1000, seed=0)
    texts = [c.turns[0] for c in convs]
    assert len(set(texts)) == len(texts)
    assert all(20 <= len(t) <= 1500 for t in texts)
    kinds = Counter(c.id.split(":")[0] for c in convs)
    assert kinds == {"builtin-code": 400, "builtin-math": 350, "builtin-chat": 250}
    assert sum("```python" in t for t in texts) > 50  # source snippets made it in
    assert len({t.split()[0] for t in texts}) > 10  # many opening words, not one template


def test_eval_prompt_files_are_held_out_from_builtin():
    builtin = {c.turns[0] for c in builtin_prompts(3000, seed=0)}
    for name in ("eval-math", "eval-code", "eval-chat"):
        convs = read_prompt_file(REPO / "prompts" / f"{name}.jsonl", on_error="fatal")
        assert len(convs) == 12
        assert not builtin & {c.turns[0] for c in convs}


# ----- token layout -----


def test_sample_builder_merges_prefix_extensions_and_masks_only_answers():
    b = SampleBuilder("c:0")
    b.add_turn(0, [1, 2, 3], [7, 8, 9])
    b.add_turn(1, [1, 2, 3, 7, 8, 9, 4, 5], [6, 9])
    [sample] = b.samples()
    assert sample == {
        "id": "c:0",
        "input_ids": [1, 2, 3, 7, 8, 9, 4, 5, 6, 9],
        "loss_mask": [0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
    }


def test_sample_builder_splits_where_the_history_is_re_rendered():
    b = SampleBuilder("c:0")
    b.add_turn(0, [1, 2], [7, 9])
    b.add_turn(1, [1, 2, 5, 9, 4], [6, 9])  # the template rewrote answer 0 as [5, 9]
    assert b.samples() == [
        {"id": "c:0", "input_ids": [1, 2, 7, 9], "loss_mask": [0, 0, 1, 1]},
        {"id": "c:0/1", "input_ids": [1, 2, 5, 9, 4, 6, 9], "loss_mask": [0, 0, 0, 0, 0, 1, 1]},
    ]
    assert b.splits == 1


def test_regenerated_samples_follow_the_render_turn_by_turn(target):
    codec = CharCodec()
    samples, stats = regenerate_batch(target, codec.codec(), CONVERSATIONS, 0, CFG)
    groups = by_conversation(samples)
    for conv in CONVERSATIONS:
        check_on_policy_layout(groups[conv.id], conv, codec, target.eos_ids, CFG.max_new_tokens)
    assert stats["answers"] == sum(len(c.turns) for c in CONVERSATIONS) - stats["empty_answers"]
    assert stats["supervised_tokens"] == stats["generated_tokens"]


# Qwen3-like: the generation prompt gets an empty think block that re-rendered history turns lack.
QWEN_LIKE = SMOL_LIKE.replace(
    "assistant\n{% endif %}",
    "assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)


@pytest.mark.parametrize("template", [SMOL_LIKE, QWEN_LIKE], ids=["prefix-stable", "rewrites-history"])
def test_loss_mask_on_a_real_chat_template(template):
    t = char_level_target(template)
    convs = [Conversation(("Hi there", "And then?", "Thanks"), "c:0"), Conversation(("Why?",), "c:1")]
    cfg = PrepareConfig(max_new_tokens=5, temperature=1.0, top_p=1.0, batch_size=2, shard_size=2)
    samples, stats = regenerate_batch(t, ChatCodec.for_target(t), convs, 0, cfg)
    groups = by_conversation(samples)
    for conv in convs:
        check_on_policy_layout(groups[conv.id], conv, ChatCodec.for_target(t), t.eos_ids, cfg.max_new_tokens)
    if template is QWEN_LIKE:  # history turns lack the think block, so no turn extends the one before
        answers = sum(
            sum(1 for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1]))
            for m in (s["loss_mask"] for s in groups["c:0"])
        )
        assert len(groups["c:0"]) == answers and stats["splits"] >= answers - 1


# ----- the run: resume exactly once -----


class Wrapped:
    """The target, with sample_batch open to overriding."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)


class CrashAfter(Wrapped):
    """sample_batch raises after `calls` successful calls: a simulated crash."""

    def __init__(self, target, calls):
        super().__init__(target)
        self.left = calls

    def sample_batch(self, *args, **kwargs):
        if self.left == 0:
            raise RuntimeError("simulated crash")
        self.left -= 1
        return self.target.sample_batch(*args, **kwargs)


def shard_files(d):
    return {p.name: p.read_bytes() for p in sorted(Path(d).glob("samples-*"))}


def test_prepare_data_writes_meta_and_shards(target, tmp_path):
    meta = prepare_data(target, CONVERSATIONS, tmp_path / "d", CFG, codec=CharCodec().codec(), progress=False)
    assert meta["format"] == "dominospec-data/1" and meta["complete"]
    assert meta["vocab_size"] == 64 and meta["eos_ids"] == [63] and meta["tokenizer_sha256"] == "char-codec"
    assert meta["temperature"] == 1.0 and meta["conversations_total"] == 7
    assert sorted(p.name for p in (tmp_path / "d").glob("samples-*.jsonl")) == [
        f"samples-{k:05d}.jsonl" for k in range(4)
    ]
    loaded_meta, samples = load_dataset_dir(tmp_path / "d", target)
    assert meta["counts"]["samples"] == len(samples)
    assert meta["counts"]["supervised_tokens"] == sum(sum(s["loss_mask"]) for s in samples)


@pytest.mark.parametrize("crash_after", [1, 4, 5])  # calls per shard: 2, 3, 1, 2: crash inside shard 0, 1, 2
def test_resume_after_a_crash_is_exactly_once_and_identical(target, tmp_path, crash_after):
    codec = CharCodec().codec()
    prepare_data(target, CONVERSATIONS, tmp_path / "ref", CFG, codec=codec, progress=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_data(CrashAfter(target, crash_after), CONVERSATIONS, tmp_path / "run", CFG, codec=codec, progress=False)
    (tmp_path / "run" / ".samples-00003.jsonl.tmp").write_text("half a line")  # as kill -9 mid-write leaves it
    prepare_data(target, CONVERSATIONS, tmp_path / "run", CFG, codec=codec, progress=False)
    assert shard_files(tmp_path / "run") == shard_files(tmp_path / "ref")
    assert not list((tmp_path / "run").glob(".*.tmp"))
    ids = [s["id"] for s in load_dataset_dir(tmp_path / "run")[1]]
    assert len(ids) == len(set(ids)) and {i.split("/")[0] for i in ids} <= {c.id for c in CONVERSATIONS}


@pytest.mark.slow
def test_resume_after_kill_9_is_exactly_once_and_identical(target, tmp_path):
    codec = CharCodec().codec()
    prepare_data(target, CONVERSATIONS, tmp_path / "ref", CFG, codec=codec, progress=False)
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import conftest as t
from dominospec.data.prepare import prepare_data

class Slow:
    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)

    def sample_batch(self, *a, **k):
        time.sleep(0.3)
        return self.target.sample_batch(*a, **k)

prepare_data(Slow(t.tiny_target("llama", vocab=64)), t.CONVERSATIONS, sys.argv[1], t.PREPARE,
             codec=t.CharCodec().codec(), progress=False)
"""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (run / "samples-00001.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert not (run / "samples-00003.jsonl").exists(), "killed too late to test anything"
    prepare_data(target, CONVERSATIONS, run, CFG, codec=codec, progress=False)
    assert shard_files(run) == shard_files(tmp_path / "ref")


def test_complete_dir_is_not_regenerated(target, tmp_path):
    codec = CharCodec().codec()
    prepare_data(target, CONVERSATIONS, tmp_path / "d", CFG, codec=codec, progress=False)
    meta = prepare_data(CrashAfter(target, 0), CONVERSATIONS, tmp_path / "d", CFG, codec=codec, progress=False)
    assert meta["complete"]


def test_resume_with_other_settings_is_refused_naming_the_field(target, tmp_path):
    codec = CharCodec().codec()
    with pytest.raises(RuntimeError):
        prepare_data(CrashAfter(target, 1), CONVERSATIONS, tmp_path / "d", CFG, codec=codec, progress=False)
    other = PrepareConfig(**{**CFG.__dict__, "temperature": 0.5})
    with pytest.raises(DominoError, match=r"temperature: 1\.0 there, 0\.5 now"):
        prepare_data(target, CONVERSATIONS, tmp_path / "d", other, codec=codec, progress=False)
    with pytest.raises(DominoError, match="prompts_sha256"):
        prepare_data(
            target, CONVERSATIONS[:-1] + [Conversation(("x",), "t:6")], tmp_path / "d", CFG, codec=codec, progress=False
        )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DominoError, match="not empty"):
        prepare_data(target, CONVERSATIONS, tmp_path / "other", CFG, codec=codec, progress=False)


class EmptyFirstAnswer(Wrapped):
    """Answers the first conversation of every batch with a bare EOS."""

    def sample_batch(self, prompts, *args, **kwargs):
        answers = self.target.sample_batch(prompts, *args, **kwargs)
        return [[self.target.eos_ids[0]]] + answers[1:]


def test_empty_answers_are_skipped_and_counted(target, tmp_path):
    meta = prepare_data(
        EmptyFirstAnswer(target), CONVERSATIONS, tmp_path / "d", CFG, codec=CharCodec().codec(), progress=False
    )
    assert meta["counts"]["empty_answers"] >= 4  # at least turn 0 of each of the 4 batches
    ids = {s["id"].split("/")[0] for s in load_dataset_dir(tmp_path / "d")[1]}
    assert not ids & {"t:0", "t:2", "t:4", "t:6"}


def test_shard_size_does_not_change_the_samples(target, tmp_path):
    """Seeds follow the conversation index, not the shard, so sharding differently gives the same data."""
    codec = CharCodec().codec()
    one = PrepareConfig(**{**CFG.__dict__, "batch_size": 1, "shard_size": 1})
    three = PrepareConfig(**{**CFG.__dict__, "batch_size": 1, "shard_size": 3})
    prepare_data(target, CONVERSATIONS, tmp_path / "a", one, codec=codec, progress=False)
    prepare_data(target, CONVERSATIONS, tmp_path / "b", three, codec=codec, progress=False)
    assert load_dataset_dir(tmp_path / "a")[1] == load_dataset_dir(tmp_path / "b")[1]


# ----- loading back -----


def make_dir(tmp_path, target):
    d = tmp_path / "d"
    prepare_data(target, CONVERSATIONS[:2], d, CFG, codec=CharCodec().codec(), progress=False)
    return d


def test_load_refuses_another_target(target, tmp_path):
    d = make_dir(tmp_path, target)
    with pytest.raises(DominoError, match=rf"{d}.*64 tokens.*has 96"):
        load_dataset_dir(d, tiny_target("llama", vocab=96))

    class OtherTokenizer:
        name, vocab_size, tokenizer_fingerprint = "other", 64, "f" * 64

    with pytest.raises(DominoError, match=rf"{d}.*another tokenizer.*char-codec.*ffff"):
        load_dataset_dir(d, OtherTokenizer())


@pytest.mark.parametrize(
    "sample, error",
    [
        ({"id": "x", "input_ids": [1, 64], "loss_mask": [0, 1]}, "token id 64 outside the vocabulary"),
        ({"id": "x", "input_ids": [1, 2], "loss_mask": [1]}, "2 input_ids but 1 loss_mask"),
        ({"id": "x", "input_ids": [1, 2], "loss_mask": [0, 0]}, "no supervised token"),
        ({"id": "t:0", "input_ids": [1, 2], "loss_mask": [0, 1]}, "appears twice"),
    ],
)
def test_load_reports_bad_samples_with_file_and_line(target, tmp_path, sample, error):
    d = make_dir(tmp_path, target)
    shard = d / "samples-00000.jsonl"
    n = len(shard.read_text().splitlines())
    with shard.open("a") as f:
        f.write(json.dumps(sample) + "\n")
    with pytest.raises(DominoError, match=rf"{shard}:{n + 1}: .*{error}"):
        load_dataset_dir(d)


def test_load_refuses_empty_or_foreign_dirs(target, tmp_path):
    with pytest.raises(DominoError, match="no meta.json"):
        load_dataset_dir(tmp_path)
    d = make_dir(tmp_path, target)
    for shard in d.glob("samples-*.jsonl"):
        shard.write_text("")
    with pytest.raises(DominoError, match="holds no samples"):
        load_dataset_dir(d)
    (d / "meta.json").write_text(json.dumps({"format": "something-else/2"}))
    with pytest.raises(DominoError, match="format 'something-else/2'"):
        load_dataset_dir(d)


# ----- the bundled target, end to end -----


@pytest.mark.integration
@pytest.mark.slow
def test_prepare_data_cli_on_smollm2(tmp_path, cli_smollm):
    from dominospec import cli

    target = cli_smollm
    prompts = write_lines(
        tmp_path / "p.jsonl",
        [json.dumps({"turns": ["Say hi.", "Now say bye."]}), json.dumps({"prompt": "What is 2+3?"})],
    )
    assert (
        cli.main(
            [
                "prepare-data",
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "d"),
                "--max-new-tokens",
                "8",
                "--batch-size",
                "2",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    meta, samples = load_dataset_dir(tmp_path / "d", target)
    assert meta["tokenizer_sha256"] == target.tokenizer_fingerprint and meta["counts"]["conversations"] == 2
    convs = {c.id: c for c in read_prompt_file(prompts)}
    for cid, group in by_conversation(samples).items():
        check_on_policy_layout(group, convs[cid], ChatCodec.for_target(target), target.eos_ids, 8)
        first_answer = group[0]["loss_mask"].index(1)
        assert target.tokenizer.decode(group[0]["input_ids"][:first_answer]).endswith("<|im_start|>assistant\n")


def test_skip_continues_a_sources_draw_without_repeating_it():
    """--skip N drops the first N conversations: builtin:M+N with skip N continues builtin:N of the same seed."""
    first, _ = load_prompts(["builtin:40"], seed=3)
    rest, sources = load_prompts(["builtin:100"], seed=3, skip=40)
    whole, _ = load_prompts(["builtin:100"], seed=3)
    assert [c.turns for c in first + rest] == [c.turns for c in whole]
    assert not {c.turns for c in first} & {c.turns for c in rest} and not {c.id for c in first} & {c.id for c in rest}
    assert sources[0]["conversations"] == 60 and sources[0]["skipped"] == 40
    _, two = load_prompts(["builtin:3", "pydoc:5"], seed=1, skip=4)  # the skip runs over the sources in order
    assert [(s["conversations"], s["skipped"]) for s in two] == [(0, 3), (4, 1)]
    with pytest.raises(DominoError, match="--skip 3: the prompt sources give only 3"):
        load_prompts(["builtin:3"], skip=3)
