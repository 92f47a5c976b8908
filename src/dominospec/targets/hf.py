"""The target adapter: a Hugging Face causal LM seen through the few operations decoding needs.

Two backends run the same forward: `hf` (transformers' eager forward with its DynamicCache) and,
for the Llama family, `native` (native.py: fused, pre-packed kernels and a preallocated cache
whose rollback is setting a length). Both return the same logits and features to fp32 rounding.

A `Target` wraps a decoder-only transformers model and gives the rest of dominospec a small,
stable surface: a forward with a KV cache that returns logits and only the hidden states of the
feature layers, cache rollback, the frozen embedding and LM head, chat encoding, EOS ids and the
architecture numbers a drafter copies. Nothing outside `dominospec.targets` touches transformers'
cache or output objects, so a transformers upgrade is absorbed in this package.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from ..errors import DominoError
from .checkpoint import Checkpoint
from .features import check_layer_ids, default_layer_ids
from .generate import hf_generate, sample_batch
from .gguf import read_blocks
from .kernels import active_build, build_key, load_kernels
from .load import load_model, target_dir
from .native import KVCache, NativeModel, native_support
from .panel_cache import formatted_weights, saved_packing
from .quant import (
    AUTO,
    CPU_FORMATS,
    DOT_FORMATS,
    INT8,
    Q4_DOT,
    adopt_exact_format_,
    apply_weight_format_,
    precision_label,
    weight_only_format,
)
from .tokenizer import longest_token, vocab_fingerprint

BACKENDS = ("auto", "native", "hf")
FINGERPRINT_VERSION = 1  # bump when Target.fingerprint's definition changes (saved fingerprints are then stale)


def _kernel_build() -> str | None:
    """The CPU kernel's build key (loading it), or None where it is off or cannot be built."""
    return build_key() if load_kernels() is not None else None


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [1, S, V] (only the last row when last_logits_only)
    features: torch.Tensor | None  # [1, S, n*H] decoder-layer outputs at the feature layers


