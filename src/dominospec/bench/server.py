"""A running OpenAI-compatible server under closed-loop load, per prompt category (`bench --server`).

For each concurrency level C and each category, C clients each send one streaming chat request at a
time over the category's prompts until every prompt was answered once (at least C requests), or
until the level's time bound passes. Per (category, C): output tokens/s (the category's tokens over
its wall time), TTFT and TPOT percentiles as the client sees them, errors by kind, and, where the
server reports the `spec_metrics` extension (dominospec's), acceptance: tau (answer tokens per target
cycle) and the share of verified drafts accepted.

Prompt files are JSONL; a line's `category` names its category (Spec-Bench's question.jsonl and
SPEED-Bench's rows have one, with the prompt in `turns`), else the file's stem does. Any layout the
project's prompt reader knows works (`turns`, `conversations`, `messages`, `prompt`); the first
user turn is the prompt.

Several runs (two servers, or results.json files of earlier runs) compare side by side: the first
run is the baseline of the speedup column.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..data.prompts import user_turns
from ..errors import DominoError
from ..io import write_json_atomic
from ..serve.loadtest import check_loopback, percentiles
from .report import fmt, markdown_table

SCHEMA = "dominospec-bench-server/1"


# ----- prompts by category -----


def read_categories(paths, limit: int | None = None) -> dict[str, list[str]]:
    """{category: first user turns} over the files, in file order; `limit` prompts per category at most."""
    out: dict[str, list[str]] = {}
    for path in map(Path, paths):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DominoError(f"--prompts {path}: cannot read it ({exc})") from None
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                turns = user_turns(obj)
            except (json.JSONDecodeError, ValueError) as exc:
                raise DominoError(f"{path}:{n}: {exc}") from None
            category = obj.get("category")
            category = str(category) if isinstance(category, (str, int)) and str(category).strip() else path.stem
            prompts = out.setdefault(category, [])
            if limit is None or len(prompts) < limit:
                prompts.append(turns[0])
    if not out:
        raise DominoError(f"--prompts {', '.join(map(str, paths))}: no prompt in them")
    return out


# ----- one run -----


@dataclass
class ServerBenchConfig:
    url: str  # the server's root, e.g. http://127.0.0.1:8000 (loopback only)
    categories: dict[str, list[str]]
    levels: list[int]
    label: str = ""  # the run's name in reports (default: the model and URL)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    spec_metrics: bool = True  # ask for the extension (servers that do not know it ignore the field)
    extra_body: dict = field(default_factory=dict)  # e.g. {"speculative": False} for plain decoding
    api_key: str | None = None
    level_timeout_s: float = 600.0  # no request starts later than this after its (category, level) began
    request_timeout_s: float = 300.0


@dataclass
class Record:
    ok: bool
    error: str | None = None
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    spec: dict | None = None  # usage.spec_metrics, when the server sent it


async def _one(http: httpx.AsyncClient, cfg: ServerBenchConfig, model: str, prompt: str, seed: int) -> Record:
    """One streaming chat request; times and counts from the client's side."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"spec_metrics": True} if cfg.spec_metrics else {}),
        **cfg.extra_body,
    }
    start, first, last, pieces, usage = time.monotonic(), None, None, 0, None
    try:
        async with http.stream("POST", f"{cfg.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return Record(False, f"http_{r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Record(False, "stream_error")
                usage = event.get("usage") or usage
                if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                    last = time.monotonic()
                    first = first or last
                    pieces += 1
    except httpx.TimeoutException:
        return Record(False, "timeout")
    except httpx.HTTPError as exc:
        return Record(False, type(exc).__name__)
    tokens = usage["completion_tokens"] if usage else pieces  # without usage: one token per text chunk
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    spec = usage.get("spec_metrics") if usage else None
    return Record(True, tokens=tokens, ttft_s=None if first is None else first - start, tpot_s=tpot, spec=spec)


async def _level(http, cfg: ServerBenchConfig, model: str, prompts: list[str], clients: int) -> tuple[list, float]:
    """Closed loop: `clients` workers over the prompts (each at least once, at least `clients` requests)."""
    todo = list(enumerate(prompts))
    while len(todo) < clients:
        todo += todo[: clients - len(todo)]
    queue = iter(todo)
    records: list[Record] = []
    t0 = time.monotonic()

    async def worker():
        for i, prompt in queue:
            if time.monotonic() - t0 > cfg.level_timeout_s:
                return
            records.append(await _one(http, cfg, model, prompt, cfg.seed + i))

    await asyncio.gather(*(worker() for _ in range(clients)))
    return records, time.monotonic() - t0


def summarize(records: list[Record], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in ok)
    with_spec = [r.spec for r in ok if r.spec]
    spec = None
    if with_spec:
        cycles = sum(s["cycles"] for s in with_spec)
        drafted = sum(s["drafted"] for s in with_spec)
        width = max(len(s["accepted_by_position"]) for s in with_spec)
        by_pos = [
            sum(s["accepted_by_position"][k] for s in with_spec if k < len(s["accepted_by_position"]))
            for k in range(width)
        ]
        spec = {
            "requests": len(with_spec),
            "tau": sum(sum(s["source_counts"].values()) for s in with_spec) / cycles if cycles else None,
            "acceptance": sum(s["accepted"] for s in with_spec) / drafted if drafted else None,
            "drafted_per_cycle": drafted / cycles if cycles else None,
            "accepted_by_position": [n / cycles for n in by_pos] if cycles else [],
            "source_counts": dict(sum((Counter(s["source_counts"]) for s in with_spec), Counter())),
        }
    return {
        "requests": len(records),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        "tpot_ms": percentiles([r.tpot_s for r in ok if r.tpot_s is not None], 1000),
        "spec": spec,
    }


async def _run(cfg: ServerBenchConfig, progress=None) -> dict:
    base = cfg.url = check_loopback(cfg.url, "--server")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.levels) + 4)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits, headers=headers) as http:
        try:
            r = await http.get(f"{base}/v1/models")
        except httpx.HTTPError as exc:
            raise DominoError(f"--server {base}: no server answers there ({type(exc).__name__})") from None
        if r.status_code != 200:
            raise DominoError(f"--server {base}: GET /v1/models answered {r.status_code}: {r.text[:200]}")
        model = r.json()["data"][0]["id"]
        rows = []
        for clients in cfg.levels:
            for category, prompts in cfg.categories.items():
                records, wall = await _level(http, cfg, model, prompts, clients)
                rows.append({"category": category, "concurrency": clients, **summarize(records, wall)})
                if progress:
                    progress(f"{cfg.label or base}: {category} at {clients}: {format_row_brief(rows[-1])}")
    return {
        "schema": SCHEMA,
        "label": cfg.label or f"{model} @ {base}",
        "url": base,
        "model": model,
        "config": {
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
            "levels": list(cfg.levels),
            "prompts": {c: len(p) for c, p in cfg.categories.items()},
            "extra_body": cfg.extra_body,
        },
        "rows": rows,
    }


