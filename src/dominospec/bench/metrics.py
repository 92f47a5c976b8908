"""Benchmark metrics: pure functions over per-prompt runs and their per-cycle records.

Nothing here touches a model or a clock. `runner.py` turns each generation into a `PromptRun`
and everything reported (tokens/s, speedup, tau, acceptance by block position, where the
time goes, losslessness) is computed from those records, so each number can be checked on
hand-made records in a unit test.

The per-cycle lists `accepted` and `committed` mean what they mean in decode/result.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..decode.result import tokens_per_cycle

REFERENCE = "ar"  # plain decoding: what speedup and losslessness are measured against


@dataclass
class PromptRun:
    """One method on one prompt: the output tokens, timings and (speculative only) cycle records."""

    method: str
    dataset: str
    prompt_index: int  # index inside its dataset
    tokens: list[int]  # new tokens only
    total_s: float  # wall clock of the whole generation, prefill included
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accepted: list[int] = field(default_factory=list)  # per cycle
    committed: list[int] = field(default_factory=list)  # per cycle
    block_size: int = 0  # drafts per cycle; 0 for methods without cycles
    verified: list[int] = field(default_factory=list)  # per cycle: drafts the target checked
    lookup_cycles: int = 0  # cycles whose drafts prompt lookup copied
    draft_skipped: int = 0  # cycles the cost policy ran as a plain decode step (drafting did not pay)
    prompt_len: int = 0  # prompt tokens (where the run's context starts)
    nodraft_steps: int = 0  # steps that verified no draft (every step of plain decoding), and their seconds:
    nodraft_draft_s: float = 0.0  # ... proposing and observing
    nodraft_verify_s: float = 0.0  # ... the target forward, acceptance and rollback
    nodraft_s: float = 0.0  # ... the whole step
    timed_out: bool = False  # stopped at the per-prompt time limit: no output, counted apart

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def cycles(self) -> int:
        return len(self.accepted)

    @classmethod
    def from_generation(cls, res, method: str, dataset: str, prompt_index: int) -> PromptRun:
        """From a decoding.GenerationResult."""
        return cls(
            method=method,
            dataset=dataset,
            prompt_index=prompt_index,
            tokens=list(res.tokens),
            total_s=res.total_s,
            prefill_s=res.prefill_s,
            draft_s=res.draft_s,
            verify_s=res.verify_s,
            accepted=list(res.accepted),
            committed=list(res.committed),
            block_size=res.block_size,
            verified=list(res.verified),
            lookup_cycles=res.lookup_cycles,
            draft_skipped=getattr(res, "draft_skipped", 0),
            prompt_len=getattr(res, "prompt_len", 0),
            nodraft_steps=getattr(res, "nodraft_steps", 0),
            nodraft_draft_s=getattr(res, "nodraft_draft_s", 0.0),
            nodraft_verify_s=getattr(res, "nodraft_verify_s", 0.0),
            nodraft_s=getattr(res, "nodraft_s", 0.0),
        )


# ----- acceptance by block position -----


def position_counts(
    accepted: Sequence[int], block_size: int, verified: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """(judged, accepted) counts for block positions k = 1..block_size.

    Position k is judged in a cycle iff draft k was verified (verified >= k; default: every draft is)
    and drafts 1..k-1 were all accepted (accepted >= k-1); it is accepted iff accepted >= k.
    """
    judged = [0] * block_size
    passed = [0] * block_size
    verified = verified if verified else [block_size] * len(accepted)
    for a, v in zip(accepted, verified):
        if a < 0 or a > v or v > block_size:
            raise ValueError(f"accepted count {a} of {v} verified drafts outside 0..{block_size}")
        for k in range(1, v + 1):
            if a >= k - 1:
                judged[k - 1] += 1
            if a >= k:
                passed[k - 1] += 1
    return judged, passed


def conditional_acceptance(
    accepted: Sequence[int], block_size: int, verified: Sequence[int] | None = None
) -> list[float | None]:
    """P(accept k | 1..k-1 accepted, k verified) per position; None where position k was never judged."""
    judged, passed = position_counts(accepted, block_size, verified)
    return [p / j if j else None for j, p in zip(judged, passed)]


def unconditional_acceptance(accepted: Sequence[int], block_size: int) -> list[float | None]:
    """P(drafts 1..k all accepted) per position, over all cycles; None when there are no cycles."""
    _, passed = position_counts(accepted, block_size)
    n = len(accepted)
    return [p / n if n else None for p in passed]


# ----- speed -----


def tokens_per_second(new_tokens: Iterable[int], seconds: Iterable[float]) -> float:
    """Aggregate throughput: total new tokens / total time (not a mean of per-prompt rates)."""
    total_t = sum(seconds)
    return sum(new_tokens) / total_t if total_t > 0 else 0.0


def speedup(tps: float, reference_tps: float | None) -> float | None:
    return tps / reference_tps if reference_tps else None


def time_split(runs: Sequence[PromptRun]) -> dict:
    """Where the time goes, in ms: per prompt for prefill, per cycle for draft / verify / the rest.

    "host" is what is left of the decode loop after drafting and verifying
    (total - prefill - draft - verify): acceptance, cache bookkeeping, Python.
    """
    n = len(runs)
    cycles = sum(r.cycles for r in runs)
    tokens = sum(r.new_tokens for r in runs)
    total = sum(r.total_s for r in runs)
    prefill = sum(r.prefill_s for r in runs)
    prompt_tokens = sum(r.prompt_len for r in runs)
    draft = sum(r.draft_s for r in runs)
    verify = sum(r.verify_s for r in runs)
    out = {
        "cycles": cycles,
        "total_s": total,
        "prefill_ms_per_prompt": 1e3 * prefill / n if n and prefill > 0 else None,  # None: not measured
        "prompt_tok_per_s": prompt_tokens / prefill if prefill > 0 and prompt_tokens else None,
        "ms_per_token": 1e3 * total / tokens if tokens else None,
        "draft_ms_per_cycle": None,
        "verify_ms_per_cycle": None,
        "host_ms_per_cycle": None,
    }
    if not cycles and prefill > 0 and tokens > n:
        # plain decoding: the first token comes out of the prefill, each later one from one step
        out["decode_ms_per_step"] = 1e3 * (total - prefill) / (tokens - n)
    nodraft = sum(r.nodraft_steps for r in runs)
    if nodraft:  # a step that verified no draft, by part (ms): plain decoding's step, or a cycle that drafted nothing
        whole = sum(r.nodraft_s for r in runs)
        out["nodraft_steps"] = nodraft
        out["nodraft_draft_ms"] = 1e3 * sum(r.nodraft_draft_s for r in runs) / nodraft
        out["nodraft_verify_ms"] = 1e3 * sum(r.nodraft_verify_s for r in runs) / nodraft
        out["nodraft_ms"] = 1e3 * whole / nodraft
        out["nodraft_host_ms"] = out["nodraft_ms"] - out["nodraft_draft_ms"] - out["nodraft_verify_ms"]
    if cycles:
        out["draft_ms_per_cycle"] = 1e3 * draft / cycles
        out["verify_ms_per_cycle"] = 1e3 * verify / cycles
        out["host_ms_per_cycle"] = 1e3 * (total - prefill - draft - verify) / cycles
    return out


# ----- what the device profile predicts for the same cycles -----


def _verify_row(profile: dict, context: float) -> dict[int, float]:
    """k new tokens -> seconds of one target forward, at the profiled context closest to `context`."""
    ctx = min(profile["verify"], key=lambda c: abs(int(c) - context))
    row = profile["verify"][ctx]
    return dict(zip(row["k"], row["seconds"]))


def profile_prediction(runs: Sequence[PromptRun], profile: dict, draft_b: int | None = None) -> dict:
    """The device profile's price for the cycles these runs ran, in ms, next to what the loop measured.

    verify: one forward over verified[i] + 1 tokens per cycle, at the profiled context closest to the run's
    middle (prompt + half its answer); None if a cycle verified more than the profile covers.
    draft: the profile's draft cycle at draft_b drafts for every cycle the drafter ran (not skipped by the cost
    policy, not a prompt-lookup copy), spread over all cycles as the measured figure is; None without draft_b.
    decode step: one forward over one token, per token after the first (plain decoding's step).
    """
    verify_s, cycles, covered = 0.0, 0, True
    step_s, steps = 0.0, 0
    drafted = 0
    for r in runs:
        row = _verify_row(profile, r.prompt_len + r.new_tokens / 2)
        for v in r.verified or [r.block_size] * r.cycles:
            covered = covered and v + 1 in row
            verify_s += row.get(v + 1, 0.0)
        cycles += r.cycles
        drafted += r.cycles - r.draft_skipped - r.lookup_cycles
        if not r.cycles and r.new_tokens > 1:
            step_s += row[1] * (r.new_tokens - 1)
            steps += r.new_tokens - 1
    draft = profile.get("draft") or {}
    draft_s = dict(zip(draft.get("b", []), draft.get("seconds", []))).get(draft_b)
    return {
        "profile_verify_ms_per_cycle": 1e3 * verify_s / cycles if cycles and covered else None,
        "profile_draft_ms_per_cycle": 1e3 * draft_s * drafted / cycles if cycles and draft_s else None,
        "profile_decode_ms_per_step": 1e3 * step_s / steps if steps else None,
    }


# ----- losslessness -----


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatches(runs: Sequence[PromptRun], reference: dict[tuple[str, int], Sequence[int]]) -> list[dict]:
    """Every run whose output differs from the reference output of the same prompt."""
    found = []
    for r in runs:
        ref = reference.get((r.dataset, r.prompt_index))  # None: the reference timed out on that prompt
        pos = None if ref is None else first_difference(r.tokens, ref)
        if pos is not None:
            found.append({"method": r.method, "dataset": r.dataset, "prompt_index": r.prompt_index, "first_diff": pos})
    return found


# ----- one method, one group of prompts -----


def summarize(
    runs: Sequence[PromptRun],
    reference_tps: float | None = None,
    reference_tokens: dict[tuple[str, int], Sequence[int]] | None = None,
) -> dict:
    """All reported numbers for one method over `runs` (one dataset, or all of them).

    reference_tps: the reference method's tokens/s on the same prompts (speedup is None without it).
    reference_tokens: (dataset, prompt_index) -> reference output; None means outputs are not
    compared (sampling), and lossless_mismatches is None.
    Runs stopped at the per-prompt time limit are counted (timed_out) and left out of every other figure.
    """
    timed_out = sum(r.timed_out for r in runs)
    runs = [r for r in runs if not r.timed_out]
    block = max((r.block_size for r in runs), default=0)
    accepted = [a for r in runs for a in r.accepted]
    committed = [c for r in runs for c in r.committed]
    tps = tokens_per_second((r.new_tokens for r in runs), (r.total_s for r in runs))
    diff = mismatches(runs, reference_tokens) if reference_tokens is not None else None
    verified = [v for r in runs for v in (r.verified or [r.block_size] * r.cycles)]
    out = {
        "tokens_per_s": tps,
        "speedup": speedup(tps, reference_tps),
        "tau": tokens_per_cycle(committed),
        "accept_conditional": conditional_acceptance(accepted, block, verified) if block else [],
        "accept_unconditional": unconditional_acceptance(accepted, block) if block else [],
        "lossless_mismatches": None if diff is None else len(diff),
        "num_prompts": len(runs),
        "timed_out": timed_out,
        "new_tokens": sum(r.new_tokens for r in runs),
        "block_size": block,
        # drafts the target checked per cycle (its forward covers one more), and those it rejected
        "verified_per_cycle": sum(verified) / len(verified) if verified else None,
        "wasted_per_cycle": (sum(verified) - sum(accepted)) / len(verified) if verified else None,
        "lookup_cycle_share": sum(r.lookup_cycles for r in runs) / len(accepted) if accepted else None,
        "draft_skipped_share": sum(r.draft_skipped for r in runs) / len(accepted) if accepted else None,
    }
    out.update(time_split(runs))
    if diff is not None:
        out["mismatched_prompts"] = diff
    return out
