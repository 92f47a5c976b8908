"""The spec_metrics extension: per-token sources from the decoding step to the HTTP answer, and the
per-request counts built from them, against a real server over the batched engine (tiny target with
a character tokenizer, a tiny drafter and prompt lookup, greedy so the answers are reproducible)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import run_cli_json, serve_in_thread, tiny_chat_target, tiny_drafter

import dominospec
from dominospec import cli
from dominospec.decode import PromptLookup, generate_speculative
from dominospec.engine import Engine, EngineRequest
from dominospec.serve.marks import cycle_acceptance, spec_metrics

MESSAGES = [{"role": "user", "content": "abcabcabcabc abcabc"}]


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target(dtype=torch.float64)


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, block_size=4)


@pytest.fixture(scope="module")
def base(target, drafter):
    engine = Engine(target, drafter, lookup=True, policy="fixed", max_batch=4)
    with serve_in_thread(engine, target) as url:
        yield url


def chat(base, stream=False, **extra) -> dict | list[dict]:
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stream": stream, **extra}
    if not stream:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check_consistent(m: dict, tokens: int, marks: list | None = None) -> None:
    """The identities the extension promises for an answer of `tokens` tokens (marks: its spec_tokens)."""
    counts = m["source_counts"]
    assert sum(counts.values()) == tokens
    assert m["accepted"] == counts["drafter"] + counts["lookup"] and m["accepted"] <= m["drafted"]
    # every cycle ends with the target's token, but the answer's cut (EOS, stop, max_tokens) may drop the last one
    cut = m["cycles"] - counts["target"]
    assert cut in (0, 1) and tokens == m["accepted"] + m["cycles"] - cut
    if marks:
        assert cut == (marks[-1][1] != "target")
    assert m["tau"] == pytest.approx(tokens / m["cycles"])
    assert m["accepted_by_position"][0] <= m["cycles"]
    assert all(a >= b for a, b in zip(m["accepted_by_position"], m["accepted_by_position"][1:]))


# ----- the marks, from the decoding step -----


def test_every_token_has_one_source_and_drafts_match_the_acceptance_records(target, drafter):
    res = generate_speculative(target, drafter, [5, 6, 7, 5, 6, 7, 5, 6], 40, lookup=PromptLookup())
    assert len(res.sources) == len(res.tokens) and set(res.sources) <= {"drafter", "lookup", "target"}
    assert res.sources.count("lookup") > 0  # the loop copies: the test sees more than one source
    per_cycle = cycle_acceptance(res.sources)
    assert per_cycle[0] == 0 and len(per_cycle) == res.cycles + 1  # the prompt's forward drew the first token
    # a cut at EOS / the budget may drop the last cycle's tail; every earlier cycle is whole
    assert per_cycle[1:-1] == res.accepted[:-1] and per_cycle[-1] <= res.accepted[-1]


def test_spec_metrics_counts_a_cycle_cut_before_its_target_token():
    marks = ["target", "lookup", "lookup", "target", "target", "drafter", "drafter"]
    m = spec_metrics(marks, [0, 3, 2, 4])
    assert cycle_acceptance(marks) == [0, 2, 0, 2]
    assert (m["cycles"], m["drafted"], m["accepted"]) == (4, 9, 4)
    assert m["accepted_by_position"] == [2, 2, 0, 0]
    assert m["source_counts"] == {"drafter": 2, "lookup": 2, "target": 3}
    assert m["tau"] == pytest.approx(7 / 4)


# ----- over HTTP -----


def test_plain_openai_bodies_see_nothing_new(base):
    whole = chat(base)
    assert "spec_metrics" not in whole["usage"] and "spec_tokens" not in whole["choices"][0]
    chunks = chat(base, stream=True)
    assert all("spec_tokens" not in c["choices"][0] for c in chunks)
    assert not any("usage" in c for c in chunks)  # include_usage was not asked


def test_spec_metrics_match_the_answer_whole_and_streamed(base):
    whole = chat(base, spec_metrics=True)
    m, choice = whole["usage"]["spec_metrics"], whole["choices"][0]
    check_consistent(m, whole["usage"]["completion_tokens"], choice["spec_tokens"])
    assert m["accepted"] > 0  # drafts were accepted: the counts say something
    assert "".join(text for text, _ in choice["spec_tokens"]) == choice["message"]["content"]
    assert {s for _, s in choice["spec_tokens"]} <= {"drafter", "lookup", "target"}

    chunks = chat(base, stream=True, spec_metrics=True)
    text = ""
    for c in chunks[:-1]:  # every text chunk carries its own marks
        content = c["choices"][0]["delta"].get("content", "")
        assert "".join(t for t, _ in c["choices"][0].get("spec_tokens", [])) == content
        text += content
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["spec_metrics"] == m


def test_spec_metrics_follow_a_stop_string_cut(base):
    full = chat(base, spec_metrics=True)["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = chat(base, spec_metrics=True, stop=[stop])
    assert r["choices"][0]["message"]["content"] == full[: full.index(stop)]
    check_consistent(r["usage"]["spec_metrics"], r["usage"]["completion_tokens"])


def test_completions_take_the_extension_too(base):
    body = {"prompt": "xyzxyzxyzxyz", "max_tokens": 30, "temperature": 0, "spec_metrics": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    check_consistent(r["usage"]["spec_metrics"], r["usage"]["completion_tokens"])
    assert "".join(t for t, _ in r["choices"][0]["spec_tokens"]) == r["choices"][0]["text"]


def test_a_plain_request_proposes_nothing_and_gives_the_same_greedy_answer(base):
    spec = chat(base, spec_metrics=True)
    plain = chat(base, spec_metrics=True, speculative=False)
    assert plain["choices"][0]["message"]["content"] == spec["choices"][0]["message"]["content"]
    m, tokens = plain["usage"]["spec_metrics"], plain["usage"]["completion_tokens"]
    assert (m["drafted"], m["accepted"], m["cycles"]) == (0, 0, tokens)
    assert m["source_counts"]["target"] == tokens


def test_plain_and_speculative_rows_share_a_batch_without_changing_each_other(target, drafter):
    """Plain rows in a speculative engine: every answer equals its own run alone (greedy)."""
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12], [20, 21, 20, 21, 20]]

    flags = [True, False, True]

    def run(prompts, flags):
        engine = Engine(target, drafter, lookup=True, policy="fixed", max_batch=4)
        handles = [engine.submit(EngineRequest(p, 24, eos_ids=[], speculative=f)) for p, f in zip(prompts, flags)]
        engine.run_until_idle()
        return [h.wait(0) for h in handles]

    mixed = run(prompts, flags)
    for prompt, flag, result in zip(prompts, flags, mixed):
        assert result.tokens == run([prompt], [flag])[0].tokens
    assert set(mixed[1].sources) == {"target"} and sum(mixed[1].verified) == 0
    assert any(s != "target" for s in mixed[0].sources + mixed[2].sources)


# ----- generate: the marks in a terminal -----

SRC = Path(dominospec.__file__).resolve().parents[1]  # the subprocess imports the package under test
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def generate_on_a_terminal(char_model, *extra) -> str:
    """stdout of `dominospec generate` run on a pseudo-terminal (it sees a TTY)."""
    primary, secondary = pty.openpty()
    cmd = [sys.executable, "-m", "dominospec.cli", "generate", "hi hi hi", "--target", str(char_model)]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [*cmd, "--drafter", "lookup", "--max-new-tokens", "30", *extra],
        stdout=secondary,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    os.close(secondary)
    out = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(primary)
    assert proc.wait(timeout=120) == 0
    return out.decode().replace("\r\n", "\n")


@pytest.mark.slow
def test_generate_colours_tokens_by_source_only_on_a_terminal(char_model, capsys):
    rc, out, _ = run_cli_json(capsys, "generate", "hi hi hi", "--target", char_model, "--drafter", "lookup",
                              "--max-new-tokens", "30", "--json")  # fmt: skip
    assert rc == 0 and out["lookup_cycles"] > 0  # copies were accepted: there is something to colour
    cli.main(["generate", "hi hi hi", "--target", str(char_model), "--drafter", "lookup", "--max-new-tokens", "30"])
    piped = capsys.readouterr().out  # not a terminal: plain text
    assert "\x1b" not in piped and piped == out["text"]

    coloured = generate_on_a_terminal(char_model)
    assert "\x1b[36m" in coloured  # a prompt-lookup copy, in cyan
    assert ANSI.sub("", coloured) == out["text"]  # the colours change nothing else
    assert generate_on_a_terminal(char_model, "--no-color") == out["text"]
