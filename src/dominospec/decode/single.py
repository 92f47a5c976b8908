"""Decoding at batch 1: the prompt's forward, then the shared step (step.py) for one row until done.

Plain decoding is the step with a proposer that proposes nothing; speculative decoding the step with
the drafter, prompt lookup or the hybrid of both, and a verify-length policy (schedule.py). The engine
(dominospec.engine) runs the same step for many rows with one ragged forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig, accept_rejection
from .lookup import PromptLookup
from .proposers import PlainProposer, make_proposer
from .result import GenerationResult
from .rollout import Proposal
from .schedule import VerifyPolicy
from .step import OneCache, SeqState, check_request, commit_first, make_generator, prefill, step


def fit_budget(target, prompt_ids: Sequence[int], max_new_tokens: int, notes: list[str]) -> int:
    """max_new_tokens capped so prompt and answer fit the target's context (step.check_request); the cap is noted."""
    limit, n = target.max_positions, len(prompt_ids)
    fit = check_request(prompt_ids, max_new_tokens, target.vocab_size, limit, cap=True)
    if fit.refused is not None:
        raise DominoError(
            f"the prompt has {n} tokens and fills the target's context of {limit} "
            "positions: there is no room for an answer"
        )
    if fit.capped:
        notes.append(
            f"max_new_tokens {max_new_tokens} capped at {fit.budget}: the prompt ({n} tokens) and "
            f"the answer must fit the target's context of {limit} positions"
        )
    return fit.budget


@torch.inference_mode()
def generate_autoregressive(
    target,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = 0,
    eos_ids: Sequence[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Plain decoding: the step with a proposer that proposes nothing (the reference for speed and losslessness)."""
    return decode(target, PlainProposer(), None, prompt_ids, max_new_tokens, sampling, seed, eos_ids, on_tokens)


@torch.inference_mode()
def generate_speculative(
    target,
    drafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = 0,
    block_size: int | None = None,
    use_head: bool = True,
    eos_ids: Sequence[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    verify: VerifyPolicy | None = None,
    lookup: PromptLookup | None = None,
    on_cycle: Callable[[Proposal, int, int], None] | None = None,
    marks: bool = False,
) -> GenerationResult:
    """Speculative decoding; output equals `generate_autoregressive` (greedy: token for token).

    Proposers: the drafter; prompt lookup alone (drafter=None, lookup given); or both, a hybrid that
    takes the lookup continuation when its suffix match has at least lookup.min_match tokens; neither:
    plain decoding. verify: how many of the proposed drafts the target checks each cycle (default: all
    of them). on_cycle(proposal, verified, accepted) sees every cycle with a proposal (calibration).
    marks: on_tokens(tokens, sources) with each token's source ("drafter", "lookup", "target").
    """
    if drafter is None and lookup is None:
        raise DominoError("speculative decoding needs a drafter, prompt lookup, or both")
    proposer = make_proposer(
        drafter, lookup is not None, block_size, use_head=use_head, vocab_size=target.vocab_size, device=target.device
    )
    layers = drafter.config.target_layer_ids if drafter is not None else None
    return decode(
        target,
        proposer,
        verify,
        prompt_ids,
        max_new_tokens,
        sampling,
        seed,
        eos_ids,
        on_tokens,
        lookup,
        on_cycle,
        layers,
        marks,
    )


def decode(
    target,
    proposer,
    verify: VerifyPolicy | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int | None,
    eos_ids: Sequence[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    lookup: PromptLookup | None = None,
    on_cycle: Callable[[Proposal, int, int], None] | None = None,
    layers: Sequence[int] | None = None,
    marks: bool = False,
    rule=accept_rejection,
) -> GenerationResult:
    """The batch-1 loop: prefill, then step([row]) until the row is done, timed. rule: the rejection sampler of
    sampled rows (sampling.accept_rejection; a test passes a wrong one to show its harness has power)."""
    dev = target.device
    b = proposer.block_size
    policy = verify or VerifyPolicy()
    policy.start()
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    res = GenerationResult(tokens=[], prompt_len=len(prompt_ids), block_size=b)
    budget = fit_budget(target, prompt_ids, max_new_tokens, res.notes)
    row = SeqState([int(t) for t in prompt_ids], budget, sampling, make_generator(seed, dev), eos, res, lookup)

    t0 = time.perf_counter()
    side = OneCache(target, max_len=res.prompt_len + budget + b + 1)
    proposer.claim(row)
    new = commit_first(row, prefill(row, side, proposer, len(row.prompt), layers), proposer)
    synchronize(dev)
    res.prefill_s = time.perf_counter() - t0
    if on_tokens:
        on_tokens(new, res.sources[-len(new) :]) if marks else on_tokens(new)
    while not row.done:
        t_step = time.perf_counter()
        out = step([row], proposer, policy, side, target.max_positions, layers, timed=True, rule=rule)
        if out.errors[0] is not None:
            raise out.errors[0]
        res.draft_s += out.draft_s
        res.verify_s += out.verify_s
        p, k, n = out.plan.proposals[0], out.plan.verify[0], out.accepted[0]
        if on_cycle and p is not None:
            on_cycle(p, k, n)
        new = out.new[0]
        if on_tokens and new:
            on_tokens(new, res.sources[-len(new) :]) if marks else on_tokens(new)
        if k == 0:  # a step that verified no draft: what it costs against a plain step
            res.nodraft_steps += 1
            res.nodraft_draft_s += out.draft_s
            res.nodraft_verify_s += out.verify_s
            res.nodraft_s += time.perf_counter() - t_step
    synchronize(dev)
    res.total_s = time.perf_counter() - t0
    return res
