"""Per-request speculation metrics and per-token source marks: the `spec_metrics` extension.

A request that sends `"spec_metrics": true` gets `usage.spec_metrics` for the answer it was sent
(cut where the answer was cut: EOS, a stop string, max_tokens) and, in each choice, `spec_tokens`:
the answer's text as [text, source] pieces, one per token that has text. A source is "drafter" (an
accepted drafter draft), "lookup" (an accepted prompt-lookup copy) or "target" (the target's own
token: one per cycle). Every cycle ends with the target's token, so tokens = accepted + cycles,
except that an answer cut inside a cycle's accepted drafts lacks that cycle's target token (one less).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..decode.result import SOURCES, tokens_per_cycle


def cycle_acceptance(sources: Sequence[str]) -> list[int]:
    """Accepted drafts per cycle, read from the token marks: each "target" mark closes a cycle, and
    trailing draft marks are a cycle cut before its target token."""
    per_cycle, run = [], 0
    for s in sources:
        if s == "target":
            per_cycle.append(run)
            run = 0
        else:
            run += 1
    if run:
        per_cycle.append(run)
    return per_cycle


def spec_metrics(sources: Sequence[str], verified: Sequence[int]) -> dict:
    """usage.spec_metrics of an answer.

    sources: the answer's tokens' marks; verified: drafts the target checked in each cycle that
    committed tokens, in order (the prompt's forward, which drew the first token, is cycle 0 with 0).
    """
    accepted = cycle_acceptance(sources)
    cycles = len(accepted)
    committed = [a + 1 for a in accepted]  # each cycle's tokens: its accepted drafts and the target's token
    if sources and sources[-1] != "target":
        committed[-1] -= 1  # a cycle cut inside its drafts lacks its target token
    drafted = sum(verified[:cycles])
    block = max([*verified[:cycles], *accepted, 0])
    return {
        "cycles": cycles,  # target forward passes that gave the answer tokens, the prompt's included
        "drafted": drafted,  # drafts the target checked in those cycles
        "accepted": sum(accepted),  # accepted drafts in the answer
        "tau": tokens_per_cycle(committed) if cycles else None,  # answer tokens per cycle
        "accepted_by_position": [sum(a >= k for a in accepted) for k in range(1, block + 1)],
        "source_counts": {name: sum(s == name for s in sources) for name in SOURCES},
    }


def marked_pieces(pieces: Sequence[tuple[str, int]], sources: Sequence[str]) -> list[list[str]]:
    """(text, token index) pieces -> [text, source] pairs (spec_tokens)."""
    return [[text, sources[i]] for text, i in pieces]
