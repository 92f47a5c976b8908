"""Benchmark metrics on hand-made records, and the bench runner end to end on tiny targets."""

import argparse
import json

import pytest
import torch
from conftest import tiny_drafter

from dominospec import SamplingConfig
from dominospec.bench import methods as bench_methods
from dominospec.bench import report, runner
from dominospec.bench.metrics import (
    PromptRun,
    conditional_acceptance,
    first_difference,
    position_counts,
    profile_prediction,
    summarize,
    time_split,
    tokens_per_second,
    unconditional_acceptance,
)
from dominospec.cli import bench as bench_cli
from dominospec.data.prompts import read_first_turns
from dominospec.decode import CostTable
from dominospec.decode.result import tokens_per_cycle as tau
from dominospec.errors import DominoError
from dominospec.tune.profile import profile_verify_cost

METRIC_KEYS = {
    "tokens_per_s",
    "speedup",
    "tau",
    "accept_conditional",
    "accept_unconditional",
    "lossless_mismatches",
    "num_prompts",
    "new_tokens",
}


def run(method="m", tokens=(1, 2, 3), total_s=1.0, accepted=(), committed=(), block=0, dataset="d", idx=0, **kw):
    return PromptRun(
        method,
        dataset,
        idx,
        list(tokens),
        total_s,
        accepted=list(accepted),
        committed=list(committed),
        block_size=block,
        **kw,
    )


# ----- acceptance by position -----


def test_conditional_acceptance_only_counts_cycles_that_reached_the_position():
    accepted = [0, 2, 4, 1]  # block 4
    judged, passed = position_counts(accepted, 4)
    assert judged == [4, 3, 2, 1] and passed == [3, 2, 1, 1]
    assert conditional_acceptance(accepted, 4) == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    assert unconditional_acceptance(accepted, 4) == pytest.approx([3 / 4, 2 / 4, 1 / 4, 1 / 4])


def test_unconditional_acceptance_is_the_running_product_of_conditional():
    accepted = [0, 1, 3, 3, 2, 0, 5, 1]
    cond, uncond = conditional_acceptance(accepted, 5), unconditional_acceptance(accepted, 5)
    prod = 1.0
    for c, u in zip(cond, uncond):
        prod *= c
        assert u == pytest.approx(prod)


def test_positions_never_reached_are_undefined_not_zero():
    assert conditional_acceptance([0, 0], 3) == [0.0, None, None]
    assert unconditional_acceptance([0, 0], 3) == [0.0, 0.0, 0.0]
    assert unconditional_acceptance([], 2) == [None, None]
    with pytest.raises(ValueError):
        position_counts([5], 4)


# ----- tau -----


def test_tau_counts_the_bonus_token():
    # accepted 3 drafts + bonus, then 0 + bonus: tau = (4 + 1) / 2
    r = run(tokens=range(6), accepted=[3, 0], committed=[4, 1], block=4)
    assert summarize([r])["tau"] == pytest.approx(2.5)


def test_tau_uses_committed_tokens_when_eos_cuts_a_block():
    # second cycle: the target accepted all 3 drafts, but the 2nd committed token was EOS
    r = run(tokens=range(5), accepted=[1, 3], committed=[2, 2], block=4)
    s = summarize([r])
    assert s["tau"] == pytest.approx(2.0)  # not (2 + 4) / 2
    assert s["accept_unconditional"] == pytest.approx([1.0, 0.5, 0.5, 0.0])  # verification outcome, uncut
    assert s["accept_conditional"] == pytest.approx([1.0, 0.5, 1.0, 0.0])


def test_methods_without_cycles_have_tau_one_and_no_positions():
    s = summarize([run(tokens=range(7))])
    assert s["tau"] == 1.0 and tau([]) == 1.0
    assert s["accept_conditional"] == [] and s["accept_unconditional"] == []


# ----- speed -----


