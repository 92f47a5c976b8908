"""Calibration: the STS fit on synthetic confidences, its metrics, and `dominospec calibrate` end to end."""

import json
import socket

import pytest
import torch
from conftest import run_cli, run_cli_json, tiny_drafter, write_prompts

from dominospec import DominoError
from dominospec.tune.calibrate import ConfidenceRecords, auroc, collect_records, expected_calibration_error, fit_sts


def synthetic_records(true_temps, n=4000, seed=0) -> ConfidenceRecords:
    """Cycles whose slot k truly survives with sigmoid(logit_k / T_k) once slots < k did: logits off by T_k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, len(true_temps), generator=g, dtype=torch.float64) * 3
    alive = torch.ones(n, dtype=torch.bool)
    accepted = torch.zeros(n, dtype=torch.long)
    for k, t in enumerate(true_temps):
        alive &= torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(logits[:, k] / t)
        accepted += alive
    return ConfidenceRecords(logits, accepted)


def test_sts_recovers_the_miscalibration_and_lowers_ece():
    true = [2.0, 3.0, 0.5, 1.5]  # over-confident, more so, under-confident, over-confident
    fit = fit_sts(synthetic_records(true))
    for got, want in zip(fit["temperatures"], true):
        assert got == pytest.approx(want, rel=0.2)
    for k in range(4):
        assert fit["ece_after"][k] < fit["ece_before"][k]
        assert fit["ece_after"][k] < 0.025
        assert fit["auroc_after"][k] > 0.7
    assert fit["ece_before"][0] > 0.08  # really miscalibrated to begin with
    assert fit["samples"] == [4000] * 4 and fit["survived"][0] > fit["survived"][3]


def test_sts_leaves_calibrated_confidences_alone_and_skips_slots_never_drafted():
    records = synthetic_records([1.0, 1.0, 1.0], n=4000, seed=1)
    records.logits[:500, 2] = float("nan")  # cycles cut at the context end drafted only two slots
    fit = fit_sts(records)
    assert fit["temperatures"] == pytest.approx([1.0, 1.0, 1.0], rel=0.3)  # ECE is a noisy objective
    assert fit["samples"] == [4000, 4000, 3500]
    json.dumps(fit, allow_nan=False)  # what calibration.json must hold


def test_ece_and_auroc_on_hand_made_values():
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert float(expected_calibration_error(labels.double(), labels)) == 0.0
    assert float(expected_calibration_error(torch.full((4,), 0.8, dtype=torch.float64), labels)) == pytest.approx(0.3)
    scores = torch.tensor([0.9, 0.1, 0.8, 0.3], dtype=torch.float64)
    assert auroc(scores, labels) == 1.0 and auroc(-scores, labels) == 0.0
    assert auroc(torch.zeros(4, dtype=torch.float64), labels) == 0.5  # ties count half
    assert auroc(scores, torch.ones(4)) is None


def test_records_need_a_confidence_head_and_prompts(llama_target):
    with pytest.raises(DominoError, match="no confidence head"):
        collect_records(llama_target, tiny_drafter(llama_target, block_size=3), [[1, 2, 3]])
    with pytest.raises(DominoError, match="no prompts"):
        collect_records(llama_target, tiny_drafter(llama_target, block_size=3, confidence=True), [])
    records = collect_records(
        llama_target,
        tiny_drafter(llama_target, block_size=3, confidence=True),
        [[1, 2, 3], [5, 9, 11]],
        max_new_tokens=12,
        progress=False,
    )
    assert records.logits.shape[1] == 3 and len(records) >= 4
    assert ((records.accepted >= 0) & (records.accepted <= 3)).all()


def test_cli_calibrate_then_generate_with_scheduled_verification(char_model, tmp_path, capsys):
    drafter = tmp_path / "drafter"
    rc, err = run_cli(
        capsys,
        "init",
        "--target",
        char_model,
        "--out",
        drafter,
        "--layers",
        "1",
        "--block-size",
        "3",
        "--rank",
        "4",
        "--gru-hidden-size",
        "8",
        "--intermediate-size",
        "16",
        "--confidence-head",
    )
    assert rc == 0, err
    prompts = write_prompts(tmp_path / "held-out.jsonl", ["hi there", "why not?", "a b c", "ok then"])
    rc, err = run_cli(
        capsys,
        "calibrate",
        "--target",
        char_model,
        "--drafter",
        drafter,
        "--prompts",
        prompts,
        "--max-new-tokens",
        "16",
    )
    assert rc == 0, err
    cal = json.loads((drafter / "calibration.json").read_text())
    assert len(cal["temperatures"]) == 3 and all(t > 0 for t in cal["temperatures"])
    for key in ("ece_before", "ece_after", "auroc_before", "auroc_after", "samples", "reliability_after"):
        assert len(cal[key]) == 3, key
    assert (
        cal["prompts"] == 4 and len(cal["prompts_fingerprint"]) == 64 and cal["measured_by"] == "dominospec calibrate"
    )
    assert all(a <= b + 1e-12 for a, b in zip(cal["ece_after"], cal["ece_before"]) if a is not None)
    pytest.importorskip("matplotlib")
    assert (drafter / "calibration.png").stat().st_size > 0

    # generate reads the temperatures (no fallback note), for static and cost alike
    rc, out, err = run_cli_json(
        capsys,
        "generate",
        "hi",
        "--target",
        char_model,
        "--drafter",
        drafter,
        "--verify",
        "static",
        "--confidence-threshold",
        "0.3",
        "--max-new-tokens",
        "8",
        "--json",
    )
    assert rc == 0 and "raw confidences" not in err, err
    assert out["new_tokens"] == 8 and out["verified_per_cycle"] is not None
    rc, plain, _ = run_cli_json(
        capsys, "generate", "hi", "--target", char_model, "--no-draft", "--max-new-tokens", "8", "--json"
    )
    assert plain["text"] == out["text"]
    rc, out, err = run_cli_json(
        capsys, "generate", "hi", "--target", char_model, "--drafter", "lookup", "--max-new-tokens", "8", "--json"
    )
    assert rc == 0 and out["text"] == plain["text"] and "lookup_cycles" in out

    # bench: each verify mode, lookup and hybrid side by side, all lossless
    rc, err = run_cli(
        capsys,
        "bench",
        "--target",
        char_model,
        "--prompts",
        prompts,
        "--drafter",
        drafter,
        "--methods",
        "ar,drafters,lookup,hybrid",
        "--verify",
        "fixed,static",
        "--max-new-tokens",
        "6",
        "--no-plots",
        "--no-warmup",
        "--out",
        tmp_path / "bench",
    )
    assert rc == 0, err
    res = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert list(res["methods"]) == [
        "ar",
        "lookup-b8",
        "lookup-b8-static",
        "domino-1L-b3",
        "domino-1L-b3-static",
        "hybrid-domino-1L-b3",
        "hybrid-domino-1L-b3-static",
    ]
    assert all(m["lossless_mismatches"] == 0 for m in res["methods"].values())


def test_cli_calibrate_and_scheduled_generate_refuse_bad_inputs(char_model, tmp_path, capsys):
    drafter, confident = tmp_path / "no-confidence", tmp_path / "confidence"
    for d, extra in ((drafter, ()), (confident, ("--confidence-head",))):
        assert (
            run_cli(
                capsys,
                "init",
                "--target",
                char_model,
                "--out",
                d,
                "--layers",
                "1",
                "--block-size",
                "2",
                "--rank",
                "4",
                "--gru-hidden-size",
                "8",
                "--intermediate-size",
                "16",
                *extra,
            )[0]
            == 0
        )
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, "calibrate", "--target", char_model, "--drafter", drafter, "--prompts", prompts)
    assert rc == 2 and "no confidence head" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc, err = run_cli(capsys, "calibrate", "--target", char_model, "--drafter", confident, "--prompts", empty)
    assert rc == 2 and "no usable prompts" in err and not (confident / "calibration.json").exists()
    rc, err = run_cli(
        capsys, "calibrate", "--target", char_model, "--drafter", tmp_path / "missing", "--prompts", prompts
    )
    assert rc == 2 and "not a directory" in err
    rc, err = run_cli(capsys, "generate", "hi", "--target", char_model, "--drafter", drafter, "--verify", "static")
    assert rc == 2 and "confidence head" in err  # cost runs without one: it reads the draft's top probability
    rc, err = run_cli(
        capsys, "generate", "hi", "--target", char_model, "--drafter", drafter, "--confidence-threshold", "1.5"
    )
    assert rc == 2 and "--confidence-threshold" in err


def test_generate_defaults_to_cost_scheduled_lookup_and_names_it(capsys, char_model):
    """Protects the measured default (docs/speed.md): without --drafter, prompt lookup with cost-scheduled
    verification runs, says so, and stays lossless; --drafter shipped needs a shipped drafter."""
    args = ("generate", "hi", "--target", char_model, "--max-new-tokens", "8", "--json")
    rc, out, _ = run_cli_json(capsys, *args)
    rc_plain, plain, _ = run_cli_json(capsys, *args, "--no-draft")
    assert rc == rc_plain == 0 and out["configuration"] == "lookup, verify cost" and out["text"] == plain["text"]
    rc, err = run_cli(capsys, *args, "--drafter", "shipped")
    assert rc == 2 and "no drafter is shipped" in err
    rc, err = run_cli(capsys, *args, "--no-lookup")
    assert rc == 2 and "--no-lookup leaves nothing to draft with" in err
    rc, none, _ = run_cli_json(capsys, *args, "--drafter", "none")  # as on serve: plain decoding
    assert rc == 0 and none["configuration"] == plain["configuration"] and none["text"] == plain["text"]
    rc, err = run_cli(capsys, *args, "--drafter", "shipped", "--lookup", "--no-lookup")
    assert rc == 2 and "--lookup and --no-lookup contradict each other" in err
    with socket.socket() as s:  # a port free now (serve checks it before loading)
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    rc, err = run_cli(capsys, "serve", "--target", char_model, "--drafter", "shipped", "--port", port)
    assert rc == 2 and "--drafter shipped: no drafter is shipped" in err, err  # not a plain server in silence
