"""One log line format for every stage: progress and warnings go to stderr, results to stdout."""

from __future__ import annotations

import sys

_said: set[str] = set()


def log(msg: str) -> None:
    print(f"[dominospec] {msg}", file=sys.stderr, flush=True)


def log_once(msg: str) -> None:
    """Say `msg` once per process (for notes that would otherwise repeat every step or call)."""
    if msg not in _said:
        _said.add(msg)
        log(msg)
