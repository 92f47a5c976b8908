"""A Llama-family checkpoint directory read without transformers: config.json as attributes, model.safetensors
mapped (not read) into a module tree with transformers' own parameter names.

Why: importing transformers and building its model class cost ~3 s of one core at every start, and the native
forward (native.py) reads only weights: the embedding, the norms, the projections (whose packed panels the panel
cache holds) and the rotary frequencies. `Checkpoint` has exactly what `Target` and `NativeModel.from_hf` read
from a transformers model, nothing more; whatever needs transformers' own forward or generate gets a transformers
model built on the same tensors (`Checkpoint.to_transformers`, Target.model).

Only what reproduces transformers' load bit for bit is read this way (`checkpoint_support`): a Llama, Mistral,
Qwen2 or Qwen3 config with default RoPE and every field the forward reads written out, one model.safetensors file,
fp32 on the CPU. Anything else loads through transformers, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..io import cache_dir, directory_files, write_json_atomic
from .native import NATIVE_ARCHITECTURES

WEIGHTS_FILE = "model.safetensors"
# the config fields the forward and Target read, which transformers fills with class defaults when absent
REQUIRED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "hidden_act",
    "eos_token_id",
    "bos_token_id",
)


def checkpoint_support(directory: Path) -> str | None:
    """None when `Checkpoint.load(directory)` gives the model transformers would load (float32 on the CPU), else
    why not (the caller then loads through transformers)."""
    if not (directory / WEIGHTS_FILE).is_file():
        return f"no single {WEIGHTS_FILE}"
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"config.json does not read ({exc})"
    if cfg.get("model_type") not in NATIVE_ARCHITECTURES:
        return f"model_type {cfg.get('model_type')!r}"
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    rope = cfg["rope_parameters"]
    if not isinstance(rope, dict) or rope.get("rope_type") != "default" or set(rope) != {"rope_type", "rope_theta"}:
        return f"rope_parameters {rope!r} (only default RoPE is read without transformers)"
    if any(cfg.get(k) is not None for k in ("rope_theta", "rope_scaling", "quantization_config")):
        return "legacy RoPE fields or a quantization config"
    if cfg["hidden_act"] not in ("silu", "swish"):
        return f"hidden_act {cfg['hidden_act']!r}"
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
        return "sliding-window layers"
    if cfg["model_type"] == "mistral" and cfg.get("sliding_window") is not None:
        return "sliding-window attention"
    return None


class Checkpoint(nn.Module):
    """The modules transformers' *ForCausalLM has, under the same names (model.embed_tokens, model.layers[i]
    .self_attn.q_proj, ..., model.norm, lm_head, model.model.rotary_emb.inv_freq), holding the file's tensors."""

    def __init__(self, directory: Path, config: SimpleNamespace, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.directory, self.config = directory, config
        self.generation_config = SimpleNamespace(eos_token_id=_generation_eos(directory, config))
        c = config
        head_dim = c.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = _Embedding(tensors["model.embed_tokens.weight"])
        layers = (_layer(tensors, f"model.layers.{i}.", head_dim) for i in range(c.num_hidden_layers))
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = _norm(tensors["model.norm.weight"])
        self.model.rotary_emb = _Rotary(c.rope_parameters["rope_theta"], head_dim)
        if c.tie_word_embeddings:  # one Parameter for both, as transformers ties them
            self.lm_head = _Linear(self.model.embed_tokens.weight)
        else:
            self.lm_head = _Linear(tensors["lm_head.weight"])
        self.requires_grad_(False)

    @classmethod
    def load(cls, directory: str | Path) -> Checkpoint:
        """The directory's config and weights (mapped: nothing is read until a tensor is touched), in float32."""
        from safetensors import safe_open

        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text())
        raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
        if raw.get("head_dim") is None:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        config = SimpleNamespace(**raw, _name_or_path=str(directory))
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
            tensors = {name: _float32(f.get_tensor(name)) for name in f.keys()}
        return cls(directory, config, tensors)

    def forward(self, *args, **kwargs):
        raise TypeError("a Checkpoint has no forward of its own: Target runs it natively or through to_transformers()")

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def pristine_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters as the file holds them (named_parameters' names), whatever was written into them since:
        the identity of the weights as loaded (Target.fingerprint) without keeping a copy."""
        from safetensors import safe_open

        with safe_open(str(self.directory / WEIGHTS_FILE), framework="pt") as f:
            stored = set(f.keys())
            out = {}
            for name, _ in self.named_parameters():
                key = name if name in stored else "model.embed_tokens.weight"  # a tied head is stored once
                out[name] = _float32(f.get_tensor(key))
        return out

    def saved_fingerprint(self, version: int, tokenizer: str | None, compute) -> str:
        """compute() (Target.fingerprint: ~50 ms of sampling every tensor of the file), saved once per directory:
        a later load reads it while the directory's files, the tokenizer's vocabulary and `version` (of the
        fingerprint's definition) are the ones it was computed with."""
        directory = self.directory.resolve()
        key = {"version": version, "files": directory_files(directory), "tokenizer": tokenizer}
        name = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
        path = cache_dir() / "fingerprints" / f"{directory.name}-{name}.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                return saved["fingerprint"]
        fingerprint = compute()
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"key": key, "fingerprint": fingerprint}, indent=None)
        return fingerprint

    def use_weights(self, linears: list[nn.Linear], values: list[torch.Tensor]) -> None:
        """Point each linear at new values (the panel cache's mapped ones) instead of copying them in; a tied
        embedding follows the LM head, as an in-place copy would have made it."""
        for linear, v in zip(linears, values):
            tied = linear is self.lm_head and self.config.tie_word_embeddings
            linear.weight = nn.Parameter(v, requires_grad=False)
            if tied:
                self.model.embed_tokens.weight = linear.weight

    def to_transformers(self) -> nn.Module:
        """transformers' model of this directory (its config, generation config, RoPE buffers), its parameters
        then pointed at this checkpoint's tensors: whatever a format wrote into them, both see."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(self.directory), dtype=torch.float32)
        model.load_state_dict(self.state_dict(), assign=True)
        if self.config.tie_word_embeddings:  # assign made two Parameters of the one tensor: one again
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval().requires_grad_(False)


class _Rotary(nn.Module):
    """transformers' default RoPE frequencies, computed as it computes them (the same fp32 operations)."""

    rope_type = "default"
    attention_scaling = 1.0

    def __init__(self, theta, head_dim: int):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), persistent=False
        )


