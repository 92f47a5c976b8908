"""`dominospec bench`: speed, tau, acceptance by position and losslessness, per dataset.

Layers, bottom up:
  run_benchmark(target, datasets, methods)  token-id prompts in, one PromptRun per (prompt, method)
  summarize_benchmark(runs, ...)            metrics.py numbers per method, overall and per dataset
  benchmark(..., out_dir)                   both, plus results.json, runs.jsonl, report.md, plots
  profile_verify_cost(target)               the target's verify cost for 1..K tokens (verify_cost.json)
  cmd_bench / add_bench_parser              the thin text + CLI layer (prompt files, chat template)

Fairness rules (method.md §6): every method runs on the same prompts in the same process,
after one uncounted warm-up per method, interleaved per prompt (for each prompt, every method,
in an order rotated by one each prompt) so machine noise and cache warmth hit all alike.
`ar` (plain decoding through the same adapter) is the reference for speedup and, at T=0,
for losslessness.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .decoding import SamplingConfig, generate_autoregressive, generate_speculative
from .errors import DominoError
from .metrics import PromptRun, summarize, tokens_per_second

REFERENCE = "ar"
METHOD_GROUPS = ("ar", "hf", "pld", "drafters", "ablation")
DEFAULT_METHODS = ",".join(METHOD_GROUPS)
PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8


@dataclass
class Method:
    """One way of decoding that the benchmark times."""
    name: str
    kind: str                  # "ar" | "hf" | "pld" | "drafter"
    drafter: object = None     # a Drafter, for kind "drafter"
    use_head: bool = True      # False: the ablation (base logits only)
    block_size: int | None = None
    source: str = ""           # where the drafter came from

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind}
        if self.kind == "drafter":
            c = self.drafter.config
            d.update(source=self.source, head=c.head if self.use_head else "none (ablation)",
                     layers=c.num_layers, block_size=self.block_size or c.block_size)
        if self.kind == "pld":
            d["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return d


def parse_methods(spec: str) -> list[str]:
    groups = [g.strip() for g in spec.split(",") if g.strip()]
    bad = [g for g in groups if g not in METHOD_GROUPS]
    if bad or not groups:
        raise DominoError(f"--methods {spec!r}: unknown {bad}; choose from {','.join(METHOD_GROUPS)}")
    return list(dict.fromkeys(groups))


def drafter_label(drafter, block_size: int | None = None) -> str:
    """e.g. domino-2L-b8: head, backbone layers, drafts per cycle."""
    c = drafter.config
    return f"{c.head}-{c.num_layers}L-b{block_size or c.block_size}"


def build_methods(groups: Sequence[str], drafters: Sequence[tuple[str, object]] = (),
                  block_size: int | None = None) -> tuple[list[Method], list[str]]:
    """Methods for the chosen groups; `drafters` are (source, Drafter) pairs. Returns (methods, notes).

    `ar` is always included: it is the reference everything else is compared with.
    """
    notes: list[str] = []
    methods = [Method(REFERENCE, "ar")]
    if REFERENCE not in groups:
        notes.append("ar added: it is the reference for speedup and losslessness")
    if "hf" in groups:
        methods.append(Method("hf", "hf"))
    if "pld" in groups:
        methods.append(Method("pld", "pld"))
    if ("drafters" in groups or "ablation" in groups) and not drafters:
        notes.append("no drafter given and none is shipped for this target: drafter methods skipped "
                     "(pass --drafter DIR)")
    seen: set[str] = set()
    for source, d in drafters:
        b = block_size
        if b is not None and b > d.config.block_size:
            notes.append(f"{source}: --block-size {b} is above the drafter's {d.config.block_size}; using "
                         f"{d.config.block_size}")
            b = d.config.block_size
        name = drafter_label(d, b)
        if name in seen:  # two drafters with the same shape: tell them apart by directory
            name = f"{Path(source).name}:{name}"
        seen.add(name)
        if "drafters" in groups:
            methods.append(Method(name, "drafter", d, True, b, source))
        if "ablation" in groups:
            if d.config.head == "none":
                notes.append(f"{name}: no ablation, its head is already 'none'")
            else:
                methods.append(Method(f"{name}-nohead", "drafter", d, False, b, source))
    return methods, notes


# ----- running -----

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(target, method: Method, prompt_ids: Sequence[int], max_new_tokens: int,
            sampling: SamplingConfig, seed: int, dataset: str = "", prompt_index: int = 0) -> PromptRun:
    """Decode one prompt with one method and time it."""
    if method.kind == "ar":
        res = generate_autoregressive(target, prompt_ids, max_new_tokens, sampling, seed)
        return PromptRun.from_generation(res, method.name, dataset, prompt_index)
    if method.kind == "drafter":
        res = generate_speculative(target, method.drafter, prompt_ids, max_new_tokens, sampling, seed,
                                   block_size=method.block_size, use_head=method.use_head)
        return PromptRun.from_generation(res, method.name, dataset, prompt_index)
    if method.kind in ("hf", "pld"):
        if not sampling.greedy:
            torch.manual_seed(seed)
        _sync(target.device)
        t0 = time.perf_counter()
        tokens = target.hf_generate(list(prompt_ids), max_new_tokens, sampling.temperature, sampling.top_k,
                                    sampling.top_p, prompt_lookup=PROMPT_LOOKUP_TOKENS if method.kind == "pld" else 0)
        _sync(target.device)
        return PromptRun(method.name, dataset, prompt_index, list(tokens), time.perf_counter() - t0)
    raise ValueError(f"unknown method kind {method.kind!r}")


def run_benchmark(target, datasets: dict[str, list[list[int]]], methods: Sequence[Method],
                  max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                  warmup: bool = True, progress: bool = True) -> list[PromptRun]:
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


def summarize_benchmark(runs: Sequence[PromptRun], method_names: Sequence[str], dataset_names: Sequence[str],
                        compare_outputs: bool) -> dict:
    """{"methods": {NAME: summary}, "per_dataset": {DATASET: {NAME: summary}}} (metrics.summarize)."""
    ref_tokens = ({(r.dataset, r.prompt_index): r.tokens for r in runs if r.method == REFERENCE}
                  if compare_outputs else None)

    def group(selected: list[PromptRun]) -> dict:
        ref = [r for r in selected if r.method == REFERENCE]
        ref_tps = tokens_per_second((r.new_tokens for r in ref), (r.total_s for r in ref)) if ref else None
        return {name: summarize([r for r in selected if r.method == name], ref_tps, ref_tokens)
                for name in method_names}

    overall = group(list(runs))
    per_dataset = {}
    for ds in dataset_names:
        per_dataset[ds] = group([r for r in runs if r.dataset == ds])
        for summary in per_dataset[ds].values():
            summary.pop("mismatched_prompts", None)  # listed once, in the overall summary
    return {"methods": overall, "per_dataset": per_dataset}


def benchmark(target, datasets: dict[str, list[list[int]]], methods: Sequence[Method], out_dir,
              max_new_tokens: int = 128, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
              warmup: bool = True, progress: bool = True, plots: bool = True, notes: Sequence[str] = (),
              config: dict | None = None) -> dict:
    """Run, summarise and write DIR/results.json, runs.jsonl, report.md and plots; returns the results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes = list(notes)
    t0 = time.time()
    runs = run_benchmark(target, datasets, methods, max_new_tokens, sampling, seed, warmup, progress)
    compare = sampling.greedy
    if not compare:
        notes.append(f"T={sampling.temperature} > 0: outputs are not compared with ar (lossless_mismatches is "
                     "null); distribution preservation is tested in tests/test_core.py")
    summary = summarize_benchmark(runs, [m.name for m in methods], list(datasets), compare)
    cfg = {"target": getattr(target, "name", "model"), "device": describe_device(target.device),
           "dtype": str(target.dtype).replace("torch.", ""), "max_new_tokens": max_new_tokens,
           "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed,
           "reference": REFERENCE, "warmup": warmup, "interleaved": True,
           "methods": [m.describe() for m in methods],
           "datasets": {ds: len(p) for ds, p in datasets.items()},
           "versions": _versions(), "wall_s": round(time.time() - t0, 2), "notes": notes}
    cfg.update(config or {})
    results = {"config": cfg, "methods": summary["methods"], "per_dataset": summary["per_dataset"]}

    _write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    _write_atomic(out / "runs.jsonl", "".join(json.dumps(
        {"method": r.method, "dataset": r.dataset, "prompt_index": r.prompt_index, "new_tokens": r.new_tokens,
         "total_s": r.total_s, "prefill_s": r.prefill_s, "draft_s": r.draft_s, "verify_s": r.verify_s,
         "accepted": r.accepted, "committed": r.committed, "tokens": r.tokens}) + "\n" for r in runs))
    made = write_plots(results, out) if plots else None
    if plots:
        if made is None:
            cfg["notes"].append("matplotlib is not installed: no plots (pip install matplotlib)")
            _write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    _write_atomic(out / "report.md", render_report(results, plots=made is not None))
    return results


