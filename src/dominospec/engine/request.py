"""What a caller hands the engine and gets back: a request, a handle to wait on or cancel, a result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decode.result import tokens_per_cycle
from ..errors import DominoError
from ..sampling import SamplingConfig


class EngineFull(DominoError):
    """submit() while max_queue requests already wait for a slot."""


@dataclass
class EngineRequest:
    prompt_ids: list[int]  # already chat-templated / tokenized
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None  # None: drawn from torch's global generator (decode/step.py make_generator)
    eos_ids: list[int] | None = None  # None: the target's own EOS ids
    on_tokens: Callable[..., None] | None = None  # engine thread; committed tokens in order
    # on_tokens(tokens, sources, verified): each token's source (decode.result.SOURCES) and the drafts the
    # target checked in the cycle that committed them (0 for the prompt's first token); one call per cycle
    marks: bool = False
    speculative: bool = True  # False: this request's rows propose nothing (plain decoding in any engine)
    on_finish: Callable[[RequestResult], None] | None = None  # engine thread; once


@dataclass
class RequestResult:
    request_id: int
    tokens: list[int]  # new tokens only
    prompt_len: int
    finish_reason: str  # "stop" (EOS) | "length" | "cancelled" | "error"
    error: str | None = None
    cycles: int = 0  # speculative cycles (0 for plain)
    accepted: list[int] = field(default_factory=list)  # per cycle: drafts accepted
    verified: list[int] = field(default_factory=list)  # per cycle: drafts verified
    committed: list[int] = field(default_factory=list)  # per cycle: tokens committed (cut at EOS / budget)
    sources: list[str] = field(default_factory=list)  # per token: "drafter" | "lookup" | "target"
    queued_s: float = 0.0  # submit -> admitted to a slot
    ttft_s: float | None = None  # submit -> first token
    total_s: float = 0.0  # submit -> finish

    @property
    def tau(self) -> float | None:
        """Tokens committed per cycle (decode/result.py tokens_per_cycle); None without speculative cycles."""
        return tokens_per_cycle(self.committed) if self.committed else None


class RequestHandle:
    """The caller's side of one request: wait for it, or cancel it (both thread-safe)."""

    def __init__(self, request_id: int, wake: Callable[[], None]):
        self.id = request_id
        self._wake = wake
        self._event = threading.Event()
        self._result: RequestResult | None = None
        self.cancelled = False

    def cancel(self) -> None:
        """The slot is freed at the engine's next step; on_finish sees finish_reason "cancelled"."""
        self.cancelled = True
        self._wake()

    def wait(self, timeout: float | None = None) -> RequestResult:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._event.set()
