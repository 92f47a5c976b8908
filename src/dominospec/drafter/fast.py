"""The drafter's inference path on the small-row kernel: every linear packed once, a rollout of few ops.

Why: a draft cycle of the library path is ~45 small GEMMs (each re-reading or re-packing its weight)
and ~30 tensor ops per rollout slot. Here every linear of the drafter (context projection, fused
q/k/v and gate/up, o, down, the head's GRU / low-rank / recurrent cells, the confidence head, the
LM-head rows of the draft vocabulary) is packed once into the kernel's panels (targets/kernels.py),
which stream each weight once for all rows; a row's result does not depend on how many rows share
the call. The rollout precomputes what does not depend on the drafts (w1_z(z) for every slot, the
confidence after the last slot) and runs each slot as one packed GRU gate GEMM over [x ; s], a lerp,
one low-rank GEMM pair and one pick; the Domino head's slots run in the kernel extension (a greedy block is one
call, cpu_kernels/drafter_rollout.cpp), the same ops in the same order as in Python.

When (`Drafter.fast()`): CPU, float32, the kernel built, autograd off (decoding; never a training
step), and DOMINOSPEC_DRAFTER_FAST not "off" (today's library path, for A/B runs in one process).
The packed copies remember every weight's storage and version counter: an optimiser step,
`load_state_dict`, `.to()`, a new draft vocabulary or an in-place edit repacks at the next use.
Numerics equal the library path to fp32 rounding (greedy drafts identical in the tests).

Shapes: R rows (sequences), b slots, B block, H hidden, D head dim, V' draft vocabulary, g GRU width.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..sampling import pick_per_row
from ..targets.kernels import PackedLinear, load_kernels
from .layers import rope_tables

ENV_SWITCH = "DOMINOSPEC_DRAFTER_FAST"  # "off": the drafter's library path (today's), for A/B runs


def fast_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change in place)
        return 0


def watched_tensors(drafter) -> list[torch.Tensor]:
    """What the packed copies are made from: every parameter and buffer, and the borrowed tables."""
    tensors = [*drafter.parameters(), *drafter.buffers()]
    if drafter._borrowed is not None:
        tensors += [drafter._borrowed[0].weight, drafter._borrowed[1].weight]
    return tensors


class Watch:
    """Storage and version counter of each watched tensor at packing time: any in-place change (an optimiser
    step, load_state_dict's copy, an edit), a move or a new storage makes the packed copies stale. A few
    microseconds per check (no module traversal); where tensors may be replaced (`.to()`, `attach`, an assigning
    load) the Drafter checks `covers` over the current ones."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.seen = [(t, t.data_ptr(), _version(t)) for t in tensors]

    def stale(self) -> bool:
        return any(t.data_ptr() != ptr or _version(t) != v for t, ptr, v in self.seen)

    def covers(self, tensors: list[torch.Tensor]) -> bool:
        """The same tensor objects, unchanged (after a call that may replace them: `.to()`, assign loads)."""
        return (
            len(tensors) == len(self.seen)
            and all(t is s for t, (s, _, _) in zip(tensors, self.seen))
            and not self.stale()
        )


WEIGHTS_SWITCH = "DOMINOSPEC_DRAFTER_WEIGHTS"  # float32, bfloat16, bfloat16-dot, int8, int8-dot or auto
DRAFTER_FORMATS = ("float32", "bfloat16", "bfloat16-dot", "int8", "int8-dot")


def drafter_weight_format(target) -> str:
    """The format the packed drafter streams its weights in: DOMINOSPEC_DRAFTER_WEIGHTS, else ("auto") the
    target's own weight format (int8 for the bundled SmolLM2 under --dtype auto), else float32, with int8 on the
    int8 dot product where the kernel has one (AVX512-VNNI or AVX2): a draft cycle's 8 rows then stream at memory
    speed, where int8 panels with fp32 activations pay one FMA per weight and row. bfloat16-dot: bf16 weights on
    the CPU's bf16 dot product (AVX512-BF16; activations rounded to bf16 too), twice the multiply-adds per
    instruction; int8-dot: int8 weights x activations quantised per row to int8. Only the drafts' speed and
    acceptance depend on it: verification keeps the output the target's (the shipped drafter's acceptance in
    int8-dot equals int8's: docs/speed.md)."""
    choice = os.environ.get(WEIGHTS_SWITCH, "auto").strip().lower()
    if choice == "auto":
        own = getattr(target, "weight_only", None) or "float32"
        if own == "int8" and torch.device(getattr(target, "device", "cpu")).type == "cpu":
            module = load_kernels()
            if module is not None and module.int8_dot_paths():
                return "int8-dot"
        return own
    if choice not in DRAFTER_FORMATS:
        raise ValueError(f"{WEIGHTS_SWITCH}={choice!r}: expected one of {', '.join(DRAFTER_FORMATS)} or auto")
    return choice


class Packer:
    """Packs weights into the kernel's panels in one weight format (DRAFTER_FORMATS; a dot format falls back to
    its weights widened to fp32, bfloat16 or int8, where the CPU lacks its dot product)."""

    def __init__(self, module, weight_format: str):
        self.module, self.format = module, weight_format
        if weight_format == "bfloat16-dot":
            self.format = "bfloat16_pairs" if module.has_bf16_dot() else "bfloat16"
        if weight_format == "int8-dot" and not module.int8_dot_paths():
            self.format = "int8"

    def __call__(self, *weights: torch.Tensor, bias=None) -> PackedLinear:
        """One PackedLinear over the weights stacked by output rows (a fused projection)."""
        w = weights[0] if len(weights) == 1 else torch.cat(weights)
        return PackedLinear(self.module, w.detach().float(), None if bias is None else bias.detach(), self.format)


class PackedLayer:
    """A DraftLayer's inference: fused q/k/v (k/v alone for context rows), o, fused gate/up, down."""

    def __init__(self, pack: Packer, layer):
        c = self.c = layer.c
        self.layer, self.module = layer, pack.module
        self.qkv = pack(layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
        self.kv = pack(layer.k_proj.weight, layer.v_proj.weight)
        self.o = pack(layer.o_proj.weight)
        self.gate_up = pack(layer.gate_proj.weight, layer.up_proj.weight)
        self.down = pack(layer.down_proj.weight)
        self.qk_w = self.k_w = None  # [hq+hkv, D] per-head norm weights, so q and k heads are normed in one op
        if c.qk_norm:
            self.k_w = layer.k_norm.weight.detach()
            self.qk_w = torch.cat(
                [
                    layer.q_norm.weight.detach().expand(c.num_attention_heads, -1),
                    self.k_w.expand(c.num_key_value_heads, -1),
                ]
            )

    def _rope(self, x, cos, sin, heads: int):
        # x [N, S, >= heads, D] -> the first `heads` heads rotated, [N, S, heads, D]
        return self.module.rope(x, cos, sin, heads)

    def kv_rows(self, x, cos, sin):
        """Keys/values of context rows x [N, S, H] -> [N, kv, S, D] each (cos/sin [1 or N, S, D], sign in sin)."""
        c = self.c
        n, s, _ = x.shape
        kv = self.kv(x).view(n, s, 2 * c.num_key_value_heads, c.head_dim)
        k, v = kv[:, :, : c.num_key_value_heads], kv[:, :, c.num_key_value_heads :]
        if self.k_w is not None:
            k = F.rms_norm(k, k.shape[-1:], None, c.rms_norm_eps) * self.k_w
        k = self._rope(k, cos, sin, c.num_key_value_heads)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        # x [R, B, H] block rows; ctx_k/ctx_v [R, kv, C, D]; mask bool [R, 1, B, C+B] or None
        c, L = self.c, self.layer
        R, B, _ = x.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = F.rms_norm(x, x.shape[-1:], L.input_norm.weight, c.rms_norm_eps)
        qkv = self.qkv(h).view(R, B, hq + 2 * hkv, d)  # heads q | k | v
        qk, v = qkv[:, :, : hq + hkv], qkv[:, :, hq + hkv :]
        if self.qk_w is not None:
            qk = F.rms_norm(qk, qk.shape[-1:], None, c.rms_norm_eps) * self.qk_w
        qk = self._rope(qk, cos, sin, hq + hkv)  # [R, B, hq+hkv, D]
        q, k, v = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2), v.transpose(1, 2)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            k = torch.cat([ctx_k.expand(R, -1, -1, -1), k], dim=2)  # [R, kv, C+B, D]
            v = torch.cat([ctx_v.expand(R, -1, -1, -1), v], dim=2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)  # [R, hq, B, D]
        x = x + self.o(attn.transpose(1, 2).reshape(R, B, hq * d))
        h = F.rms_norm(x, x.shape[-1:], L.post_norm.weight, c.rms_norm_eps)
        return x + self.down.after_silu_mul(self.gate_up(h))  # [R, B, H]


class Rope:
    """cos/sin rows by position from one growing table (the same fp32 arithmetic as layers.rope_tables),
    the sign of rotate_half folded into sin as the kernel's rope expects."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta, self.half = head_dim, theta, head_dim // 2
        self.tables = (torch.empty(0, head_dim), torch.empty(0, head_dim))  # one tuple: replaced whole

    def __call__(self, pos: torch.Tensor, needed: int):
        # pos [N, S] -> cos, sin [N, S, D] contiguous
        cos, sin = self.tables
        if needed > cos.shape[0]:
            n = max(needed, 2 * cos.shape[0], 256)
            cos, sin = rope_tables(torch.arange(n), self.head_dim, self.theta, torch.float32)
            sin = torch.cat([-sin[:, : self.half], sin[:, self.half :]], dim=-1)
            self.tables = (cos, sin)
        return cos[pos], sin[pos]


class DominoSteps:
    """The Domino head's slots in the kernel extension (cpu_kernels/drafter_rollout.cpp): the embedding of the
    realised token, the GRU over it (one packed gate GEMM), the low-rank correction and, for a greedy block, the
    pick, with no Python per slot. The same ops as the library head, on the packed linears."""

    needs_embedding = False  # the kernel gathers the embedding itself

    def __init__(self, pack: Packer, drafter):
        head, hidden = drafter.head, drafter.config.hidden_size
        g = self.g = head.g
        wi, wh = head.gru_ih.weight.detach(), head.gru_hh.weight.detach()  # [3g, H], [3g, g], gates r, z, n
        zeros_ih, zeros_hh = wi.new_zeros(g, hidden), wh.new_zeros(g, g)
        # [x ; s] -> [r_i + r_h, z_i + z_h, n_i, n_h]: n needs its two halves apart (r gates n_h)
        gates = torch.cat(
            [
                torch.cat([wi[: 2 * g], wh[: 2 * g]], dim=1),
                torch.cat([wi[2 * g :], zeros_hh], dim=1),
                torch.cat([zeros_ih, wh[2 * g :]], dim=1),
            ]
        )  # [4g, H+g]
        self.gates = pack(gates)
        self.w1_z, self.w1_s, self.w2 = (
            pack(head.w1_z.weight),
            pack(head.w1_s.weight),
            pack(head.w2.weight),
        )
        self.hidden = hidden
        none = torch.empty(0)
        vocab = drafter.draft_vocab if drafter.config.draft_vocab_size else torch.empty(0, dtype=torch.long)
        tensors, ints = [drafter._tables()[0].weight.detach(), vocab], []
        for lin in (self.gates, self.w1_s, self.w2):
            tensors += [lin.panels, none if lin.bias is None else lin.bias, none if lin.scale is None else lin.scale]
            ints += [lin.group, lin.out_features]
        self.kernel = pack.module.DominoRollout(tensors, ints, hidden, g)

    def start(self, z):
        """One rollout's state (kept by the caller: a drafter may roll out in several threads) for z [R, b, H]:
        the slot-independent half of the correction for every slot at once, and [x ; s] with s = 0."""
        return self.w1_z(z), z.new_zeros(z.shape[0], self.hidden + self.g)  # [R, b, rank], [R, H+g]

    def __call__(self, k, prev_emb, prev_id, base_k, state):
        w1z, xs = state
        return self.kernel.step(k, prev_id, base_k, w1z, xs)  # [R, V']; s updated in xs

    def greedy(self, state, base, anchors, top: bool):
        """Every slot of a greedy block in one call: (drafts [R, b] target ids, top probabilities [R, b] or None)."""
        drafts, tops = self.kernel.greedy(base, state[0], anchors, top)
        return drafts, tops if top else None


class MarkovSteps:
    """DSpark's bigram correction W2 W1[x_{k-1}]."""

    needs_embedding = False

    def __init__(self, pack: Packer, drafter):
        head = drafter.head
        self.w1, self.w2 = head.w1.weight.detach(), pack(head.w2.weight)

    def start(self, z):
        return None

    def __call__(self, k, prev_emb, prev_id, base_k, state):
        return self.w2(F.embedding(prev_id, self.w1)).add_(base_k)


class RNNSteps:
    """DSpark's gated recurrent correction over [s ; W1[x_{k-1}] ; z_k]."""

    needs_embedding = False

    def __init__(self, pack: Packer, drafter):
        head = drafter.head
        self.r = head.r
        self.w1 = head.w1.weight.detach()
        self.cell, self.w2 = pack(head.cell.weight, bias=head.cell.bias), pack(head.w2.weight)

    def start(self, z):
        return z, z.new_zeros(z.shape[0], 2 * self.r + z.shape[-1])  # z [R, b, H]; [s ; e ; h] [R, 2r+H], s = 0

    def __call__(self, k, prev_emb, prev_id, base_k, state):
        (z, x), r = state, self.r
        x[:, r : 2 * r] = F.embedding(prev_id, self.w1)
        x[:, 2 * r :] = z[:, k]
        g, c, o = self.cell(x).chunk(3, dim=-1)
        x[:, :r] = torch.lerp(torch.tanh(c), x[:, :r], torch.sigmoid(g))  # gate s + (1 - gate) tanh(c)
        return self.w2(torch.tanh(o)).add_(base_k)


class PathSteps:
    """The path selector: pair scores of (previous token, each of the slot's top-m base candidates), gated by z_k."""

    needs_embedding = False

    def __init__(self, pack: Packer, drafter):
        head = drafter.head
        self.m = head.m
        self.w1, self.w2 = head.w1.weight.detach(), head.w2.weight.detach()  # code tables: gathered, not streamed
        self.gate = pack(head.gate.weight)

    def start(self, z):
        return torch.sigmoid(self.gate(z))  # [R, b, rank]: every slot's gate at once

    def __call__(self, k, prev_emb, prev_id, base_k, gates):
        if k == 0:  # slot 0 stays pure
            return base_k
        cands = base_k.topk(self.m, dim=-1).indices  # [R, m]
        a = F.embedding(prev_id, self.w1) * gates[:, k]  # [R, rank]
        pair = (F.embedding(cands, self.w2) * a.unsqueeze(1)).sum(-1)  # [R, m]
        return torch.zeros_like(base_k).scatter_(-1, cands, pair).add_(base_k)


STEPS = {"domino": DominoSteps, "markov": MarkovSteps, "rnn": RNNSteps, "path": PathSteps}


class PackedDrafter:
    """Packed copies of a Drafter's weights and its inference passes over them (see the module note)."""

    def __init__(self, drafter, module, weight_format: str = "float32"):
        c = drafter.config
        self.drafter, self.config, self.format = drafter, c, weight_format
        pack = Packer(module, weight_format)
        self.watch = Watch(watched_tensors(drafter))
        self.fc = pack(drafter.fc.weight)
        self.layers = [PackedLayer(pack, layer) for layer in drafter.layers]
        self.rope = Rope(c.head_dim, c.rope_theta)
        self.lm_head = self._lm_head(drafter, pack)
        self.steps = STEPS[c.head](pack, drafter) if drafter.head.corrects else None
        self.conf = None
        if drafter.confidence is not None:
            self.conf = pack(drafter.confidence.proj.weight, bias=drafter.confidence.proj.bias)

    @staticmethod
    def _lm_head(drafter, pack: Packer) -> PackedLinear:
        if drafter._head_rows is not None:  # the draft vocabulary's rows, packed once
            return pack(drafter._head_rows)
        shared = drafter._target_head_kernel  # the full LM head: the target's own panels where it has them
        return shared if shared is not None else pack(drafter._tables()[1].weight)

    # ----- the backbone -----
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, S, n*H] -> context rows [N, S, H]."""
        c = self.config
        return F.rms_norm(self.fc(features.float()), (c.hidden_size,), self.drafter.ctx_norm.weight, c.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor):
        """Per layer (k, v) [N, kv, S, D] of context rows ctx [N, S, H] at positions pos [1 or N, S]."""
        cos, sin = self.rope(pos, int(pos.max()) + 1)
        return [layer.kv_rows(ctx, cos, sin) for layer in self.layers]

    def block(self, x, pos, ctx_kv, mask):
        """z [R, B, H] of block rows x at positions pos [R, B] over per-layer context K/V."""
        cos, sin = self.rope(pos, int(pos.max()) + 1)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer.forward(x, cos, sin, ck, cv, mask)
        c = self.config
        return F.rms_norm(x, (c.hidden_size,), self.drafter.norm.weight, c.rms_norm_eps)

    def base_logits(self, z: torch.Tensor) -> torch.Tensor:
        return self.lm_head(z)  # [..., V']

    # ----- the rollout -----
    def rollout(self, z, anchors, samplings, gens, use_head: bool, top: bool):
        """z [R, b, H], anchors [R] -> (drafts [R, b] target ids, per-row [b, V'] distributions or None,
        confidence logits [R, b] or None, top draft probabilities [R, b] or None)."""
        d = self.drafter
        R, b, _ = z.shape
        base = self.base_logits(z)  # [R, b, V']
        if not use_head or self.steps is None:
            picks, dists = pick_per_row(base, samplings, gens)  # [R, b]
            drafts = d.to_target_ids(picks)
            tops = torch.softmax(base, -1).amax(-1) if top else None
        elif all(s.greedy for s in samplings) and hasattr(self.steps, "greedy"):  # the whole block in one call
            drafts, tops = self.steps.greedy(self.steps.start(z), base, anchors, top)
            dists = [None] * R
        else:
            steps = self.steps
            state = steps.start(z)
            drafts = anchors.new_empty(R, b)
            tops = base.new_empty(R, b) if top else None
            rows = [[] for _ in range(R)]
            prev = anchors
            for k in range(b):
                emb = d.embed(prev) if steps.needs_embedding else None
                logits = steps(k, emb, prev, base[:, k], state)  # [R, V']
                if top:
                    tops[:, k] = torch.softmax(logits, -1).amax(-1)
                picks, dk = pick_per_row(logits[:, None], samplings, gens)  # [R, 1]
                prev = drafts[:, k] = d.to_target_ids(picks[:, 0])
                for r, p in enumerate(dk):
                    rows[r].append(p)
            dists = [None if s.greedy else torch.cat(rows[r]) for r, s in enumerate(samplings)]
        confidence = None
        if self.conf is not None:  # slot k reads the token before it: the anchor, then the drafts
            prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)  # [R, b]
            x = z if not d.confidence.reads_prev else torch.cat([z, d.embed(prev).float()], dim=-1)
            confidence = self.conf(x)[..., 0]  # [R, b]
        return drafts, dists, confidence, tops