# ----- the verify cost table -----

@torch.inference_mode()
def profile_verify_cost(target, context: int = 256, max_k: int = 16, repeats: int = 7, seed: int = 0,
                        progress: bool = True) -> dict:
    """Median time of one target forward over k new tokens after a cached context, k = 1..max_k.

    This is what verifying k-1 drafts (block [anchor, d_1..d_{k-1}]) costs, with the same
    forward call the decoding loop uses (features on). Repeats are interleaved over k so a
    slow spell on the machine spreads over all sizes instead of inflating one.
    """
    from tqdm import tqdm

    if context < 1 or max_k < 1 or repeats < 1:
        raise DominoError(f"profile needs context, max_k and repeats >= 1 (got {context}, {max_k}, {repeats})")
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit and context + max_k > limit:
        raise DominoError(f"--context {context} + {max_k} tokens exceeds the target's {limit} positions")
    dev = target.device
    gen = torch.Generator().manual_seed(seed)
    ks = list(range(1, max_k + 1))
    ctx = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(dev)
    blocks = {k: torch.randint(0, target.vocab_size, (1, k), generator=gen).to(dev) for k in ks}
    cache = target.new_cache()
    target.forward(ctx, cache, last_logits_only=True, with_features=False)
    for k in ks:  # warm-up, uncounted
        target.forward(blocks[k], cache)
        target.crop_cache(cache, context)
    times: dict[int, list[float]] = {k: [] for k in ks}
    with tqdm(total=repeats * len(ks), desc="profile", unit="fwd", disable=not progress, dynamic_ncols=True) as bar:
        for _ in range(repeats):
            for k in ks:
                _sync(dev)
                t0 = time.perf_counter()
                target.forward(blocks[k], cache)
                _sync(dev)
                times[k].append(time.perf_counter() - t0)
                target.crop_cache(cache, context)
                bar.update()
    seconds = [statistics.median(times[k]) for k in ks]
    fastest = [min(times[k]) for k in ks]
    return {"device": describe_device(dev), "context": context, "k": ks, "seconds": seconds,
            "relative_to_1": [s / seconds[0] for s in seconds], "sps": [1.0 / s for s in seconds],
            "target": getattr(target, "name", "model"), "dtype": str(target.dtype).replace("torch.", ""),
            "repeats": repeats, "statistic": "median",
            # noise only ever adds time: on a shared machine the minimum is the steadier estimate
            "min_seconds": fastest, "min_relative_to_1": [s / fastest[0] for s in fastest]}


