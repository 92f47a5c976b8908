"""Sampling settings, logit warping and the one acceptance function (`accept_drafts`).

Greedy: a draft is accepted while it equals the target's argmax, so the output is token for
token what plain greedy decoding gives. Sampling: Leviathan/Chen rejection sampling against the
distribution each draft was really drawn from (`accept_rejection`, per row), so the output is
distributed as the target's. `accept_drafts` applies both to every row of a step in one call.
Warping (temperature, top-k, top-p) is one function, applied alike to target and draft.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import DominoError


def check_sampling(temperature: float, top_k: int, top_p: float, prefix: str = "") -> None:
    """The one validation of sampling numbers (CLI flags and data-set settings alike)."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise DominoError(f"{prefix}temperature must be a finite number >= 0, got {temperature}")
    if not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise DominoError(f"{prefix}top-p must be in (0, 1], got {top_p}")
    if int(top_k) != top_k or top_k < 0:
        raise DominoError(f"{prefix}top-k must be an integer >= 0, got {top_k}")


# Settings this small are greedy. logits / T overflows float32 once T < |logit| / 3.4e38 (and a T
# under float32's range rounds to 0), which turns the softmax into NaN; long before that every logit
# gap a model produces already gives a one-hot distribution. A top_p this small (float32 rounds it
# to 0 below 1e-45) keeps only the most likely token, which is the argmax.
MIN_TEMPERATURE = 1e-20
MIN_TOP_P = 1e-20


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy; (0, MIN_TEMPERATURE) is made 0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off; (0, MIN_TOP_P) makes the settings greedy

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.temperature < MIN_TEMPERATURE or self.top_p < MIN_TOP_P:  # the one place of this rule
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_probs(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p; the same function for target and draft. [..., V]."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def pick_per_row(logits: torch.Tensor, samplings, gens) -> tuple[torch.Tensor, list]:
    """Row r of logits [R, ..., V] -> (picks [R, ...], the distribution row r was drawn from, or None where
    greedy): the argmax, or a draw from warp_probs with gens[r], rows in order, each from its own generator."""
    if all(s.greedy for s in samplings):
        return logits.argmax(-1), [None] * logits.shape[0]  # one op for every row (the same argmaxes)
    picks, dists = [], []
    for r, (s, g) in enumerate(zip(samplings, gens)):
        if s.greedy:
            picks.append(logits[r].argmax(-1))
            dists.append(None)
        else:
            p = warp_probs(logits[r], s)
            picks.append(sample(p, g))
            dists.append(p)
    return torch.stack(picks), dists


CANDIDATES = 256  # tokens the fast path of sample_rows looks at


def sample_rows(logits: torch.Tensor, s: SamplingConfig, gens: list) -> list[int]:
    """One token per row of logits [R, V], row r drawn with gens[r], from exactly warp_probs' distribution."""
    if s.greedy:
        return logits.argmax(-1).tolist()
    fast = candidate_probs(logits, s)
    if fast is None:
        return _sample_rows_dense(logits, s, gens)
    probs, idx = fast
    return [int(idx[r, torch.multinomial(probs[r], 1, generator=g)]) for r, g in enumerate(gens)]


def candidate_probs(logits: torch.Tensor, s: SamplingConfig, k: int = CANDIDATES):
    """warp_probs restricted to each row's top k tokens: (probs [R, k], token ids [R, k]), or None.

    Sorting the whole vocabulary for top-p costs more than a batched decode step; but a token
    outside the top k can only survive top-p when those hold less than top_p of the mass (or
    top-k when top_k >= k, or ties at the k-th logit). None when any row is in such a case: the
    caller then takes the full path. Otherwise the (unnormalised) shares are warp_probs' exactly.
    """
    x = logits.float() / s.temperature
    V = x.shape[-1]
    k = min(k, V)
    vals, idx = torch.topk(x, k, dim=-1)  # [R, k], descending
    if s.top_k and s.top_k < V:
        if s.top_k >= k:
            return None
        kth = vals[:, s.top_k - 1 : s.top_k]
        if k < V and bool((vals[:, -1:] >= kth).any()):  # ties with the k-th run past the candidates
            return None
        vals = vals.masked_fill(vals < kth, float("-inf"))
        total = torch.logsumexp(vals, dim=-1, keepdim=True)  # the top-k set lies inside the candidates
    else:
        if k < V and s.top_p >= 1.0:  # nothing cuts the tail
            return None
        total = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(vals - total)  # [R, k]: each candidate's share of the whole (top-k-masked) row
    if s.top_p < 1.0:
        if k < V and bool((probs.sum(-1) < s.top_p).any()):
            return None
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        probs = probs.masked_fill(before >= s.top_p, 0.0)
    return probs, idx


def _sample_rows_dense(logits: torch.Tensor, s: SamplingConfig, gens: list) -> list[int]:
    probs = warp_probs(logits, s)
    return [int(torch.multinomial(probs[r], 1, generator=g)) for r, g in enumerate(gens)]


def accept_rejection(
    drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, gen: torch.Generator | None
) -> tuple[int, int]:
    """Leviathan/Chen rejection sampling.

    drafts [b]; draft_probs [b, V]: the distributions the drafts were really sampled from;
    target_probs [b+1, V], warped like the drafts. Returns (accepted count, next token).
    """
    b = drafts.shape[0]
    idx = torch.arange(b, device=drafts.device)
    p_t = target_probs[idx, drafts]
    p_d = draft_probs[idx, drafts]
    u = torch.rand(b, generator=gen, device=drafts.device)
    ok = (u * p_d < p_t).int().cumprod(0)  # u < p_t/p_d without dividing by zero
    n = int(ok.sum())
    if n == b:
        return n, int(sample(target_probs[b], gen))
    residual = (target_probs[n] - draft_probs[n]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[n]
    return n, int(sample(residual, gen))


def accept_drafts(
    drafts: torch.Tensor,
    cu_num_drafts: Sequence[int],
    target_logits: torch.Tensor,
    first_logit: Sequence[int],
    draft_probs: Sequence[torch.Tensor | None],
    samplings: Sequence[SamplingConfig],
    gens: Sequence[torch.Generator | None],
    rule: Callable = accept_rejection,
) -> tuple[list[int | None], list[int | None], list[Exception | None]]:
    """The acceptance of every row's drafts in one call, greedy and sampled rows alike (vLLM's flattened form).

    drafts [N]: every row's verified drafts, concatenated; row r's are drafts[cu_num_drafts[r]:cu_num_drafts[r+1]]
    (k_r of them; cu_num_drafts [R+1]). target_logits [T, V]: row r's k_r + 1 positions (one per draft, then the
    bonus) start at first_logit[r] ([R]; cu_num_drafts[r] + r when the logits are flattened too, r * S for a
    padded [R, S, V] batch viewed as [R * S, V]). draft_probs [R]: row r's [k_r, V] draft distributions (None for
    a greedy row). Returns (accepted n [R], the target's next token [R], error [R]).

    A greedy row accepts while its drafts equal the target's argmax (one argmax over every position), so its
    output is token for token plain greedy decoding's. A sampled row runs `rule`, the per-row rejection sampler
    (accept_rejection: the reference the chi-square tests pin), with its own generator, rows in order, so each
    draws exactly what it would alone. A row whose sampling raises gets its exception (n, token None): it fails
    alone. rule: the sampled rows' acceptance (a test passes a wrong one to show its harness has power).
    """
    greedy = [s.greedy for s in samplings]
    choice = target_logits.argmax(-1).tolist() if any(greedy) else None  # [T] the target's own picks
    flat = drafts.tolist() if any(greedy) else None
    ns, nxts, errors = [], [], []
    for r, g in enumerate(greedy):
        lo, hi, at = cu_num_drafts[r], cu_num_drafts[r + 1], first_logit[r]
        if g:
            n = 0
            while lo + n < hi and choice[at + n] == flat[lo + n]:
                n += 1
            ns.append(n)
            nxts.append(choice[at + n])
            errors.append(None)
            continue
        k = hi - lo
        logits = target_logits[at : at + k + 1]  # [k+1, V]
        probs = draft_probs[r] if draft_probs[r] is not None else logits[:0]
        try:
            n, nxt = rule(drafts[lo:hi], probs, warp_probs(logits, samplings[r]), gens[r])
            err = None
        except Exception as exc:  # e.g. a distribution torch cannot sample from
            n, nxt, err = None, None, exc
        ns.append(n)
        nxts.append(nxt)
        errors.append(err)
    return ns, nxts, errors


def acceptance_rate(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """1 - TV(p_d, p_t): the chance rejection sampling keeps a draft drawn from p_d.

    p_t may be restricted to a draft vocabulary; its missing mass then counts as disagreement.
    """
    return 1 - 0.5 * ((p_d - p_t).abs().sum(-1) + (1 - p_t.sum(-1)))
