"""`dominospec serve`: an OpenAI-compatible HTTP server over the batched engine."""

from __future__ import annotations

import importlib.util
import ipaddress
import os

from ..decode.schedule import DEFAULT_THRESHOLD
from ..errors import DominoError
from ..log import log
from .common import (
    LOOKUP,
    add_target_args,
    require_at_least,
    resolve_drafter,
    target_from_args,
    warn_if_reduced_precision,
)

NONE = "none"  # --drafter none: plain decoding


SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai")


def need_serve_extra() -> None:
    """The server's packages are an extra: only the commands that use them ask for them."""
    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise DominoError(
            f"this command needs the serve extra ({', '.join(missing)} missing): pip install 'dominospec[serve]'"
        )


def cmd_serve(args) -> int:
    need_serve_extra()
    from ..engine import Engine
    from ..serve import ServeConfig, make_server

    require_at_least(args, 1, "max_batch", "port", "max_len", "block_size")
    require_at_least(args, 0, "max_queue")
    if not 0 < args.confidence_threshold < 1:
        raise DominoError(f"--confidence-threshold must be in (0, 1), got {args.confidence_threshold}")
    if not args.request_timeout > 0:
        raise DominoError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise DominoError("--api-key is empty")
    if not _is_loopback(args.host) and args.api_key is None:
        log(f"serve: listening on {args.host} without --api-key: anyone who reaches this port can use the model")
    target = target_from_args(args)
    lookup = args.drafter == LOOKUP
    drafter = None
    if args.drafter not in (LOOKUP, NONE) and args.verify != "plain":
        drafter = resolve_drafter(target, args.drafter)
    verify = args.verify or ("cost" if drafter is not None or lookup else "plain")
    if verify != "plain" and drafter is None and not lookup:
        raise DominoError(
            f"--verify {verify} drafts, but there is no drafter (none ships for {target.name!r}): "
            "give --drafter DIR or --drafter lookup, or --verify plain"
        )
    warn_if_reduced_precision(target)
    engine = Engine(
        target,
        drafter,
        lookup=lookup and verify != "plain",
        policy=verify,
        block_size=args.block_size,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_len=args.max_len,
        threshold=args.confidence_threshold,
    )
    config = ServeConfig(model_name=target.name, api_key=args.api_key, request_timeout=args.request_timeout)
    mode = "plain" if verify == "plain" else f"{'lookup' if drafter is None else 'drafter'}, verify {verify}"
    log(
        f"serve: {target.name} ({mode}) on http://{args.host}:{args.port}/v1, {args.max_batch} slots of "
        f"{engine.max_len} positions, queue {args.max_queue}"
    )
    make_server(engine, target, config, host=args.host, port=args.port, log_level=args.log_level).run()
    log("serve: stopped")
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the target over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (POST /v1/chat/completions, /v1/completions; GET /v1/models, "
        "/health, /metrics) on the batched engine, with speculative decoding, and a playground page at / "
        "(open it in a browser). SIGTERM drains running requests and exits 0.",
    )
    add_target_args(p)
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter directory (default: the one shipped for the bundled target), lookup (prompt lookup "
        "alone) or none (plain decoding)",
    )
    p.add_argument(
        "--verify",
        default=None,
        choices=("plain", "fixed", "static", "cost"),
        help="verify-length policy over the batch: plain (no drafting), fixed (every draft), static "
        "(confidence threshold), cost (DSpark's scheduler over the batch: drafts only while it pays, verifies "
        "what the measured cost of a forward pays for; the device's cost table is measured on first use) "
        "(default: cost with a drafter or lookup, plain without: under load it measured best, docs/engine.md)",
    )
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per cycle (default: the drafter's)")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="for --verify static (default %(default)s)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default %(default)s: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default %(default)s)")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for a slot; beyond, 429 (default %(default)s)"
    )
    p.add_argument(
        "--max-len", type=int, default=None, help="positions per slot, prompt + answer (default: the engine's)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("DOMINOSPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and the playground's static "
        "files (the page asks for the key) (default: $DOMINOSPEC_API_KEY, else no key)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take from arrival to its last token, queueing included (default %(default)s)",
    )
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)
