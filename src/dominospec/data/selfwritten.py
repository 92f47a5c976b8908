"""Prompts written by the target itself: `--prompts self:N`.

With no hub, the builtin pool is finite. Here the target gets the chat template opened at a user
turn, with a short opening ("Write a Python function that", "A train leaves", ...) so topics
spread over code, math and chat in the builtin pool's proportions, and writes the rest of the
question; prepare-data then lets it answer as usual. Questions that did not end their turn,
that are very short, very long or repetitive, that hold template tokens, or that repeat an
earlier one (case and spacing ignored) are dropped; generation continues until N are kept or
the attempts run out (reported).
"""

from __future__ import annotations

import random

from ..errors import DominoError
from ..log import log
from .prompts import Conversation

OPENINGS = {
    "code": [
        "Write a Python function that",
        "How do I",
        "In Python, what is the difference between",
        "Write a program that",
        "Write a SQL query that",
        "Implement a class that",
        "What is the time complexity of",
        "Write a shell command that",
    ],
    "math": [
        "A train leaves",
        "Solve for x:",
        "A store sells",
        "What is the probability that",
        "Calculate",
        "A rectangle has",
        "If a recipe needs",
        "Prove that",
        "How many ways can",
        "Sarah has",
    ],
    "chat": [
        "Explain",
        "What are the main causes of",
        "Give me tips on",
        "Write a short story about",
        "Compare",
        "Summarize the idea of",
        "What should I consider when",
        "Describe",
        "Why do",
        "Write an email to",
    ],
}
MIX = {"code": 40, "math": 35, "chat": 25}
MIN_WORDS, MAX_CHARS = 5, 600


def self_written_prompts(
    target, n: int, seed: int = 0, batch_size: int = 32, max_tokens: int = 96, report=None
) -> list[Conversation]:
    """n distinct questions written by `target`, ids self-<kind>:<i>, deterministic in seed."""
    report = report or log
    if n < 1:
        raise DominoError(f"self:{n}: N must be at least 1")
    eos = set(target.eos_ids)
    rng = random.Random(seed)
    kinds = [k for k, w in MIX.items() for _ in range(w)]
    out: list[Conversation] = []
    seen: set[str] = set()
    dropped = attempts = 0
    while len(out) < n and attempts < 4 * n + batch_size:
        batch = []
        for _ in range(batch_size):
            kind = rng.choice(kinds)
            batch.append((kind, rng.choice(OPENINGS[kind])))
        answers = target.sample_batch(
            [target.open_user_turn(o + " ") for _, o in batch],
            max_tokens,
            temperature=1.0,
            top_p=0.95,
            seed=rng.randrange(2**62),
        )
        attempts += batch_size
        for (kind, opening), ids in zip(batch, answers):
            text = f"{opening} {target.decode(ids).strip()}".strip()
            key = " ".join(text.lower().split())
            if not ids or ids[-1] not in eos or not _usable(text) or key in seen:
                dropped += 1
                continue
            seen.add(key)
            out.append(Conversation((text,), f"self-{kind}:{len(out)}"))
            if len(out) == n:
                break
    report(
        f"self:{n}: the target wrote {len(out)} usable prompts in {attempts} attempts ({dropped} dropped: "
        "unfinished, too short or long, repetitive, or repeated)"
    )
    if not out:
        raise DominoError(f"self:{n}: the target wrote no usable prompt")
    return out


def _usable(text: str) -> bool:
    words = text.split()
    if len(words) < MIN_WORDS or len(text) > MAX_CHARS or "<|" in text:
        return False
    return len(set(words)) >= 0.5 * len(words)  # not a loop of the same few words
