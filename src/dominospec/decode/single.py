"""Decoding at batch 1: plain autoregressive and Domino speculative, with lossless acceptance.

The speculative cycle (read top to bottom):
  1. propose: one drafter backbone pass over [anchor, MASK...], then the head's left-to-right
     rollout (propose.draft_block) -> a Proposal of b drafts
  2. verify: one target forward over [anchor, d_1..d_b] (b+1 positions)
  3. accept: greedy exact match, or rejection sampling against the draft's real distribution
  4. commit accepted drafts + one target token, roll the target cache back, feed the committed
     rows' features into the draft cache.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..devices import synchronize
from ..errors import DominoError
from ..sampling import SamplingConfig, accept_greedy, accept_rejection, sample, warp_probs
from ..target.context import cap_new_tokens
from .propose import draft_block
from .result import GenerationResult


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
        raise DominoError(f"the prompt has {prompt_len} tokens and fills the target's context of {limit} "
                          "positions: there is no room for an answer")
    if budget < max_new_tokens:
        notes.append(f"max_new_tokens {max_new_tokens} capped at {budget}: the prompt ({prompt_len} tokens) and "
                     f"the answer must fit the target's context of {limit} positions")
    return budget


@torch.inference_mode()
def generate_autoregressive(target, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                            sampling: SamplingConfig = SamplingConfig(), seed: int | None = 0,
                            eos_ids: Sequence[int] | None = None,
                            on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
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
def generate_speculative(target, drafter, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                         sampling: SamplingConfig = SamplingConfig(), seed: int | None = 0,
                         block_size: int | None = None, use_head: bool = True,
                         eos_ids: Sequence[int] | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Domino speculative decoding; output equals `generate_autoregressive` (greedy: token for token)."""
    dev = target.device
    b = drafter.config.block_size if block_size is None else int(block_size)
    if not 1 <= b <= drafter.config.block_size:
        raise DominoError(f"block size {b} must be between 1 and the drafter's {drafter.config.block_size}")
    ids = _check_prompt(prompt_ids, max_new_tokens).to(dev)
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    gen = _generator(seed, dev)
    res = GenerationResult(tokens=[], prompt_len=ids.shape[1], block_size=b)
    max_new_tokens = _fit_budget(target, res.prompt_len, max_new_tokens, res.notes)
    limit = target.max_positions

    t0 = time.perf_counter()
    tcache, dcache = target.new_cache(max_len=ids.shape[1] + max_new_tokens + b + 1), drafter.new_cache()
    layers = drafter.config.target_layer_ids
    out = target.forward(ids, tcache, last_logits_only=True, layer_ids=layers)
    drafter.extend_cache(dcache, out.features)
    tok = _first_token(out.logits[0, -1], sampling, gen)
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
        proposal = draft_block(drafter, dcache, anchor, drafts_now, sampling, gen, use_head)
        drafts = proposal.drafts
        synchronize(dev)
        t2 = time.perf_counter()
        block = torch.cat([anchor, drafts]).unsqueeze(0)  # [1, b+1]
        out = target.forward(block, tcache, layer_ids=layers)
        logits = out.logits[0]                            # [b+1, V]
        if sampling.greedy:
            n, nxt = accept_greedy(drafts, logits)
        else:
            n, nxt = accept_rejection(drafts, proposal.draft_probs, warp_probs(logits, sampling), gen)
        new = drafts[:n].tolist() + [nxt]
        # keep the anchor and accepted drafts in the target cache; the new token is the next anchor
        target.crop_cache(tcache, committed_len + n)
        synchronize(dev)
        t3 = time.perf_counter()
        drafter.extend_cache(dcache, out.features[:, : n + 1])  # drafter work: counted as draft time
        synchronize(dev)
        res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
        res.verify_s += t3 - t2
        new, done = _truncate(new, eos, max_new_tokens - len(res.tokens))
        res.cycles += 1
        res.accepted.append(n)
        res.committed.append(len(new))
        res.tokens.extend(new)
        if on_tokens:
            on_tokens(new)
        tok = new[-1]
    synchronize(dev)
    res.total_s = time.perf_counter() - t0
    return res
