"""Native forward for Llama-family HF decoder-only models (Llama/SmolLM2, Mistral, Qwen2, Qwen3).

Why: speculative decoding verifies k+1 tokens per target pass, and on CPU the HF eager path spends
much of that pass on per-op Python overhead and on un-packed GEMMs. This module re-implements the
forward in the gpt-fast spirit: a config dataclass, plain modules, one preallocated KV cache that
rolls back by setting a length, fused q/k/v and gate/up projections and (CPU fp32) pre-packed
weights. It is built from an already loaded HF model and shares its weight tensors (embedding,
norms, o/down projections, tied LM head); new tensors are the fused q/k/v and gate/up weights and,
on CPU fp32, the packed kernel panels that replace every W (see `Linear`; ~0.54 GB for SmolLM2-135M).
Build it on the device and dtype you run on: the packed copies do not follow `.to()`.

Shapes: B batch, S new tokens per row, T keys attended, H hidden, D head dim, Hq/Hkv heads, V vocab.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import DominoError
from ..log import log_once
from .kernels import ENV_SWITCH, PackedLinear, kernels_enabled, load_kernels
from .quant import CPU_FORMATS, DOT_FORMATS, Blocks, format_values

NATIVE_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}
FUSED_SWITCH = "DOMINOSPEC_FUSED_LAYERS"  # "off": such forwards loop over the layers in Python (for A/B runs)
PER_QUERY_MAX = 1 << 30  # new tokens per row up to which the kernel attends (all; scripts/ab_attention.py lowers it)


def fused_layers_enabled() -> bool:
    return os.environ.get(FUSED_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def native_support(hf_model) -> str | None:
    """None when `NativeModel.from_hf(hf_model)` reproduces the HF forward, else a sentence why not."""
    cfg = getattr(hf_model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in NATIVE_ARCHITECTURES:
        return f"model_type {mt!r} is not a supported native architecture ({', '.join(sorted(NATIVE_ARCHITECTURES))})."
    inner = getattr(hf_model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(hf_model, "lm_head"):
        return f"{type(hf_model).__name__} does not have the model.layers / lm_head layout of a causal LM."
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} is not supported (only silu)."
    rope = getattr(inner, "rotary_emb", None)
    rope_type = getattr(rope, "rope_type", None)
    if rope is None or not isinstance(rope_type, str) or not torch.is_tensor(getattr(rope, "inv_freq", None)):
        return "the model has no single static rotary embedding (model.model.rotary_emb.inv_freq)."
    if rope_type in ("dynamic", "longrope"):
        return (
            f"rope scaling {rope_type!r} recomputes frequencies from the sequence length; "
            "only static rope is supported."
        )
    window = getattr(cfg, "sliding_window", None)
    sliding_layers = mt == "mistral" or "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if window is not None and sliding_layers and window < cfg.max_position_embeddings:
        return f"sliding-window attention (window {window}) is in effect; native attention is full-causal."
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return "num_attention_heads is not a multiple of num_key_value_heads."
    w = inner.embed_tokens.weight
    if not w.dtype.is_floating_point or w.device.type == "meta":
        return f"weights are {w.dtype} on {w.device.type}; native needs dense floating-point weights."
    return None


@dataclass
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each q/k head before RoPE

    @classmethod
    def from_hf(cls, config) -> NativeConfig:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=config.model_type == "qwen3",
        )


def without_kernel_note(weight_format: str) -> str:
    """The one note a weight-only target without the small-row kernel gets (and why it has none)."""
    why = f"{ENV_SWITCH}=off" if not kernels_enabled() else "the small-row kernel is not available"
    return (
        f"{why}: {weight_format} weights run as fp32 values on the library GEMMs (the same model, at fp32's "
        "speed, not the kernel's)"
    )


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear(nn.Module):
    """y = x @ W^T + b with the CPU fp32 kernel that measured fastest per row count.

    CPU fp32 with the small-M kernel built (kernels.py; DOMINOSPEC_KERNELS=off disables it): W is
    packed once into the kernel's panels, which serve every row count; nothing else is kept for a
    fused W. Measured on an AMD EPYC (Zen 4, AVX-512), 1 thread, all matmuls of SmolLM2-135M
    (scripts/bench_kernels.py): 20.5 ms at M = 1 (today's GEMV path 30.1), 25.7 at M = 8 (oneDNN
    packed 38.2), level with oneDNN from M = 17 up to prefill sizes. The kernel's rows do not
    depend on each other, so a token's logits are the same bits in a decode step and in a verify.
    Without the kernel, M >= 2 rows: oneDNN with W reordered once into its blocked layout; M = 1:
    MKL against a pre-transposed [in, out] copy when out > in, else F.linear on the shared weight.
    CUDA or non-fp32: plain F.linear.

    weight_format bfloat16 / int8 (quant.py; CPU fp32 only): the kernel's panels hold the weights in
    that format; without the kernel, the library paths run on the format's values in fp32 (the same
    model, at fp32's speed). blocks: the weight as its GGUF file holds it (quant.Blocks), which q4-dot packs.
    weight may be given as its row blocks (a fused projection's [q; k; v]): they are stacked only where something
    reads the stack, so panels the panel cache holds cost no copy of the weights.
    """

    def __init__(
        self,
        weight: torch.Tensor | list[torch.Tensor],
        bias: torch.Tensor | None = None,
        weight_format: str = "float32",
        blocks=None,
    ):
        super().__init__()
        first = weight[0] if isinstance(weight, list) else weight
        kernel_path = first.device.type == "cpu" and first.dtype == torch.float32
        module = load_kernels() if kernel_path else None
        if module is not None:
            self.kernel = PackedLinear(module, weight, bias, weight_format, blocks)
            self.weight, self.bias, self.packed, self.weight_t = None, bias, None, None  # panels serve every row count
            self.out_features = self.kernel.out_features
            return
        if isinstance(weight, list):
            weight = torch.cat(weight)  # [out, in]
        self.weight, self.bias = weight, bias  # [out, in], [out]; shared with HF when not fused
        self.out_features, in_features = weight.shape
        self.packed = self.weight_t = self.kernel = None
        if not kernel_path:
            if weight_format in CPU_FORMATS:
                raise ValueError(f"{weight_format} weights need fp32 CPU weights, not {weight.dtype} ({weight.device})")
            return
        if weight_format in DOT_FORMATS:
            raise DominoError(f"{weight_format} runs on the CPU kernels' dot product, and they did not load here")
        if weight_format in CPU_FORMATS:  # no kernel: the format's values, fp32 library paths
            log_once(without_kernel_note(weight_format))
            weight = format_values(weight, weight_format)
            self.weight = nn.Parameter(weight, requires_grad=False)  # the slot may hold a shared HF Parameter
        if _packing_available():
            self.onednn = torch.ops.mkldnn._linear_pointwise.default  # the overload: ~10 us/call less
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())  # oneDNN blocked
                if self.out_features > in_features:
                    self.weight_t = weight.detach().t().contiguous()  # [in, out]
                    self.weight = None  # not needed any more (frees the fused copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)  # [..., out]
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.numel() != x.shape[-1]:  # M >= 2 rows; oneDNN takes [..., in] directly
            return self.onednn(x, self.packed, self.bias, "none", [], "")  # [..., out]
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        y = torch.matmul(x, self.weight_t)  # [..., out]
        return y if self.bias is None else y.add_(self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # one Python-level op (ATen composite on CPU)
    # HF computes the norm in fp32 and casts back before the weight; copy that for bit parity.
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


class KVCache:
    """Preallocated K/V: k, v [layers, batch, kv_heads, max_len, head_dim]; the one cache of the house.

    `lengths` is a python list of ints (one per row): reading it never syncs a device and rollback
    is an assignment. Positions >= lengths[b] hold stale values that attention never reads. A
    forward that would overrun max_len doubles the buffers first (rare; copies them once).
    The target's native forward and the drafter both keep their context here. A serving engine
    uses rows as fixed slots: `claim` one for a new sequence, `release` it when the sequence ends;
    no other row is copied or moved.
    """

    def __init__(self, cfg: NativeConfig, batch: int, max_len: int, dtype, device):
        self._allocate(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    @classmethod
    def allocate(
        cls, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device, row_dim: int = 0
    ) -> KVCache:
        """A cache of any layer / head shape (the drafter's layers, say); row_dim > 0 also keeps one vector of
        that size per position (`kept`: the drafter's context rows when it fuses the last one)."""
        cache = cls.__new__(cls)
        cache._allocate(layers, batch, kv_heads, max_len, head_dim, dtype, device)
        if row_dim:
            cache.kept = torch.zeros(batch, max_len, row_dim, dtype=dtype, device=device)
        return cache

    def _allocate(self, layers, batch, kv_heads, max_len, head_dim, dtype, device) -> None:
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.kept: torch.Tensor | None = None  # [batch, max_len, row_dim] per-position vectors, if asked for
        self.lengths = [0] * batch
        self.claimed = [False] * batch  # slot bookkeeping (claim / release)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_row(self) -> int:
        kept = 0 if self.kept is None else self.kept[0].numel() * self.kept.element_size()
        return 2 * self.k[:, 0].numel() * self.k.element_size() + kept

    def length(self, row: int = 0) -> int:
        return self.lengths[row]

    def set_length(self, row: int, n: int) -> None:
        if not 0 <= n <= self.max_len:
            raise ValueError(f"length {n} out of range 0..{self.max_len}")
        self.lengths[row] = int(n)

    def crop(self, n: int) -> None:
        """Batch-1 rollback: keep the first n positions."""
        if self.batch != 1:
            raise ValueError("crop() is for batch 1; use set_length(row, n)")
        self.set_length(0, n)

    def claim(self) -> int | None:
        """The lowest free slot, now claimed and empty; None when every slot is taken."""
        for r, taken in enumerate(self.claimed):
            if not taken:
                self.claimed[r], self.lengths[r] = True, 0
                return r
        return None

    def release(self, row: int) -> None:
        """Free a slot; its stale K/V stay in place and are overwritten by the next sequence."""
        self.claimed[row], self.lengths[row] = False, 0

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished sequences of a batch), keeping their order."""
        idx = torch.tensor(rows, device=self.k.device)
        self.k, self.v = self.k.index_select(1, idx), self.v.index_select(1, idx)
        if self.kept is not None:
            self.kept = self.kept.index_select(0, idx)
        self.lengths = [self.lengths[r] for r in rows]
        self.claimed = [self.claimed[r] for r in rows]

    def reset(self) -> None:
        self.lengths = [0] * self.batch

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1 as a cache on the same storage: a forward over some slots, no copy.

        Writes through the view land in this cache; `sync(view, start)` copies the lengths back.
        The view must not grow (size this cache for the longest sequence first).
        """
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.kept = None if self.kept is None else self.kept[start:stop]
        view.lengths = self.lengths[start:stop]
        view.claimed = self.claimed[start:stop]
        return view

    def row(self, b: int) -> KVCache:
        """Row b as a batch-1 cache on the same storage: a prompt can be prefilled alone, unpadded."""
        return self.rows(b, b + 1)

    def sync(self, view: KVCache, start: int) -> None:
        """Take the lengths of a `rows(start, ...)` view after a forward through it."""
        self.lengths[start : start + view.batch] = view.lengths

    def ensure(self, needed: int) -> None:
        """Grow (doubling) so that `needed` positions fit; rare path, copies the old buffers."""
        if needed <= self.max_len:
            return
        new_len = max(needed, 2 * self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], new_len, old.shape[4])
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)
        if self.kept is not None:
            kept = self.kept.new_zeros(self.kept.shape[0], new_len, self.kept.shape[2])
            kept[:, : self.kept.shape[1]] = self.kept
            self.kept = kept


