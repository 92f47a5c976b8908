"""What one generation reports: the tokens, per-cycle acceptance records and where the time went.

Two per-cycle lists carry different facts:
  accepted[i]  = drafts the target accepted in cycle i: the verification outcome, not cut by
                 EOS or the token budget. Acceptance by position is computed from it.
  committed[i] = tokens actually committed in cycle i (accepted drafts + the target's own token,
                 then cut at EOS / max-new-tokens). tau is computed from it.
  verified[i]  = drafts the target checked in cycle i (its forward covered verified[i] + 1 tokens);
                 verified - accepted of them were wasted.
and one per-token list:
  sources[j]   = where new token j came from: "drafter" (an accepted drafter draft), "lookup" (an
                 accepted prompt-lookup copy) or "target" (the target's own token, one per cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SOURCES = ("drafter", "lookup", "target")


def tokens_per_cycle(committed: Sequence[int]) -> float:
    """tau, the one definition: tokens committed per cycle (accepted drafts + the target's own token, cut
    at EOS and the budget). A run without draft cycles commits one token per target step: tau 1.0."""
    return sum(committed) / len(committed) if committed else 1.0


def expected_tokens(acceptance: Sequence[float], b: int) -> float:
    """The tau to expect for b drafts: 1 + sum_k prod_{i<=k} p_i, with p_i the conditional acceptance at
    position i (before any EOS or budget cut)."""
    tau, survive = 1.0, 1.0
    for p in list(acceptance)[:b]:
        survive *= p
        tau += survive
    return tau


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    prompt_len: int
    cycles: int = 0
    block_size: int = 0
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per new token: one of SOURCES
    lookup_cycles: int = 0  # cycles whose drafts were copied by prompt lookup
    draft_skipped: int = 0  # cycles run as a plain decode step because drafting did not pay (cost policy)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    # steps that verified no draft (plain decoding's every step; a speculative loop's cycles without a proposal):
    # how many, and their own draft / verify / whole-step seconds (what a cycle that drafts nothing costs)
    nodraft_steps: int = 0
    nodraft_draft_s: float = 0.0
    nodraft_verify_s: float = 0.0
    nodraft_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. "max_new_tokens capped at the context"

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float | None:
        """Tokens committed per cycle; None for plain decoding, which has no draft cycles to count."""
        return tokens_per_cycle(self.committed) if self.cycles else None

    @property
    def accepted_per_position(self) -> list[int]:
        """How many cycles had their draft at block position k (1-based) accepted."""
        return [sum(1 for a in self.accepted if a >= k) for k in range(1, self.block_size + 1)]

    @property
    def verified_per_cycle(self) -> float | None:
        return sum(self.verified) / len(self.verified) if self.verified else None

    @property
    def wasted_per_cycle(self) -> float | None:
        """Drafts the target checked and rejected, per cycle."""
        return (sum(self.verified) - sum(self.accepted)) / len(self.verified) if self.verified else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self, text: str | None = None) -> dict:
        return {
            "text": text,
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "tau": self.tau,
            "cycles": self.cycles,
            "accepted_per_position": self.accepted_per_position,
            "verified_per_cycle": self.verified_per_cycle,
            "wasted_per_cycle": self.wasted_per_cycle,
            "lookup_cycles": self.lookup_cycles,
            "draft_skipped": self.draft_skipped,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "prefill_s": self.prefill_s,
            "total_s": self.total_s,
            "nodraft_steps": self.nodraft_steps,
            "nodraft_s": self.nodraft_s,
            "notes": self.notes,
        }