def test_tokens_per_s_is_aggregate_not_mean_of_rates():
    runs = [run(tokens=range(10), total_s=1.0), run(tokens=range(10), total_s=4.0, idx=1)]
    assert tokens_per_second([10, 10], [1.0, 4.0]) == pytest.approx(4.0)  # mean of rates would be 6.25
    s = summarize(runs, reference_tps=2.0)
    assert s["tokens_per_s"] == pytest.approx(4.0) and s["speedup"] == pytest.approx(2.0)
    assert s["num_prompts"] == 2 and s["new_tokens"] == 20
    assert summarize(runs)["speedup"] is None


def test_time_split_leaves_the_rest_to_host_overhead():
    r = run(
        tokens=range(8),
        total_s=1.0,
        prefill_s=0.1,
        draft_s=0.2,
        verify_s=0.5,
        accepted=[1, 1, 1, 1],
        committed=[2, 2, 2, 1],
        block=2,
    )
    t = time_split([r])
    assert t["cycles"] == 4
    assert (t["draft_ms_per_cycle"], t["verify_ms_per_cycle"], t["host_ms_per_cycle"]) == pytest.approx((50, 125, 50))
    assert time_split([run(tokens=range(5), total_s=1.0, prefill_s=0.2)])["decode_ms_per_step"] == pytest.approx(200)
    prompts = [run(prefill_s=0.2, prompt_len=300), run(prefill_s=0.1, prompt_len=150)]
    assert time_split(prompts)["prompt_tok_per_s"] == pytest.approx(1500)  # prompt tokens over prefill seconds


def test_profile_prediction_prices_each_cycle_at_its_own_k_and_context():
    """Verify: the profiled forward over k + 1 tokens per cycle at the nearest profiled context; draft: the profiled
    cycle for the cycles the drafter ran, spread over all; plain decoding: one-token forwards after the first token."""
    profile = {
        "verify": {
            "256": {"k": [1, 2, 3], "seconds": [0.010, 0.012, 0.015]},
            "1024": {"k": [1, 2, 3], "seconds": [0.020, 0.030, 0.040]},
        },
        "draft": {"b": [1, 2], "seconds": [0.001, 0.002]},
    }
    spec = run(tokens=range(5), accepted=[1, 0, 2], committed=[2, 1, 3], block=2)
    spec.verified, spec.draft_skipped, spec.prompt_len = [2, 0, 2], 1, 200
    p = profile_prediction([spec], profile, draft_b=2)
    assert p["profile_verify_ms_per_cycle"] == pytest.approx((15 + 10 + 15) / 3)
    assert p["profile_draft_ms_per_cycle"] == pytest.approx(2 * 2 / 3)  # the skipped cycle drafted nothing
    assert profile_prediction([spec], profile)["profile_draft_ms_per_cycle"] is None  # another drafter's profile
    spec.verified = [2, 0, 3]  # k + 1 = 4 is not in the profile: no prediction rather than a wrong one
    assert profile_prediction([spec], profile, 2)["profile_verify_ms_per_cycle"] is None
    ar = run(tokens=range(5))
    ar.prompt_len = 900  # the middle of its context (902) is nearest the 1024 row
    assert profile_prediction([ar], profile)["profile_decode_ms_per_step"] == pytest.approx(20)


