"""How much of the target's context a prompt leaves for its answer: the one place these limits live.

`Target.max_positions` is the context (None: unknown, and then nothing is capped). A prompt is
usable when it leaves at least MIN_ANSWER_TOKENS positions for the answer; an answer is cut where
the context ends. Text is measured in characters before it is tokenized: no token stands for more
than `max_token_chars` characters (the longest vocabulary entry), so a text longer than the room
times that bound cannot fit and is refused without paying for tokenizing it (a 1 MB line costs
nothing).

One rule, "prompt + answer must fit": `fit_request` returns a request's budget or the parameter at fault,
and each surface only phrases it:
  batch 1 (`generate_*`, `dominospec generate`, the transformers hook): cap=True, max_new_tokens is capped at
      what the context leaves, with a note in GenerationResult.notes; no room at all is a DominoError
  the engine (Engine.submit): a request that does not fit its slot (Engine.context) is a DominoError
  the server: the same count as the engine's, refused with HTTP 400 `context_length_exceeded`; without
      max_tokens the answer gets what the context leaves
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MIN_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Fit:
    """How one request fits a context: the new tokens it gets, or the parameter at fault and why."""

    budget: int | None  # new tokens (None: refused, or measured in characters and not known before tokenizing)
    refused: str | None = None  # "prompt" or "max_tokens": the parameter that does not fit; None: it fits
    why: str | None = None  # refused: "empty" (no prompt token), "full" (no room left for an answer), "over"
    # (max_tokens asks for more than the context leaves), "below" (max_tokens < 1)
    capped: bool = False  # cap=True lowered the asked budget to what the context leaves


def fit_request(
    prompt: int,
    asked: int | None,
    context: int | None,
    *,
    cap: bool = False,
    token_chars: int | None = None,
    unbounded: int = 1024,
) -> Fit:
    """The one rule for a request of a `prompt`-token prompt asking for `asked` new tokens (None: as many as the
    context leaves, at least MIN_ANSWER_TOKENS) within `context` positions (None: unknown, nothing is refused;
    without asked the answer gets `unbounded`). cap: lower an asked budget that does not fit to what the context
    leaves (refused only when it leaves nothing). token_chars: `prompt` counts characters, before tokenizing,
    and no token covers more than token_chars of them; only what that bound proves is refused (budget None)."""
    if prompt == 0:
        return Fit(None, "prompt", "empty")
    if asked is not None and asked < 1:
        return Fit(None, "max_tokens", "below")
    if context is None:
        return Fit(None if token_chars else asked if asked is not None else unbounded)
    if token_chars:
        if asked is not None and asked >= context and not cap:
            return Fit(None, "max_tokens", "over")
        most = (context - (asked if asked is not None and not cap else MIN_ANSWER_TOKENS)) * token_chars
        return Fit(None, "prompt", "full") if prompt > most else Fit(None)
    room = context - prompt
    if asked is None:
        return Fit(room) if room >= MIN_ANSWER_TOKENS else Fit(None, "prompt", "full")
    if asked <= room:
        return Fit(asked)
    if cap:
        return Fit(room, capped=True) if room >= 1 else Fit(None, "prompt", "full")
    return Fit(None, "max_tokens", "over")


def answer_room(max_positions: int | None, prompt_len: int) -> int | None:
    """Positions left after a prompt of `prompt_len` tokens; None when the context is unknown."""
    return None if max_positions is None else max_positions - prompt_len


def cap_new_tokens(max_new_tokens: int, prompt_len: int, max_positions: int | None) -> int:
    """`max_new_tokens`, lowered so that prompt and answer fit the context (never below 0)."""
    room = answer_room(max_positions, prompt_len)
    return max_new_tokens if room is None else max(0, min(max_new_tokens, room))


def prompt_too_long(n_tokens: int, max_positions: int | None) -> str | None:
    """Why a prompt of `n_tokens` cannot be answered within the context, or None when it can."""
    if fit_request(n_tokens, None, max_positions).refused is None:
        return None
    return (
        f"has {n_tokens} tokens; the target's context of {max_positions} positions takes prompts of at "
        f"most {max_positions - MIN_ANSWER_TOKENS} tokens (room for a {MIN_ANSWER_TOKENS}-token answer)"
    )


def encode_if_fits(
    text: str, encode: Callable[[str], list[int]], max_positions: int | None, max_token_chars: int | None
) -> tuple[list[int] | None, str | None]:
    """(prompt ids, None), or (None, why the prompt cannot be answered within the context).

    `encode` turns the text into the full prompt (chat template included); it is not called for
    text that is too long by its character count alone.
    """
    if text and max_token_chars and fit_request(len(text), None, max_positions, token_chars=max_token_chars).refused:
        most_chars = (max_positions - MIN_ANSWER_TOKENS) * max_token_chars
        return None, (
            f"has {len(text)} characters; the target's context of {max_positions} positions "
            f"holds at most {most_chars} (no token covers more than {max_token_chars}) with room "
            f"for a {MIN_ANSWER_TOKENS}-token answer"
        )
    ids = encode(text)
    reason = prompt_too_long(len(ids), max_positions)
    return (None, reason) if reason else (ids, None)