def write_verify_cost(table: dict, out_dir, plots: bool = True) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "verify_cost.json", json.dumps(table, indent=2) + "\n")
    if plots:
        plot_verify_cost(table, out / "verify_cost.png")


def format_verify_cost(table: dict) -> str:
    lines = [f"verify cost of {table.get('target', 'the target')} on {table['device']}, context {table['context']} "
             f"(median of {table.get('repeats', '?')}):", "",
             "| k new tokens | ms | x one token | verify steps/s | min ms | min x one token |",
             "|---:|---:|---:|---:|---:|---:|"]
    mins = table.get("min_seconds") or [None] * len(table["k"])
    min_rel = table.get("min_relative_to_1") or [None] * len(table["k"])
    for k, s, r, sps, m, mr in zip(table["k"], table["seconds"], table["relative_to_1"], table["sps"], mins, min_rel):
        lines.append(f"| {k} | {1e3 * s:.1f} | {r:.2f} | {sps:.1f} | {_f(m and 1e3 * m, 1)} | {_f(mr)} |")
    return "\n".join(lines)


# ----- report -----

def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_method_table(methods: dict) -> str:
    lines = ["| method | tok/s | speedup | tau | mismatches | prompts | new tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in methods.items():
        mm = "-" if m["lossless_mismatches"] is None else str(m["lossless_mismatches"])
        lines.append(f"| {name} | {_f(m['tokens_per_s'])} | {_f(m['speedup'])}x | {_f(m['tau'])} | {mm} | "
                     f"{m['num_prompts']} | {m['new_tokens']} |")
    return "\n".join(lines)


def format_acceptance_table(methods: dict, key: str) -> str:
    with_cycles = {n: m for n, m in methods.items() if m[key]}
    if not with_cycles:
        return "(no speculative method ran)"
    width = max(len(m[key]) for m in with_cycles.values())
    lines = ["| method | " + " | ".join(f"k={k}" for k in range(1, width + 1)) + " |",
             "|---|" + "---:|" * width]
    for name, m in with_cycles.items():
        cells = [_f(v) for v in m[key]] + [""] * (width - len(m[key]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_time_table(methods: dict) -> str:
    lines = ["| method | prefill ms/prompt | draft ms/cycle | verify ms/cycle | other host ms/cycle | ms/token |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, m in methods.items():
        lines.append(f"| {name} | {_f(m['prefill_ms_per_prompt'], 1)} | {_f(m['draft_ms_per_cycle'], 1)} | "
                     f"{_f(m['verify_ms_per_cycle'], 1)} | {_f(m['host_ms_per_cycle'], 1)} | "
                     f"{_f(m['ms_per_token'], 1)} |")
    return "\n".join(lines)


def render_report(results: dict, plots: bool = False) -> str:
    cfg = results["config"]
    sampling = "greedy (T=0)" if cfg["temperature"] == 0 else (
        f"T={cfg['temperature']}, top-p {cfg['top_p']}, top-k {cfg['top_k'] or 'off'}")
    parts = ["# dominospec bench", "",
             f"Target `{cfg['target']}` on {cfg['device']} ({cfg['dtype']}), {sampling}, "
             f"max {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}. Datasets: "
             + ", ".join(f"{d} ({n} prompts)" for d, n in cfg["datasets"].items()) + ". "
             "All methods ran in one process, after a warm-up, interleaved per prompt; speedup is "
             "tokens/s over `ar` (plain decoding through the same adapter) on the same prompts; tau counts the "
             "bonus token (1.0 for methods without draft cycles).", "",
             "## Overall", "", format_method_table(results["methods"]), ""]
    for ds, methods in results["per_dataset"].items():
        parts += [f"## {ds}", "", format_method_table(methods), ""]
    parts += ["## Acceptance by block position", "",
              "Conditional: P(draft k accepted | drafts 1..k-1 accepted); '-' where position k was never reached.", "",
              format_acceptance_table(results["methods"], "accept_conditional"), "",
              "Unconditional: P(drafts 1..k all accepted), over all cycles.", "",
              format_acceptance_table(results["methods"], "accept_unconditional"), ""]
    parts += ["## Where the time goes", "",
              "Per cycle: draft (backbone + head rollout), verify (one target forward over the block, acceptance, "
              "target cache rollback, and the drafter's context-cache update), other host (the rest of the loop: "
              "total - prefill - draft - verify). Per-token latency is (draft + verify + other) / tau. "
              "hf and pld run inside transformers, so only their total is known.", "",
              format_time_table(results["methods"]), ""]
    ar = results["methods"].get(REFERENCE, {})
    step = ar.get("decode_ms_per_step")
    if step:
        rows = [f"- {n}: verify = {m['verify_ms_per_cycle'] / step:.2f} decode steps, draft = "
                f"{m['draft_ms_per_cycle'] / step:.2f} decode steps per cycle; break-even tau = "
                f"{(m['draft_ms_per_cycle'] + m['verify_ms_per_cycle'] + m['host_ms_per_cycle']) / step:.2f}"
                for n, m in results["methods"].items() if m.get("verify_ms_per_cycle")]
        parts += [f"One plain decode step (ar) costs {step:.1f} ms."] + ([""] + rows if rows else []) + [""]
    mism = [x for m in results["methods"].values() for x in m.get("mismatched_prompts", [])]
    parts += ["## Losslessness", ""]
    if cfg["temperature"] != 0:
        parts.append("Not compared at T > 0 (outputs are samples); see the notes.")
    elif not mism:
        parts.append("Every method's greedy output is token-identical to `ar` on every prompt.")
    else:
        parts += ["Outputs that differ from `ar` (prompt index within its dataset, first differing token):", ""]
        parts += [f"- {x['method']}: {x['dataset']} #{x['prompt_index']}, token {x['first_diff']}" for x in mism]
    parts.append("")
    if cfg.get("notes"):
        parts += ["## Notes", ""] + [f"- {n}" for n in cfg["notes"]] + [""]
    if plots:
        parts += ["## Plots", "", "![acceptance by position](acceptance.png)", "",
                  "![speedup per dataset](speedup.png)", ""]
    return "\n".join(parts)


# ----- plots (optional: matplotlib may be missing) -----

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def write_plots(results: dict, out: Path) -> list[Path] | None:
    """acceptance.png and speedup.png; None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    spec = {n: m for n, m in results["methods"].items() if m["accept_unconditional"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "accept_conditional", "P(accept k | 1..k-1 accepted)"),
                           (axes[1], "accept_unconditional", "P(1..k all accepted)")):
        for name, m in spec.items():
            ks = [k for k, v in enumerate(m[key], 1) if v is not None]
            ax.plot(ks, [m[key][k - 1] for k in ks], marker="o", label=name)
        width = max((len(m[key]) for m in spec.values()), default=1)
        ax.set_xticks(range(1, width + 1))
        ax.set_xlim(0.5, width + 0.5)
        ax.set_xlabel("block position k")
        ax.set_title(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if spec:
        axes[1].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "no speculative method ran", ha="center", transform=axes[0].transAxes)
    _save(fig, out / "acceptance.png")
    plt.close(fig)

    groups = list(results["per_dataset"]) + ["overall"]
    tables = [results["per_dataset"][g] for g in groups[:-1]] + [results["methods"]]
    names = list(results["methods"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(names)) / 2), 4))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [t[name]["speedup"] or 0.0 for t in tables], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over ar (tokens/s)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, out / "speedup.png")
    plt.close(fig)
    return [out / "acceptance.png", out / "speedup.png"]


def plot_verify_cost(table: dict, path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(table["k"], table["relative_to_1"], marker="o", label="median")
    if table.get("min_relative_to_1"):
        ax.plot(table["k"], table["min_relative_to_1"], marker=".", linestyle="--", label="fastest")
        ax.legend(fontsize=8)
    ax.set_xlabel("new tokens in one target forward (drafts + 1)")
    ax.set_ylabel("cost relative to 1 token")
    ax.set_title(f"verify cost, context {table['context']}, {table['device']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _save(fig, Path(path))
    plt.close(fig)
    return True


# ----- helpers -----

def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)  # a killed run never leaves a half-written file


def describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    if dev.type == "cpu":
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"cpu ({name}, {torch.get_num_threads()} threads)"
    return str(dev)


def _versions() -> dict:
    import transformers

    from . import __version__
    return {"dominospec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


# ----- prompt files -----

def read_first_turns(path) -> list[str]:
    """The first user turn of each conversation in a prompt file (layouts: see prompts.py)."""
    from .prompts import read_prompt_file

    path = Path(path)
    if not path.is_file():
        raise DominoError(f"--prompts {path}: no such file")
    return [c.turns[0] for c in read_prompt_file(path) if c.turns]


def load_prompt_sets(paths: Sequence[str], target, limit: int | None = None) -> dict[str, list[list[int]]]:
    """One dataset per file, named after its stem; prompts chat-templated into token ids."""
    datasets: dict[str, list[list[int]]] = {}
    for p in paths:
        prompts = read_first_turns(p)[:limit] if limit else read_first_turns(p)
        if not prompts:
            raise DominoError(f"--prompts {p}: no prompts found (expected JSONL with 'turns', 'conversations', "
                              "'messages' or 'prompt')")
        name, n = Path(p).stem, 2
        while name in datasets:
            name, n = f"{Path(p).stem}-{n}", n + 1
        datasets[name] = [target.encode_chat(text) for text in prompts]
    return datasets


# ----- command line -----

def cmd_bench(args) -> int:
    from .cli import load_target, log, resolve_drafter

    if not args.prompts and not args.profile:
        raise DominoError("nothing to do: give --prompts FILE.jsonl (one or more), --profile, or both")
    for name in ("max_new_tokens", "limit", "block_size", "context", "max_k", "repeats", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise DominoError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    groups = parse_methods(args.methods)
    for p in args.prompts:
        if not Path(p).is_file():
            raise DominoError(f"--prompts {p}: no such file")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args)
    out = Path(args.out)

    if args.profile:
        log(f"profiling verify cost: 1..{args.max_k} new tokens after a {args.context}-token context, "
            f"median of {args.repeats}")
        table = profile_verify_cost(target, args.context, args.max_k, args.repeats, args.seed)
        write_verify_cost(table, out, plots=not args.no_plots)
        print(format_verify_cost(table))
        log(f"wrote {out / 'verify_cost.json'}")
    if not args.prompts:
        return 0

    drafters = []
    if args.drafter:
        drafters = [(d, resolve_drafter(target, d)) for d in args.drafter]
    elif "drafters" in groups or "ablation" in groups:
        shipped = resolve_drafter(target, None)
        if shipped is not None:
            drafters = [("shipped default", shipped)]
    methods, notes = build_methods(groups, drafters, args.block_size)
    for n in notes:
        log(n)
    datasets = load_prompt_sets(args.prompts, target, args.limit)
    log(f"benchmarking {', '.join(m.name for m in methods)} on "
        + ", ".join(f"{d} ({len(p)})" for d, p in datasets.items()))
    results = benchmark(target, datasets, methods, out, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        seed=args.seed, warmup=not args.no_warmup, plots=not args.no_plots, notes=notes,
                        config={"prompt_files": [str(p) for p in args.prompts], "limit": args.limit,
                                "block_size": args.block_size})
    for m in results["methods"].values():
        for x in m.get("mismatched_prompts", []):
            log(f"MISMATCH {x['method']}: {x['dataset']} prompt {x['prompt_index']} differs from ar at token "
                f"{x['first_diff']}")
    print(format_method_table(results["methods"]))
    log(f"wrote {out / 'results.json'} and {out / 'report.md'}")
    return 0


def add_bench_parser(sub) -> None:
    from .cli import add_sampling_args, add_target_args

    p = sub.add_parser(
        "bench", help="benchmark speedup, tau, acceptance and losslessness against plain decoding",
        description="Run plain decoding (ar, the reference), transformers generate (hf), prompt lookup (pld) and "
                    "each drafter with and without its sequential head on the same prompts, interleaved per prompt "
                    "after a warm-up; write DIR/results.json, report.md and plots. With --profile, also measure "
                    "the target's verify cost for 1..K new tokens (DIR/verify_cost.json).")
    p.add_argument("--prompts", action="append", default=[], metavar="FILE.jsonl",
                   help="prompt file (repeatable); one dataset per file, named after its stem; the first user turn "
                        "of each conversation is the prompt")
    add_target_args(p)
    p.add_argument("--drafter", action="append", default=[], metavar="DIR",
                   help="drafter directory (repeatable; default: the one shipped for the bundled target)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of ar, hf, pld, drafters, ablation (drafters without their head) "
                        "(default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--block-size", type=int, default=None, help="drafts per cycle (default: each drafter's own)")
    add_sampling_args(p)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; on a shared machine, fewer threads "
                        "than busy cores gives steadier timings)")
    p.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up run of each method")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    g = p.add_argument_group("verify cost profile")
    g.add_argument("--profile", action="store_true",
                   help="measure one target forward over k = 1..K new tokens after a cached context "
                        "(the cost table a scheduler uses); runs before the benchmark when --prompts is given too")
    g.add_argument("--context", type=int, default=256, help="context length for --profile (default %(default)s)")
    g.add_argument("--max-k", type=int, default=16, help="largest k for --profile (default %(default)s)")
    g.add_argument("--repeats", type=int, default=7, help="timed repeats per k; the median is kept "
                                                            "(default %(default)s)")
    p.set_defaults(func=cmd_bench)