def _generation_eos(directory: Path, config: SimpleNamespace):
    """generation_config.json's eos_token_id where the file has one, else the config's (as transformers reads it)."""
    try:
        gen = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return config.eos_token_id
    return gen.get("eos_token_id", config.eos_token_id)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Linear(nn.Linear):
    """nn.Linear around given tensors (no initialisation: nn.Linear's own would draw 135M random numbers)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
        self.bias = None if bias is None else _param(bias)


class _Embedding(nn.Embedding):
    """nn.Embedding around a given table (no initialisation)."""

    def __init__(self, weight: torch.Tensor):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq = self.sparse = False
        self.weight = _param(weight)


def _norm(weight: torch.Tensor) -> nn.Module:
    m = nn.Module()
    m.weight = _param(weight)
    return m


def _layer(tensors: dict, prefix: str, head_dim: int) -> nn.Module:
    def linear(name):
        return _Linear(tensors[f"{prefix}{name}.weight"], tensors.get(f"{prefix}{name}.bias"))

    layer = nn.Module()  # modules in transformers' order, so named_parameters() lists them as it does
    attn = layer.self_attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, name, linear(f"self_attn.{name}"))
    for name in ("q_norm", "k_norm"):  # Qwen3
        if f"{prefix}self_attn.{name}.weight" in tensors:
            setattr(attn, name, _norm(tensors[f"{prefix}self_attn.{name}.weight"]))
    attn.scaling = head_dim**-0.5  # transformers' softmax scale for these families
    mlp = layer.mlp = nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, linear(f"mlp.{name}"))
    layer.input_layernorm = _norm(tensors[f"{prefix}input_layernorm.weight"])
    layer.post_attention_layernorm = _norm(tensors[f"{prefix}post_attention_layernorm.weight"])
    return layer