class Target:
    """A frozen HF causal LM: forward with a cache, rollback, frozen tables, text."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        layer_ids: Sequence[int] | None = None,
        name: str = "model",
        backend: str = "hf",
        weights: str | None = None,
        blocks: dict | None = None,
    ):
        """weights: None (the model as it is), or a weight-only format, bfloat16 or int8 (quant.py): its
        linear weights are rounded to that format in place and the native kernel streams them so; "auto":
        the fewest-bytes format that holds them to fp32 rounding (quant.adopt_exact_format_), else none.
        blocks: the GGUF file's own blocks by parameter name (gguf.read_blocks), which q4-dot packs.
        model: a transformers model, or a Checkpoint (checkpoint.py: the same weights read without transformers,
        for the native backend; `model` builds the transformers model on its tensors where one is needed)."""
        self.module = model.eval()  # what the weights are read from: `model`, or a Checkpoint
        self._transformers: nn.Module | None = None  # the transformers model built on a Checkpoint's tensors
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.layer_ids = check_layer_ids(
            layer_ids if layer_ids is not None else default_layer_ids(self.num_layers), self.num_layers
        )
        if backend not in BACKENDS:
            raise DominoError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.native: NativeModel | None = None
        self.backend_note: str | None = None  # why a requested native backend is not used
        self.exact_weights = False  # the weight format held the loaded weights (quant.holds): the same model
        why = native_support(model) if backend in ("auto", "native") else "--backend hf"
        if why is not None and isinstance(model, Checkpoint):  # transformers runs it: its model from here on
            self.module = model = self.model
        # the weights' format and packed panels, from the cache where an earlier process saved them (panel_cache.py)
        with saved_packing(model, weights, _kernel_build) if why is None else nullcontext() as saved:
            self.weight_only = self._apply_weights(weights, why, blocks)  # a CPU format (quant.CPU_FORMATS), or None
            if why is None:
                self.native = NativeModel.from_hf(model, self.weight_only or "float32", blocks)
        self.packed_from_cache = saved is not None and saved.hit  # this load read the saved panels
        if why is not None and backend == "native":
            self.backend_note = f"target {name!r} runs on the transformers path: {why}"

    @property
    def model(self) -> nn.Module:
        """The transformers model: the one given, or, for a Checkpoint, one built on its tensors at the first call
        that needs transformers' own forward or generate (the --backend hf path, baselines, batched sampling)."""
        if not isinstance(self.module, Checkpoint):
            return self.module
        if self._transformers is None:
            self._transformers = self.module.to_transformers()
        return self._transformers

    @cached_property
    def _cache_kw(self) -> str:
        """transformers 5.24 renamed past_key_values to cache (old name warns, removed in 5.40)."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _apply_weights(self, weights: str | None, why_not_native: str | None, blocks: dict | None) -> str | None:
        """Round the weights to a weight-only format in place and return it; None: the model computes in its dtype.

        Without the native backend, int8 is refused and bfloat16 means the whole model in bf16."""
        if weights == AUTO:
            if why_not_native is not None or self.dtype != torch.float32 or self.device.type != "cpu":
                return None
            self._keep_identity()
            weights = formatted_weights(self.module, adopt_exact_format_)
            self.exact_weights = weights is not None
            return weights
        if weights in (None, str(self.dtype).replace("torch.", "")):
            return None
        if weights not in CPU_FORMATS:
            raise DominoError(f"weights {weights!r} is not a CPU weight format ({', '.join(CPU_FORMATS)})")
        if why_not_native is not None:
            if weights in DOT_FORMATS:
                raise DominoError(
                    f"--dtype {weights} needs the native backend (the CPU kernel's dot product), but target "
                    f"{self.name!r} runs on transformers: {why_not_native}"
                )
            if weights == INT8:
                raise DominoError(
                    f"--dtype int8 needs the native backend (int8 weights on its small-row kernel), but target "
                    f"{self.name!r} runs on transformers: {why_not_native}"
                )
            self.model.to(torch.bfloat16)  # transformers' bf16, activations included
            return None
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise DominoError(f"{weights} weights need an fp32 model on the CPU, got {self.dtype} on {self.device}")
        self._keep_identity()
        self.exact_weights = formatted_weights(self.module, lambda m: apply_weight_format_(m, weights, blocks))
        return weights

    def _keep_identity(self) -> None:
        """Take the identity of the weights as loaded (fingerprint) before a format rewrites them; a Checkpoint's
        file still holds them, so its fingerprint waits until something asks for it."""
        if not isinstance(self.module, Checkpoint):
            _ = self.fingerprint

    @property
    def weight_format(self) -> str:
        """The weights' format: the weight-only format, else the model's dtype ("float32", "bfloat16", ...)."""
        return self.weight_only or str(self.dtype).replace("torch.", "")

    @property
    def precision(self) -> str:
        """How this target computes, as identities record it (data, feature caches, acceptance): "float32",
        "bfloat16", ... for a plain model; "bfloat16-weights", "int8-weights" for fp32 activations on weights
        rounded to that format ("-dot": bf16 on the CPU's bf16 dot product, which rounds activations too).
        A format that held the loaded weights (to fp32 rounding, quant.holds) is the same model: its precision is
        the plain dtype's."""
        if self.exact_weights and not self.rounds_activations:
            return str(self.dtype).replace("torch.", "")
        return self.run_precision

    @property
    def rounds_activations(self) -> bool:
        """The forward rounds activations too (a dot format: int8-dot, bfloat16-dot or DOMINOSPEC_BF16_DOT=on)."""
        return self.weight_only in DOT_FORMATS or (self.native is not None and self.native.bf16_dot)

    @property
    def run_precision(self) -> str:
        """What the forward streams and computes with, exact or not (what a device profile's speed depends on)."""
        return precision_label(self.dtype, self.weight_only, self.native is not None and self.native.bf16_dot)

    @property
    def backend(self) -> str:
        return "native" if self.native is not None else "hf"

    @property
    def supports_rows(self) -> bool:
        """Whether this target decodes many sequences in the rows of one cache (new_row_cache, forward_rows,
        set_row_length): the native backend does, transformers' does not."""
        return self.native is not None

    @property
    def row_bytes_per_position(self) -> int:
        """Bytes one position of one row of `new_row_cache` holds (K and V over every layer); 0 without rows."""
        if self.native is None:
            return 0
        cfg = self.native.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.native.dtype.itemsize

    @property
    def row_logits_dtype(self) -> torch.dtype:
        """The dtype of the logits `forward_rows` returns (what a buffer of next-token logits should hold)."""
        return self.native.dtype if self.native is not None else self.dtype

    def backend_state(self) -> tuple:
        """An opaque handle on this target's forward (its packed native weights, or why it has none); it
        holds weights, never the model. `use_backend_state` lets another wrapper of the same model reuse it."""
        return self.native, self.backend_note

    def use_backend_state(self, state: tuple) -> None:
        self.native, self.backend_note = state

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm over the last decoder layer's states (what the LM head reads); native backend."""
        if self.native is None:
            raise DominoError(f"target {self.name!r}: the final norm is read from the native backend only")
        return self.native.final_norm(hidden)

    @classmethod
    def load(
        cls,
        name_or_path: str | None = None,
        device: str | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        layer_ids: Sequence[int] | None = None,
        progress=None,
        backend: str = "auto",
    ) -> Target:
        """By alias (default: the bundled model), local directory or hub id; see load.py.

        backend: auto (native where supported), native (says so when it is not), hf.
        dtype: auto (bf16 on GPU; on the CPU, fp32 activations on the fewest-bytes weight format that holds
        the weights to fp32 rounding: int8, bfloat16, else fp32), float32, bfloat16, float16, or int8. On the CPU
        with the native backend, bfloat16 and int8 mean those weights with fp32 activations (quant.py).
        """
        weights = weight_only_format(dtype, device, backend)
        model, tokenizer, name = load_model(
            name_or_path,
            device=device,
            dtype=torch.float32 if weights else dtype,
            progress=progress,
            native=backend in ("auto", "native"),
        )
        blocks = read_blocks(target_dir(name)) if weights == Q4_DOT else None  # the file's own 4-bit blocks
        target = cls(model, tokenizer, layer_ids=layer_ids, name=name, backend=backend, weights=weights, blocks=blocks)
        if target.backend_note and progress:
            progress(target.backend_note)
        if weights == AUTO and target.weight_only and progress and active_build() != "off":
            # (without the kernel, native.py's one note says what runs instead)
            progress(
                f"--dtype auto: {target.weight_only} weights on the CPU kernel (they hold {name}'s weights to fp32 "
                "rounding: the same model on fewer bytes); --dtype float32 runs the fp32 kernel"
            )
        return target

    @property
    def device(self) -> torch.device:
        return self.module.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.get_output_embeddings().weight.dtype

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the target was built for (None when its config does not say)."""
        n = getattr(self.module.config, "max_position_embeddings", None)
        return int(n) if n else None

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token stands for (its longest vocabulary entry; byte-level and
        SentencePiece entries are never shorter than their text), so text of n characters has at
        least n / max_token_chars tokens. None without a tokenizer."""
        return None if self.tokenizer is None else longest_token(self.tokenizer)

    @property
    def arch(self) -> dict:
        """Attention and MLP shape numbers a drafter copies from its target."""
        cfg = self.module.config
        heads = int(getattr(cfg, "num_attention_heads", 8))
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return {
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(cfg, "head_dim", None) or self.hidden_size // heads),
            "intermediate_size": int(getattr(cfg, "intermediate_size", None) or 4 * self.hidden_size),
            "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
            "rope_theta": float(theta if theta is not None else getattr(cfg, "rope_theta", 10000.0)),
        }

    # ----- frozen tables -----
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.module.get_input_embeddings().weight  # [V, H]

    def input_embeddings(self) -> nn.Module:
        return self.module.get_input_embeddings()

    def output_embeddings(self) -> nn.Module:
        return self.module.get_output_embeddings()

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.get_output_embeddings()(hidden)

    # the weights of decoder layer j under family-neutral names (for initialising a draft layer)
    LAYER_WEIGHTS = {
        "input_norm": "input_layernorm",
        "post_norm": "post_attention_layernorm",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
        "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "down_proj": "mlp.down_proj",
    }

    def decoder_layer_weights(self, j: int) -> dict[str, torch.Tensor]:
        """Decoder layer j's weights, {neutral name: tensor}; modules the family lacks (q/k norm) are absent."""
        layers = getattr(getattr(self.module, "model", None), "layers", None)
        if layers is None:
            raise DominoError(f"target {self.name!r} ({self.arch}) has no Llama-style decoder layers to copy")
        if not 0 <= j < len(layers):
            raise DominoError(f"--init-from-layer {j} is out of range: the target has layers 0..{len(layers) - 1}")
        out = {}
        for name, path in self.LAYER_WEIGHTS.items():
            module = layers[j]
            for part in path.split("."):
                module = getattr(module, part, None)
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                out[name] = weight.detach()
        return out

    # ----- cache -----
    def new_cache(self, max_len: int = 1024):
        """An empty batch-1 cache; `max_len` is a size hint (the native cache grows when needed)."""
        if self.native is not None:
            return self.native.new_cache(batch=1, max_len=max_len)
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def cache_length(self, cache) -> int:
        if isinstance(cache, KVCache):
            return cache.length(0)
        return int(cache.get_seq_length())

    def crop_cache(self, cache, length: int) -> None:
        """Roll the cache back to its first `length` positions."""
        if isinstance(cache, KVCache):
            if length < cache.length(0):
                cache.crop(length)
            return
        extra = int(cache.get_seq_length()) - length
        if extra > 0:
            cache.crop(-extra)  # positive crop(n) raises from transformers 5.18 on

    # ----- rows: independent sequences in the fixed slots of one cache (native backend only) -----
    def new_row_cache(self, batch: int, max_len: int) -> KVCache:
        """A preallocated cache of `batch` slots of `max_len` positions each (see KVCache.claim)."""
        if self.native is None:
            raise DominoError(
                f"target {self.name!r} runs on the transformers backend, which decodes one sequence at a "
                "time; batched decoding needs the native backend (Llama/Mistral/Qwen2/Qwen3, --backend native)"
            )
        return self.native.new_cache(batch=batch, max_len=max_len)

    @torch.inference_mode()
    def forward_rows(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        num_new: Sequence[int] | None = None,
        start: int = 0,
        logits: str = "all",
        layer_ids: Sequence[int] | None = None,
        with_features: bool = False,
    ) -> TargetOutput:
        """One ragged forward over cache rows start..start+R-1: row r appends its first num_new[r] tokens.

        ids [R, S] (columns past num_new[r] are padding); logits "all" -> [R, S, V], "last" -> [R, 1, V]
        at each row's last new token, "none" -> None. Other rows of the cache are neither read nor moved.
        """
        view = cache.rows(start, start + ids.shape[0])
        if max(view.lengths) + ids.shape[1] > cache.max_len:  # a view cannot grow: writes would be lost
            raise DominoError(
                f"rows {start}..{start + ids.shape[0] - 1} would pass the cache's {cache.max_len} positions "
                f"(longest row {max(view.lengths)} + {ids.shape[1]} new)"
            )
        out, feats = self.native(
            ids,
            view,
            num_new=None if num_new is None else list(num_new),
            logits=logits,
            feature_layers=list(layer_ids or self.layer_ids) if with_features else None,
        )
        cache.sync(view, start)
        return TargetOutput(out.unsqueeze(1) if logits == "last" else out, feats)

    @staticmethod
    def set_row_length(cache: KVCache, row: int, length: int) -> None:
        """Roll one row back (or forward over positions it already holds) to `length` positions."""
        cache.set_length(row, length)

    # ----- forward -----
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache,
        last_logits_only: bool = False,
        with_features: bool = True,
        layer_ids: Sequence[int] | None = None,
    ) -> TargetOutput:
        """Run ids [1, S] after the cached prefix; extends the cache in place.

        Returns logits and the concatenated hidden states of `layer_ids` (default: the target's
        own feature layers; a drafter passes the layers it was trained on) for the S new positions.
        """
        layers = list(layer_ids or self.layer_ids)
        if self.native is not None:
            logits, feats = self.native(
                ids,
                cache,
                logits="last" if last_logits_only else "all",
                feature_layers=layers if with_features else None,
            )
            return TargetOutput(logits.unsqueeze(1) if last_logits_only else logits, feats)
        past = self.cache_length(cache)
        positions = torch.arange(past, past + ids.shape[1], device=ids.device).unsqueeze(0)
        kwargs = {
            "input_ids": ids,
            self._cache_kw: cache,
            "use_cache": True,
            "position_ids": positions,
            "output_hidden_states": with_features,
        }
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        feats = None
        if with_features:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1] for i in layers], dim=-1)
        return TargetOutput(out.logits, feats)

    @torch.no_grad()  # not inference_mode: the trainer feeds these rows to a drafter under autograd
    def sequence_features(
        self, seqs: Sequence[Sequence[int]], layer_ids: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No-cache batched forward for training and validation, one right-padded batch.

        Returns, per sequence, its feature-layer states [S_i, n*H] and its post-norm final hidden
        states [S_i, H] (what the frozen LM head reads), each its own tensor.
        """
        layer_ids = list(layer_ids or self.layer_ids)
        if self.native is not None:
            return self._native_sequence_features(seqs, layer_ids)
        lens = [len(s) for s in seqs]
        ids = torch.zeros(len(seqs), max(lens), dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, : lens[r]] = torch.tensor(list(s))
            att[r, : lens[r]] = 1
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=att.to(self.device),
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        hs = out.hidden_states
        feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)  # [N, S, n*H]
        return ([feats[r, :n].clone() for r, n in enumerate(lens)], [hs[-1][r, :n].clone() for r, n in enumerate(lens)])

    def _native_sequence_features(self, seqs, layer_ids: list[int]):
        """The same on the native path, one sequence at a time (no padding computed). HF's last hidden
        state is post-norm, so a feature layer that is the last layer is taken after the final norm too."""
        native, last = self.native, self.num_layers - 1
        want = sorted(set(layer_ids) | {last})
        feats, finals = [], []
        for s in seqs:
            cache = native.new_cache(batch=1, max_len=len(s))
            _, rows = native(torch.tensor([list(s)], device=self.device), cache, logits="none", feature_layers=want)
            per = dict(zip(want, rows[0].split(self.hidden_size, dim=-1)))  # layer -> [S, H]
            final = native.final_norm(per[last])
            feats.append(torch.cat([final if j == last else per[j] for j in layer_ids], dim=-1))
            finals.append(final)
        return feats, finals

    # ----- transformers' own generate: benchmark baselines and data making -----
    def hf_generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        prompt_lookup: int = 0,
    ) -> list[int]:
        return hf_generate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, prompt_lookup)

    def sample_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.7,
        top_p: float = 0.8,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[list[int]]:
        return sample_batch(self, prompts, max_new_tokens, temperature, top_p, top_k, seed)

    # ----- text -----
    @property
    def eos_ids(self) -> list[int]:
        ids: set[int] = set()
        gen = getattr(self.module, "generation_config", None)
        for src in (
            getattr(gen, "eos_token_id", None),
            getattr(self.module.config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None,
        ):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else list(src))
        return sorted(ids)

    @property
    def pad_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        eos = self.eos_ids
        return eos[0] if eos else None

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise DominoError(f"target {self.name!r} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode_chat(
        self, messages: list[dict] | str, enable_thinking: bool = False, template_kwargs: dict | None = None
    ) -> list[int]:
        """Chat-template a conversation, ready to generate. Thinking is off unless asked for (templates
        without the switch ignore it); template_kwargs reach the template as extra variables."""
        tok = self._need_tokenizer()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if getattr(tok, "chat_template", None):
            kwargs = {**(template_kwargs or {}), "enable_thinking": bool(enable_thinking)}
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok("\n".join(m["content"] for m in messages))["input_ids"]

    def open_user_turn(self, opening: str) -> list[int]:
        """The chat template up to an unfinished user turn that starts with `opening`: the model writes the rest."""
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            return tok(opening)["input_ids"]
        mark = "\x00DOMINO-USER-TURN\x00"
        text = tok.apply_chat_template(
            [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False, enable_thinking=False
        )
        return tok(text[: text.index(mark)] + opening, add_special_tokens=False)["input_ids"]

    def encode_raw(self, text: str) -> list[int]:
        return self._need_tokenizer()(text)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=True)

    # ----- identity: data sets record these, so ids are never read with another tokenizer -----
    @property
    def tokenizer_fingerprint(self) -> str | None:
        """sha256 of the sorted (token, id) vocabulary, added tokens included; None without a tokenizer."""
        return None if self.tokenizer is None else vocab_fingerprint(self.tokenizer)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 identifying the model by content, not by the name it was loaded under.

        `tiny/`, `tiny` and /abs/path/tiny are one model; two models saved at one path are two. It
        covers the architecture numbers of the config, the tokenizer, and the sign bits of a strided
        sample of every weight tensor: signs survive casting to bf16/fp16 exactly, so the same
        weights loaded in another dtype keep their fingerprint. A weight format (--dtype int8) is
        applied after it is taken: identities record the format beside it (`precision`). A Checkpoint's is
        computed once per directory and saved (Checkpoint.saved_fingerprint).
        """
        if isinstance(self.module, Checkpoint):
            return self.module.saved_fingerprint(FINGERPRINT_VERSION, self.tokenizer_fingerprint, self._fingerprint)
        return self._fingerprint()

    def _fingerprint(self) -> str:
        cfg = self.module.config
        keys = (
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_theta",
            "tie_word_embeddings",
        )
        h = hashlib.sha256()
        h.update(json.dumps({k: getattr(cfg, k, None) for k in keys}, sort_keys=True, default=str).encode())
        h.update(str(self.tokenizer_fingerprint).encode())
        seen = set()
        loaded = self.module.pristine_parameters() if isinstance(self.module, Checkpoint) else None
        params = loaded.items() if loaded is not None else self.module.named_parameters()
        for name, w in sorted(params, key=lambda kv: kv[0]):
            if w.data_ptr() in seen:  # tied weights count once
                continue
            seen.add(w.data_ptr())
            flat = w.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 256)][:256]
            h.update(name.encode() + str(tuple(w.shape)).encode())
            h.update(bytes(torch.signbit(sample.float()).cpu().to(torch.uint8).tolist()))
        return h.hexdigest()

    @property
    def chat_template_fingerprint(self) -> str | None:
        """sha256 of the chat template text; None without a tokenizer or template."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if not template:
            return None
        return hashlib.sha256(str(template).encode()).hexdigest()
