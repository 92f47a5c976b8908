"""How much of the target's context a prompt leaves for its answer: the one place these limits live.

`Target.max_positions` is the context (None: unknown, and then nothing is capped). A prompt is
usable when it leaves at least MIN_ANSWER_TOKENS positions for the answer; an answer is cut where
the context ends. Text is measured in characters before it is tokenized: no token stands for more
than `max_token_chars` characters (the longest vocabulary entry), so a text longer than the room
times that bound cannot fit and is refused without paying for tokenizing it (a 1 MB line costs
nothing).

One rule, "prompt + answer must fit", three documented behaviours:
  batch 1 (`generate_*`, `dominospec generate`, the transformers hook): max_new_tokens is capped at what
      the context leaves, with a note in GenerationResult.notes; no room at all is a DominoError
  the engine (Engine.submit): a request that does not fit its slot (Engine.context) is a DominoError
  the server: the same count as the engine's, refused with HTTP 400 `context_length_exceeded`; without
      max_tokens the answer gets what the context leaves
"""

from __future__ import annotations

from collections.abc import Callable

MIN_ANSWER_TOKENS = 16


def answer_room(max_positions: int | None, prompt_len: int) -> int | None:
    """Positions left after a prompt of `prompt_len` tokens; None when the context is unknown."""
    return None if max_positions is None else max_positions - prompt_len


def cap_new_tokens(max_new_tokens: int, prompt_len: int, max_positions: int | None) -> int:
    """`max_new_tokens`, lowered so that prompt and answer fit the context (never below 0)."""
    room = answer_room(max_positions, prompt_len)
    return max_new_tokens if room is None else max(0, min(max_new_tokens, room))


def prompt_too_long(n_tokens: int, max_positions: int | None) -> str | None:
    """Why a prompt of `n_tokens` cannot be answered within the context, or None when it can."""
    if max_positions is None or n_tokens + MIN_ANSWER_TOKENS <= max_positions:
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
    if max_positions is not None and max_token_chars:
        most_chars = (max_positions - MIN_ANSWER_TOKENS) * max_token_chars
        if len(text) > most_chars:
            return None, (
                f"has {len(text)} characters; the target's context of {max_positions} positions "
                f"holds at most {most_chars} (no token covers more than {max_token_chars}) with room "
                f"for a {MIN_ANSWER_TOKENS}-token answer"
            )
    ids = encode(text)
    reason = prompt_too_long(len(ids), max_positions)
    return (None, reason) if reason else (ids, None)
