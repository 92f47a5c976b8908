"""Decoding at batch 1: plain autoregressive and Domino speculative, with lossless acceptance.

The speculative cycle (read top to bottom):
  1. propose: one drafter backbone pass over [anchor, MASK...], then the head's left-to-right
     rollout (propose.draft_block) -> a Proposal of b drafts; or a copy from the context
     (lookup.PromptLookup), alone or as a hybrid with the drafter
  2. verify: the policy (schedule.py) picks k <= b from the drafts and their confidences; one
     target forward over [anchor, d_1..d_k] (k+1 positions)
  3. accept: greedy exact match, or rejection sampling against the draft's real distribution
  4. commit accepted drafts + one target token, roll the target cache back, feed the committed
     rows' features into the draft cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig, accept_greedy, accept_rejection, sample, warp_probs
from ..target.context import cap_new_tokens
from .lookup import LOOKUP_BLOCK_SIZE, PromptLookup
from .propose import Proposal, draft_block
from .result import GenerationResult
from .schedule import VerifyPolicy


def _truncate(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) and at the token budget; says whether generation ends."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: min(i + 1, room)], True
    return tokens[:room], len(tokens) >= room


def _first_token(logits_row: torch.Tensor, s: SamplingConfig, gen) -> int:
    if s.greedy:
        return int(logits_row.argmax(-1))
    return int(sample(warp_probs(logits_row, s), gen))


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(0 if seed is None else int(seed))
    return gen


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
    gen = _generator(seed, dev)
    res = GenerationResult(tokens=[], prompt_len=ids.shape[1])
    max_new_tokens = _fit_budget(target, res.prompt_len, max_new_tokens, res.notes)
    t0 = time.perf_counter()
    cache = target.new_cache(max_len=ids.shape[1] + max_new_tokens + 1)
    out = target.forward(ids, cache, last_logits_only=True, with_features=False)
    tok = _first_token(out.logits[0, -1], sampling, gen)
    synchronize(dev)
    res.prefill_s = time.perf_counter() - t0
    while True:
        res.tokens.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in eos or len(res.tokens) >= max_new_tokens:
            break
        out = target.forward(torch.tensor([[tok]], device=dev), cache, with_features=False)
        tok = _first_token(out.logits[0, -1], sampling, gen)
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
) -> GenerationResult:
    """Speculative decoding; output equals `generate_autoregressive` (greedy: token for token).

    Proposers: the drafter; prompt lookup alone (drafter=None, lookup given); or both, a hybrid that
    takes the lookup continuation when its suffix match has at least lookup.min_match tokens.
    verify: how many of the proposed drafts the target checks each cycle (default: all of them).
    on_cycle(proposal, verified, accepted) sees every cycle (calibration records it).
    """
    dev = target.device
    if drafter is None and lookup is None:
        raise DominoError("speculative decoding needs a drafter, prompt lookup, or both")
    b = (
        int(block_size)
        if block_size is not None
        else (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
    )
    top = drafter.config.block_size if drafter is not None else b
    if not 1 <= b <= top:
        raise DominoError(f"block size {b} must be between 1 and the drafter's {top}")
    verify = verify or VerifyPolicy()
    verify.start()
    ids = _check_prompt(prompt_ids, max_new_tokens).to(dev)
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    gen = _generator(seed, dev)
    res = GenerationResult(tokens=[], prompt_len=ids.shape[1], block_size=b)
    max_new_tokens = _fit_budget(target, res.prompt_len, max_new_tokens, res.notes)
    limit = target.max_positions

    t0 = time.perf_counter()
    tcache = target.new_cache(max_len=ids.shape[1] + max_new_tokens + b + 1)
    dcache = drafter.new_cache() if drafter is not None else None
    layers = drafter.config.target_layer_ids if drafter is not None else None
    out = target.forward(ids, tcache, last_logits_only=True, layer_ids=layers, with_features=dcache is not None)
    if dcache is not None:
        drafter.extend_cache(dcache, out.features)
    tok = _first_token(out.logits[0, -1], sampling, gen)
    if lookup is not None:
        lookup.start(prompt_ids)
        lookup.extend([tok])
    synchronize(dev)
    res.prefill_s = time.perf_counter() - t0
    res.tokens.append(tok)
    if on_tokens:
        on_tokens([tok])
    done = tok in eos or max_new_tokens <= 1
    while not done:
        committed_len = res.prompt_len + len(res.tokens)  # the anchor is the last committed token
        # the verify block takes positions committed_len-1 .. committed_len-1+drafts: keep it in the context
        drafts_now = b if limit is None else min(b, limit - committed_len)
        anchor = torch.tensor([tok], device=dev)
        t1 = time.perf_counter()
        proposal = None
        if lookup is not None:  # a hybrid takes the copy only from a long enough match
            proposal, matched = lookup.propose(drafts_now, target.vocab_size, sampling, dev)
            if drafter is not None and matched < lookup.min_match:
                proposal = None
        if proposal is None and drafter is not None:
            if verify.wants_draft(committed_len - 1):  # from earlier cycles only: lossless when sampling
                proposal = draft_block(drafter, dcache, anchor, drafts_now, sampling, gen, use_head)
            else:
                res.draft_skipped += 1  # this cycle is one plain decode step
        # k drafts verified: decided from the drafts and confidences only, never from the target's verdict
        k = verify.verify_length(proposal, committed_len - 1) if proposal is not None else 0
        drafts = proposal.drafts[:k] if proposal is not None else anchor[:0]
        synchronize(dev)
        t2 = time.perf_counter()
        block = torch.cat([anchor, drafts]).unsqueeze(0)  # [1, k+1]
        out = target.forward(block, tcache, layer_ids=layers, with_features=dcache is not None)
        logits = out.logits[0]  # [k+1, V]
        if sampling.greedy:
            n, nxt = accept_greedy(drafts, logits)
        else:
            draft_probs = proposal.draft_probs[:k] if proposal is not None else logits[:0]
            n, nxt = accept_rejection(drafts, draft_probs, warp_probs(logits, sampling), gen)
        new = drafts[:n].tolist() + [nxt]
        # keep the anchor and accepted drafts in the target cache; the new token is the next anchor
        target.crop_cache(tcache, committed_len + n)
        synchronize(dev)
        t3 = time.perf_counter()
        if dcache is not None:
            drafter.extend_cache(dcache, out.features[:, : n + 1])  # drafter work: counted as draft time
        synchronize(dev)
        res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
        res.verify_s += t3 - t2
        if proposal is not None and proposal.source == "lookup":
            lookup.record(k, n)
            res.lookup_cycles += 1
        if proposal is not None:
            verify.observe(proposal, k, n)
            if on_cycle:
                on_cycle(proposal, k, n)
        new, done = _truncate(new, eos, max_new_tokens - len(res.tokens))
        res.cycles += 1
        res.accepted.append(n)
        res.verified.append(k)
        res.committed.append(len(new))
        res.tokens.extend(new)
        if lookup is not None:
            lookup.extend(new)
        if on_tokens:
            on_tokens(new)
        tok = new[-1]
    synchronize(dev)
    res.total_s = time.perf_counter() - t0
    return res
