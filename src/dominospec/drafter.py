"""The Domino drafter: a parallel draft backbone plus a light sequential head.

Backbone (method.md §2): context features from a few target layers are projected to the
hidden size and injected as extra keys/values into every draft layer; the block
[anchor, MASK, ..., MASK] attends bidirectionally to itself and to the context strictly
before the anchor. Block slot k predicts the token at anchor+1+k (the shift-label rule).
The target's embedding table and LM head are borrowed at run time and never saved here.

Heads (method.md §3-4) turn the backbone's base logits into the logits a draft token is
sampled from, left to right inside the block: `none`, `domino`, `markov`, `rnn`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import DominoError
from .target import check_layer_ids

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "dominospec-drafter/1"
HEADS = ("none", "domino", "markov", "rnn")


@dataclass
class DrafterConfig:
    # what the drafter must match in its target
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    target_layer_ids: list[int]
    # backbone
    num_layers: int = 2
    intermediate_size: int = 1536
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    block_size: int = 8
    mask_token_id: int | None = None  # None: a learned mask vector
    draft_vocab_size: int = 0         # >0: score only this many frequent tokens (lossless; cheaper on CPU)
    # sequential head
    head: str = "domino"
    gru_hidden_size: int = 256
    rank: int = 64
    confidence_head: bool = False
    # bookkeeping
    target_name: str = ""
    format: str = FORMAT
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        problems = []
        if self.head not in HEADS:
            problems.append(f"head {self.head!r} is not one of {list(HEADS)}")
        for name in ("hidden_size", "vocab_size", "num_layers", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "gru_hidden_size", "rank"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % max(1, self.num_key_value_heads):
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} outside 0..vocab_size {self.vocab_size}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}")
        if problems:
            raise DominoError("invalid drafter config: " + "; ".join(problems))
        check_layer_ids(self.target_layer_ids, self.target_num_layers)

    @classmethod
    def for_target(cls, target, **overrides) -> "DrafterConfig":
        """Defaults that fit `target` (a dominospec Target); any field can be overridden."""
        cfg = target.model.config
        heads = int(getattr(cfg, "num_attention_heads", 8))
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or target.hidden_size // heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict)
                      else getattr(cfg, "rope_theta", 10000.0))
        base = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                    target_num_layers=target.num_layers, target_layer_ids=list(target.layer_ids),
                    num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                    intermediate_size=int(getattr(cfg, "intermediate_size", 4 * target.hidden_size)),
                    rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta=theta,
                    target_name=str(target.name))
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    @property
    def out_vocab(self) -> int:
        """Width of the drafter's logits: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise DominoError(f"{source}: unknown drafter config keys {unknown}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise DominoError(f"{source}: missing drafter config keys {missing}")
        if data.get("format", FORMAT) != FORMAT:
            raise DominoError(f"{source}: format {data['format']!r} is not {FORMAT!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise DominoError(f"{source}: {exc}") from None


# ----- building blocks -----

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin [..., S, head_dim] for absolute positions [..., S]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [N, heads, S, D]; cos/sin: [N or 1, S, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DraftLayer(nn.Module):
    """A Llama/Qwen3-style layer whose queries come from the block only (KV injection)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h, d = c.hidden_size, c.head_dim
        self.input_norm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, c.rms_norm_eps) if c.qk_norm else nn.Identity()
        self.post_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def _heads(self, x, n):
        return x.view(x.shape[0], x.shape[1], n, self.c.head_dim).transpose(1, 2)

    def kv(self, x, cos, sin):
        """Keys/values of rows x [N, S, H] -> [N, kv_heads, S, D] each."""
        k = self.k_norm(self._heads(self.k_proj(x), self.c.num_key_value_heads))
        v = self._heads(self.v_proj(x), self.c.num_key_value_heads)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        # x: [N, Bq, H] block rows; ctx_k/ctx_v: [N or 1, kv, C, D]; mask: bool [N or 1, 1, Bq, C+Bq]
        c = self.c
        h = self.input_norm(x)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), c.num_attention_heads)), cos, sin)
        k, v = self.kv(h, cos, sin)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            n = x.shape[0]
            k = torch.cat([ctx_k.expand(n, -1, -1, -1), k], dim=2)
            v = torch.cat([ctx_v.expand(n, -1, -1, -1), v], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


# ----- sequential heads -----
# Every head sees, for block slot k, the backbone state z_k and the token realised just
# before the slot's target, prev_k = x_{a+k} (slot 0: the anchor). It returns a logit
# correction delta_k (None: no correction) so that final_k = base_k + delta_k.

class NoHead(nn.Module):
    def init_state(self, z):
        return None

    def step(self, k, z_k, prev_emb, prev_id, state):
        return None, state

    def teacher_forced(self, z, prev_emb, prev_ids):
        return None


class DominoHead(nn.Module):
    """GRU causal encoder over realised block tokens + low-rank logit correction (§3)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        g = c.gru_hidden_size
        self.g = g
        self.gru_ih = nn.Linear(c.hidden_size, 3 * g, bias=False)  # gates in PyTorch order r, z, n
        self.gru_hh = nn.Linear(g, 3 * g, bias=False)
        self.w1_z = nn.Linear(c.hidden_size, c.rank, bias=False)  # W1 split over [z ; s]
        self.w1_s = nn.Linear(g, c.rank, bias=False)
        self.w2 = nn.Linear(c.rank, c.out_vocab, bias=False)
        nn.init.zeros_(self.w2.weight)  # an untrained head leaves the base logits unchanged

    def gru_cell(self, x_proj, s):
        r_i, z_i, n_i = x_proj.chunk(3, dim=-1)
        r_h, z_h, n_h = self.gru_hh(s).chunk(3, dim=-1)
        r = torch.sigmoid(r_i + r_h)
        u = torch.sigmoid(z_i + z_h)
        n = torch.tanh(n_i + r * n_h)
        return (1 - u) * n + u * s

    def init_state(self, z):
        return z.new_zeros(z.shape[0], self.g)

    def step(self, k, z_k, prev_emb, prev_id, state):
        state = self.gru_cell(self.gru_ih(prev_emb), state)
        if k == 0:  # slot 0 stays pure: the backbone already sees the anchor
            return None, state
        return self.w2(F.silu(self.w1_z(z_k) + self.w1_s(state))), state

    def teacher_forced(self, z, prev_emb, prev_ids):
        # z: [N, B, H]; prev_emb: [N, B, H] embeddings of x_{a..a+B-1}
        x_proj = self.gru_ih(prev_emb)
        s = z.new_zeros(z.shape[0], self.g)
        states = []
        for k in range(z.shape[1]):
            s = self.gru_cell(x_proj[:, k], s)
            states.append(s)
        states = torch.stack(states, dim=1)  # [N, B, G]
        delta = self.w2(F.silu(self.w1_z(z) + self.w1_s(states)))
        return torch.cat([torch.zeros_like(delta[:, :1]), delta[:, 1:]], dim=1)


class MarkovHead(nn.Module):
    """DSpark's rank-r bigram correction B(x_{k-1}, .) = W2 W1[x_{k-1}] (§4)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.w1 = nn.Embedding(c.vocab_size, c.rank)
        self.w2 = nn.Linear(c.rank, c.out_vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(c.rank))
        nn.init.zeros_(self.w2.weight)

    def init_state(self, z):
        return None

    def step(self, k, z_k, prev_emb, prev_id, state):
        return self.w2(self.w1(prev_id)), state

    def teacher_forced(self, z, prev_emb, prev_ids):
        return self.w2(self.w1(prev_ids))


class RNNHead(nn.Module):
    """DSpark's gated recurrent correction over [s_{k-1} ; W1[x_{k-1}] ; h_k] (§4)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        r = c.rank
        self.r = r
        self.w1 = nn.Embedding(c.vocab_size, r)
        self.cell = nn.Linear(2 * r + c.hidden_size, 3 * r, bias=True)
        self.w2 = nn.Linear(r, c.out_vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(r))
        nn.init.zeros_(self.w2.weight)

    def init_state(self, z):
        return z.new_zeros(z.shape[0], self.r)

    def _cell(self, s, e, h):
        g, c, o = self.cell(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        s = gate * s + (1 - gate) * torch.tanh(c)
        return s, self.w2(torch.tanh(o))

    def step(self, k, z_k, prev_emb, prev_id, state):
        state, delta = self._cell(state, self.w1(prev_id), z_k)
        return delta, state

    def teacher_forced(self, z, prev_emb, prev_ids):
        e = self.w1(prev_ids)
        s = z.new_zeros(z.shape[0], self.r)
        deltas = []
        for k in range(z.shape[1]):
            s, d = self._cell(s, e[:, k], z[:, k])
            deltas.append(d)
        return torch.stack(deltas, dim=1)


HEAD_CLASSES = {"none": lambda c: NoHead(), "domino": DominoHead, "markov": MarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w . [z_k ; embed(x_{a+k})]): P(slot k's draft survives | earlier ones did)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(2 * c.hidden_size, 1, bias=True)

    def forward(self, z, prev_emb):
        return self.proj(torch.cat([z, prev_emb], dim=-1)).squeeze(-1)  # logits [N, B]


# ----- the drafter -----

class DraftCache:
    """Per-layer K/V of committed context rows only; the block's own K/V are never stored."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0


def block_attention_mask(anchor_pos: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask [N, 1, N*B, C + N*B] for N blocks sharing one context of C rows.

    Block n (anchored at anchor_pos[n]) sees context rows at positions < anchor_pos[n] and its
    own B rows (bidirectionally), nothing of the other blocks. Defined once, used by training.
    """
    n = anchor_pos.shape[0]
    dev = anchor_pos.device
    ctx = torch.arange(ctx_len, device=dev).unsqueeze(0) < anchor_pos.unsqueeze(1)  # [N, C]
    ctx = ctx.repeat_interleave(block_size, dim=0)  # [N*B, C]
    owner = torch.arange(n, device=dev).repeat_interleave(block_size)
    own = owner.unsqueeze(1) == owner.unsqueeze(0)  # [N*B, N*B]
    return torch.cat([ctx, own], dim=1).view(1, 1, n * block_size, ctx_len + n * block_size)


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        n_feat = len(c.target_layer_ids)
        self.fc = nn.Linear(n_feat * c.hidden_size, c.hidden_size, bias=False)
        self.ctx_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.mask_token_id is None else None
        self.head = HEAD_CLASSES[c.head](c)
        self.confidence = ConfidenceHead(c) if c.confidence_head else None
        if c.draft_vocab_size:  # draft-vocabulary slot -> target token id; set by training
            self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size))
        self.apply(self._init)
        if isinstance(self.head, (DominoHead, MarkovHead, RNNHead)):
            nn.init.zeros_(self.head.w2.weight)
        # (embedding, lm_head) borrowed from the target; a tuple so they are neither
        # registered as submodules nor saved, moved or trained with the drafter
        self._borrowed: tuple[nn.Module, nn.Module] | None = None
        self._head_rows: torch.Tensor | None = None  # LM-head rows of the draft vocabulary

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    # ----- the target's frozen tables -----
    def attach(self, target) -> "Drafter":
        """Check that this drafter fits `target`, borrow its embedding and LM head, match device/dtype."""
        self.check_fits(target)
        self.to(device=target.device, dtype=target.dtype)
        self._borrowed = (target.model.get_input_embeddings(), target.model.get_output_embeddings())
        self.refresh_head_rows()
        return self

    def check_fits(self, target) -> None:
        c = self.config
        pairs = [("hidden_size", c.hidden_size, target.hidden_size),
                 ("vocab_size", c.vocab_size, target.vocab_size),
                 ("target_num_layers", c.target_num_layers, target.num_layers)]
        bad = [f"{name}: drafter {mine} vs target {theirs}" for name, mine, theirs in pairs if mine != theirs]
        if bad:
            raise DominoError(f"drafter (made for {c.target_name or 'another target'!r}) does not fit target "
                              f"{target.name!r}: " + "; ".join(bad))
        check_layer_ids(c.target_layer_ids, target.num_layers)  # the drafter says which layers it reads

    def _tables(self):
        if self._borrowed is None:
            raise DominoError("drafter is not attached to a target; call drafter.attach(target)")
        return self._borrowed

    def embed(self, ids):
        return self._tables()[0](ids)

    def refresh_head_rows(self) -> None:
        """Gather the LM-head rows of the draft vocabulary (after attach or a new draft_vocab)."""
        self._head_rows = None
        if self.config.draft_vocab_size and self._borrowed is not None:
            self._head_rows = self._tables()[1].weight[self.draft_vocab].detach()

    def base_logits(self, z: torch.Tensor) -> torch.Tensor:
        """The frozen LM head on z [..., H] -> [..., out_vocab] (draft-vocabulary rows only)."""
        w = self._tables()[1].weight if self._head_rows is None else self._head_rows
        return F.linear(z, w.to(z.dtype))

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return ids if not self.config.draft_vocab_size else self.draft_vocab[ids]

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., out_vocab] -> [..., V], zero outside the draft vocabulary."""
        if not self.config.draft_vocab_size:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self.draft_vocab, probs)

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft-vocabulary indices, -1 where a token is outside it."""
        if not self.config.draft_vocab_size:
            return ids
        table = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        table[self.draft_vocab] = torch.arange(self.config.draft_vocab_size, device=ids.device)
        return table[ids]

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """Embeddings of [anchor, MASK, ..., MASK] per block: anchors [N] -> [N, B, H]."""
        c = self.config
        first = self.embed(anchors).unsqueeze(1).to(self.dtype)
        if c.mask_token_id is not None:
            mask = self.embed(torch.full_like(anchors, c.mask_token_id)).unsqueeze(1).to(self.dtype)
        else:
            mask = self.mask_embedding.view(1, 1, -1)
        return torch.cat([first, mask.expand(anchors.shape[0], c.block_size - 1, -1)], dim=1)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, S, n*H] -> context rows [N, S, H]."""
        return self.ctx_norm(self.fc(features.to(self.dtype)))

    # ----- inference: one block at a time over a cached context -----
    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def extend_cache(self, cache: DraftCache, features: torch.Tensor) -> None:
        """Append committed context rows (target features [1, S, n*H] at positions cache.length..)."""
        s = features.shape[1]
        if s == 0:
            return
        ctx = self.context(features)
        pos = torch.arange(cache.length, cache.length + s, device=features.device).unsqueeze(0)
        cos, sin = rope_tables(pos, self.config.head_dim, self.config.rope_theta, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.kv(ctx, cos, sin)
            cache.k[i] = k if cache.k[i] is None else torch.cat([cache.k[i], k], dim=2)
            cache.v[i] = v if cache.v[i] is None else torch.cat([cache.v[i], v], dim=2)
        cache.length += s

    def backbone_block(self, cache: DraftCache, anchor: torch.Tensor) -> torch.Tensor:
        """Final hidden states z [1, B, H] of the block anchored right after the cached context."""
        x = self.block_inputs(anchor)
        pos = torch.arange(cache.length, cache.length + self.config.block_size, device=x.device).unsqueeze(0)
        cos, sin = rope_tables(pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i])
        return self.norm(x)

    # ----- training: many blocks of one sequence in one forward -----
    def forward_blocks(self, features: torch.Tensor, anchor_pos: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """z [N, B, H] for N blocks over one sequence's context.

        features: [1, S, n*H] target features at positions 0..S-1; anchor_pos: [N] block anchors;
        anchors: [N] the token ids at those positions. Equivalent to N cached single-block
        calls with the cache holding positions < anchor_pos[n] (tested).
        """
        c = self.config
        n, s = anchors.shape[0], features.shape[1]
        ctx = self.context(features)
        ctx_pos = torch.arange(s, device=features.device).unsqueeze(0)
        cos_c, sin_c = rope_tables(ctx_pos, c.head_dim, c.rope_theta, ctx.dtype)
        x = self.block_inputs(anchors).reshape(1, n * c.block_size, -1)
        pos = (anchor_pos.unsqueeze(1) + torch.arange(c.block_size, device=x.device)).reshape(1, -1)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_theta, x.dtype)
        mask = block_attention_mask(anchor_pos, s, c.block_size)
        for layer in self.layers:
            ck, cv = layer.kv(ctx, cos_c, sin_c)
            x = layer(x, cos, sin, ck, cv, mask=mask)
        return self.norm(x).view(n, c.block_size, -1)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----- checkpoints -----
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """config.json + model.safetensors, each written atomically."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        tmp_w = out / (WEIGHTS_NAME + ".tmp")
        save_file(state, str(tmp_w), metadata={"format": FORMAT})
        tmp_c = out / (CONFIG_NAME + ".tmp")
        tmp_c.write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        os.replace(tmp_w, out / WEIGHTS_NAME)
        os.replace(tmp_c, out / CONFIG_NAME)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target=None) -> "Drafter":
        """Load a drafter directory; with `target`, also check the fit and attach to it."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(directory)
        if not d.is_dir():
            raise DominoError(f"drafter {d}: no such directory")
        cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
        if not cfg_path.exists():
            raise DominoError(f"drafter {d}: missing {CONFIG_NAME}")
        if not w_path.exists():
            raise DominoError(f"drafter {d}: missing {WEIGHTS_NAME}")
        try:
            data = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise DominoError(f"{cfg_path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise DominoError(f"{cfg_path}: expected a JSON object, got {type(data).__name__}")
        config = DrafterConfig.from_dict(data, source=str(cfg_path))
        try:
            state = load_file(str(w_path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DominoError(f"{w_path}: not a readable safetensors file ({exc})") from None
        model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise DominoError(f"{w_path} does not match {cfg_path}: missing tensors {missing[:5]}"
                              f"{'...' if len(missing) > 5 else ''}, unexpected tensors {unexpected[:5]}"
                              f"{'...' if len(unexpected) > 5 else ''}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(expected[k].shape):
                raise DominoError(f"{w_path}: tensor {k} has shape {tuple(v.shape)}, config implies "
                                  f"{tuple(expected[k].shape)}")
        model.load_state_dict(state)
        if config.draft_vocab_size:
            dv = model.draft_vocab
            if int(dv.min()) < 0 or int(dv.max()) >= config.vocab_size or dv.unique().numel() != dv.numel():
                raise DominoError(f"{w_path}: draft_vocab must hold {dv.numel()} distinct ids in 0..{config.vocab_size - 1}")
        model.eval()
        if target is not None:
            model.attach(target)
        return model
