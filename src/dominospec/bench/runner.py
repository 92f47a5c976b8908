"""The benchmark runner: speed, tau, acceptance by position and losslessness, per dataset.

Layers, bottom up:
  run_benchmark(target, datasets, methods)  token-id prompts in, one PromptRun per (prompt, method)
  summarize_benchmark(runs, ...)            metrics.py numbers per method, overall and per dataset
  benchmark(..., out_dir)                   both, plus results.json, runs.jsonl, report.md, plots

Fairness rules: every method runs on the same prompts in the same process,
after one uncounted warm-up per method, interleaved per prompt (for each prompt, every method,
in an order rotated by one each prompt) so machine noise and cache warmth hit all alike.
`ar` (plain decoding through the same adapter) is the reference for speedup and, at T=0,
for losslessness.
"""

from __future__ import annotations

import json
import platform
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..data.prompts import read_prompt_file
from ..decode.schedule import VERIFY_MODES
from ..devices import describe_device
from ..drafter.checkpoint import ACCEPTANCE_NAME, sidecar_path
from ..errors import DominoError
from ..io import ensure_writable_dir, write_atomic, write_json_atomic
from ..log import log
from ..sampling import SamplingConfig
from ..targets.context import cap_new_tokens, encode_if_fits
from ..tune.profile import load_profile, precision, profile_drafter_label
from ..version import __version__
from .methods import METHOD_GROUPS, Method, PromptLookupAlone, Speculative
from .metrics import REFERENCE, PromptRun, profile_prediction, summarize, tokens_per_second
from .report import render_report, write_plots

WARMUP_TOKENS = 8
PROMPT_TIME_LIMIT_S = 600.0  # one method on one prompt; past it the method stops (bench --prompt-time-limit)


def parse_choices(spec: str, flag: str, allowed: Sequence[str]) -> list[str]:
    """A comma list of names from `allowed`, deduplicated in order; anything else names the flag."""
    names = [g.strip() for g in spec.split(",") if g.strip()]
    bad = [g for g in names if g not in allowed]
    if not names:
        raise DominoError(f"{flag} {spec!r} names nothing; choose one or more of {','.join(allowed)}")
    if bad:
        raise DominoError(f"{flag} {spec!r}: unknown {', '.join(bad)}; choose from {','.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_methods(spec: str) -> list[str]:
    return parse_choices(spec, "--methods", METHOD_GROUPS)


def parse_verify(spec: str) -> list[str]:
    return parse_choices(spec, "--verify", tuple(VERIFY_MODES))


# ----- running -----

NEAR_TIE_MARGIN = 0.5  # logits: what bf16/fp16 rounding through the layers can plausibly flip


@torch.inference_mode()
def not_near_tie(target, prompt_ids: Sequence[int], tokens: Sequence[int], margin: float = NEAR_TIE_MARGIN) -> int:
    """Tokens of a greedy output that the target, re-reading prompt + output in one pass, scores more than
    `margin` logits below its own argmax: a divergence rounding cannot explain."""
    if not tokens:
        return 0
    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=target.device)
    logits = target.forward(ids, target.new_cache(max_len=ids.shape[1]), with_features=False).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : ids.shape[1] - 1]  # row j predicts tokens[j]
    chosen = rows.gather(1, torch.tensor(list(tokens), device=rows.device)[:, None]).squeeze(1)
    return int((rows.max(-1).values - chosen > margin).sum())


