"""Benchmark output for people: markdown tables, the report, and plots (matplotlib is optional)."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_path, write_json_atomic
from .metrics import REFERENCE


def format_verify_cost(table: dict) -> str:
    lines = [
        f"verify cost of {table.get('target', 'the target')} on {table['device']}, context {table['context']} "
        f"(median of {table.get('repeats', '?')}):",
        "",
        "| k new tokens | ms | x one token | verify steps/s | min ms | min x one token |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    mins = table.get("min_seconds") or [None] * len(table["k"])
    min_rel = table.get("min_relative_to_1") or [None] * len(table["k"])
    for k, s, r, sps, m, mr in zip(table["k"], table["seconds"], table["relative_to_1"], table["sps"], mins, min_rel):
        lines.append(f"| {k} | {1e3 * s:.1f} | {r:.2f} | {sps:.1f} | {fmt(m and 1e3 * m, 1)} | {fmt(mr)} |")
    return "\n".join(lines)


# ----- report -----


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(head: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A markdown table: the first `left` columns left-aligned (names), the rest right-aligned (numbers)."""
    align = ["---"] * left + ["---:"] * (len(head) - left)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def format_method_table(methods: dict) -> str:
    lines = [
        "| method | tok/s | speedup | tau | verified/cycle | wasted/cycle | no-draft cycles | mismatches | prompts "
        "| new tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        mm = "-" if m["lossless_mismatches"] is None else str(m["lossless_mismatches"])
        if "not_near_tie" in m:
            mm += f" ({m['not_near_tie']} not near-tie)"
        lines.append(
            f"| {name} | {fmt(m['tokens_per_s'])} | {fmt(m['speedup'])}x | {fmt(m['tau'])} | "
            f"{fmt(m.get('verified_per_cycle'))} | {fmt(m.get('wasted_per_cycle'))} | {_share(m)} | {mm} | "
            f"{_prompts(m)} | {m['new_tokens']} |"
        )
    return "\n".join(lines)


def _prompts(m: dict) -> str:
    """Prompts run, and those stopped at the per-prompt time limit (bench --prompt-time-limit)."""
    late = m.get("timed_out")
    return f"{m['num_prompts']} (+{late} timed out)" if late else str(m["num_prompts"])


def _share(m: dict) -> str:
    """Cycles the cost policy ran without drafting (a plain step), as a percentage; '-' without cycles."""
    x = m.get("draft_skipped_share")
    return "-" if x is None else f"{100 * x:.0f}%"


def format_acceptance_table(methods: dict, key: str) -> str:
    with_cycles = {n: m for n, m in methods.items() if m[key]}
    if not with_cycles:
        return "(no speculative method ran)"
    width = max(len(m[key]) for m in with_cycles.values())
    lines = ["| method | " + " | ".join(f"k={k}" for k in range(1, width + 1)) + " |", "|---|" + "---:|" * width]
    for name, m in with_cycles.items():
        cells = [fmt(v) for v in m[key]] + [""] * (width - len(m[key]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_time_table(methods: dict) -> str:
    lines = [
        "| method | prefill ms/prompt | prompt tok/s | draft ms/cycle | (profile) | verify ms/cycle | (profile) "
        "| other host ms/cycle | ms/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | {fmt(m['prefill_ms_per_prompt'], 1)} | {fmt(m.get('prompt_tok_per_s'), 0)} | "
            f"{fmt(m['draft_ms_per_cycle'], 1)} | "
            f"{fmt(m.get('profile_draft_ms_per_cycle'), 1)} | {fmt(m['verify_ms_per_cycle'], 1)} | "
            f"{fmt(m.get('profile_verify_ms_per_cycle'), 1)} | {fmt(m['host_ms_per_cycle'], 1)} | "
            f"{fmt(m['ms_per_token'], 1)} |"
        )
    return "\n".join(lines)


def format_nodraft_table(methods: dict) -> str:
    """Steps that verified no draft, by part: plain decoding's step (ar) next to each method's cycles that
    drafted nothing, and their cost in plain steps."""
    ar = methods.get(REFERENCE, {}).get("nodraft_ms")
    lines = [
        "| method | no-draft steps | draft ms | verify ms | host ms | ms/step | x plain step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        if not m.get("nodraft_steps"):
            continue
        lines.append(
            f"| {name} | {m['nodraft_steps']} | {fmt(m['nodraft_draft_ms'])} | {fmt(m['nodraft_verify_ms'])} | "
            f"{fmt(m['nodraft_host_ms'])} | {fmt(m['nodraft_ms'])} | {fmt(ar and m['nodraft_ms'] / ar, 3)} |"
        )
    return "\n".join(lines)


def render_report(results: dict, plots: bool = False) -> str:
    cfg = results["config"]
    sampling = (
        "greedy (T=0)"
        if cfg["temperature"] == 0
        else (f"T={cfg['temperature']}, top-p {cfg['top_p']}, top-k {cfg['top_k'] or 'off'}")
    )
    parts = [
        "# dominospec bench",
        "",
        f"Target `{cfg['target']}` on {cfg['device']} ({cfg['dtype']}), {sampling}, "
        f"max {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}. Datasets: "
        + ", ".join(f"{d} ({n} prompts)" for d, n in cfg["datasets"].items())
        + ". "
        "All methods ran in one process, after a warm-up, interleaved per prompt; speedup is "
        "tokens/s over `ar` (plain decoding through the same adapter) on the same prompts; tau counts the "
        "bonus token (1.0 for methods without draft cycles); verified/cycle = drafts the target checked per "
        "cycle (its forward covers one more token), wasted/cycle = those it rejected; no-draft cycles = cycles the "
        "cost policy ran as a plain step because drafting did not pay. Suffixes: -static / "
        "-cost = confidence-scheduled verification, -nohead = the ablation; hybrid-X = X with prompt lookup.",
        "",
        "## Overall",
        "",
        format_method_table(results["methods"]),
        "",
    ]
    for ds, methods in results["per_dataset"].items():
        parts += [f"## {ds}", "", format_method_table(methods), ""]
    parts += [
        "## Acceptance by block position",
        "",
        "Conditional: P(draft k accepted | drafts 1..k-1 accepted); '-' where position k was never reached.",
        "",
        format_acceptance_table(results["methods"], "accept_conditional"),
        "",
        "Unconditional: P(drafts 1..k all accepted), over all cycles.",
        "",
        format_acceptance_table(results["methods"], "accept_unconditional"),
        "",
    ]
    parts += [
        "## Where the time goes",
        "",
        "Per cycle: draft (backbone + head rollout), verify (one target forward over the block, acceptance, "
        "target cache rollback, and the drafter's context-cache update), other host (the rest of the loop: "
        "total - prefill - draft - verify). Per-token latency is (draft + verify + other) / tau. "
        "hf and pld run inside transformers, so only their total is known. (profile): what the stored device "
        "profile (`dominospec profile`) prices the same cycles at: its verify forward at each cycle's k + 1 tokens "
        "(nearest profiled context), its draft cycle for every cycle the drafter ran; a measured figure above it "
        "is loop overhead the profile does not see.",
        "",
        format_time_table(results["methods"]),
        "",
        "Steps that verified no draft (every step of plain decoding; a speculative method's cycles that drafted "
        "nothing), by part: draft = proposing and observing, verify = the target forward, acceptance and rollback, "
        "host = the rest of the loop's step.",
        "",
        format_nodraft_table(results["methods"]),
        "",
    ]
    ar = results["methods"].get(REFERENCE, {})
    step = ar.get("decode_ms_per_step")
    if step:
        rows = [
            f"- {n}: verify = {m['verify_ms_per_cycle'] / step:.2f} decode steps, draft = "
            f"{m['draft_ms_per_cycle'] / step:.2f} decode steps per cycle; break-even tau = "
            f"{(m['draft_ms_per_cycle'] + m['verify_ms_per_cycle'] + m['host_ms_per_cycle']) / step:.2f}"
            for n, m in results["methods"].items()
            if m.get("verify_ms_per_cycle")
        ]
        predicted = ar.get("profile_decode_ms_per_step")
        said = f" (the profile: {predicted:.1f} ms)" if predicted else ""
        parts += [f"One plain decode step (ar) costs {step:.1f} ms{said}."] + ([""] + rows if rows else []) + [""]
    mism = [x for m in results["methods"].values() for x in m.get("mismatched_prompts", [])]
    parts += ["## Losslessness", ""]
    if cfg["temperature"] != 0:
        parts.append("Not compared at T > 0 (outputs are samples); see the notes.")
    elif not mism:
        peers = [n for n, m in results["methods"].items() if m.get("lossless_mismatches", 0) is None]
        parts.append(
            "Every method's greedy output is token-identical to `ar` on every prompt"
            + (f" ({', '.join(peers)}: other weights, not compared)." if peers else ".")
        )
    else:
        parts += ["Outputs that differ from `ar` (prompt index within its dataset, first differing token):", ""]
        parts += [f"- {x['method']}: {x['dataset']} #{x['prompt_index']}, token {x['first_diff']}" for x in mism]
    parts.append("")
    if cfg.get("notes"):
        parts += ["## Notes", ""] + [f"- {n}" for n in cfg["notes"]] + [""]
    if plots:
        parts += [
            "## Plots",
            "",
            "![acceptance by position](acceptance.png)",
            "",
            "![speedup per dataset](speedup.png)",
            "",
        ]
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def write_plots(results: dict, out: Path) -> list[Path] | None:
    """acceptance.png and speedup.png; None when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    spec = {n: m for n, m in results["methods"].items() if m["accept_unconditional"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "accept_conditional", "P(accept k | 1..k-1 accepted)"),
        (axes[1], "accept_unconditional", "P(1..k all accepted)"),
    ):
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


def write_verify_cost(table: dict, out_dir, plots: bool = True) -> None:
    """DIR/verify_cost.json (and verify_cost.png)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "verify_cost.json", table, indent=2)
    if plots:
        plot_verify_cost(table, out / "verify_cost.png")


def format_device_profile(table: dict) -> str:
    """Verify cost per context as multiples of one decode step, and the draft cost per block size."""
    fp = table["fingerprint"]
    lines = [
        f"device profile: {fp['hardware']} ({fp['device']}, {fp['threads']} threads), {fp['target']} on "
        f"{fp['backend']} in {fp['dtype']}",
        "",
    ]
    ctxs = list(table["verify"])
    ks = table["verify"][ctxs[0]]["k"]
    lines.append("| k new tokens | " + " | ".join(f"ctx {c}: ms | x step" for c in ctxs) + " |")
    lines.append("|---:|" + "---:|---:|" * len(ctxs))
    for i, k in enumerate(ks):
        cells = []
        for c in ctxs:
            v = table["verify"][c]
            cells.append(f"{1e3 * v['seconds'][i]:.1f} | {v['relative_to_1'][i]:.2f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if "draft" in table:
        d = table["draft"]
        lines += [
            "",
            f"draft cycle ({d.get('drafter', 'drafter')}, context {d['context']}; the drafter's cache takes two "
            "committed positions, then the block is drafted):",
            "",
            "| b drafts | ms, greedy | ms, sampled |",
            "|---:|---:|---:|",
        ]
        sampled = d.get("seconds_sampled") or [None] * len(d["b"])
        lines += [
            f"| {b} | {1e3 * s:.1f} | {'-' if t is None else f'{1e3 * t:.1f}'} |"
            for b, s, t in zip(d["b"], d["seconds"], sampled)
        ]
    if "batch" in table:  # the engine's table: R rows of k new tokens each, B = R * k
        bt = table["batch"]
        lines += ["", f"batched forward (engine), context {bt['context']}, ms by rows R and new tokens per row k:", ""]
        lines.append("| k | " + " | ".join(f"R={r}" for r in bt["rows"]) + " |")
        lines.append("|---:|" + "---:|" * len(bt["rows"]))
        for i, k in enumerate(bt["k"]):
            lines.append(f"| {k} | " + " | ".join(f"{1e3 * row[i]:.1f}" for row in bt["seconds"]) + " |")
        if bt.get("draft_seconds"):
            lines.append("| draft pass | " + " | ".join(f"{1e3 * s:.1f}" for s in bt["draft_seconds"]) + " |")
    return "\n".join(lines)


def plot_device_profile(table: dict, path: Path) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, v in table["verify"].items():
        ax.plot(v["k"], v["relative_to_1"], marker="o", label=f"verify, context {c}")
    if "draft" in table:
        c0 = next(iter(table["verify"].values()))
        step = c0["seconds"][0]
        ax.plot(
            table["draft"]["b"],
            [s / step for s in table["draft"]["seconds"]],
            marker=".",
            linestyle="--",
            label="draft cycle (b drafts)",
        )
    fp = table["fingerprint"]
    ax.set_xlabel("new tokens in one forward (verify) / drafts per cycle (draft)")
    ax.set_ylabel("cost in decode steps")
    ax.set_title(f"{fp['target']} on {fp['backend']}, {fp['hardware']}, {fp['threads']} threads", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, Path(path))
    plt.close(fig)
    return True


def plot_reliability(calibration: dict, path: Path) -> bool:
    """Reliability diagram of the survival products by block position, raw and after STS; False without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, ece_key, title in (
        (axes[0], "reliability_before", "ece_before", "raw confidences"),
        (axes[1], "reliability_after", "ece_after", "after STS"),
    ):
        ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle="--")
        for k, bins in enumerate(calibration[key], 1):
            if bins:
                ece = calibration[ece_key][k - 1]
                ax.plot(
                    [b["predicted"] for b in bins],
                    [b["observed"] for b in bins],
                    marker="o",
                    markersize=3,
                    label=f"k={k} (ECE {100 * ece:.1f}%)",
                )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted P(drafts 1..k survive)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("observed frequency")
    _save(fig, Path(path))
    plt.close(fig)
    return True
