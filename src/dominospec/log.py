"""One log line format for every stage: progress and warnings go to stderr, results to stdout."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

_said: set[str] = set()


def log(msg: str) -> None:
    print(f"[dominospec] {msg}", file=sys.stderr, flush=True)


def log_once(msg: str) -> None:
    """Say `msg` once per process (for notes that would otherwise repeat every step or call)."""
    if msg not in _said:
        _said.add(msg)
        log(msg)


@contextlib.contextmanager
def ticking(what: str, every_s: float = 15.0):
    """While the block runs, say every `every_s` seconds how long `what` has taken (long, otherwise silent work)."""
    stop, t0 = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not stop.wait(every_s):
            log(f"{what}: {time.perf_counter() - t0:.0f} s so far")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