def run_benchmark(
    target,
    datasets: dict[str, list[list[int]]],
    methods: Sequence[Method],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
    time_limit_s: float | None = PROMPT_TIME_LIMIT_S,
    stopped: dict[str, str] | None = None,
) -> list[PromptRun]:
    """Every method on every token-id prompt, interleaved per prompt; one PromptRun each.

    time_limit_s bounds one method on one prompt (its warm-up too; None: no bound): a run past it is
    stopped and recorded as timed out, and that method runs no further prompt. `stopped` (when given)
    receives method name -> what stopped it."""
    from tqdm import tqdm

    flat = [(ds, i, ids) for ds, prompts in datasets.items() for i, ids in enumerate(prompts)]
    if not flat:
        raise DominoError("no prompts to benchmark")
    stopped = {} if stopped is None else stopped
    runs: list[PromptRun] = []

    def timed_out(m: Method, where: str) -> None:
        stopped[m.name] = (
            f"{m.name}: stopped on {where}, past the per-prompt time limit of {time_limit_s:g} s "
            "(--prompt-time-limit); its later prompts were not run"
        )
        log(stopped[m.name])

    if warmup:  # uncounted: first calls pay for allocator growth, kernel selection, lazy imports
        for m in methods:
            try:
                with prompt_time_limit(time_limit_s):
                    m.run(target, flat[0][2], min(max_new_tokens, WARMUP_TOKENS), sampling, seed)
            except PromptTimeout:
                timed_out(m, "its warm-up")
    bar = tqdm(total=len(flat) * len(methods), desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    try:
        for n, (ds, i, ids) in enumerate(flat):
            shift = n % len(methods)  # rotate the order so no method always runs first or last
            for m in list(methods[shift:]) + list(methods[:shift]):
                bar.update()
                if m.name in stopped:
                    continue
                bar.set_postfix_str(f"{ds}#{i} {m.name}", refresh=False)
                try:
                    with prompt_time_limit(time_limit_s):
                        run = m.run(target, ids, max_new_tokens, sampling, seed + n, ds, i)  # one seed per prompt
                except PromptTimeout:
                    run = PromptRun(m.name, ds, i, [], time_limit_s, prompt_len=len(ids), timed_out=True)
                    timed_out(m, f"{ds}#{i}")
                runs.append(run)
    finally:
        bar.close()
    return runs


class PromptTimeout(Exception):
    """One method on one prompt ran past bench's per-prompt time limit."""


@contextmanager
def prompt_time_limit(seconds: float | None):
    """Raise PromptTimeout in this thread once `seconds` have passed (SIGALRM: it stops Python code of any
    method, and C code when it returns to Python). Without a bound where no alarm can be set (seconds None,
    another thread than the main one, a platform without setitimer)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_signum, _frame):
        raise PromptTimeout

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def summarize_benchmark(
    runs: Sequence[PromptRun],
    method_names: Sequence[str],
    dataset_names: Sequence[str],
    compare_outputs: bool,
    uncompared: Sequence[str] = (),
) -> dict:
    """{"methods": {NAME: summary}, "per_dataset": {DATASET: {NAME: summary}}} (metrics.summarize).

    uncompared: methods whose outputs are not held to ar's (the llama.cpp peer: other weights)."""
    ref_tokens = (
        {(r.dataset, r.prompt_index): r.tokens for r in runs if r.method == REFERENCE and not r.timed_out}
        if compare_outputs
        else None
    )

    def group(selected: list[PromptRun]) -> dict:
        ref = [r for r in selected if r.method == REFERENCE and not r.timed_out]
        ref_tps = tokens_per_second((r.new_tokens for r in ref), (r.total_s for r in ref)) if ref else None
        return {
            name: summarize(
                [r for r in selected if r.method == name], ref_tps, None if name in uncompared else ref_tokens
            )
            for name in method_names
        }

    overall = group(list(runs))
    per_dataset = {}
    for ds in dataset_names:
        per_dataset[ds] = group([r for r in runs if r.dataset == ds])
        for summary in per_dataset[ds].values():
            summary.pop("mismatched_prompts", None)  # listed once, in the overall summary
    return {"methods": overall, "per_dataset": per_dataset}


def add_profile_prediction(
    methods_summary: dict, runs: Sequence[PromptRun], methods: Sequence[Method], profile
) -> None:
    """Each method's summary gains the stored device profile's price of the cycles it ran (metrics.profile_prediction):
    profile_draft_ms_per_cycle (only where the profile timed this drafter), profile_verify_ms_per_cycle and,
    for plain decoding, profile_decode_ms_per_step, next to the measured figures so a gap shows."""
    drafter_in_profile = ((profile or {}).get("draft") or {}).get("drafter")
    for m in methods:
        summary = methods_summary[m.name]
        if profile is None:
            summary.update(profile_verify_ms_per_cycle=None, profile_draft_ms_per_cycle=None)
            continue
        b = None
        drafter = getattr(m, "drafter", None)
        if drafter is not None and profile_drafter_label(drafter) == drafter_in_profile:
            b = m.block_size or drafter.config.block_size
        summary.update(profile_prediction([r for r in runs if r.method == m.name], profile, b))


def benchmark(
    target,
    datasets: dict[str, list[list[int]]],
    methods: Sequence[Method],
    out_dir,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
    plots: bool = True,
    notes: Sequence[str] = (),
    config: dict | None = None,
    time_limit_s: float | None = PROMPT_TIME_LIMIT_S,
) -> dict:
    """Run, summarise and write DIR/results.json, runs.jsonl, report.md and plots; returns the results."""
    out = ensure_writable_dir(out_dir)  # before the run: a result that cannot be written is lost
    notes = list(notes)
    capped = sum(
        cap_new_tokens(max_new_tokens, len(p), target.max_positions) < max_new_tokens
        for prompts in datasets.values()
        for p in prompts
    )
    if capped:
        notes.append(
            f"{capped} prompt(s) leave less than max_new_tokens {max_new_tokens} of the target's context "
            f"({target.max_positions} positions): every method's answer to them is cut there"
        )
    t0 = time.time()
    stopped: dict[str, str] = {}
    runs = run_benchmark(
        target, datasets, methods, max_new_tokens, sampling, seed, warmup, progress, time_limit_s, stopped
    )
    notes += stopped.values()
    compare = sampling.greedy
    if not compare:
        notes.append(
            f"T={sampling.temperature} > 0: outputs are not compared with ar (lossless_mismatches is "
            "null); distribution preservation is tested in tests/test_core.py"
        )
    uncompared = [m.name for m in methods if not m.compared]
    summary = summarize_benchmark(runs, [m.name for m in methods], list(datasets), compare, uncompared)
    try:
        profile = load_profile(target)
    except DominoError as exc:
        profile = None
        notes.append(f"the device profile was not read ({exc}): no predicted draft / verify ms")
    profile_kind = None if profile is None else ("quick" if profile.get("quick") else "full")
    if profile is None:
        notes.append(
            "no stored device profile for this target and thread count: run `dominospec profile` to see "
            "its predicted draft / verify ms per cycle next to the measured ones"
        )
    elif profile_kind == "quick":
        notes.append(
            "the stored device profile (read by --verify cost and the predicted ms) is a quick one, timed with "
            "few repeats when first needed: `dominospec profile` measures the full table"
        )
    add_profile_prediction(summary["methods"], runs, methods, profile)
    if compare and target.dtype not in (torch.float32, torch.float64):
        # reduced precision: a mismatch is acceptable only where the target itself was near a tie
        for name, m in summary["methods"].items():
            m["not_near_tie"] = sum(
                not_near_tie(target, datasets[r.dataset][r.prompt_index], r.tokens) for r in runs if r.method == name
            )
        notes.append(
            f"{str(target.dtype).replace('torch.', '')}: greedy outputs may differ from ar at near-ties "
            f"(batch-shape rounding); not_near_tie counts tokens that are neither the target's argmax "
            f"nor within {NEAR_TIE_MARGIN} logits of it when the target re-reads the output (must be 0)"
        )
    cfg = {
        "target": getattr(target, "name", "model"),
        "device": describe_device(target.device),
        "dtype": precision(target),
        "backend": getattr(target, "backend", "hf"),
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": seed,
        "reference": REFERENCE,
        "warmup": warmup,
        "prompt_time_limit_s": time_limit_s,
        "interleaved": True,
        "methods": [m.describe() for m in methods],
        "datasets": {ds: len(p) for ds, p in datasets.items()},
        "device_profile": profile_kind,
        "versions": _versions(),
        "wall_s": round(time.time() - t0, 2),
        "notes": notes,
    }
    cfg.update(config or {})
    results = {"config": cfg, "methods": summary["methods"], "per_dataset": summary["per_dataset"]}

    write_json_atomic(out / "results.json", results, indent=2)
    write_atomic(
        out / "runs.jsonl",
        "".join(
            json.dumps(
                {
                    "method": r.method,
                    "dataset": r.dataset,
                    "prompt_index": r.prompt_index,
                    "new_tokens": r.new_tokens,
                    "total_s": r.total_s,
                    "prefill_s": r.prefill_s,
                    "draft_s": r.draft_s,
                    "verify_s": r.verify_s,
                    "accepted": r.accepted,
                    "committed": r.committed,
                    "verified": r.verified,
                    "lookup_cycles": r.lookup_cycles,
                    "draft_skipped": r.draft_skipped,
                    "prompt_len": r.prompt_len,
                    "nodraft_steps": r.nodraft_steps,
                    "nodraft_s": r.nodraft_s,
                    "timed_out": r.timed_out,
                    "tokens": r.tokens,
                }
            )
            + "\n"
            for r in runs
        ),
    )
    made = write_plots(results, out) if plots else None
    if plots:
        if made is None:
            cfg["notes"].append("matplotlib is not installed: no plots (pip install matplotlib)")
            write_json_atomic(out / "results.json", results, indent=2)
    write_atomic(out / "report.md", render_report(results, plots=made is not None))
    return results


def _versions() -> dict:
    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "dominospec": __version__,
        "torch": torch.__version__,
        "transformers": installed("transformers"),
        "python": platform.python_version(),
    }