def test_bench_reports_the_profiles_prediction_next_to_the_measured_cycle(tmp_path, llama_target, monkeypatch):
    d = tiny_drafter(llama_target, head="domino", block_size=4)
    profile = {
        "verify": {"256": {"k": list(range(1, 6)), "seconds": [0.01 * k for k in range(1, 6)]}},
        "draft": {"b": [1, 2, 3, 4], "seconds": [0.001] * 4, "drafter": runner.profile_drafter_label(d)},
    }
    monkeypatch.setattr(runner, "load_profile", lambda target: profile)
    methods, _ = bench_methods.build_methods(("ar", "drafters"), [("tiny", d)])
    runner.benchmark(llama_target, DATASETS, methods, tmp_path, max_new_tokens=8, progress=False, plots=False)
    m = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert m["domino-2L-b4"]["profile_verify_ms_per_cycle"] > 10 and m["domino-2L-b4"]["profile_draft_ms_per_cycle"] > 0
    assert m["ar"]["profile_decode_ms_per_step"] == pytest.approx(10)
    assert "(profile)" in (tmp_path / "report.md").read_text()
    cfg = json.loads((tmp_path / "results.json").read_text())["config"]
    assert cfg["device_profile"] == "full" and not any("quick" in n for n in cfg["notes"])
    profile["quick"] = True  # one timed with few repeats on first use: the results say so
    methods, _ = bench_methods.build_methods(("ar",), [])
    runner.benchmark(llama_target, DATASETS, methods, tmp_path, max_new_tokens=4, progress=False, plots=False)
    cfg = json.loads((tmp_path / "results.json").read_text())["config"]
    assert cfg["device_profile"] == "quick" and any("is a quick one" in n for n in cfg["notes"])


def test_one_drafter_in_several_weight_formats_gets_a_method_per_format(llama_target, tmp_path, capsys):
    """Protects: bench --drafter-weights runs each drafter once per weight format, each copy streaming its own
    format and named ...@FORMAT; an unknown format is refused by name before anything loads."""
    drafters = []
    for fmt in ("float32", "int8"):
        d = tiny_drafter(llama_target, head="domino", block_size=4)
        d.weight_format = fmt
        drafters.append((f"tiny @{fmt}", d))
    methods, _ = bench_methods.build_methods(("drafters",), drafters)
    assert [m.name for m in methods] == ["ar", "domino-2L-b4@float32", "domino-2L-b4@int8"]  # ar: the reference
    from dominospec import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    assert cli.main(["bench", "--prompts", str(prompts), "--drafter-weights", "int4", "--out", str(tmp_path)]) == 2
    assert "--drafter-weights 'int4': unknown int4" in capsys.readouterr().err


# ----- losslessness -----


def test_first_difference_counts_length_differences():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_mismatches_are_counted_against_the_reference_per_prompt():
    runs = [
        run("ar", [1, 2, 3], dataset="x", idx=0),
        run("ar", [4, 5], dataset="y", idx=0),
        run("spec", [1, 2, 3], dataset="x", idx=0),
        run("spec", [4, 6], dataset="y", idx=0),
    ]
    out = runner.summarize_benchmark(runs, ["ar", "spec"], ["x", "y"], compare_outputs=True)
    assert out["methods"]["ar"]["lossless_mismatches"] == 0
    assert out["methods"]["spec"]["lossless_mismatches"] == 1
    assert out["methods"]["spec"]["mismatched_prompts"] == [
        {"method": "spec", "dataset": "y", "prompt_index": 0, "first_diff": 1}
    ]
    assert out["per_dataset"]["x"]["spec"]["lossless_mismatches"] == 0
    assert out["per_dataset"]["y"]["spec"]["lossless_mismatches"] == 1
    sampled = runner.summarize_benchmark(runs, ["ar", "spec"], ["x", "y"], compare_outputs=False)
    assert sampled["methods"]["spec"]["lossless_mismatches"] is None


# ----- the runner on tiny targets -----

DATASETS = {"alpha": [[1, 2, 3], [5, 9, 11, 2, 7, 8]], "beta": [[4, 4, 4, 4, 8, 30]]}