class Rope:
    """cos/sin tables from HF's own inv_freq and attention_scaling (covers default/linear/llama3/yarn)."""

    def __init__(self, rotary_emb, head_dim: int, dtype, device):
        self.inv_freq = rotary_emb.inv_freq.detach().to(device=device, dtype=torch.float32)  # [D/2]
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
        self.dtype, self.half = dtype, head_dim // 2
        self.cos = self.sin = None
        self._build(256)

    def _build(self, n: int) -> None:
        # Same fp32 arithmetic as HF's rotary forward, then cast, so tables match it bit for bit.
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        sin = (emb.sin() * self.scaling).to(self.dtype)
        # rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1.., +1..]: fold the sign into sin.
        self.sin = torch.cat((-sin[:, : self.half], sin[:, self.half :]), dim=-1)

    def tables(self, needed: int):
        if needed > self.cos.shape[0]:
            self._build(max(needed, 2 * self.cos.shape[0]))
        return self.cos, self.sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, S, heads, D]; cos/sin [B or 1, S, 1, D]
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), sin)


class Block(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: NativeConfig, hf_layer, weight_format: str = "float32", blocks=None):
        """blocks: the layer's GGUF blocks by projection name ("q_proj", ..., quant.Blocks), for q4-dot."""
        super().__init__()
        a, m = hf_layer.self_attn, hf_layer.mlp
        blocks = blocks or {}
        self.cfg = cfg
        self.attn_norm = hf_layer.input_layernorm.weight  # [H], shared
        self.mlp_norm = hf_layer.post_attention_layernorm.weight
        self.eps = cfg.rms_norm_eps
        with torch.no_grad():  # fused weights (stacked by Linear where needed): one GEMM instead of three / two
            qkv_w = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]  # [(Hq+2Hkv)*D, H] stacked
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu_w = [m.gate_proj.weight, m.up_proj.weight]  # [2I, H] stacked
            gu_b = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
            self.qk_norm = None
            if cfg.qk_norm:  # per-head weights stacked so q and k are normed in one op
                self.qk_norm = torch.cat(
                    [a.q_norm.weight.expand(cfg.num_heads, -1), a.k_norm.weight.expand(cfg.num_kv_heads, -1)]
                )  # [Hq+Hkv, D]
        fmt, part = weight_format, blocks.get
        self.qkv = Linear(qkv_w, qkv_b, fmt, Blocks.cat([part("q_proj"), part("k_proj"), part("v_proj")]))
        self.o = Linear(a.o_proj.weight, a.o_proj.bias, fmt, part("o_proj"))
        self.gate_up = Linear(gu_w, gu_b, fmt, Blocks.cat([part("gate_proj"), part("up_proj")]))
        self.down = Linear(m.down_proj.weight, m.down_proj.bias, fmt, part("down_proj"))
        self.scale = float(getattr(a, "scaling", cfg.head_dim**-0.5))  # HF's own softmax scale

    def forward(self, x, layer: int, cache: KVCache, ctx: _Step) -> torch.Tensor:
        c = self.cfg
        B, S, _ = x.shape
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        fused = self.down.kernel is not None  # the kernel extension also fuses RoPE and SiLU-mul
        qkv = self.qkv(rms_norm(x, self.attn_norm, self.eps)).view(B, S, Hq + 2 * Hkv, D)  # heads q|k|v
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]  # q and k heads side by side; [B, S, Hkv, D]
        if self.qk_norm is not None:
            qk = rms_norm(qk, None, self.eps) * self.qk_norm  # [B, S, Hq+Hkv, D]
        if fused:  # one call: rotate q and k heads, reading them in place from qkv
            cos, sin = ctx.cos.reshape(-1, S, D), ctx.sin.reshape(-1, S, D)  # [B or 1, S, D]
            qk = self.down.kernel.module.rope(qk, cos.contiguous(), sin.contiguous(), Hq + Hkv)
        else:
            qk = ctx.rope.apply(qk, ctx.cos, ctx.sin)  # one RoPE for q and k together
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]  # [B, S, Hq, D], [B, S, Hkv, D]
        kc, vc = cache.k[layer], cache.v[layer]  # [B, Hkv, max_len, D]
        # padding columns land past the row's length: never read
        if ctx.scatter is None:  # every row starts at ctx.start: one slice write each
            p = ctx.start
            kc[:, :, p : p + S] = k.transpose(1, 2)
            vc[:, :, p : p + S] = v.transpose(1, 2)
        else:  # ragged rows: one indexed write each, row b at its own positions pos[b]
            rows, pos = ctx.scatter  # [B, 1], [B, S]
            kc[rows, :, pos] = k  # the indexed axes come first: [B, S, Hkv, D], as k is
            vc[rows, :, pos] = v
        keys, vals = kc[:, :, : ctx.T], vc[:, :, : ctx.T]  # [B, Hkv, T, D] views, no copy
        if ctx.per_query:  # every query alone, in one fixed order: the same bits whatever shares the call
            out = self.down.kernel.module.attend(q, kc, vc, ctx.starts, self.scale)  # [B, S, Hq, D]
        elif ctx.grouped:  # S == 1, no mask: fold the q heads of one kv group into the query axis
            out = F.scaled_dot_product_attention(q.reshape(B, Hkv, Hq // Hkv, D), keys, vals, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, vals, attn_mask=ctx.mask, scale=self.scale, enable_gqa=True
            )  # [B, Hq, S, D]
            out = out.transpose(1, 2)
        h = x + self.o(out.reshape(B, S, Hq * D))  # out-of-place: x may be a returned feature
        gate_up = self.gate_up(rms_norm(h, self.mlp_norm, self.eps))  # [B, S, 2I]
        if fused:
            return h + self.down.kernel.after_silu_mul(gate_up)  # [B, S, H]
        gate, up = gate_up.chunk(2, dim=-1)  # [B, S, I] x2
        return h + self.down(F.silu(gate) * up)  # [B, S, H]


def layer_blocks(blocks: dict, layer: int) -> dict:
    """Layer `layer`'s GGUF blocks by projection name ("q_proj", ...) from blocks by parameter name."""
    prefix = f"model.layers.{layer}."
    return {name.split(".")[-2]: b for name, b in blocks.items() if name.startswith(prefix)}


@dataclass
class _Step:
    """What every layer of one forward shares: RoPE rows, where to write, how far to read, mask."""

    rope: Rope
    cos: torch.Tensor
    sin: torch.Tensor
    start: int  # where every row writes when they start together
    scatter: tuple[torch.Tensor, torch.Tensor] | None  # else (rows [B, 1], positions [B, S])
    T: int
    mask: torch.Tensor | None
    grouped: bool
    starts: torch.Tensor | None = None  # [B] int64, where each row's first new token sits (per_query only)
    per_query: bool = False  # attention by the kernel, one query at a time (every forward where it loaded)


class NativeModel(nn.Module):
    """weight_format: float32 (the weights as loaded), or bfloat16 / int8 weights with fp32 activations
    (the model's weights should already hold the format's values: quant.apply_weight_format_), or a dot format.
    blocks: a GGUF's own blocks by parameter name (gguf.read_blocks), which q4-dot packs."""

    def __init__(self, cfg: NativeConfig, hf_model, weight_format: str = "float32", blocks=None):
        super().__init__()
        inner = hf_model.model
        self.cfg = cfg
        self.embed = inner.embed_tokens.weight  # [V, H], shared
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.weight_format = weight_format
        blocks = blocks or {}
        self.blocks = nn.ModuleList(
            Block(cfg, layer, weight_format, layer_blocks(blocks, i)) for i, layer in enumerate(inner.layers)
        )
        self.norm = inner.norm.weight
        head = hf_model.lm_head.weight  # tied models: this is the embedding tensor itself
        self.lm_head = Linear(
            head, getattr(hf_model.lm_head, "bias", None), weight_format, blocks.get("lm_head.weight")
        )
        self.rope = Rope(inner.rotary_emb, cfg.head_dim, self.dtype, self.device)
        self._fused = None  # the kernel extension's DecoderLayers, built at the first decode-sized forward

    @classmethod
    def from_hf(cls, hf_model, weight_format: str = "float32", blocks=None) -> NativeModel:
        why = native_support(hf_model)
        if why is not None:
            raise ValueError(why)
        return cls(NativeConfig.from_hf(hf_model.config), hf_model, weight_format, blocks).eval()

    def fused_layers(self):
        """Every layer's weights handed to the kernel extension once (its DecoderLayers), or None without it."""
        if self._fused is None and self.blocks[0].down.kernel is not None:
            c, tensors, ints = self.cfg, [], []
            none = torch.empty(0)
            for b in self.blocks:
                qk = none if b.qk_norm is None else b.qk_norm.detach().float().contiguous()
                tensors += [b.attn_norm.detach().contiguous(), b.mlp_norm.detach().contiguous(), qk]
                for lin in (b.qkv, b.o, b.gate_up, b.down):
                    k = lin.kernel
                    tensors += [k.panels, none if k.bias is None else k.bias, none if k.scale is None else k.scale]
                    ints += [k.group, k.out_features]
            scale = self.blocks[0].scale
            module = self.blocks[0].down.kernel.module
            self._fused = module.DecoderLayers(
                tensors, ints, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, scale
            )
        return self._fused

    @property
    def bf16_dot(self) -> bool:
        """bf16 weights run on the CPU's bf16 dot product (DOMINOSPEC_BF16_DOT=on, AVX512-BF16)."""
        kernel = self.lm_head.kernel
        return kernel is not None and kernel.format == "bfloat16_pairs"

    @property
    def weight_bytes(self) -> int:
        """Bytes of linear weights one forward streams through the kernel (0 without it)."""
        linears = [self.lm_head] + [getattr(b, n) for b in self.blocks for n in ("qkv", "o", "gate_up", "down")]
        return sum(lin.kernel.nbytes for lin in linears if lin.kernel is not None)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm (what the LM head reads)."""
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def new_cache(self, batch: int = 1, max_len: int = 2048) -> KVCache:
        return KVCache(self.cfg, batch, max_len, self.dtype, self.device)

    @torch.no_grad()  # not inference_mode: returned features may feed a drafter that trains
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        num_new: list[int] | None = None,
        logits: str = "all",
        feature_layers: list[int] | None = None,
    ):
        """Append tokens to the cache and run them; returns (logits, features).

        input_ids [B, S]: row b appends its first num_new[b] tokens (default S) at positions
        cache.lengths[b].. ; later columns are padding and affect nothing. Causal inside the new
        tokens. logits: "all" -> [B, S, V], "last" -> [B, V] at each row's last real token (column 0
        for a row with 0 new tokens), "none" -> None. features: decoder-layer outputs (residual
        stream before the final norm; HF hidden_states[j + 1], except that HF's entry for the last
        layer is post-norm) for j in feature_layers, concatenated: [B, S, len * H], or None.
        """
        B, S = input_ids.shape
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        if not set(feature_layers or []) <= set(range(self.cfg.num_layers)):
            raise ValueError(f"feature_layers {feature_layers} out of range 0..{self.cfg.num_layers - 1}")
        if B != cache.batch:
            raise ValueError(f"input batch {B} != cache batch {cache.batch}")
        n = [S] * B if num_new is None else [int(t) for t in num_new]
        if len(n) != B or not all(0 <= t <= S for t in n):
            raise ValueError(f"num_new {num_new} must give 0..{S} tokens for each of {B} rows")
        starts = list(cache.lengths)
        cache.ensure(max(starts) + S)  # padding columns are written too
        T = max(p + t for p, t in zip(starts, n))  # longest valid prefix after this step
        cos, sin = self.rope.tables(max(starts) + S)
        if B == 1 or len(set(starts)) == 1:  # same positions in every row: slice, no gather
            p = starts[0]
            cos, sin = cos[None, p : p + S, None], sin[None, p : p + S, None]  # [1, S, 1, D]
            pos, scatter = None, None
        else:
            p = 0
            pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(S, device=self.device)
            cos, sin = cos[pos][:, :, None], sin[pos][:, :, None]  # [B, S, 1, D]
            scatter = (torch.arange(B, device=self.device)[:, None], pos)
        # With the kernel every forward (decode, verify, engine batches and prefill chunks of any length) runs
        # attention in it, each query on its own, so a token's logits are the same bits decoded alone, verified
        # among others, batched with other requests, or prefilled whole or in chunks of any size (SDPA's masked
        # multi-query and one-query paths sum in different orders, ~1e-6 apart; activations rounded to bf16 or
        # int8 turned that into flipped greedy answers). It also measured faster than SDPA for prompts of
        # 64-700 tokens (int8, 1 thread: 0.89-0.94x the time).
        per_query = S <= PER_QUERY_MAX and self.blocks[0].down.kernel is not None
        starts_t = torch.tensor(starts, dtype=torch.long) if per_query else None
        mask = None
        if not per_query and (S > 1 or any(p + t != T for p, t in zip(starts, n))):
            # Causal with per-row offset; padding queries see their prefix too (no all-False rows).
            qpos = pos if pos is not None else (starts[0] + torch.arange(S, device=self.device))[None]
            allowed = torch.arange(T, device=self.device) <= qpos[..., None]  # [B or 1, S, T]
            # additive float mask built once: SDPA would convert a bool mask again in every layer
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill_(~allowed, float("-inf"))[:, None]  # [B or 1, 1, S, T]
        grouped = mask is None and S == 1
        ctx = _Step(self.rope, cos, sin, p, scatter, T, mask, grouped, starts_t, per_query)

        want, feats = set(feature_layers or []), {}
        x = F.embedding(input_ids, self.embed)  # [B, S, H]
        if per_query and fused_layers_enabled():  # every layer in one call of the kernel extension
            keep = sorted(want)
            d = self.cfg.head_dim
            cs, sn = cos.reshape(-1, S, d).contiguous(), sin.reshape(-1, S, d).contiguous()  # [B or 1, S, D]
            x, *kept = self.fused_layers().run(x, cache.k, cache.v, cs, sn, starts_t, keep)
            feats = dict(zip(keep, kept))
        else:
            for i, block in enumerate(self.blocks):
                x = block(x, i, cache, ctx)
                if i in want:
                    feats[i] = x  # residual stream after layer i, before the final norm
        for b in range(B):
            cache.lengths[b] = starts[b] + n[b]

        out = None
        if logits == "all":
            out = self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps))  # [B, S, V]
        elif logits == "last":  # only the rows we need through the big LM head
            idx = torch.tensor([max(t - 1, 0) for t in n], device=self.device)  # a row with 0 new: column 0
            last = x[torch.arange(B, device=self.device), idx] if B > 1 else x[:, max(n[0] - 1, 0)]  # [B, H]
            out = self.lm_head(rms_norm(last, self.norm, self.cfg.rms_norm_eps))  # [B, V]
        features = torch.cat([feats[j] for j in feature_layers], dim=-1) if feature_layers else None
        return out, features  # features [B, S, len(feature_layers) * H]
