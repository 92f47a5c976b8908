"""Prompt lookup: propose the continuation of the latest earlier occurrence of the last few tokens.

Summaries, answers over a retrieved document and code edits copy long runs of the prompt; a
lookup proposer finds them for free. The history (prompt + every committed token) is indexed
incrementally: after each token, the n-grams ending just before it (n = min_ngram..max_ngram) map to
the position that follows them, so the longest suffix match is a few dictionary reads per cycle.

A lookup draft is a certainty: its draft distribution is one-hot at the copied token, which the
rejection sampler handles exactly (accept with probability p_t(d); on rejection sample from p_t with
d removed). Its confidence logits are the running acceptance by block position of earlier lookup
cycles, known before the target sees this cycle, so a verify-length policy may read them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import DominoError
from ..sampling import SamplingConfig
from .rollout import Proposal

LOOKUP_BLOCK_SIZE = 8  # drafts per cycle of the lookup proposer alone
HYBRID_MIN_MATCH = 3  # a hybrid takes the lookup continuation from a suffix match this long


class PromptLookup:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, min_match: int = HYBRID_MIN_MATCH):
        if not 1 <= min_ngram <= max_ngram:
            raise DominoError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if min_match < 1:
            raise DominoError(f"--lookup-min-match must be at least 1, got {min_match}")
        self.max_ngram, self.min_ngram, self.min_match = max_ngram, min_ngram, min_match
        self.start([])

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Forget everything; index the prompt."""
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.judged: list[int] = []  # lookup cycles that reached block position k
        self.passed: list[int] = []  # ... and had draft k accepted
        self.extend(prompt_ids)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            end = len(self.history)  # the n-grams ending at `end - 1` are now followed by t
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.index[tuple(self.history[end - n : end])] = end
            self.history.append(int(t))

    def match(self) -> tuple[int, int]:
        """(start of the continuation, match length) for the longest suffix seen before; (-1, 0) if none."""
        h = self.history
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            start = self.index.get(tuple(h[len(h) - n :]))
            if start is not None:
                return start, n
        return -1, 0

    def propose(self, b: int, vocab_size: int, sampling: SamplingConfig, device=None) -> tuple[Proposal | None, int]:
        """(up to b copied drafts, match length); (None, 0) when the last tokens never occurred before."""
        start, n = self.match()
        if start < 0 or b < 1:
            return None, n
        drafts = torch.tensor(self.history[start : start + b], dtype=torch.long, device=device)
        probs = None
        if not sampling.greedy:  # one-hot: the draft was chosen with certainty
            probs = torch.zeros(len(drafts), vocab_size, device=device)
            probs[torch.arange(len(drafts), device=device), drafts] = 1.0
        return Proposal(drafts, probs, self.confidence_logits(len(drafts), device), source="lookup"), n

    def confidence_logits(self, b: int, device=None) -> torch.Tensor:
        """logit of the running P(lookup draft k accepted | drafts < k were), with a uniform prior."""
        out = []
        for k in range(b):
            judged = self.judged[k] if k < len(self.judged) else 0
            passed = self.passed[k] if k < len(self.passed) else 0
            p = (passed + 1) / (judged + 2)
            out.append(math.log(p / (1 - p)))
        return torch.tensor(out, dtype=torch.float64, device=device)

    def record(self, verified: int, accepted: int) -> None:
        """The outcome of a lookup cycle: positions 1..accepted+1 judged (while verified), 1..accepted passed."""
        while len(self.judged) < verified:
            self.judged.append(0)
            self.passed.append(0)
        for k in range(min(verified, accepted + 1)):
            self.judged[k] += 1
            self.passed[k] += k < accepted
