"""What each amount of training data buys: validation tau of drafters trained on growing prefixes of one data set.

    taskset -c 1 python scripts/scaling_curve.py runs/curve/n256-bf16 runs/curve/n512-bf16 ... \
        --data data/smollm2-135m --json docs/scaling.json --plot docs/img/scaling.png

Each RUN is a `dominospec train --out` directory (trained with --train-samples N). Every drafter is
judged again here on one held-out set, the validation split of --data (its on-policy conversations
whose id hash falls below --val-fraction, the split train uses), walked the way greedy decoding walks
an answer (`--val-walk`), so runs trained while the data set was smaller stay comparable. Reported per
run: training samples, epochs, the best step, validation tau and the first draft's acceptance there,
and the run's training CPU-hours (from metrics.jsonl, where it was recorded). With --eval-like, each
drafter is also judged on the target's greedy answers to held-out prompts of the benchmark's own kinds
(the prompts/eval-*.jsonl lines after the first --bench-limit, which `bench --limit 3` decodes): the
validation that predicts `bench` (scripts/val_gap.py --eval-like).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dominospec.bench.runner import load_prompt_sets
from dominospec.data.dataset import load_dataset_dir
from dominospec.drafter import Drafter
from dominospec.targets import Target
from dominospec.targets.features import FeatureCache
from dominospec.train.validate import Validator, ValResult, conversation_of, greedy_answer_samples, split_validation


def remember_features(target) -> None:
    """Every drafter here reads the same target layers of the same samples: one feature pass serves all."""
    compute, memo = target.sequence_features, {}

    def sequence_features(seqs, layer_ids=None):
        key = tuple(layer_ids or target.layer_ids)
        todo = [list(s) for s in seqs if (key, tuple(s)) not in memo]
        if todo:
            feats, finals = compute(todo, list(key))
            for s, f, g in zip(todo, feats, finals):
                memo[key, tuple(s)] = (f, g)
        got = [memo[key, tuple(s)] for s in seqs]
        return [f for f, _ in got], [g for _, g in got]

    target.sequence_features = sequence_features


def run_facts(run: Path) -> dict:
    """Samples, steps and CPU time of a finished training run, from its own files (a drafter directory
    without them, such as the shipped one, gives its name only)."""
    if not (run / "train_state" / "trainer.pt").exists():
        return {"run": run.name, "samples": None, "bf16": None}
    state = torch.load(run / "train_state" / "trainer.pt", map_location="cpu", weights_only=False)
    cfg = state["train_config"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "tau_greedy" in r]
    val = [r for r in records if "val_tau" in r]
    best = max(val, key=lambda r: r["val_tau"]) if val else None
    cpu = max((r.get("cpu_s", 0.0) for r in steps), default=0.0)
    samples = state["num_samples"]
    return {
        "run": run.name,
        "samples": samples,
        "steps": state["step"],
        "epochs": round(state["step"] * cfg["batch_size"] / samples, 2),
        "bf16": cfg.get("bf16", False),
        "best_step": best["step"] if best else None,
        "train_val_tau": best["val_tau"] if best else None,
        "train_cpu_h": round(cpu / 3600, 3) if cpu else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="train --out directories: the curve's points")
    ap.add_argument("--also", nargs="*", type=Path, default=[], help="more drafters for the table, not the curve")
    ap.add_argument("--data", default="data/smollm2-135m", help="the data set whose held-out split judges all runs")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    ap.add_argument("--plot", type=Path, default=None, help="draw tau and first-draft acceptance against samples")
    ap.add_argument("--eval-like", action="store_true", help="also judge on held-out eval-like prompts (above)")
    ap.add_argument("--bench-limit", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy answer length of the eval-like prompts")
    ap.add_argument(
        "--train-band",
        type=float,
        default=0.0,
        metavar="F",
        help="also judge on trained conversations, those whose id hash falls in [--val-fraction, --val-fraction + F): "
        "the fit on seen data beside the held-out one (a gap near zero: the drafter is too small or undertrained "
        "for more data of the same kind to pay)",
    )
    ap.add_argument(
        "--feature-cache",
        type=Path,
        default=None,
        help="read the held-out samples' target features from this cache, storing those it lacks (what train "
        "--feature-cache keeps; fp16, so figures can differ from a run without it in the last digit): judging "
        "drafters in later runs then makes no target pass",
    )
    args = ap.parse_args()
    if not args.runs and not args.also:
        ap.error("give train --out directories (the curve's points), --also drafter directories, or both")
    torch.set_num_threads(1)
    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    remember_features(target)
    samples = load_dataset_dir(args.data, target=target)[1]
    _, val = split_validation(samples, args.val_fraction)
    cache = FeatureCache(args.feature_cache, target) if args.feature_cache else None
    validator = Validator(target, val, walk=True, feature_cache=cache)
    band_validator = None
    if args.train_band > 0:
        held = {conversation_of(s) for s in val}
        _, wider = split_validation(samples, args.val_fraction + args.train_band)
        band = [s for s in wider if conversation_of(s) not in held]
        band_validator = Validator(target, band, walk=True, feature_cache=cache)
    like_sets = {}
    if args.eval_like:  # one validator per eval set (by category); the overall figure sums their counts
        sets = load_prompt_sets(sorted(str(p) for p in Path("prompts").glob("eval-*.jsonl")), target)
        answers = {
            Path(name).stem.removeprefix("eval-"): greedy_answer_samples(
                target, prompts[args.bench_limit :], args.new_tokens, f"eval-like-{Path(name).stem}"
            )
            for name, prompts in sets.items()
        }
        like_sets = {name: Validator(target, samples, walk=True) for name, samples in answers.items() if samples}
    rows = []
    for run in args.runs + args.also:
        row = run_facts(run) | {"curve": run in args.runs}
        drafter = Drafter.from_pretrained(run, target=target).float()
        result = validator.evaluate(drafter)
        row.update(val_tau=round(result.tau, 4), p1=round(result.conditional[0] or 0.0, 4), val_blocks=result.blocks)
        if band_validator is not None:
            fit = band_validator.evaluate(drafter)
            row.update(train_band_tau=round(fit.tau, 4), train_band_p1=round(fit.conditional[0] or 0.0, 4))
        if like_sets:
            by_set = {name: v.evaluate(drafter) for name, v in like_sets.items()}
            r = ValResult(
                [sum(js) for js in zip(*(x.judged for x in by_set.values()))],
                [sum(ps) for ps in zip(*(x.passed for x in by_set.values()))],
                sum(x.samples for x in by_set.values()),
            )
            row.update(eval_like_tau=round(r.tau, 4), eval_like_p1=round(r.conditional[0] or 0.0, 4))
            row["eval_like_by_set"] = {
                name: {"tau": round(r.tau, 4), "p1": round(r.conditional[0] or 0.0, 4)} for name, r in by_set.items()
            }
        rows.append(row)
        print(
            f"{row['run']:<24} samples {row['samples']}  epochs {row.get('epochs')}  best step {row.get('best_step')}  "
            f"tau {row['val_tau']:.3f}  p1 {row['p1']:.3f}  (at training: {row.get('train_val_tau')})  "
            f"train CPU-h {row.get('train_cpu_h')}"
            + (f"  eval-like tau {row['eval_like_tau']:.3f}" if like_sets else "")
            + (
                f"  trained band tau {row['train_band_tau']:.3f} p1 {row['train_band_p1']:.3f}"
                if band_validator
                else ""
            )
        )
        for name, r in row.get("eval_like_by_set", {}).items():
            print(f"    eval-like {name:<10} tau {r['tau']:.3f}  p1 {r['p1']:.3f}")
    print(markdown(rows))
    table = {"data": args.data, "held_out": len(val), "walk": True, "runs": rows}
    if band_validator is not None:
        table["train_band"] = len(band_validator.samples)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


def markdown(rows: list[dict]) -> str:
    """The table as docs/scaling.md shows it."""
    head = "| drafter | training samples | epochs | best step | train CPU-h | tau | p1 | eval-like tau | eval-like p1 |"
    out = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["run"], r.get("samples"), r.get("epochs"), r.get("best_step"), r.get("train_cpu_h")]
        cells += [f"{r['val_tau']:.3f}", f"{r['p1']:.3f}"]
        cells += [f"{r['eval_like_tau']:.3f}", f"{r['eval_like_p1']:.3f}"] if "eval_like_tau" in r else ["-", "-"]
        out.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    series = [("val", "held-out training conversations"), ("eval_like", "held-out eval-like prompts (predicts bench)")]
    for key, label in series:
        tau, p1 = ("val_tau", "p1") if key == "val" else ("eval_like_tau", "eval_like_p1")
        for bf16, style in ((True, "o-"), (False, "s")):
            pts = sorted((r["samples"], r[tau], r[p1]) for r in rows if r["curve"] and r["bf16"] is bf16 and tau in r)
            if pts:
                name = label if bf16 else f"{label}, fp32"
                a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
                b.plot([p[0] for p in pts], [p[2] for p in pts], style, label=name)
    for ax, name in ((a, "tau (walked, greedy; block 8)"), (b, "first-draft acceptance")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("on-policy training conversations")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
