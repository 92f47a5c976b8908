"""`dominospec loadtest`: drive a running `dominospec serve` with streaming clients and report."""

from __future__ import annotations

import json
from pathlib import Path

from ..data.builtin import builtin_prompts
from ..data.prompts import read_first_turns
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
from ..sampling import check_sampling
from .common import require_at_least
from .serve import need_serve_extra

HELD_OUT_SEED = 2026  # builtin prompts drawn with a seed the shipped data set does not use


def cmd_loadtest(args) -> int:
    need_serve_extra()
    from ..bench.loadtest import LoadTestConfig, check_loopback, run_loadtest, write_loadtest

    check_loadtest_args(args)
    check_loopback(args.url)
    out = ensure_writable_dir(args.out) if args.out else None
    if args.prompts:
        prompts = read_first_turns(args.prompts)
    else:
        prompts = [c.turns[0] for c in builtin_prompts(args.builtin, seed=HELD_OUT_SEED)]
    if not prompts:
        raise DominoError(f"--prompts {args.prompts}: no usable prompt")
    cfg = LoadTestConfig(
        url=args.url,
        prompts=prompts,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        api_key=args.api_key,
        server_pid=args.server_pid,
        fault_round=args.fault_round,
    )
    log(f"loadtest: {cfg.concurrency} streaming clients for {args.duration:g} s against {args.url}")
    report = run_loadtest(cfg)
    print(json.dumps(report.to_dict()) if args.json else report.table())
    if out is not None:
        log("wrote " + ", ".join(str(p) for p in write_loadtest(report, out, plots=not args.no_plots)))
    if report.requests == 0:
        log("loadtest: no request was sent")
        return 1
    return 1 if report.errors else 0


MAX_CLIENTS = 1024  # concurrent streaming clients (each holds a connection)


def check_loadtest_args(args) -> None:
    """The load test's own numbers, checked here: the server would refuse them request by request."""
    from ..serve.protocol import MAX_TEMPERATURE

    require_at_least(args, 1, "concurrency", "max_requests", "max_tokens", "builtin")
    if not args.duration > 0:
        raise DominoError(f"--duration must be > 0 seconds, got {args.duration}")
    check_sampling(args.temperature, 0, 1.0, prefix="--")
    if args.temperature > MAX_TEMPERATURE:
        raise DominoError(
            f"--temperature must be in [0, {MAX_TEMPERATURE:g}] (the API's range), got {args.temperature:g}"
        )
    if args.concurrency > MAX_CLIENTS:
        raise DominoError(f"--concurrency must be at most {MAX_CLIENTS}, got {args.concurrency}")
    if args.max_requests is not None and args.concurrency > args.max_requests:
        log(f"loadtest: --max-requests {args.max_requests} keeps only {args.max_requests} clients busy")
        args.concurrency = args.max_requests
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").exists():
        raise DominoError(f"--server-pid {args.server_pid}: no such process on this machine")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "loadtest",
        help="load-test a running `dominospec serve` (loopback only)",
        description="Closed-loop streaming chat clients against a server on this machine: throughput, "
        "TTFT/TPOT percentiles, errors by kind and the server's RSS over time; --fault-round adds "
        "disconnecting clients, malformed bodies and a burst beyond the queue halfway through. "
        "Exits 1 when any client request failed.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root (default %(default)s)")
    p.add_argument(
        "--concurrency", type=int, default=4, help="clients, one request at a time each (default %(default)s)"
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds to start requests for (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=None, help="stop after this many requests in all")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="default %(default)s")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (first user turns; default: builtin prompts)")
    p.add_argument("--builtin", type=int, default=64, help="builtin prompts to cycle through (default %(default)s)")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument(
        "--server-pid", type=int, default=None, help="read the server's RSS from /proc/PID (default: its /metrics)"
    )
    p.add_argument("--fault-round", action="store_true", help="disconnects, bad bodies and a burst, halfway")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="also write DIR/loadtest.json (with each request's start, TTFT and latency) and loadtest.png "
        "(the server's RSS and the latencies over the run; matplotlib, the plots extra)",
    )
    p.add_argument("--no-plots", action="store_true", help="with --out: no PNG")
    p.set_defaults(func=cmd_loadtest)
