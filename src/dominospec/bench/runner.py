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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..data.prompts import read_prompt_file
from ..decode import generate_autoregressive, generate_speculative
from ..decode.lookup import HYBRID_MIN_MATCH, LOOKUP_BLOCK_SIZE, PromptLookup
from ..decode.schedule import DEFAULT_THRESHOLD, VERIFY_MODES, CostTable, VerifyPolicy, make_policy
from ..devices import describe_device, synchronize
from ..drafter.checkpoint import ACCEPTANCE_NAME, sidecar_path
from ..errors import DominoError
from ..io import ensure_writable_dir, write_atomic, write_json_atomic
from ..log import log
from ..sampling import SamplingConfig
from ..target.context import cap_new_tokens, encode_if_fits
from ..version import __version__
from .metrics import REFERENCE, PromptRun, summarize, tokens_per_second
from .report import render_report, write_plots

METHOD_GROUPS = ("ar", "hf", "pld", "drafters", "ablation", "lookup", "hybrid", "sweep")
DEFAULT_METHODS = "ar,hf,pld,drafters,ablation,lookup,hybrid"
PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8


@dataclass
class Method:
    """One way of decoding that the benchmark times."""

    name: str
    kind: str  # "ar" | "hf" | "pld" | "drafter" | "lookup" (prompt lookup alone)
    drafter: object = None  # a Drafter, for kind "drafter"
    use_head: bool = True  # False: the ablation (base logits only)
    block_size: int | None = None
    source: str = ""  # where the drafter came from
    policy: VerifyPolicy | None = None  # how many drafts to verify each cycle (None: all)
    lookup_min_match: int | None = None  # kind "drafter": a hybrid with prompt lookup from this match length

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        if self.kind == "drafter":
            c = self.drafter.config
            d.update(
                source=self.source,
                head=c.head if self.use_head else "none (ablation)",
                layers=c.num_layers,
                block_size=self.block_size or c.block_size,
            )
        if self.kind == "lookup":
            d["block_size"] = self.block_size
        if self.lookup_min_match is not None:
            d["hybrid_lookup_min_match"] = self.lookup_min_match
        if self.policy is not None:
            d.update(self.policy.describe())
        if self.kind == "pld":
            d["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return d

    def new_lookup(self) -> PromptLookup | None:
        if self.kind == "lookup":
            return PromptLookup()
        return PromptLookup(min_match=self.lookup_min_match) if self.lookup_min_match is not None else None


def parse_choices(spec: str, flag: str, allowed: Sequence[str]) -> list[str]:
    """A comma list of names from `allowed`, deduplicated in order; anything else names the flag."""
    names = [g.strip() for g in spec.split(",") if g.strip()]
    bad = [g for g in names if g not in allowed]
    if bad or not names:
        raise DominoError(f"{flag} {spec!r}: unknown {bad}; choose from {','.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_methods(spec: str) -> list[str]:
    return parse_choices(spec, "--methods", METHOD_GROUPS)


def parse_verify(spec: str) -> list[str]:
    return parse_choices(spec, "--verify", VERIFY_MODES)


def drafter_label(drafter, block_size: int | None = None) -> str:
    """e.g. domino-2L-b8: head, backbone layers, drafts per cycle."""
    c = drafter.config
    return f"{c.head}-{c.num_layers}L-b{block_size or c.block_size}"


def build_methods(
    groups: Sequence[str],
    drafters: Sequence[tuple[str, object]] = (),
    block_size: int | dict[str, int] | None = None,
    verify: Sequence[str] = ("fixed",),
    target=None,
    costs: CostTable | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    lookup_min_match: int = HYBRID_MIN_MATCH,
) -> tuple[list[Method], list[str]]:
    """Methods for the chosen groups; `drafters` are (source, Drafter) pairs. Returns (methods, notes).

    `ar` is always included: it is the reference everything else is compared with. Each drafter, the
    lookup proposer and each hybrid run once per `verify` mode (fixed keeps the plain name, the others
    get -static / -cost); a mode a method cannot run (no confidence head, no device profile for cost)
    is skipped with a note. `sweep` adds each drafter at every smaller fixed block size.
    """
    notes: list[str] = []
    methods = [Method(REFERENCE, "ar")]
    if REFERENCE not in groups:
        notes.append("ar added: it is the reference for speedup and losslessness")
    if "hf" in groups:
        methods.append(Method("hf", "hf"))
    if "pld" in groups:
        methods.append(Method("pld", "pld"))
    if any(g in groups for g in ("drafters", "ablation", "hybrid", "sweep")) and not drafters:
        notes.append(
            "no drafter given and none is shipped for this target: drafter methods skipped (pass --drafter DIR)"
        )

    def with_policies(name: str, drafter, b: int | None, lookup: bool) -> list[tuple[str, VerifyPolicy]]:
        out = []
        for mode in verify:
            try:
                policy = make_policy(mode, drafter, target, threshold, costs, b, lookup=lookup, report=notes.append)
            except DominoError as exc:
                notes.append(f"{name}-{mode}: skipped ({exc})")
                continue
            out.append((name if mode == "fixed" else f"{name}-{mode}", policy))
        return out

    if "lookup" in groups:
        b = block_size if isinstance(block_size, int) else LOOKUP_BLOCK_SIZE
        for name, policy in with_policies(f"lookup-b{b}", None, b, True):
            methods.append(Method(name, "lookup", block_size=b, policy=policy))
    seen: set[str] = set()
    for source, d in drafters:
        b = block_size.get(source) if isinstance(block_size, dict) else block_size
        if b is not None and b > d.config.block_size:
            notes.append(
                f"{source}: --block-size {b} is above the drafter's {d.config.block_size}; using {d.config.block_size}"
            )
            b = d.config.block_size
        name = drafter_label(d, b)
        if name in seen:  # two drafters with the same shape: tell them apart by directory
            name = f"{Path(source).name}:{name}"
        seen.add(name)
        if "drafters" in groups:
            for label, policy in with_policies(name, d, b, False):
                methods.append(Method(label, "drafter", d, True, b, source, policy))
        if "ablation" in groups:
            if d.config.head == "none":
                notes.append(f"{name}: no ablation, its head is already 'none'")
            else:
                methods.append(Method(f"{name}-nohead", "drafter", d, False, b, source))
        if "hybrid" in groups:
            for label, policy in with_policies(f"hybrid-{name}", d, b, False):
                methods.append(Method(label, "drafter", d, True, b, source, policy, lookup_min_match))
        if "sweep" in groups:
            for smaller in range(1, (b or d.config.block_size)):
                methods.append(Method(f"{name.rsplit('-b', 1)[0]}-b{smaller}", "drafter", d, True, smaller, source))
    return methods, notes


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


def run_one(
    target,
    method: Method,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    dataset: str = "",
    prompt_index: int = 0,
) -> PromptRun:
    """Decode one prompt with one method and time it."""
    if method.kind == "ar":
        res = generate_autoregressive(target, prompt_ids, max_new_tokens, sampling, seed)
        return PromptRun.from_generation(res, method.name, dataset, prompt_index)
    if method.kind in ("drafter", "lookup"):
        res = generate_speculative(
            target,
            method.drafter,
            prompt_ids,
            max_new_tokens,
            sampling,
            seed,
            block_size=method.block_size,
            use_head=method.use_head,
            verify=method.policy,
            lookup=method.new_lookup(),
        )
        return PromptRun.from_generation(res, method.name, dataset, prompt_index)
    if method.kind in ("hf", "pld"):  # capped at the context like the adapter's own decoding
        max_new_tokens = cap_new_tokens(max_new_tokens, len(prompt_ids), target.max_positions)
        if not sampling.greedy:
            torch.manual_seed(seed)
        synchronize(target.device)
        t0 = time.perf_counter()
        tokens = target.hf_generate(
            list(prompt_ids),
            max_new_tokens,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            prompt_lookup=PROMPT_LOOKUP_TOKENS if method.kind == "pld" else 0,
        )
        synchronize(target.device)
        return PromptRun(method.name, dataset, prompt_index, list(tokens), time.perf_counter() - t0)
    raise ValueError(f"unknown method kind {method.kind!r}")


def run_benchmark(
    target,
    datasets: dict[str, list[list[int]]],
    methods: Sequence[Method],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
) -> list[PromptRun]:
    """Every method on every token-id prompt, interleaved per prompt; one PromptRun each."""
    from tqdm import tqdm

    flat = [(ds, i, ids) for ds, prompts in datasets.items() for i, ids in enumerate(prompts)]
    if not flat:
        raise DominoError("no prompts to benchmark")
    if warmup:  # uncounted: first calls pay for allocator growth, kernel selection, lazy imports
        for m in methods:
            run_one(target, m, flat[0][2], min(max_new_tokens, WARMUP_TOKENS), sampling, seed)
    runs: list[PromptRun] = []
    bar = tqdm(total=len(flat) * len(methods), desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    try:
        for n, (ds, i, ids) in enumerate(flat):
            shift = n % len(methods)  # rotate the order so no method always runs first or last
            for m in list(methods[shift:]) + list(methods[:shift]):
                bar.set_postfix_str(f"{ds}#{i} {m.name}", refresh=False)
                # one seed per prompt, shared by all methods
                runs.append(run_one(target, m, ids, max_new_tokens, sampling, seed + n, ds, i))
                bar.update()
    finally:
        bar.close()
    return runs


def summarize_benchmark(
    runs: Sequence[PromptRun], method_names: Sequence[str], dataset_names: Sequence[str], compare_outputs: bool
) -> dict:
    """{"methods": {NAME: summary}, "per_dataset": {DATASET: {NAME: summary}}} (metrics.summarize)."""
    ref_tokens = (
        {(r.dataset, r.prompt_index): r.tokens for r in runs if r.method == REFERENCE} if compare_outputs else None
    )

    def group(selected: list[PromptRun]) -> dict:
        ref = [r for r in selected if r.method == REFERENCE]
        ref_tps = tokens_per_second((r.new_tokens for r in ref), (r.total_s for r in ref)) if ref else None
        return {
            name: summarize([r for r in selected if r.method == name], ref_tps, ref_tokens) for name in method_names
        }

    overall = group(list(runs))
    per_dataset = {}
    for ds in dataset_names:
        per_dataset[ds] = group([r for r in runs if r.dataset == ds])
        for summary in per_dataset[ds].values():
            summary.pop("mismatched_prompts", None)  # listed once, in the overall summary
    return {"methods": overall, "per_dataset": per_dataset}


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
    runs = run_benchmark(target, datasets, methods, max_new_tokens, sampling, seed, warmup, progress)
    compare = sampling.greedy
    if not compare:
        notes.append(
            f"T={sampling.temperature} > 0: outputs are not compared with ar (lossless_mismatches is "
            "null); distribution preservation is tested in tests/test_core.py"
        )
    summary = summarize_benchmark(runs, [m.name for m in methods], list(datasets), compare)
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
        "dtype": str(target.dtype).replace("torch.", ""),
        "backend": getattr(target, "backend", "hf"),
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": seed,
        "reference": REFERENCE,
        "warmup": warmup,
        "interleaved": True,
        "methods": [m.describe() for m in methods],
        "datasets": {ds: len(p) for ds, p in datasets.items()},
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
        d = m.drafter
        if (
            m.kind != "drafter"
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