def bench_server(cfg: ServerBenchConfig, progress=None) -> dict:
    """Drive the server at every level over every category; the run's results (JSON-ready)."""
    if not cfg.levels or min(cfg.levels) < 1:
        raise DominoError("bench --server needs concurrency levels >= 1")
    return asyncio.run(_run(cfg, progress))


def format_row_brief(row: dict) -> str:
    tau = row["spec"]["tau"] if row["spec"] else None
    return (
        f"{row['requests']} requests, {row['tokens_per_s']:.1f} tok/s, TTFT p50 {fmt(row['ttft_ms']['p50'], 0)} ms, "
        f"TPOT p50 {fmt(row['tpot_ms']['p50'], 1)} ms, tau {fmt(tau)}"
        + (f", errors {row['errors']}" if row["errors"] else "")
    )


# ----- reading and comparing runs -----


def load_runs(path) -> list[dict]:
    """The runs in a server.json: one run, or {"runs": [...]} from a comparison."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DominoError(f"--compare {path}: not a bench --server result ({exc})") from None
    runs = data.get("runs", [data]) if isinstance(data, dict) else []
    if not runs or not all(isinstance(r, dict) and r.get("schema") == SCHEMA for r in runs):
        raise DominoError(f"--compare {path}: not a bench --server result (no schema {SCHEMA!r})")
    return runs


def pooled(run: dict) -> list[dict]:
    """Per concurrency, every category together: tokens over the summed wall time (categories ran in turn)."""
    out = []
    for c in run["config"]["levels"]:
        rows = [r for r in run["rows"] if r["concurrency"] == c]
        tokens, wall = sum(r["tokens"] for r in rows), sum(r["wall_s"] for r in rows)
        out.append({"concurrency": c, "tokens_per_s": tokens / wall if wall > 0 else 0.0})
    return out


def _row(run: dict, category: str, c: int) -> dict | None:
    return next((r for r in run["rows"] if r["category"] == category and r["concurrency"] == c), None)


def render_report(runs: list[dict]) -> str:
    """The markdown report of one run, or of several side by side (speedup against the first)."""
    base = runs[0]
    cfg = base["config"]
    parts = [
        "# dominospec bench --server",
        "",
        f"Closed-loop streaming chat clients per category and concurrency; max_tokens {cfg['max_tokens']}, "
        f"temperature {cfg['temperature']}. tok/s = the category's output tokens over its wall time; TTFT and "
        "TPOT (ms, p50 / p90 / p99) as the client saw them; tau = answer tokens per target cycle and acceptance = "
        "accepted / verified drafts, where the server reports `spec_metrics`.",
        "",
        "Runs: "
        + "; ".join(f"**{r['label']}** ({r['url']}, {sum(r['config']['prompts'].values())} prompts)" for r in runs),
        "",
    ]
    if len(runs) > 1:
        parts += [f"Speedup = tok/s over the first run's (**{base['label']}**).", ""]
    for c in cfg["levels"]:
        parts += [f"## Concurrency {c}", ""]
        head = ["category"]
        for r in runs:
            head += [f"{r['label']} tok/s"] + (["speedup"] if r is not base else [])
            head += [f"{r['label']} TTFT ms", f"{r['label']} TPOT ms", f"{r['label']} tau", f"{r['label']} accepted"]
        body = []
        categories = list(dict.fromkeys(row["category"] for r in runs for row in r["rows"]))
        for category in categories:
            cells = [category]
            ref = _row(base, category, c)
            for r in runs:
                row = _row(r, category, c)
                if row is None:
                    cells += ["-"] * (5 if r is base else 6)
                    continue
                cells.append(fmt(row["tokens_per_s"], 1))
                if r is not base:
                    ratio = row["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] else None
                    cells.append("-" if ratio is None else f"{ratio:.2f}x")
                spec = row["spec"] or {}
                cells += [
                    _pct(row["ttft_ms"], 0),
                    _pct(row["tpot_ms"], 1),
                    fmt(spec.get("tau")),
                    fmt(spec.get("acceptance")),
                ]
            body.append(cells)
        parts += [markdown_table(head, body, left=1), ""]
        errors = {
            r["label"]: row["errors"] for r in runs for row in r["rows"] if row["concurrency"] == c and row["errors"]
        }
        if errors:
            parts += [f"Errors: {errors}", ""]
    return "\n".join(parts)


def _pct(d: dict, digits: int) -> str:
    return " / ".join(fmt(d[k], digits) for k in ("p50", "p90", "p99"))


def write_report(runs: list[dict], out: Path, plots: bool = True) -> list[Path]:
    """DIR/server.json (every run), server.md and, with matplotlib, server.png; the paths written."""
    written = [out / "server.json", out / "server.md"]
    write_json_atomic(written[0], runs[0] if len(runs) == 1 else {"runs": runs}, indent=2)
    written[1].write_text(render_report(runs) + "\n")
    if plots and plot_runs(runs, out / "server.png"):
        written.append(out / "server.png")
    return written


def plot_runs(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (thr, tpot), (cat, acc) = axes
    categories = list(dict.fromkeys(row["category"] for r in runs for row in r["rows"]))
    lowest = min(runs[0]["config"]["levels"])
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        style = dict(marker="o", label=run["label"], color=f"C{i}")
        levels = run["config"]["levels"]
        thr.plot(levels, [p["tokens_per_s"] for p in pooled(run)], **style)
        medians = [_median_over(run, c, "tpot_ms") for c in levels]
        tpot.plot(levels, medians, **style)
        xs = [j + i * width for j in range(len(categories))]
        cat.bar(
            xs, [(_row(run, k, lowest) or {}).get("tokens_per_s", 0) for k in categories], width, label=run["label"]
        )
        taus = [((_row(run, k, lowest) or {}).get("spec") or {}).get("tau") or 0 for k in categories]
        acc.bar(xs, taus, width, label=run["label"])
    levels = runs[0]["config"]["levels"]
    for ax, title in ((thr, "output tok/s, all categories"), (tpot, "TPOT p50 (ms), median over categories")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_title(title)
    for ax, title in ((cat, f"tok/s by category at concurrency {lowest}"), (acc, f"tau by category at {lowest}")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
        ax.set_title(title)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _median_over(run: dict, c: int, key: str) -> float | None:
    values = sorted(r[key]["p50"] for r in run["rows"] if r["concurrency"] == c and r[key]["p50"] is not None)
    return values[len(values) // 2] if values else None
