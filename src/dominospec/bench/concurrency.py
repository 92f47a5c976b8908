"""The engine under load: closed-loop clients, per configuration and concurrency (`bench --concurrency`).

A configuration is a tune/spec.py SpecConfig (proposer x verify mode), labelled as `bench` labels its
methods: plain, lookup-cost, drafter-fixed, hybrid-cost, ... (with the drafter's name when several run).

At concurrency C, C clients each submit a request, wait for it, and submit the next, over the
prompt sets, until every prompt has been answered once (at least C requests). The engine runs with
max_batch = C. Reported per (policy, C): aggregate generated tokens/s over the wall time, per-request
time per output token (median, p90; after the first token), time to first token, tau, the
average verify length per request per step (DSpark's budget curve), the share of steps run without a
drafter pass, and at T=0 the requests whose tokens differ from the first run's answer to the same
prompt (batched fp32 rounds differently from batch 1: a near-tie can flip, and this counts it).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..decode.result import tokens_per_cycle
from ..devices import describe_device
from ..engine import Engine, EngineRequest
from ..errors import DominoError
from ..io import write_json_atomic
from ..sampling import SamplingConfig
from ..tune.profile import precision
from ..tune.spec import SpecConfig

WARMUP_TOKENS = 8


MAX_CONCURRENCY = 1024  # closed-loop clients of one level


def parse_concurrency(spec: str) -> list[int]:
    try:
        levels = [int(c) for c in spec.split(",") if c.strip()]
    except ValueError:
        raise DominoError(f"--concurrency {spec!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise DominoError(f"--concurrency {spec!r}: concurrency levels must be >= 1")
    if max(levels) > MAX_CONCURRENCY:
        raise DominoError(
            f"--concurrency {spec!r}: at most {MAX_CONCURRENCY} clients (each is a thread and an engine slot)"
        )
    return levels


def make_engine(target, spec: SpecConfig, max_batch: int, costs=None, max_len=None) -> Engine:
    """The engine of one configuration (tune/spec.py) with `max_batch` slots."""
    return Engine(
        target, spec=spec, max_batch=max_batch, max_queue=max(64, 2 * max_batch), max_len=max_len, costs=costs
    )


def runnable(target, specs: dict[str, SpecConfig], costs=None, max_len=None) -> tuple[dict[str, SpecConfig], list[str]]:
    """The configurations an engine can run here, and a note for each one it cannot (e.g. static without a
    confidence head), checked before anything is timed."""
    ok, notes = {}, []
    for label, spec in specs.items():
        try:
            make_engine(target, spec, 1, costs, max_len)
        except DominoError as exc:
            notes.append(f"{label}: skipped ({exc})")
            continue
        ok[label] = spec
    return ok, notes


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = q * (len(xs) - 1)
    lo = int(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def closed_loop(engine: Engine, prompts: list[list[int]], clients: int, max_new_tokens: int, sampling, seed=0):
    """C client threads, each submitting its next prompt when its last answer is done.

    -> (results, wall s, which[j] = the index in `prompts` of results[j])."""
    todo = list(prompts)
    while len(todo) < clients:
        todo += prompts
    lock, results, which = threading.Lock(), [], []
    queue = iter(enumerate(todo))

    def client():
        while True:
            with lock:
                nxt = next(queue, None)
            if nxt is None:
                return
            i, p = nxt
            res = engine.submit(EngineRequest(p, max_new_tokens, sampling, seed=seed + i)).wait()
            with lock:
                results.append(res)
                which.append(i % len(prompts))

    engine.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    engine.shutdown(drain=True)
    return results, wall, which


def summarize_level(results, wall: float) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    tpot = [(r.total_s - r.ttft_s) / (len(r.tokens) - 1) for r in results if len(r.tokens) > 1 and r.ttft_s]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    cycles = sum(len(r.accepted) for r in results)
    per_request_verify = [sum(r.verified) / len(r.verified) for r in results if r.verified]
    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tpot_median_s": _quantile(tpot, 0.5),
        "tpot_p90_s": _quantile(tpot, 0.9),
        "ttft_median_s": _quantile(ttft, 0.5),
        "ttft_p90_s": _quantile(ttft, 0.9),
        "tau": tokens_per_cycle([c for r in results for c in r.committed]) if cycles else None,
        "verify_per_request": statistics.mean(per_request_verify) if per_request_verify else None,
        "errors": sum(r.finish_reason == "error" for r in results),
    }


def bench_concurrency(
    target,
    specs: dict[str, SpecConfig],
    datasets: dict[str, list[list[int]]],
    levels: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    costs=None,
    progress=None,
) -> dict:
    """Every configuration (label -> SpecConfig, tune/spec.py) at every concurrency level over the same
    prompts; the results dict (see module doc). A configuration the engine cannot run is skipped with a note."""
    prompts = list(itertools.chain.from_iterable(datasets.values()))
    if not prompts:
        raise DominoError("bench --concurrency: no prompts")
    widest = max((s.block_size or 16 for s in specs.values()), default=16)
    max_len = max(len(p) for p in prompts) + max_new_tokens + 2 * widest + 2
    specs, notes = runnable(target, specs, costs, max_len)
    for note in notes:
        if progress:
            progress(note)
    rows, reference = [], {}  # greedy: each prompt's tokens from the first run, what every other run must equal
    for policy, spec in specs.items():
        for c in levels:
            engine = make_engine(target, spec, c, costs, max_len)
            warm = engine.submit(EngineRequest(prompts[0], WARMUP_TOKENS, sampling, seed=seed))
            engine.run_until_idle()
            warm.wait()
            results, wall, which = closed_loop(engine, prompts, c, max_new_tokens, sampling, seed)
            row = {"policy": policy, "concurrency": c, **summarize_level(results, wall)}
            if sampling.greedy:
                for i, r in zip(which, results):
                    reference.setdefault(i, r.tokens)
                row["mismatches"] = sum(r.tokens != reference[i] for i, r in zip(which, results))
            row["slot_bytes"] = engine.slot_bytes
            stats = engine.stats()
            row["draft_skipped"] = stats["draft_skipped"] / stats["steps"] if stats["steps"] else 0.0
            rows.append(row)
            if progress:
                progress(format_row(row))
    return {
        "device": describe_device(target.device),
        "target": getattr(target, "name", "model"),
        "dtype": precision(target),
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
        "max_new_tokens": max_new_tokens,
        "prompts": {name: len(p) for name, p in datasets.items()},
        "levels": list(levels),
        "policies": list(specs),
        "configurations": {label: spec.describe() for label, spec in specs.items()},
        "notes": notes,
        "rows": rows,
    }


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def format_row(row: dict) -> str:
    tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
    verify = "-" if row["verify_per_request"] is None else f"{row['verify_per_request']:.2f}"
    return (
        f"| {row['policy']} | {row['concurrency']} | {row['tokens_per_s']:.1f} | {_ms(row['tpot_median_s'])} | "
        f"{_ms(row['tpot_p90_s'])} | {_ms(row['ttft_median_s'])} | {tau} | {verify} | "
        f"{100 * row.get('draft_skipped', 0.0):.0f}% | {row.get('mismatches', '-')} | {row['requests']} |"
    )


def format_concurrency_table(results: dict) -> str:
    head = (
        "| policy | concurrency | tok/s | TPOT median ms | TPOT p90 ms | TTFT median ms | tau | "
        "verify/request | steps without drafting | mismatches | requests |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    return "\n".join([head] + [format_row(r) for r in results["rows"]])


def write_concurrency(results: dict, out: Path, plots: bool = True) -> list[Path]:
    """concurrency.json, concurrency.md and (with matplotlib) concurrency.png; the paths written."""
    written = [out / "concurrency.json", out / "concurrency.md"]
    write_json_atomic(written[0], results, indent=2)
    written[1].write_text(format_concurrency_table(results) + "\n")
    if plots and plot_concurrency(results, out / "concurrency.png"):
        written.append(out / "concurrency.png")
    return written


def plot_concurrency(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, policy in enumerate(results["policies"]):
        rows = [r for r in results["rows"] if r["policy"] == policy]
        cs, style = [r["concurrency"] for r in rows], dict(marker="o", label=policy, color=f"C{i}")
        axes[0].plot(cs, [r["tokens_per_s"] for r in rows], **style)
        axes[1].plot(cs, [1e3 * (r["tpot_median_s"] or 0) for r in rows], **style)
        if any(r["verify_per_request"] is not None for r in rows):
            axes[2].plot(cs, [r["verify_per_request"] for r in rows], **style)
    titles = ("aggregate tokens/s", "TPOT median (ms)", "verify length per request")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
