"""Running the app: uvicorn, the engine's lifetime, and draining on SIGTERM.

The first SIGTERM (or Ctrl-C) starts a drain: new generation requests get 503 with Retry-After
and /health says "draining", while requests already submitted run to their end. When none is
left (or `drain_timeout` passes) uvicorn stops, the engine shuts down, and `serve` returns, so
the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import signal
import socket
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..log import log
from .app import Gate, ServeConfig, create_app


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain between the signal and the stop."""

    def __init__(self, config: uvicorn.Config, gate: Gate, drain_timeout: float, started: float | None = None):
        super().__init__(config)
        self.gate, self.drain_timeout = gate, drain_timeout
        self.drain_deadline: float | None = None
        self.started_at = started  # time.monotonic() when the command began, for the ready line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.started_at is not None:  # listening: say so, and how long the start took
            c = self.config
            log(
                f"serve: ready on http://{c.host}:{c.port} ({time.monotonic() - self.started_at:.1f} s after the "
                "command started)"
            )

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn would re-raise a captured signal after stopping (exit status 128+n); a drain is a clean exit
        if self.gate.draining:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        log(f"serve: {signal.Signals(sig).name}: draining {self.gate.active} request(s), refusing new ones")
        self.gate.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.gate.draining and not self.should_exit:
            if self.gate.active == 0 or time.monotonic() > self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


HEAD_TIMEOUT_S = 10.0  # seconds a client may take to send a request's line and headers


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a limit on sending a request head: a client that opens a connection
    (or sends part of its headers) and stalls is disconnected, not held forever. (uvicorn's keep-alive
    timer stops at the first byte of a head.) The body's own limit is the app's (ServeConfig.body_timeout_s)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
        waiting_after = self.cycle  # a new head makes a new cycle
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out, waiting_after)

    def _head_timed_out(self, waiting_after) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()


def make_server(
    engine,
    target,
    config: ServeConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    started: float | None = None,
) -> DrainingServer:
    """The server over `engine` (started with the app, shut down with it); `.run()` blocks until it stops.
    started: time.monotonic() when the command began; the server then logs a ready line with the time taken."""
    gate = Gate()
    app = create_app(engine, target, config, gate)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        http=HeadTimeoutProtocol,
    )
    return DrainingServer(uv_config, gate, drain_timeout=config.request_timeout, started=started)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for tests and load tests on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
