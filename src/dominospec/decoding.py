"""Decoding: plain autoregressive and Domino speculative, batch 1, with lossless acceptance.

The speculative cycle (read top to bottom):
  1. backbone: one drafter pass over [anchor, MASK...] -> z, base logits for the block
  2. head rollout: left to right, d_{k+1} ~ warp(base_k + delta_k(z_k, d_<=k))
  3. verify: one target forward over [anchor, d_1..d_b] (b+1 positions)
  4. accept: greedy exact match, or rejection sampling against the draft's real distribution
  5. commit accepted drafts + one target token, crop the target cache, feed the committed
     rows' features into the draft cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .errors import DominoError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1: off

    def __post_init__(self):
        if self.temperature < 0:
            raise DominoError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DominoError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DominoError(f"top_k must be >= 0, got {self.top_k}")

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


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """drafts [b], target_logits [b+1, V] -> (accepted count, the target's next token)."""
    choice = target_logits.argmax(-1)  # [b+1]
    match = (choice[:-1] == drafts).int().cumprod(0)
    n = int(match.sum())
    return n, int(choice[n])


def accept_rejection(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     gen: torch.Generator | None) -> tuple[int, int]:
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


@dataclass
class GenerationResult:
    tokens: list[int]                      # new tokens only
    prompt_len: int
    cycles: int = 0
    block_size: int = 0
    accepted: list[int] = field(default_factory=list)  # per cycle: drafts the target accepted
    committed: list[int] = field(default_factory=list)  # per cycle: tokens committed (after EOS/limit)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float | None:
        """Tokens committed per cycle, bonus included."""
        return sum(self.committed) / self.cycles if self.cycles else None

    @property
    def accepted_per_position(self) -> list[int]:
        """How many cycles had their draft at block position k (1-based) accepted."""
        return [sum(1 for a in self.accepted if a >= k) for k in range(1, self.block_size + 1)]

    @property
    def judged_per_position(self) -> list[int]:
        """How many cycles had position k judged at all (all earlier ones accepted)."""
        return [sum(1 for a in self.accepted if a >= k - 1) for k in range(1, self.block_size + 1)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self, text: str | None = None) -> dict:
        return {"text": text, "new_tokens": self.new_tokens, "tokens_per_s": self.tokens_per_s,
                "tau": self.tau, "cycles": self.cycles, "accepted_per_position": self.accepted_per_position,
                "draft_s": self.draft_s, "verify_s": self.verify_s, "prefill_s": self.prefill_s,
                "total_s": self.total_s}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    t0 = time.perf_counter()
    cache = target.new_cache()
    out = target.forward(ids, cache, last_logits_only=True, with_features=False)
    tok = _first_token(out.logits[0, -1], sampling, gen)
    _sync(dev)
    res.prefill_s = time.perf_counter() - t0
    while True:
        res.tokens.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in eos or len(res.tokens) >= max_new_tokens:
            break
        out = target.forward(torch.tensor([[tok]], device=dev), cache, with_features=False)
        tok = _first_token(out.logits[0, -1], sampling, gen)
    _sync(dev)
    res.total_s = time.perf_counter() - t0
    return res


def draft_block(drafter, cache, anchor: torch.Tensor, b: int, sampling: SamplingConfig, gen,
                use_head: bool = True):
    """Steps 1-2: backbone pass, then the head's left-to-right rollout over the first b slots.

    Returns drafts [b] (target ids) and, when sampling, the distributions they were drawn from
    over the target vocabulary [b, V] (zero outside a draft vocabulary).
    """
    z = drafter.backbone_block(cache, anchor)[0, :b]  # [b, H]
    base = drafter.base_logits(z)                     # [b, V'] (V' = draft vocabulary)
    head = drafter.head
    if not use_head or drafter.config.head == "none":
        if sampling.greedy:
            return drafter.to_target_ids(base.argmax(-1)), None
        probs = warp_probs(base, sampling)
        return drafter.to_target_ids(sample(probs, gen)), drafter.to_target_probs(probs)
    drafts, dists = [], []
    prev = anchor                                     # [1] target id
    state = head.init_state(z[:1])
    for k in range(b):
        delta, state = head.step(k, z[k:k + 1], drafter.embed(prev), prev, state)
        logits = base[k:k + 1] if delta is None else base[k:k + 1] + delta
        if sampling.greedy:
            pick = logits.argmax(-1)
        else:
            p = warp_probs(logits, sampling)
            pick = sample(p, gen)
            dists.append(p)
        prev = drafter.to_target_ids(pick)
        drafts.append(prev)
    drafts = torch.cat(drafts)
    return drafts, (drafter.to_target_probs(torch.cat(dists)) if dists else None)


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

    t0 = time.perf_counter()
    tcache, dcache = target.new_cache(), drafter.new_cache()
    layers = drafter.config.target_layer_ids
    out = target.forward(ids, tcache, last_logits_only=True, layer_ids=layers)
    drafter.extend_cache(dcache, out.features)
    tok = _first_token(out.logits[0, -1], sampling, gen)
    _sync(dev)
    res.prefill_s = time.perf_counter() - t0
    res.tokens.append(tok)
    if on_tokens:
        on_tokens([tok])
    done = tok in eos or max_new_tokens <= 1
    while not done:
        committed_len = res.prompt_len + len(res.tokens)  # the anchor is the last committed token
        anchor = torch.tensor([tok], device=dev)
        t1 = time.perf_counter()
        drafts, draft_probs = draft_block(drafter, dcache, anchor, b, sampling, gen, use_head)
        _sync(dev)
        t2 = time.perf_counter()
        block = torch.cat([anchor, drafts]).unsqueeze(0)  # [1, b+1]
        out = target.forward(block, tcache, layer_ids=layers)
        logits = out.logits[0]                            # [b+1, V]
        if sampling.greedy:
            n, nxt = accept_greedy(drafts, logits)
        else:
            n, nxt = accept_rejection(drafts, draft_probs, warp_probs(logits, sampling), gen)
        new = drafts[:n].tolist() + [nxt]
        # keep the anchor and accepted drafts in the target cache; the new token is the next anchor
        target.crop_cache(tcache, committed_len + n)
        _sync(dev)
        t3 = time.perf_counter()
        drafter.extend_cache(dcache, out.features[:, : n + 1])  # drafter work: counted as draft time
        _sync(dev)
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
    _sync(dev)
    res.total_s = time.perf_counter() - t0
    return res
