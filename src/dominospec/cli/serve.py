"""`dominospec serve`: an OpenAI-compatible HTTP server over the batched engine."""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import os
import socket
import time
from pathlib import Path

import torch

from ..errors import DominoError
from ..log import log
from .common import (
    add_spec_args,
    add_target_args,
    check_verify_args,
    require_at_least,
    spec_from_args,
    target_from_args,
    warn_if_reduced_precision,
)

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai")


def need_serve_extra() -> None:
    """The server's packages are an extra: only the commands that use them ask for them."""
    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise DominoError(
            f"this command needs the serve extra ({', '.join(missing)} missing): pip install 'dominospec[serve]'"
        )


def cmd_serve(args) -> int:
    started = time.monotonic()
    need_serve_extra()
    from ..engine import Engine
    from ..serve import LOOPBACK_HOSTS, ServeConfig, make_server

    check_serve_args(args)
    api_key = api_key_from(args)
    check_listen(args.host, args.port)  # a busy port or a bad host, before the model loads (and any warning)
    if not _is_loopback(args.host) and api_key is None:
        log(f"serve: listening on {args.host} without --api-key: anyone who reaches this port can use the model")
    spec = spec_from_args(args, "serve", args.block_size)  # a drafter directory is checked before the target loads
    target = target_from_args(args)
    warn_if_reduced_precision(target)
    engine = Engine(
        target,
        spec=spec,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_len=args.max_len,
    )
    config = ServeConfig(
        model_name=args.served_model_name or served_name(target.name),
        api_key=api_key,
        request_timeout=args.request_timeout,
        allowed_hosts=LOOPBACK_HOSTS if _is_loopback(args.host) else None,
        allowed_origins=tuple(args.allow_origin),
    )
    log(
        f"serve: {target.name} ({spec.describe()}) on http://{args.host}:{args.port}/v1, {args.max_batch} slots of "
        f"{engine.max_len} positions, queue {args.max_queue}"
    )
    # a request without a seed draws one from torch's global generator (decode/step.py make_generator):
    # seeded from the OS here, so each server process answers such requests with fresh randomness
    torch.seed()
    make_server(engine, target, config, host=args.host, port=args.port, log_level=args.log_level, started=started).run()
    log("serve: stopped")
    return 0


MIN_MAX_LEN = 3  # one prompt token, one answer token, and the position past it


def check_serve_args(args) -> None:
    """Every number serve takes, checked before the model loads."""
    require_at_least(args, 1, "max_batch", "port", "block_size")
    require_at_least(args, MIN_MAX_LEN, "max_len")
    require_at_least(args, 0, "max_queue")
    if args.port > 65535:
        raise DominoError(f"--port must be in 1..65535, got {args.port}")
    if args.max_len is not None and args.block_size is not None and args.max_len < args.block_size + MIN_MAX_LEN:
        raise DominoError(
            f"--max-len {args.max_len} leaves no room for a request: a cycle needs the prompt, the anchor and "
            f"--block-size {args.block_size} draft positions ({args.block_size + MIN_MAX_LEN} at least)"
        )
    check_verify_args(args)
    if not args.request_timeout > 0:
        raise DominoError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise DominoError("--served-model-name is empty")
    check_origins(args.allow_origin)


def check_origins(origins: list[str]) -> None:
    """--allow-origin: each an origin a browser sends (scheme://host[:port], no path), or * for any."""
    from ..serve.app import origin_of

    for origin in origins:
        if origin != "*" and origin_of(origin) is None:
            raise DominoError(
                f"--allow-origin {origin!r} is not an origin: give scheme://host[:port] as a browser sends it "
                "(e.g. http://localhost:3000), or * for any page"
            )


def api_key_from(args) -> str | None:
    """--api-key, else $DOMINOSPEC_API_KEY; a key no client could send exactly is refused, naming its source."""
    key, source = args.api_key, "--api-key"
    if key is None:
        key, source = os.environ.get("DOMINOSPEC_API_KEY"), "DOMINOSPEC_API_KEY"
    if key is None:
        return None
    if not key:
        raise DominoError(f"{source} is empty")
    if key != key.strip():
        raise DominoError(f"{source} has leading or trailing whitespace, which no client sends; remove it")
    bad = [c for c in key if not (c.isascii() and c.isprintable()) or c.isspace()]
    if bad:
        raise DominoError(
            f"{source} holds {bad[0]!r}: an HTTP Authorization header carries printable ASCII without spaces only"
        )
    return key


def check_listen(host: str, port: int) -> None:
    """Bind once and let go: a host that is not this machine's or a port in use is named before loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise DominoError(f"--host {host!r}: not an address this machine has ({exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise DominoError(f"--host {host} --port {port}: cannot listen there ({why})") from None


def served_name(target_name: str) -> str:
    """The model id clients see: a local directory's base name (not the path), else the name given."""
    path = Path(target_name)
    return path.resolve().name if path.is_dir() else str(target_name)


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
    add_spec_args(p, "serve")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per cycle (default: the drafter's)")
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default %(default)s: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="default %(default)s")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages on ORIGIN (scheme://host[:port], e.g. http://localhost:3000; * for any) call the "
        "server; repeat for several. By default only the server's own pages (its scheme, host and port) may",
    )
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default %(default)s)")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for a slot; beyond, 429 (default %(default)s)"
    )
    p.add_argument(
        "--max-len", type=int, default=None, help="positions per slot, prompt + answer (default: the engine's)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and see (default: the target directory's base name, or its alias/hub id)",
    )
    p.add_argument(
        "--api-key",
        default=None,
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
