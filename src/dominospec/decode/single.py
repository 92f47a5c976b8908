"""Decoding at batch 1: plain autoregressive and Domino speculative, with lossless acceptance.

The speculative loop is the shared step (step.py) run for one sequence:
  1. propose: a proposer (proposers.py): the drafter's backbone pass and head rollout, a copy from
     the context (prompt lookup), or the hybrid of both -> a Proposal of up to b drafts
  2. verify: the policy (schedule.py) picks k <= b from the drafts and their confidences; one
     target forward over [anchor, d_1..d_k] (k+1 positions)
  3. accept: greedy exact match, or rejection sampling against the draft's real distribution
  4. commit accepted drafts + one target token, roll the target cache back, tell the proposer
     (the drafter takes the committed rows' features into its cache).
The engine (dominospec.engine) runs the same step for many sequences with one ragged forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig, accept_rejection
from ..targets.context import cap_new_tokens
from .lookup import PromptLookup
from .propose import Proposal, draft_block
from .proposers import HybridProposer, make_proposer
from .result import GenerationResult
from .schedule import VerifyPolicy
from .step import SeqState, accept, block_tokens, commit, first_token, make_generator, rollback_length, start


def _check_prompt(prompt_ids: Sequence[int], max_new_tokens: int) -> torch.Tensor:
    if len(prompt_ids) == 0:
        raise DominoError("the prompt is empty (0 tokens)")
    if max_new_tokens < 1:
        raise DominoError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return torch.tensor([list(prompt_ids)], dtype=torch.long)


def _fit_budget(target, prompt_len: int, max_new_tokens: int, notes: list[str]) -> int:
    """max_new_tokens capped so prompt and answer fit the target's context; the cap is noted."""
    limit = target.max_positions
    budget = cap_new_tokens(max_new_tokens, prompt_len, limit)
    if budget < 1:
        raise DominoError(
            f"the prompt has {prompt_len} tokens and fills the target's context of {limit} "
            "positions: there is no room for an answer"
        )
    if budget < max_new_tokens:
        notes.append(
            f"max_new_tokens {max_new_tokens} capped at {budget}: the prompt ({prompt_len} tokens) and "
            f"the answer must fit the target's context of {limit} positions"
        )
    return budget


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
    """Plain decoding through the same adapter: the reference for speed and for losslessness."""
    dev = target.device
    ids = _check_prompt(prompt_ids, max_new_tokens).to(dev)
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    gen = make_generator(seed, dev)
    res = GenerationResult(tokens=[], prompt_len=ids.shape[1])
    max_new_tokens = _fit_budget(target, res.prompt_len, max_new_tokens, res.notes)
    t0 = time.perf_counter()
    cache = target.new_cache(max_len=ids.shape[1] + max_new_tokens + 1)
    out = target.forward(ids, cache, last_logits_only=True, with_features=False)
    tok = first_token(out.logits[0, -1], sampling, gen)
    synchronize(dev)
    res.prefill_s = time.perf_counter() - t0
    while True:
        res.tokens.append(tok)
        res.sources.append("target")
        if on_tokens:
            on_tokens([tok])
        if tok in eos or len(res.tokens) >= max_new_tokens:
            break
        out = target.forward(torch.tensor([[tok]], device=dev), cache, with_features=False)
        tok = first_token(out.logits[0, -1], sampling, gen)
    synchronize(dev)
    res.total_s = time.perf_counter() - t0
    return res


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
    takes the lookup continuation when its suffix match has at least lookup.min_match tokens.
    verify: how many of the proposed drafts the target checks each cycle (default: all of them).
    on_cycle(proposal, verified, accepted) sees every cycle (calibration records it).
    marks: on_tokens(tokens, sources) with each token's source ("drafter", "lookup", "target").
    """
    dev = target.device
    proposer = make_proposer(
        drafter,
        lookup is not None,
        block_size,
        use_head=use_head,
        vocab_size=target.vocab_size,
        device=dev,
        draft_one=lambda *args: draft_block(*args),  # this module's name, looked up per call (tests wrap it)
    )
    b = proposer.block_size
    verify = verify or VerifyPolicy()
    verify.start()
    ids = _check_prompt(prompt_ids, max_new_tokens).to(dev)
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    res = GenerationResult(tokens=[], prompt_len=ids.shape[1], block_size=b)
    budget = _fit_budget(target, res.prompt_len, max_new_tokens, res.notes)
    seq = SeqState(list(prompt_ids), budget, sampling, make_generator(seed, dev), eos, res, lookup)
    limit = target.max_positions

    t0 = time.perf_counter()
    tcache = target.new_cache(max_len=ids.shape[1] + budget + b + 1)
    proposer.claim(seq)
    layers = drafter.config.target_layer_ids if drafter is not None else None
    feats = drafter is not None
    out = target.forward(ids, tcache, last_logits_only=True, layer_ids=layers, with_features=feats)
    if feats:
        proposer.extend(seq, out.features)
    new = start(seq, out.logits[0, -1])
    synchronize(dev)
    res.prefill_s = time.perf_counter() - t0
    if on_tokens:
        on_tokens(new, res.sources[-len(new) :]) if marks else on_tokens(new)
    while not seq.done:
        before = seq.committed_len  # the anchor is the last committed token
        t1 = time.perf_counter()
        # the verify block takes positions before-1 .. before-1+drafts: keep it in the context
        room = seq.room(b, limit)
        if drafter is None or verify.wants_draft(before - 1):  # earlier cycles only: lossless when sampling
            proposal = proposer.propose([seq], [room])[0]
        else:  # drafting does not pay now: the cycle is one plain decode step (a hybrid still copies)
            proposal = proposer.copies([seq], [room])[0] if isinstance(proposer, HybridProposer) else None
            if proposal is None:
                res.draft_skipped += 1
        # k drafts verified: decided from the drafts and confidences only, never from the target's verdict
        k = verify.verify_length(proposal, before - 1) if proposal is not None else 0
        synchronize(dev)
        t2 = time.perf_counter()
        block = block_tokens(seq, proposal, k, dev)[None]  # [1, k+1]
        out = target.forward(block, tcache, layer_ids=layers, with_features=feats)
        # logits [k+1, V]; the rule is this module's name, looked up per call (tests swap it)
        n, nxt = accept(seq, proposal, k, out.logits[0], lambda *args: accept_rejection(*args))
        # keep the anchor and accepted drafts in the target cache; the new token is the next anchor
        target.crop_cache(tcache, rollback_length(before, n))
        synchronize(dev)
        t3 = time.perf_counter()
        if feats:  # drafter work: counted as draft time
            proposer.observe(seq, proposal, k, n, out.features[:, : n + 1])
        synchronize(dev)
        res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
        res.verify_s += t3 - t2
        new = commit(seq, proposal, k, n, nxt)
        if proposal is not None:
            verify.observe(proposal, k, n)
            if on_cycle:
                on_cycle(proposal, k, n)
        if on_tokens and new:
            on_tokens(new, res.sources[-len(new) :]) if marks else on_tokens(new)
    synchronize(dev)
    res.total_s = time.perf_counter() - t0
    return res
