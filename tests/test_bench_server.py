"""`dominospec bench --server`: a live test server (tiny chat target over the batched engine) driven per
category at two concurrency levels, speculative against plain, in one report."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import run_cli, serve_in_thread, tiny_chat_target, tiny_drafter

from dominospec.bench.server import read_categories
from dominospec.engine import Engine
from dominospec.errors import DominoError


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target(dtype=torch.float64)


@pytest.fixture
def prompt_files(tmp_path):
    """One file in Spec-Bench's layout (question_id, category, turns) and one of the project's eval layout."""
    spec_bench = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write abc abc abc.", "And again."]},
        {"question_id": 2, "category": "writing", "turns": ["Write xyz."]},
        {"question_id": 3, "category": "math_reasoning", "turns": ["1+1=?"]},
    ]
    spec_bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = tmp_path / "eval-code.jsonl"
    own.write_text(json.dumps({"turns": ["def f(): return 1"]}) + "\n")
    return spec_bench, own


def test_categories_come_from_the_line_else_the_file(prompt_files, tmp_path):
    spec_bench, own = prompt_files
    assert read_categories([spec_bench, own]) == {
        "writing": ["Write abc abc abc.", "Write xyz."],  # the first user turn of each
        "math_reasoning": ["1+1=?"],
        "eval-code": ["def f(): return 1"],
    }
    assert read_categories([spec_bench], limit=1)["writing"] == ["Write abc abc abc."]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"category": "x"}\n')
    with pytest.raises(DominoError, match=r"bad.jsonl:2: unknown layout"):
        read_categories([bad])


@pytest.mark.slow
def test_bench_server_reports_each_category_and_level_and_compares_runs(target, prompt_files, tmp_path, capsys):
    spec_bench, own = prompt_files
    common = ["--prompts", spec_bench, "--prompts", own, "--concurrency", "1,2", "--max-new-tokens", "12"]
    common += ["--temperature", "0"]
    speculative = Engine(target, tiny_drafter(target), lookup=True, policy="fixed", max_batch=2)
    with serve_in_thread(speculative, target) as url:
        rc, err = run_cli(capsys, "bench", "--server", url, "--label", "speculative", *common, "--out", tmp_path / "a")
    assert rc == 0, err
    run = json.loads((tmp_path / "a" / "server.json").read_text())
    assert run["label"] == "speculative" and run["model"] == target.name
    cells = {(r["category"], r["concurrency"]) for r in run["rows"]}
    assert cells == {(c, n) for c in ("writing", "math_reasoning", "eval-code") for n in (1, 2)}
    for row in run["rows"]:
        prompts = run["config"]["prompts"][row["category"]]
        assert row["requests"] == max(prompts, row["concurrency"]) and not row["errors"]
        assert 0 < row["tokens"] <= 12 * row["requests"] and row["tokens_per_s"] > 0
        assert row["ttft_ms"]["p50"] > 0 and row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        # the server's per-request marks account for exactly the tokens the client counted
        assert sum(row["spec"]["source_counts"].values()) == row["tokens"] and row["spec"]["tau"] >= 1

    plain = Engine(target, max_batch=2)
    with serve_in_thread(plain, target) as url:
        rc, err = run_cli(capsys, "bench", "--compare", tmp_path / "a" / "server.json", "--server", url,
                          "--label", "plain", *common, "--out", tmp_path / "b")  # fmt: skip
    assert rc == 0, err
    both = json.loads((tmp_path / "b" / "server.json").read_text())["runs"]
    assert [r["label"] for r in both] == ["speculative", "plain"]
    assert all(row["spec"]["tau"] == 1 for row in both[1]["rows"])  # a plain server: one token per cycle
    report = (tmp_path / "b" / "server.md").read_text()
    assert "## Concurrency 1" in report and "## Concurrency 2" in report and "speedup" in report
    for category in ("writing", "math_reasoning", "eval-code"):
        assert report.count(f"| {category} |") == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "b" / "server.png").stat().st_size > 0


def test_bench_server_refuses_other_machines_before_running(capsys, tmp_path):
    rc, err = run_cli(capsys, "bench", "--server", "http://example.com:8000", "--prompts", "x", "--out", tmp_path)
    assert rc == 2 and "this machine" in err


@pytest.mark.slow
def test_loadtest_writes_rss_and_latency_over_time(target, prompt_files, tmp_path, capsys):
    with serve_in_thread(Engine(target, max_batch=2), target) as url:
        rc, err = run_cli(capsys, "loadtest", "--url", url, "--concurrency", "2", "--duration", "2",
                          "--max-tokens", "8", "--prompts", prompt_files[0], "--server-pid", os.getpid(),
                          "--out", tmp_path)  # fmt: skip
    assert rc == 0, err
    report = json.loads((tmp_path / "loadtest.json").read_text())
    timeline = report["timeline"]
    assert len(timeline) == report["requests"] > 0 and report["rss_mb"]
    assert [row[0] for row in timeline] == sorted(row[0] for row in timeline)  # in start order
    assert all(ttft <= latency and 0 < tokens <= 8 for _, ttft, latency, tokens in timeline)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loadtest.png").stat().st_size > 0