def test_bench_end_to_end_layout_and_lossless_greedy(tmp_path, llama_target):
    drafters = [
        ("tiny-domino", tiny_drafter(llama_target, head="domino", block_size=4)),
        ("tiny-none", tiny_drafter(llama_target, head="none", block_size=3)),
    ]
    methods, notes = bench_methods.build_methods(("ar", "hf", "pld", "drafters", "ablation"), drafters)
    names = [m.name for m in methods]
    assert names == ["ar", "hf", "pld", "domino-2L-b4", "domino-2L-b4-nohead", "none-2L-b3"]
    assert any("none-2L-b3" in n and "ablation" in n for n in notes)

    runner.benchmark(llama_target, DATASETS, methods, tmp_path, max_new_tokens=8, progress=False, notes=notes)
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res) == {"config", "methods", "per_dataset"}
    assert list(res["methods"]) == names and list(res["per_dataset"]) == ["alpha", "beta"]
    for table, prompts in [(res["methods"], 3)] + [(res["per_dataset"][d], len(p)) for d, p in DATASETS.items()]:
        for name, m in table.items():
            assert METRIC_KEYS <= set(m), name
            assert m["lossless_mismatches"] == 0, name
            assert m["num_prompts"] == prompts and m["tau"] >= 1.0
        assert table["ar"]["speedup"] == pytest.approx(1.0)
    m = res["methods"]
    assert len(m["domino-2L-b4"]["accept_conditional"]) == 4 and len(m["none-2L-b3"]["accept_unconditional"]) == 3
    assert m["hf"]["accept_conditional"] == [] and m["domino-2L-b4"]["verify_ms_per_cycle"] > 0
    assert res["config"]["datasets"] == {"alpha": 2, "beta": 1} and res["config"]["temperature"] == 0.0
    report = (tmp_path / "report.md").read_text()
    for section in ("## Overall", "## alpha", "## beta", "## Acceptance by block position", "## Where the time goes"):
        assert section in report
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 3 * len(names)


def test_methods_are_interleaved_per_prompt(llama_target):
    methods, _ = bench_methods.build_methods(["ar", "hf"])
    runs = runner.run_benchmark(llama_target, DATASETS, methods, max_new_tokens=3, warmup=False, progress=False)
    prompts = [(r.dataset, r.prompt_index) for r in runs]
    assert prompts == [("alpha", 0)] * 2 + [("alpha", 1)] * 2 + [("beta", 0)] * 2
    assert [r.method for r in runs] == ["ar", "hf", "hf", "ar", "ar", "hf"]  # order rotates per prompt


def test_sampling_bench_compares_no_outputs(tmp_path, llama_target):
    methods, _ = bench_methods.build_methods(["ar", "drafters"], [("d", tiny_drafter(llama_target, block_size=4))])
    res = runner.benchmark(
        llama_target,
        {"alpha": DATASETS["alpha"]},
        methods,
        tmp_path,
        max_new_tokens=8,
        sampling=SamplingConfig(temperature=0.8),
        progress=False,
        plots=False,
    )
    assert all(m["lossless_mismatches"] is None for m in res["methods"].values())
    assert any("not compared" in n for n in res["config"]["notes"])


def test_method_selection_errors_and_notes(llama_target):
    with pytest.raises(DominoError, match="unknown"):
        runner.parse_methods("ar,speculative")
    methods, notes = bench_methods.build_methods(["hf", "drafters"])
    assert [m.name for m in methods] == ["ar", "hf"]
    assert any("no drafter" in n for n in notes) and any("reference" in n for n in notes)
    d = tiny_drafter(llama_target, block_size=4)
    methods, notes = bench_methods.build_methods(["drafters"], [("a", d), ("b", d)], block_size=9)
    assert [m.name for m in methods] == ["ar", "domino-2L-b4", "b:domino-2L-b4"]
    assert methods[1].block_size == 4 and any("above" in n for n in notes)


def test_an_uncalibrated_drafter_is_named_once_in_the_notes(llama_target, tmp_path):
    """Protects: with two drafters lacking calibration.json, the notes name each drafter's directory once,
    though each drafter's cost policy is built for two methods (alone and with prompt lookup)."""
    drafters = []
    for name in ("a", "b"):
        d = tiny_drafter(llama_target, block_size=4, confidence=True)
        d.directory = tmp_path / name
        drafters.append((name, d))
    costs = CostTable({0: [1.0, 1.1, 1.2, 1.3, 1.4]})
    methods, notes = bench_methods.build_methods(["drafters", "hybrid"], drafters, verify=("cost",), costs=costs)
    assert len(methods) == 5  # ar, then each drafter alone and with lookup
    for name in ("a", "b"):
        named = [n for n in notes if f"no calibration.json in {tmp_path / name}:" in n]
        assert len(named) == 1, notes
    assert not any("next to the drafter" in n for n in notes)