# ----- prompt files -----


def load_prompt_sets(paths: Sequence[str], target, limit: int | None = None, report=None) -> dict[str, list[list[int]]]:
    """One dataset per file, named after its stem; prompts chat-templated into token ids.

    A prompt that leaves no answer room in the target's context is reported as FILE:LINE and left out.
    """
    report = report or log
    datasets: dict[str, list[list[int]]] = {}
    for p in paths:
        conversations = read_prompt_file(p, source=str(p), report=report)[:limit]  # ids: FILE:LINE
        prompts = []
        for conv in conversations:
            ids, too_long = encode_if_fits(
                conv.turns[0], target.encode_chat, target.max_positions, target.max_token_chars
            )
            if too_long:
                report(f"{conv.id}: prompt {too_long}; skipped")
            else:
                prompts.append(ids)
        if not prompts:
            raise DominoError(
                f"--prompts {p}: no usable prompts (expected JSONL with 'turns', 'conversations', "
                "'messages' or 'prompt', short enough for the target's context)"
            )
        name, n = Path(p).stem, 2
        while name in datasets:
            name, n = f"{Path(p).stem}-{n}", n + 1
        datasets[name] = prompts
    return datasets


def save_acceptance(results: dict, methods: Sequence[Method], report=None) -> list[Path]:
    """Write each drafter's conditional acceptance by position (greedy, full block, head on) into its
    directory as acceptance.json: what --block-size auto reads until training validation provides it.

    A method that measured no draft cycle writes nothing (it would tell --block-size auto that
    every draft fails); each drafter left unwritten is said through `report`, with the reason.
    """
    report = report or log
    written = []
    for m in methods:
        d = getattr(m, "drafter", None)
        if (
            d is None
            or not isinstance(m, Speculative)
            or isinstance(m, PromptLookupAlone)
            or not m.use_head
            or sidecar_path(d, ACCEPTANCE_NAME) is None
            or (m.policy is not None and m.policy.name != "fixed")
            or m.lookup_min_match is not None
        ):
            continue
        summary = results["methods"][m.name]
        if results["config"]["temperature"] != 0 or summary["block_size"] != d.config.block_size:
            report(f"{m.name}: no {ACCEPTANCE_NAME} written (needs a greedy run at the drafter's own block size)")
            continue
        if not summary.get("cycles"):
            report(f"{m.name}: no {ACCEPTANCE_NAME} written: the run measured no draft cycle (answers too short?)")
            continue
        path = sidecar_path(d, ACCEPTANCE_NAME)
        cond = [p if p is not None else 0.0 for p in summary["accept_conditional"]]
        write_json_atomic(
            path,
            {
                "conditional": cond,
                "tau": summary["tau"],
                "cycles": summary["cycles"],
                "measured_by": "dominospec bench (greedy)",
                "target": results["config"]["target"],
                "datasets": results["config"]["datasets"],
                "max_new_tokens": results["config"]["max_new_tokens"],
            },
            indent=2,
        )
        written.append(path)
    return written
