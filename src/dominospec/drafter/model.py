"""The Domino drafter: a parallel draft backbone plus a light sequential head.

Backbone: context features from a few target layers are projected to the hidden size and
injected as extra keys/values into every draft layer; the block [anchor, MASK, ..., MASK]
attends bidirectionally to itself and to the context strictly before the anchor. Block slot k
predicts the token at anchor+1+k (the shift-label rule). The target's embedding table and LM
head are borrowed at run time and never saved here.

Heads (heads.py) turn the backbone's base logits into the logits a draft token is sampled from,
left to right inside the block.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DominoError
from ..targets.features import check_layer_ids
from ..targets.kernels import load_kernels
from ..targets.native import KVCache
from .checkpoint import (
    CONFIG_NAME,
    check_draft_vocab,
    check_state,
    named_drafter_dir,
    read_checkpoint,
    save_checkpoint,
)
from .config import DrafterConfig
from .fast import PackedDrafter, drafter_weight_format, fast_enabled, watched_tensors
from .heads import HEADS, ConfidenceHead
from .layers import DraftLayer, RMSNorm, block_attention_mask, rope_tables

# The fused last context row is RMS-normed (entries ~1), a token embedding's entries ~0.05-0.1, and Adam moves
# every weight by ~lr per step: unscaled, a projection starting at zero swamped the anchor's embedding within a
# few steps (docs/training.md, "The target's last context row fused into the block").
FUSE_SCALE = 0.02


class DraftCache:
    """One sequence's row of a per-row draft cache (a KVCache slot): K/V of committed context rows
    only; the block's own K/V are never stored. Batch 1 owns a one-row cache that grows by doubling."""

    def __init__(self, rows: KVCache, slot: int = 0):
        self.rows, self.slot = rows, slot

    @property
    def length(self) -> int:
        return self.rows.lengths[self.slot]


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
        self.fuse = nn.Linear(c.hidden_size, c.hidden_size, bias=False) if c.fuse_context else None
        self.head = HEADS[c.head](c)
        self.confidence = ConfidenceHead(c) if c.confidence_head else None
        self.directory: Path | None = None  # set by from_pretrained: where the sidecar files live
        if c.draft_vocab_size:  # draft-vocabulary slot -> target token id; set by training
            self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size))
        self.apply(self._init)
        self.head.zero_correction()  # an untrained head leaves the base logits unchanged
        # (embedding, lm_head) borrowed from the target; a tuple so they are neither
        # registered as submodules nor saved, moved or trained with the drafter
        self._borrowed: tuple[nn.Module, nn.Module] | None = None
        self._head_rows: torch.Tensor | None = None  # LM-head rows of the draft vocabulary
        self._target_head_kernel = None  # the target's packed LM head (native CPU fp32), for the fast path
        self._packed: PackedDrafter | None = None  # inference copies on the small-row kernel (fast.py)
        self.weight_format = "float32"  # of the packed copies: the target's weight format at attach (fast.py)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @classmethod
    def for_target(cls, target, **arch) -> Drafter:
        """A fresh drafter shaped for `target` (arch: DrafterConfig fields; None keeps a default), attached.

        A learned mask vector starts at the mean target embedding, a neutral point of its space.
        """
        drafter = cls(DrafterConfig.for_target(target, **arch))
        with torch.no_grad():
            if drafter.mask_embedding is not None:
                drafter.mask_embedding.copy_(target.embed_weight.float().mean(0).to(drafter.mask_embedding.dtype))
        return drafter.attach(target)

    # ----- the target's frozen tables -----
    def attach(self, target) -> Drafter:
        """Check that this drafter fits `target`, borrow its embedding and LM head, match device/dtype."""
        self.check_fits(target)
        self.to(device=target.device, dtype=target.dtype)
        self._borrowed = (target.input_embeddings(), target.output_embeddings())
        self.weight_format = drafter_weight_format(target)
        self._drop_stale_pack()  # the same target again keeps them (attach is cheap to repeat)
        self._target_head_kernel = None
        native_head = getattr(getattr(target, "native", None), "lm_head", None)
        if getattr(self._borrowed[1], "bias", None) is None and getattr(native_head, "bias", None) is None:
            self._target_head_kernel = getattr(native_head, "kernel", None)
        self.refresh_head_rows()
        if not self.training:  # an inference drafter packs now, not inside its first timed cycle
            with torch.no_grad():
                self.fast()
        return self

    @property
    def inference_path(self) -> str:
        """ "packed" where decoding runs drafter/fast.py (CPU float32, kernel built, attached, switch on), else
        "library": what a draft-cost measurement is valid for."""
        if self._borrowed is None or not fast_enabled():
            return "library"
        w = self.fc.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or self._tables()[1].weight.dtype != torch.float32:
            return "library"
        return "packed" if load_kernels() is not None else "library"

    def fast(self) -> PackedDrafter | None:
        """The packed inference path (drafter/fast.py), or None where the library path runs: autograd on
        (training), or not `inference_path` "packed". Packed at first use and again whenever a weight
        changed (storage or version counter)."""
        if torch.is_grad_enabled() or self.inference_path != "packed":
            return None
        module = load_kernels()
        packed = self._packed  # one read: another thread may repack meanwhile
        if packed is None or packed.format != self.weight_format or packed.watch.stale():
            packed = self._packed = PackedDrafter(self, module, self.weight_format)
        return packed

    def __getstate__(self):  # copies and pickles leave the packed copies behind (made again at next use)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_packed": None, "_target_head_kernel": None}

    def _drop_stale_pack(self) -> None:
        """Forget the packed copies if a watched tensor was replaced or changed (they are made again at next use)."""
        packed = getattr(self, "_packed", None)
        if packed is not None and not packed.watch.covers(watched_tensors(self)):
            self._packed = None

    def _apply(self, fn, *args, **kwargs):  # .to() / .float() may replace the watched tensors
        out = super()._apply(fn, *args, **kwargs)
        self._drop_stale_pack()
        return out

    def load_state_dict(self, *args, **kwargs):  # assign=True replaces them
        out = super().load_state_dict(*args, **kwargs)
        self._drop_stale_pack()
        return out

    def check_fits(self, target) -> None:
        c = self.config
        pairs = [
            ("hidden_size", c.hidden_size, target.hidden_size),
            ("vocab_size", c.vocab_size, target.vocab_size),
            ("target_num_layers", c.target_num_layers, target.num_layers),
        ]
        bad = [f"{name}: drafter {mine} vs target {theirs}" for name, mine, theirs in pairs if mine != theirs]
        if bad:
            raise DominoError(
                f"drafter (made for {c.target_name or 'another target'!r}) does not fit target "
                f"{target.name!r}: " + "; ".join(bad)
            )
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
        fast = self.fast()
        if fast is not None:
            return fast.base_logits(z)
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

    def block_inputs(self, anchors: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of [anchor, MASK, ..., MASK] per block: anchors [N] -> [N, B, H].

        last [N, H]: each block's last context row (zeros where the anchor has none), whose projection
        `fuse` adds to every row of its block (config.fuse_context; ignored otherwise).
        """
        c = self.config
        first = self.embed(anchors).unsqueeze(1).to(self.dtype)
        if c.mask_token_id is not None:
            mask = self.embed(torch.full_like(anchors, c.mask_token_id)).unsqueeze(1).to(self.dtype)
        else:
            mask = self.mask_embedding.view(1, 1, -1)
        x = torch.cat([first, mask.expand(anchors.shape[0], c.block_size - 1, -1)], dim=1)
        if self.fuse is not None:
            if last is None:
                raise DominoError("internal: a drafter that fuses the last context row was not given it")
            x = x + FUSE_SCALE * self.fuse(last.to(x.dtype)).unsqueeze(1)
        return x

    def last_context(self, ctx: torch.Tensor, anchor_pos: torch.Tensor, offsets=None) -> torch.Tensor | None:
        """The context row right before each anchor: ctx [S, H], anchor_pos [N] -> [N, H], zeros at anchor 0.
        offsets [N]: where each anchor's own sequence starts in ctx (packed sequences). None when this drafter
        does not fuse the row."""
        if self.fuse is None:
            return None
        at = anchor_pos - 1 if offsets is None else anchor_pos + offsets - 1
        rows = ctx[at.clamp(min=0)]
        return rows * (anchor_pos > 0).unsqueeze(1).to(rows.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, S, n*H] -> context rows [N, S, H]."""
        fast = self.fast()
        if fast is not None:
            return fast.context(features)
        return self.ctx_norm(self.fc(features.to(self.dtype)))

    # ----- inference: blocks over a cached context, one sequence or many in cache slots -----
    def new_row_cache(self, batch: int, max_len: int) -> KVCache:
        """A preallocated per-row draft cache of `batch` slots (the engine's; see KVCache.claim)."""
        c = self.config
        return KVCache.allocate(
            len(self.layers),
            batch,
            c.num_key_value_heads,
            max_len,
            c.head_dim,
            self.dtype,
            self.fc.weight.device,
            row_dim=c.hidden_size if self.fuse is not None else 0,  # the context rows, for the fused last one
        )

    def new_cache(self, max_len: int = 256) -> DraftCache:
        """A batch-1 cache (it grows when a sequence outruns `max_len`)."""
        rows = self.new_row_cache(1, max_len)
        rows.claimed[0] = True
        return DraftCache(rows, 0)

    def extend_cache(self, cache: DraftCache, features: torch.Tensor) -> None:
        """Append committed context rows (target features [1, S, n*H] at positions cache.length..)."""
        s = features.shape[1]
        if s == 0:
            return
        rows, slot, start = cache.rows, cache.slot, cache.length
        rows.ensure(start + s)
        pos = torch.arange(start, start + s, device=features.device).unsqueeze(0)
        fast = self.fast()
        ctx = self.context(features)  # [1, S, H]
        if fast is not None:
            kvs = fast.context_kv(ctx, pos)
        else:
            cos, sin = rope_tables(pos, self.config.head_dim, self.config.rope_theta, ctx.dtype)
            kvs = [layer.kv(ctx, cos, sin) for layer in self.layers]
        for i, (k, v) in enumerate(kvs):  # [1, kv, S, D] each
            rows.k[i, slot, :, start : start + s] = k[0]
            rows.v[i, slot, :, start : start + s] = v[0]
        if self.fuse is not None:
            rows.kept[slot, start : start + s] = ctx[0]
        rows.lengths[slot] = start + s

    def backbone_block(self, cache: DraftCache, anchor: torch.Tensor) -> torch.Tensor:
        """Final hidden states z [1, B, H] of the block anchored right after the cached context."""
        return self.backbone_rows(cache.rows, [cache.slot], anchor)

    def backbone_rows(self, rows: KVCache, slots: list[int], anchors: torch.Tensor) -> torch.Tensor:
        """z [R, B, H] of one block per slot, each anchored right after its own cached context.

        anchors [R]. Rows with shorter contexts see only their own positions (a key mask); the K/V of
        the slots are gathered once per layer (the drafter has few layers).
        """
        lens = [rows.lengths[s] for s in slots]
        last = None
        if self.fuse is not None:  # each slot's last context row, zeros for an empty context (one gather)
            n = torch.tensor(lens, device=rows.kept.device)
            at = (torch.tensor(slots, device=n.device), (n - 1).clamp(min=0))
            last = rows.kept[at] * (n > 0).unsqueeze(1).to(rows.kept.dtype)
        x = self.block_inputs(anchors, last)  # [R, B, H]
        C, bs, dev = max(lens), self.config.block_size, x.device
        pos = torch.tensor(lens, device=dev)[:, None] + torch.arange(bs, device=dev)  # [R, B]
        mask = None
        if len(set(lens)) > 1:  # [R, 1, B, C + B]: own context, then the whole block
            ctx_ok = torch.arange(C, device=dev) < torch.tensor(lens, device=dev)[:, None]  # [R, C]
            mask = torch.cat([ctx_ok, ctx_ok.new_ones(len(slots), bs)], dim=1)[:, None, None, :].expand(-1, 1, bs, -1)
        first = slots[0]
        sel = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else slots
        fast = self.fast()
        if fast is not None:
            ctx_kv = [(rows.k[i, sel, :, :C], rows.v[i, sel, :, :C]) for i in range(len(self.layers))]
            return fast.block(x, pos, ctx_kv, mask)
        cos, sin = rope_tables(pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            ck, cv = rows.k[i, sel, :, :C], rows.v[i, sel, :, :C]  # [R, kv, C, D] (a gather copies)
            x = layer(x, cos, sin, ck, cv, mask=mask)
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
        x = self.block_inputs(anchors, self.last_context(ctx[0], anchor_pos)).reshape(1, n * c.block_size, -1)
        pos = (anchor_pos.unsqueeze(1) + torch.arange(c.block_size, device=x.device)).reshape(1, -1)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_theta, x.dtype)
        mask = block_attention_mask(anchor_pos, s, c.block_size)
        for layer in self.layers:
            ck, cv = layer.kv(ctx, cos_c, sin_c)
            x = layer(x, cos, sin, ck, cv, mask=mask)
        return self.norm(x).view(n, c.block_size, -1)

    def forward_packed(
        self,
        features: torch.Tensor,
        lengths: list[int],
        anchor_pos: torch.Tensor,
        anchors: torch.Tensor,
        counts: list[int],
    ) -> torch.Tensor:
        """z [N, B, H] for the blocks of several sequences in one forward (training's fast path).

        features: [sum(lengths), n*H] the sequences' target features one after another; anchor_pos,
        anchors: [N] each block's position in its own sequence and token there, the blocks in
        sequence order, counts[r] of them for sequence r. Equals `forward_blocks` per sequence (tested).
        """
        c = self.config
        dev = features.device
        ctx = self.context(features.unsqueeze(0))  # [1, S_total, H]
        ctx_pos = torch.cat([torch.arange(n, device=dev) for n in lengths]).unsqueeze(0)
        cos_c, sin_c = rope_tables(ctx_pos, c.head_dim, c.rope_theta, ctx.dtype)
        offsets = None
        if self.fuse is not None:  # where each block's sequence starts in ctx, for its last context row
            starts = torch.tensor([0, *lengths[:-1]], device=dev).cumsum(0)
            offsets = starts.repeat_interleave(torch.tensor(counts, device=dev))
        x = self.block_inputs(anchors, self.last_context(ctx[0], anchor_pos, offsets))  # [N, B, H]
        pos = anchor_pos.unsqueeze(1) + torch.arange(c.block_size, device=dev)  # [N, B]
        cos, sin = rope_tables(pos, c.head_dim, c.rope_theta, x.dtype)
        # block n sees its own sequence's rows before its anchor
        visible, start = [], 0
        for n, count in zip(lengths, counts):
            a = anchor_pos[start : start + count]
            visible.append(torch.arange(n, device=dev).unsqueeze(0) < a.unsqueeze(1))  # [count, n]
            start += count
        for layer in self.layers:
            ck, cv = layer.kv(ctx, cos_c, sin_c)  # [1, kv, S_total, D]
            contexts = [
                (k[0], v[0], vis) for k, v, vis in zip(ck.split(lengths, dim=2), cv.split(lengths, dim=2), visible)
            ]
            x = layer.forward_packed(x, cos, sin, contexts, counts)
        return self.norm(x)

    def _remade(self, **fields) -> Drafter:
        """A new, untrained drafter of this one's config with `fields` changed, on its device and dtype."""
        config = DrafterConfig.from_dict({**self.config.to_dict(), **fields})
        return Drafter(config).to(device=self.fc.weight.device, dtype=self.dtype)

    def with_head(self, head: str, **fields) -> Drafter:
        """A copy of this drafter with a new, untrained sequential head (DrafterConfig fields of the head in
        `fields`): the backbone, the confidence head and the draft vocabulary are kept; attach it to a target
        before use. What compares heads on one trained backbone."""
        fresh = self._remade(head=head, **fields)
        kept = {k: v for k, v in self.state_dict().items() if not k.startswith("head.")}
        missing, unexpected = fresh.load_state_dict(kept, strict=False)
        assert not unexpected and all(k.startswith("head.") for k in missing), (missing, unexpected)
        return fresh.train(self.training)

    def with_draft_vocab(self, ids: torch.Tensor | None) -> Drafter:
        """A copy of this drafter scoring a new draft vocabulary (`ids`: sorted distinct target token ids;
        None: the full vocabulary); attach it to a target before use. The backbone is vocabulary-free (its
        LM-head rows are the target's), so only the head's per-slot rows (`vocab_rows`) follow: a token that
        stays keeps its row, a new one starts at the mean of the old rows. A correction's part shared by all
        tokens shifts every logit alike and the softmax ignores it, but a zero row would leave the new tokens
        out of that shift: the shipped drafter re-vocabularied with zero rows drafted at tau 1.415 untrained,
        with mean rows at 1.533, against 1.539 before (held-out validation, docs/training.md)."""
        vocab = self.config.vocab_size
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long).cpu()
            if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != len(ids):
                raise DominoError(f"a draft vocabulary must hold distinct token ids in 0..{vocab - 1}")
            ids = ids.sort().values
        fresh = self._remade(draft_vocab_size=0 if ids is None else len(ids))
        old_ids = self.draft_vocab.cpu() if self.config.draft_vocab_size else torch.arange(vocab)
        new_ids = torch.arange(vocab) if ids is None else ids
        slot = torch.full((vocab,), -1, dtype=torch.long)
        slot[old_ids] = torch.arange(len(old_ids))
        src = slot[new_ids]  # each new slot's old slot, -1 where the token is new
        kept = src >= 0
        state = self.state_dict()
        for name in self.head.vocab_rows:
            old = state[f"head.{name}"]
            rows = old.mean(0, keepdim=True).repeat(len(new_ids), *[1] * (old.ndim - 1))
            rows[kept.to(old.device)] = old[src[kept].to(old.device)]
            state[f"head.{name}"] = rows
        if ids is None:
            state.pop("draft_vocab", None)
        else:
            state["draft_vocab"] = ids.to(fresh.fc.weight.device)
        fresh.load_state_dict(state)
        return fresh.train(self.training)

    def with_layers(self, num_layers: int) -> Drafter:
        """A copy of this drafter grown to `num_layers` backbone layers; attach it to a target before use.

        The trained layers, head, confidence head and draft vocabulary are kept. Each new layer goes on
        top, starts as a copy of the layer below it with its two residual outputs (o_proj, down_proj)
        zeroed, so it adds nothing yet: the grown drafter drafts exactly as this one did, and training
        moves the residual outputs first (their gradients do not vanish) and the copied projections
        after. What compares one and two draft layers on one trained drafter."""
        have = self.config.num_layers
        if num_layers < have:
            raise DominoError(f"a drafter of {have} layers cannot be cut to {num_layers}: grow it, or train anew")
        fresh = self._remade(num_layers=num_layers)
        missing, unexpected = fresh.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
        with torch.no_grad():
            for layer in fresh.layers[have:]:
                layer.load_state_dict(self.layers[-1].state_dict())
                layer.o_proj.weight.zero_()
                layer.down_proj.weight.zero_()
        return fresh.train(self.training)

    def with_fusion(self) -> Drafter:
        """A copy of this drafter that fuses the last context row into its block inputs (fuse_context), the
        projection starting at zero so it drafts exactly as this one did until it trains; attach it before use."""
        if self.fuse is not None:
            raise DominoError("this drafter fuses the last context row already")
        fresh = self._remade(fuse_context=True)
        missing, unexpected = fresh.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and missing == ["fuse.weight"], (missing, unexpected)
        with torch.no_grad():
            fresh.fuse.weight.zero_()
        return fresh.train(self.training)

    def num_trainable_parameters(self) -> int:
        """Parameters the optimiser updates (the borrowed embedding and LM head are not among them)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # ----- checkpoints -----
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """config.json + model.safetensors, each written atomically."""
        save_checkpoint(self.config, self.state_dict(), directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, target=None) -> Drafter:
        """Load a drafter directory; with `target`, also check the fit and attach to it. "shipped" (or the bundled
        target's alias, "smollm2-135m") names the drafter shipped for `target` (checkpoint.named_drafter_dir)."""
        directory = named_drafter_dir(directory, getattr(target, "name", None))
        config, state, w_path = read_checkpoint(directory)
        model = cls(config)
        check_state(state, model.state_dict(), w_path, Path(directory) / CONFIG_NAME)
        model.load_state_dict(state)
        if config.draft_vocab_size:
            check_draft_vocab(model.draft_vocab, config.vocab_size, w_path)
        model.eval()
        model.directory = Path(directory)  # where its sidecar files live (checkpoint.sidecar_path)
        if target is not None:
            model.attach(target)
        return model
