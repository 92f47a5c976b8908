"""What a new user runs into: every mistake gets the right behaviour or a clear error (exit 2, no
traceback) that names the file, line, value or setting; nothing finished is lost.

CLI-level tests use a tiny Llama saved as a Hugging Face directory with a one-character-per-token
tokenizer and a context of only 64 positions, so "too long" is easy to reach.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    CHAR_CONTEXT,
    run_cli,
    run_cli_json,
    save_char_model,
    synthetic_samples,
    tiny_drafter,
    write_prompts,
)

import dominospec
from dominospec import (
    DominoError,
    Drafter,
    DrafterConfig,
    SamplingConfig,
    Target,
    cli,
    generate_autoregressive,
    generate_speculative,
)
from dominospec.bench import runner
from dominospec.bench.methods import TransformersGenerate
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.prompts import read_prompt_file
from dominospec.io import exclusive_lock
from dominospec.train.samples import validate_samples
from dominospec.train.trainer import TrainConfig, Trainer

CONTEXT = CHAR_CONTEXT
NOWHERE = "/nonexistent/target-that-must-not-load"  # an argument error must be reported before this loads


# ----- fixtures -----


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def char_data(char_model, shared_dir) -> Path:
    """prepare-data output of the char model: 4 short prompts, answers cut at the context."""
    prompts = write_prompts(shared_dir / "short.jsonl", ["hi", "why?", "a b", "ok"])
    out = shared_dir / "char-data"
    assert (
        cli.main(
            [
                "prepare-data",
                "--target",
                str(char_model),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                "100",
                "--batch-size",
                "2",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    return out


def train_args(char_model, data, out, *extra):
    return [
        "train",
        "--target",
        char_model,
        "--data",
        data,
        "--out",
        out,
        "--layers",
        "1",
        "--block-size",
        "2",
        "--gru-hidden-size",
        "8",
        "--rank",
        "4",
        "--intermediate-size",
        "16",
        "--batch-size",
        "2",
        "--anchors",
        "4",
        "--max-steps",
        "2",
        "--save-every",
        "1",
        *extra,
    ]


# ----- 1. prompts longer than the context -----


def test_text_too_long_by_characters_is_refused_without_tokenizing():
    from dominospec.targets.context import MIN_ANSWER_TOKENS, encode_if_fits

    def never(text):
        raise AssertionError("a 1 MB prompt must not be tokenized")

    ids, why = encode_if_fits("x" * 1_000_000, never, 64, 12)
    assert ids is None and why.startswith("has 1000000 characters") and "at most 576" in why
    ids, why = encode_if_fits("x" * 50, lambda t: list(range(len(t))), 64, 12)
    assert ids is None and why == (
        f"has 50 tokens; the target's context of 64 positions takes prompts of at most "
        f"{64 - MIN_ANSWER_TOKENS} tokens (room for a 16-token answer)"
    )
    assert encode_if_fits("x" * 48, lambda t: list(range(len(t))), 64, 12) == (list(range(48)), None)
    assert encode_if_fits("x" * 10**6, list, None, 12)[1] is None  # unknown context: nothing refused


def test_prepare_data_skips_prompts_that_cannot_fit_and_cuts_answers_at_the_context(char_model, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "x" * 40, "y" * 1_000_000, "ok"])
    out = tmp_path / "d"
    rc, err = run_cli(
        capsys,
        "prepare-data",
        "--target",
        char_model,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        100,
        "--batch-size",
        2,
        "--temperature",
        0,
    )
    assert rc == 0, err
    assert "prompt p:2 has 59 tokens; the target's context of 64 positions takes prompts of at most 48" in err
    assert "prompt p:3 has 1000000 characters" in err
    assert "skipped 2 prompt(s) too long for the target's context of 64 positions" in err
    assert "2 answer(s) cut at the end of the target's context" in err
    meta, samples = load_dataset_dir(out)
    assert meta["prompts_over_context"] == 2 and meta["counts"]["cut_at_context"] == 2
    assert meta["counts"]["truncated_answers"] == 0
    assert sorted(s["id"] for s in samples) == ["p:1", "p:4"]
    assert all(len(s["input_ids"]) == CONTEXT for s in samples)  # answers run to the end of the context
    rc, err = run_cli(
        capsys,
        "prepare-data",
        "--target",
        char_model,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "fatal",
        "--on-error",
        "fatal",
    )
    assert rc == 2 and "error: prompt p:2 has 59 tokens" in err


def test_generation_is_capped_at_the_context_and_says_so(llama_target):
    target = llama_target  # 512 positions
    d = tiny_drafter(target, block_size=4)
    prompt = [(7 * i) % 60 + 1 for i in range(500)]
    ar = generate_autoregressive(target, prompt, 100, eos_ids=[])
    spec = generate_speculative(target, d, prompt, 100, eos_ids=[])
    assert ar.new_tokens == 12 and spec.tokens == ar.tokens
    for res in (ar, spec):
        assert res.notes == [
            "max_new_tokens 100 capped at 12: the prompt (500 tokens) and the answer must fit the "
            "target's context of 512 positions"
        ]
    assert generate_autoregressive(target, prompt, 10, eos_ids=[]).notes == []
    with pytest.raises(DominoError, match="the prompt has 512 tokens and fills the target's context of 512"):
        generate_speculative(target, d, prompt + list(range(1, 13)), 10)


def test_cli_generate_caps_new_tokens_and_refuses_a_prompt_that_cannot_fit(char_model, capsys):
    rc, res, err = run_cli_json(
        capsys, "generate", "hi", "--target", char_model, "--no-draft", "--max-new-tokens", 1000, "--json"
    )
    note = (
        "max_new_tokens 1000 capped at 43: the prompt (21 tokens) and the answer must fit the target's "
        "context of 64 positions"
    )
    assert rc == 0 and res["new_tokens"] == 43 and res["notes"] == [note]
    assert f"[dominospec] {note}" in err
    rc, err = run_cli(capsys, "generate", "x" * 40, "--target", char_model, "--no-draft")
    assert rc == 2 and "error: PROMPT has 59 tokens; the target's context of 64 positions" in err


def test_bench_skips_prompts_that_cannot_fit_naming_file_and_line(char_model, tmp_path):
    target = Target.load(str(char_model), device="cpu")
    prompts = write_prompts(tmp_path / "set.jsonl", ["hi", "x" * 40, "ok"])
    said = []
    sets = runner.load_prompt_sets([str(prompts)], target, report=said.append)
    assert [len(p) for p in sets["set"]] == [21, 21]
    assert said == [
        f"{prompts}:2: prompt has 59 tokens; the target's context of 64 positions takes prompts of "
        "at most 48 tokens (room for a 16-token answer); skipped"
    ]
    hf = TransformersGenerate().run(target, sets["set"][0], 100, SamplingConfig(), 0)
    assert hf.new_tokens == CONTEXT - 21  # transformers' own generate is capped like the others


def test_training_cuts_over_long_samples_instead_of_refusing_the_data(qwen3_target):
    long = {"id": "long", "input_ids": list(range(1, 11)), "loss_mask": [0] * 2 + [1] * 8}
    late = {"id": "late", "input_ids": list(range(1, 11)), "loss_mask": [0] * 7 + [1] * 3}
    short = {"id": "short", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    said = []
    kept = validate_samples([long, late, short], qwen3_target, 6, "data", report=said.append)
    assert [s["id"] for s in kept] == ["long", "short"]
    assert kept[0]["input_ids"] == list(range(1, 7)) and kept[0]["loss_mask"] == [0, 0, 1, 1, 1, 1]
    assert said == [
        "data: 2 sample(s) longer than the context limit 6 (--max-seq-len / the target's "
        "max_position_embeddings) cut to it; 1 of them dropped, no answer left within the limit"
    ]


# ----- 2. training numbers, and a run whose loss diverges -----


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gamma", 0.0, "--gamma must be a finite number > 0, got 0.0"),
        ("gamma", math.nan, "--gamma must be a finite number > 0, got nan"),
        ("lr", -1.0, "--lr must be a finite number > 0, got -1.0"),
        ("lr", math.inf, "--lr must be a finite number > 0, got inf"),
        ("batch_size", 0, "--batch-size must be an integer >= 1, got 0"),
        ("save_every", 0, "--save-every must be an integer >= 1, got 0"),
        ("anchors", -1, r"--anchors must be an integer >= 0 \(0: all\), got -1"),
        ("distill", -0.5, r"--distill must be in \[0, 1\], got -0.5"),
        ("max_steps", -3, "--max-steps must be an integer >= 0, got -3"),
        ("epochs", 0.0, "--epochs must be a finite number > 0, got 0.0"),
        ("lambda_start", 1.5, r"--lambda-start must be in \[0, 1\], got 1.5"),
        ("lambda_decay", math.nan, r"--lambda-decay must be a fraction in \[0, 1\], got nan"),
        ("max_seq_len", 1, "--max-seq-len must be an integer >= 2, got 1"),
    ],
)
def test_every_training_number_is_checked_naming_its_flag(field, value, message):
    with pytest.raises(DominoError, match=message):
        TrainConfig(**{field: value})


def test_cli_train_refuses_gamma_0_before_loading_anything(capsys):
    rc, err = run_cli(capsys, "train", "--target", NOWHERE, "--data", NOWHERE, "--out", NOWHERE, "--gamma", 0)
    assert rc == 2 and err.strip() == "dominospec: error: --gamma must be a finite number > 0, got 0.0"


def test_a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(qwen3_target, tmp_path):
    d = tiny_drafter(qwen3_target, block_size=4, randomize_head=False).float()
    trainer = Trainer(
        qwen3_target,
        d,
        synthetic_samples(qwen3_target, n=4),
        tmp_path,
        TrainConfig(max_steps=6, batch_size=2, anchors=4, save_every=2),
        progress=False,
    )

    def poison(step):  # what a too-high learning rate does, without waiting for it
        if step == 2:
            with torch.no_grad():
                d.fc.weight[0, 0] = float("nan")

    with pytest.raises(
        DominoError,
        match=r"training stopped at step 3: the loss is not finite \(.*nan.*; "
        r"the last good checkpoint \(step 2\) is kept in .*train_state and no "
        r"drafter was exported",
    ):
        trainer.fit(on_step=poison)
    assert torch.load(tmp_path / "train_state" / "trainer.pt", weights_only=False)["step"] == 2
    assert not (tmp_path / "model.safetensors").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


# ----- 3. resuming with other settings -----

DRAFTER_SHAPE = dict(head="domino", block_size=4, num_layers=2, intermediate_size=48, gru_hidden_size=16, rank=8)


def shaped_drafter(target, **changes):
    torch.manual_seed(1)
    return Drafter(DrafterConfig.for_target(target, **{**DRAFTER_SHAPE, **changes})).attach(target).float()


@pytest.fixture(scope="module")
def checkpoint(qwen3_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    cfg = TrainConfig(max_steps=2, batch_size=2, anchors=4, lr=3e-3, save_every=2)
    Trainer(
        qwen3_target, shaped_drafter(qwen3_target), synthetic_samples(qwen3_target, n=4), out, cfg, progress=False
    ).fit()
    return out, cfg


@pytest.mark.parametrize(
    "train_change, drafter_change, message",
    [
        ({"lr": 0.01}, {}, "--lr: 0.01 now, 0.003 in the checkpoint"),
        ({"gamma": 2.0}, {}, "--gamma: 2.0 now, None in the checkpoint"),
        ({"lambda_start": 0.5}, {}, "--lambda-start: 0.5 now, 1.0 in the checkpoint"),
        ({}, {"block_size": 3}, "--block-size: 3 now, 4 in the checkpoint"),
        ({}, {"head": "none"}, "--head: 'none' now, 'domino' in the checkpoint"),
        ({}, {"num_layers": 1}, "--layers: 1 now, 2 in the checkpoint"),
        ({}, {"gru_hidden_size": 32}, "--gru-hidden-size: 32 now, 16 in the checkpoint"),
        ({}, {"draft_vocab_size": 32}, "--draft-vocab: 32 now, 0 in the checkpoint"),
    ],
)
def test_resume_with_changed_settings_is_refused_naming_both_values(
    checkpoint, qwen3_target, train_change, drafter_change, message
):
    out, cfg = checkpoint
    changed = TrainConfig(**{**cfg.__dict__, **train_change})
    trainer = Trainer(
        qwen3_target,
        shaped_drafter(qwen3_target, **drafter_change),
        synthetic_samples(qwen3_target, n=4),
        out,
        changed,
        progress=False,
    )
    with pytest.raises(DominoError, match=rf"cannot resume {out}/train_state with other settings .*{message}"):
        trainer.load_checkpoint()


def test_resume_with_only_the_checkpoint_interval_changed_continues(checkpoint, qwen3_target):
    out, cfg = checkpoint
    trainer = Trainer(
        qwen3_target,
        shaped_drafter(qwen3_target),
        synthetic_samples(qwen3_target, n=4),
        out,
        TrainConfig(**{**cfg.__dict__, "save_every": 3}),
        progress=False,
    )
    assert trainer.load_checkpoint() and trainer.step == 2


def test_cli_resume_without_a_checkpoint_says_it_starts_fresh(char_model, char_data, tmp_path, capsys):
    rc, err = run_cli(capsys, *train_args(char_model, char_data, tmp_path / "t", "--resume"))
    assert rc == 0, err
    assert f"--resume: no checkpoint found in {tmp_path / 't' / 'train_state'}, starting fresh" in err
    assert (tmp_path / "t" / "model.safetensors").exists()


# ----- 4. an output location that cannot be written -----

MODE_BITS_OBEYED = """
import contextlib, io, json, sys
from dominospec import cli
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    results.append([rc, err.getvalue()])
print(json.dumps(results))
"""


def _obey_mode_bits():
    """Give up the two capabilities that let root ignore mode bits (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH).

    Staying uid 0 keeps the interpreter readable (it may live under a 0700 /root, out of reach of an
    unprivileged user); a 0555 directory owned by root is then unwritable, as for anyone else.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; the exec'd process gets no more than this set
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow
def test_unwritable_outputs_are_refused_before_any_work(char_model, char_data, shared_dir):
    readonly = shared_dir / "readonly"
    readonly.mkdir(mode=0o555, exist_ok=True)
    readonly.chmod(0o555)
    writable = shared_dir / "writable"
    as_root = os.geteuid() == 0
    if not as_root and os.access(readonly, os.W_OK):
        pytest.skip("cannot make a directory this user cannot write")
    prompts = write_prompts(shared_dir / "bench.jsonl", ["hi"])
    m = str(char_model)
    cases = {
        "prepare-data": (
            ["prepare-data", "--target", m, "--prompts", str(prompts), "--out", f"{readonly}/data"],
            f"--out {readonly}/data is not writable (Permission denied)",
        ),
        "init": (
            ["init", "--target", m, "--out", f"{readonly}/drafter"],
            f"--out {readonly}/drafter is not writable (Permission denied)",
        ),
        "train": (
            train_args(m, str(char_data), f"{readonly}/train"),
            f"--out {readonly}/train is not writable (Permission denied)",
        ),
        "feature-cache": (
            train_args(m, str(char_data), f"{writable}/train", "--feature-cache", f"{readonly}/cache"),
            f"--feature-cache {readonly}/cache is not writable (Permission denied)",
        ),
        "bench": (
            ["bench", "--target", m, "--prompts", str(prompts), "--methods", "ar", "--out", f"{readonly}/b"],
            f"--out {readonly}/b is not writable (Permission denied)",
        ),
    }
    package_root = Path(dominospec.__file__).resolve().parents[1]  # the dominospec these tests import
    env = dict(os.environ, PYTHONPATH=str(package_root), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    try:
        r = subprocess.run(
            [sys.executable, "-c", MODE_BITS_OBEYED, json.dumps([argv for argv, _ in cases.values()])],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_obey_mode_bits if as_root else None,
        )
    except subprocess.SubprocessError as exc:  # no CAP_SETPCAP to give the capabilities up
        pytest.skip(f"cannot make root obey mode bits here: {exc}")
    assert r.returncode == 0, r.stderr[-3000:]
    for (name, (_, message)), (rc, err) in zip(cases.items(), json.loads(r.stdout)):
        assert rc == 2 and f"dominospec: error: {message}" in err.splitlines(), (name, err)
    assert not list(readonly.iterdir())


# ----- 5. a byte-order mark -----


def test_a_byte_order_mark_does_not_cost_the_first_prompt(tmp_path, char_data):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    assert [c.turns[0] for c in read_prompt_file(path, on_error="fatal")] == ["first", "second"]
    copy = tmp_path / "data"
    shutil.copytree(char_data, copy)
    shard = copy / "samples-00000.jsonl"
    shard.write_bytes(b"\xef\xbb\xbf" + shard.read_bytes())
    assert len(load_dataset_dir(copy)[1]) == len(load_dataset_dir(char_data)[1])


# ----- 6. two training runs into one directory -----


def test_a_second_training_run_into_the_same_directory_is_refused(qwen3_target, tmp_path):
    trainer = Trainer(
        qwen3_target,
        shaped_drafter(qwen3_target),
        synthetic_samples(qwen3_target, n=4),
        tmp_path,
        TrainConfig(max_steps=1, batch_size=2, anchors=4),
        progress=False,
    )
    with exclusive_lock(tmp_path, "train"):  # another run holds OUT/.lock
        with pytest.raises(DominoError, match=rf"another train run is writing {tmp_path} \(it holds "):
            trainer.fit()
    assert not (tmp_path / "metrics.jsonl").exists()
    trainer.fit()  # once the other run is gone
    assert (tmp_path / "model.safetensors").exists()


# ----- 7 and 8. sampling values and numbers checked before any model loads -----


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["generate", "hi", "--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
        (
            ["bench", "--prompts", "{prompts}", "--out", "{tmp}/b", "--temperature", "nan"],
            "--temperature must be a finite number >= 0, got nan",
        ),
        (
            ["prepare-data", "--prompts", "{prompts}", "--out", "{tmp}/d", "--temperature", "inf"],
            "--temperature must be a finite number >= 0, got inf",
        ),
        (
            ["prepare-data", "--prompts", "{prompts}", "--out", "{tmp}/d", "--shard-size", "0"],
            "--shard-size 0 must be a positive multiple of --batch-size 8",
        ),
        (
            ["prepare-data", "--prompts", "{prompts}", "--out", "{tmp}/d", "--limit", "0"],
            "--limit must be at least 1, got 0",
        ),
        (
            ["prepare-data", "--prompts", "{prompts}", "--out", "{tmp}/d", "--max-new-tokens", "0"],
            "--max-new-tokens must be at least 1, got 0",
        ),
        (["generate", ""], "PROMPT is empty: give the message to answer"),
        (["generate", "   "], "PROMPT is empty: give the message to answer"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["generate", "hi", "--block-size", "0"], "--block-size must be at least 1, got 0"),
        (["bench", "--prompts", "{prompts}", "--out", "{tmp}/b", "--limit", "0"], "--limit must be at least 1, got 0"),
        (
            ["bench", "--prompts", "{prompts}", "--out", "{tmp}/b", "--block-size", "0"],
            "--block-size must be at least 1, got 0",
        ),
        (["init", "--out", "{tmp}/i", "--block-size", "0"], "--block-size must be at least 1, got 0"),
        (["init", "--out", "{tmp}/i", "--layers", "0"], "--layers must be at least 1, got 0"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--save-every", "0"], "--save-every must be an integer >= 1"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--max-steps", "-3"], "--max-steps must be an integer >= 0"),
        (
            ["train", "--data", "{tmp}", "--out", "{tmp}/t", "--anchors", "-1"],
            "--anchors must be an integer >= 0 (0: all), got -1",
        ),
        (
            ["train", "--data", "{tmp}", "--out", "{tmp}/t", "--block-size", "0"],
            "--block-size must be at least 1, got 0",
        ),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--draft-vocab", "-5"], "--draft-vocab must be at least 0"),
        (["train", "--data", "{tmp}", "--out", "{tmp}/t", "--memory-gb", "-1"], "--memory-gb must be a finite number"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag_before_any_model_loads(argv, message, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    argv = [a.format(prompts=prompts, tmp=tmp_path) for a in argv] + ["--target", NOWHERE]
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and err.startswith(f"dominospec: error: {message}") and "Traceback" not in err, err


# ----- 9. data written by another target -----


def test_data_written_by_another_target_is_refused_unless_allowed(char_model, char_data):
    same = Target.load(str(char_model), device="cpu")
    # same config and tokenizer, other weights: another target (a target is known by its content)
    other_dir = save_char_model(char_model.parent / "another-model", CHAR_CONTEXT, seed=1)
    other = Target.load(str(other_dir), device="cpu")
    with pytest.raises(
        DominoError,
        match=rf"data {char_data} was written by target '{char_model}', but this run "
        rf"trains for target '{other_dir}'.*--allow-other-target",
    ):
        load_dataset_dir(char_data, other)
    assert load_dataset_dir(char_data, other, allow_other_target=True)[1]
    assert load_dataset_dir(char_data, same)[1]


# ----- 10. messages that say what is wrong -----


def test_a_directory_given_as_prompts_is_called_a_directory(tmp_path, capsys):
    for argv in (
        ["prepare-data", "--prompts", tmp_path, "--out", tmp_path / "d"],
        ["bench", "--prompts", tmp_path, "--out", tmp_path / "b"],
    ):
        rc, err = run_cli(capsys, *argv, "--target", NOWHERE)
        assert rc == 2 and f"--prompts {tmp_path} is a directory; give a JSONL file" in err, err


def test_missing_matplotlib_is_said_once(tmp_path, monkeypatch, capsys):
    from dominospec import log
    from dominospec.train.plots import plot_metrics

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(log, "_said", set())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "ce": 1.0, "tau_greedy": 1.0}) + "\n")
    assert not plot_metrics(metrics, tmp_path / "training.png")
    assert not plot_metrics(metrics, tmp_path / "training.png")
    err = capsys.readouterr().err
    assert err.count("matplotlib is not installed: no training.png (pip install matplotlib)") == 1
    assert not (tmp_path / "training.png").exists()
