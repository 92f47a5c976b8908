"""The draft backbone's building blocks: RMSNorm, RoPE, a KV-injection layer and the training mask.

A draft layer takes queries from the block rows only; its keys and values are those of the
projected target context followed by the block's own, so the block attends bidirectionally to
itself and to the context before its anchor. Context rows get no queries and are never updated
layer to layer, which is why their K/V can be cached across decoding cycles exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def __init__(self, c):
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

    def _qkv(self, x, cos, sin):
        h = self.input_norm(x)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.c.num_attention_heads)), cos, sin)
        k, v = self.kv(h, cos, sin)
        return q, k, v

    def _out(self, x, attn):
        # attn: [N, heads, Bq, D] -> the residual stream after attention and the MLP
        x = x + self.o_proj(attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        # x: [N, Bq, H] block rows; ctx_k/ctx_v: [N or 1, kv, C, D]; mask: bool [N or 1, 1, Bq, C+Bq]
        c = self.c
        q, k, v = self._qkv(x, cos, sin)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            n = x.shape[0]
            k = torch.cat([ctx_k.expand(n, -1, -1, -1), k], dim=2)
            v = torch.cat([ctx_v.expand(n, -1, -1, -1), v], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self._out(x, attn)

    def forward_packed(self, x, cos, sin, contexts, counts: list[int]):
        """Training: blocks of several sequences at once, each block seeing only its own context.

        x: [N, B, H] the blocks of all sequences, in sequence order, counts[r] of them for sequence r;
        contexts[r]: (k [kv, C_r, D], v [kv, C_r, D], visible bool [counts[r], C_r]) of sequence r.
        The same result as `forward` block by block, without copying the context per block or
        scoring the blocks against each other (a joint softmax over context and own keys).
        """
        q, k, v = self._qkv(x, cos, sin)  # q [N, heads, B, D]; k, v [N, kv, B, D]
        n, heads, b, d = q.shape
        kv = k.shape[1]
        q = q.view(n, kv, heads // kv, b, d) * d**-0.5  # GQA: the query heads grouped by their key head
        own = torch.einsum("nkgbd,nkcd->nkgbc", q, k)  # [N, kv, g, B, B]
        outs, start = [], 0
        for (ck, cv, visible), count in zip(contexts, counts):
            sl = slice(start, start + count)
            scores = torch.einsum("nkgbd,ksd->nkgbs", q[sl], ck)  # [n_r, kv, g, B, C_r]
            scores = scores.masked_fill(~visible[:, None, None, None, :], float("-inf"))
            p = torch.softmax(torch.cat([scores, own[sl]], dim=-1), dim=-1)
            c_r = ck.shape[1]
            o = torch.einsum("nkgbs,ksd->nkgbd", p[..., :c_r], cv) + torch.einsum(
                "nkgbc,nkcd->nkgbd", p[..., c_r:], v[sl]
            )
            outs.append(o)
            start += count
        attn = torch.cat(outs).reshape(n, heads, b, d)
        return self._out(x, attn)


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