def test_bench_parser_defaults():
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--prompts", "a.jsonl", "--prompts", "b.jsonl", "--out", "o"])
    assert args.prompts == ["a.jsonl", "b.jsonl"] and args.methods == bench_methods.DEFAULT_METHODS
    assert (args.profile, args.context, args.max_k, args.temperature) == (False, 256, 16, 0.0)
    assert args.func is bench_cli.cmd_bench
    # a shell glob or brace after one --prompts gives several files: the same list as the flag repeated
    expanded = parser.parse_args(["bench", "--prompts", "a.jsonl", "b.jsonl", "--prompts", "c.jsonl", "--out", "o"])
    assert expanded.prompts == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_prompt_files_give_the_first_user_turn(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"turns": ["first", "second"]},
        {"conversations": [{"from": "human", "value": "share"}, {"from": "gpt", "value": "x"}]},
        {"messages": [{"role": "user", "content": "msg"}, {"role": "assistant", "content": "y"}]},
        {"prompt": "plain"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_first_turns(path) == ["first", "share", "msg", "plain"]
    with pytest.raises(DominoError, match="no such file"):
        read_first_turns(tmp_path / "missing.jsonl")


# ----- verify cost profile -----


def test_verify_cost_profile_layout(tmp_path, llama_target):
    table = profile_verify_cost(llama_target, context=16, max_k=4, repeats=2, progress=False)
    report.write_verify_cost(table, tmp_path)
    data = json.loads((tmp_path / "verify_cost.json").read_text())
    assert {"device", "context", "k", "seconds", "relative_to_1", "sps"} <= set(data)
    assert data["k"] == [1, 2, 3, 4] and data["context"] == 16
    assert len(data["seconds"]) == len(data["relative_to_1"]) == len(data["sps"]) == 4
    assert data["relative_to_1"][0] == pytest.approx(1.0)
    assert data["sps"] == pytest.approx([1 / s for s in data["seconds"]])
    assert "| 4 |" in report.format_verify_cost(data)
    with pytest.raises(DominoError, match="positions"):
        profile_verify_cost(llama_target, context=510, max_k=4, progress=False)


# ----- the text + CLI layer on the bundled target -----


@pytest.mark.integration
@pytest.mark.slow
def test_cli_bench_and_profile_on_the_bundled_target(tmp_path, capsys, cli_smollm):
    from dominospec import cli

    prompts = tmp_path / "tiny-set.jsonl"
    prompts.write_text(json.dumps({"turns": ["What is 2 + 3?"]}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--methods",
                "ar,hf",
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--no-plots",
                "--profile",
                "--context",
                "8",
                "--max-k",
                "2",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| ar |" in printed and "| 2 |" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["datasets"] == {"tiny-set": 1}
    assert res["methods"]["hf"]["lossless_mismatches"] == 0 and res["methods"]["ar"]["new_tokens"] == 4
    assert json.loads((out / "verify_cost.json").read_text())["k"] == [1, 2]
    assert cli.main(["bench", "--out", str(out)]) == 2  # nothing to do: a clear error, no traceback


def test_near_tie_check_accepts_the_target_and_catches_a_real_divergence(llama_target):
    from dominospec import generate_autoregressive

    prompt = [3, 1, 4, 1, 5]
    tokens = generate_autoregressive(llama_target, prompt, 10, eos_ids=[]).tokens
    assert runner.not_near_tie(llama_target, prompt, tokens) == 0
    logits = llama_target.forward(
        __import__("torch").tensor([prompt + tokens[:4]]), llama_target.new_cache(), with_features=False
    ).logits[0, -1]
    worst = int(logits.argmin())  # far below the argmax: no rounding explains choosing it
    assert runner.not_near_tie(llama_target, prompt, tokens[:4] + [worst] + tokens[5:]) >= 1


# ----- the peer: llama.cpp through llama-cpp-python (optional; a stand-in module where it is not installed) -----


def test_llamacpp_is_skipped_with_a_note_when_llama_cpp_python_is_missing(llama_target, monkeypatch):
    monkeypatch.setattr(bench_methods, "llamacpp_available", lambda: False)
    methods, notes = bench_methods.build_methods(["ar", "llamacpp"], target=llama_target)
    assert [m.name for m in methods] == ["ar"]
    assert any("llamacpp: skipped" in n and "llama-cpp-python is not installed" in n for n in notes)


def fake_llama_cpp(vocab: int, made: list):
    """A stand-in llama_cpp module: Llama.generate yields 3, 4, 5, ... whatever the prompt."""
    import importlib.machinery
    import types

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, draft_model, verbose):
            made.append({"path": model_path, "threads": n_threads, "batch": n_threads_batch, "draft": draft_model})

        def n_vocab(self):
            return vocab

        def set_seed(self, seed):
            pass

        def generate(self, tokens, temp, top_k, top_p, reset):
            assert reset and temp == 0.0 and isinstance(tokens, list)
            yield from range(3, 10**6)

    class LlamaPromptLookupDecoding:
        def __init__(self, num_pred_tokens):
            self.num_pred_tokens = num_pred_tokens

    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.Llama = Llama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = LlamaPromptLookupDecoding
    return module, speculative


def test_llamacpp_rows_run_beside_ours_and_are_not_held_to_ar(llama_target, tmp_path, monkeypatch):
    """Protects: `--methods ar,llamacpp --gguf FILE` adds llama.cpp plain and prompt-lookup rows, timed on the same
    prompts and budget, stopping at the budget; their outputs (another model's numerics) are not compared with
    ar, so the run's losslessness is still judged on dominospec's methods alone."""
    import sys

    made = []
    module, speculative = fake_llama_cpp(llama_target.vocab_size, made)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    methods, notes = bench_methods.build_methods(["ar", "llamacpp"], target=llama_target, gguf=str(gguf))
    assert [m.name for m in methods] == ["ar", "llamacpp"]  # the prompt-lookup row has a group of its own
    assert any("--methods ...,llamacpp-pld adds it" in n for n in notes)
    groups = ["ar", "llamacpp", "llamacpp-pld"]
    methods, notes = bench_methods.build_methods(groups, target=llama_target, gguf=str(gguf))
    assert [m.name for m in methods] == ["ar", "llamacpp", "llamacpp-pld"]
    assert any("not compared with ar" in n for n in notes)
    runner.benchmark(llama_target, DATASETS, methods, tmp_path / "out", max_new_tokens=5, progress=False)
    res = json.loads((tmp_path / "out" / "results.json").read_text())["methods"]
    assert res["ar"]["lossless_mismatches"] == 0
    assert res["llamacpp"]["lossless_mismatches"] is None and res["llamacpp"]["new_tokens"] == 5 * 3
    assert [m["draft"] is not None for m in made] == [False, True] and made[0]["path"] == str(gguf)
    threads = torch.get_num_threads()  # the prompt is evaluated on the decoding threads, not on every core
    assert all(m["threads"] == m["batch"] == threads for m in made)
    with pytest.raises(DominoError, match="no such file"):
        bench_methods.build_methods(["llamacpp"], target=llama_target, gguf=str(tmp_path / "missing.gguf"))
    module.Llama.n_vocab = lambda self: 7
    with pytest.raises(DominoError, match="vocabulary of 7 tokens"):
        bench_methods.LlamaCpp(gguf=str(gguf)).model(llama_target)
