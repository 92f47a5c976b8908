"""Weight formats of a CPU target: bf16 or int8 linear weights, fp32 activations and sums.

Why: a decode step on a CPU streams every weight of the model once, so its cost is the weights'
bytes. `--dtype bfloat16` and `--dtype int8` on the native backend keep the activations and every
sum in fp32 and store the weights of the linear layers (the decoder layers' projections and the
LM head, which is the embedding table of a tied model) as bf16 (half the bytes, rounded to
nearest) or int8 with an fp32 scale and offset per output channel and group of INT8_GROUP
inputs (0.31 of fp32's bytes; quantised at load from the weights alone, no calibration data).
Why groups and offsets (scripts/quant_agreement.py, 8 eval prompts x 64 tokens, 8 held-out
conversations): one symmetric scale per 576- or 1536-wide row of SmolLM2 left 1 of 8 greedy answers
identical to fp32's (97.9% teacher-forced top-1), symmetric groups of 64 or 32 2-3 of 8 (98.6%);
the better of a symmetric and an affine grid per group of 32 gives 8 of 8 (100%, the same
perplexity), as bf16 does: the bundled model's fp32 weights are dequantised 4-bit affine and 8-bit
blocks of 32, which those grids hold exactly. On weights trained in bf16 it is a plain 8-bit grid.

The format is applied to the loaded model in place first: its weights become the format's values,
held in fp32. Every path that reads the model (the small-row kernel, the library fallback without
a compiler, the drafter's borrowed embedding and LM head, feature extraction) then computes the
same model, and the kernel packs those values in the compact format (kernels.PackedLinear).
Speculative decoding is exact against plain decoding of that same model: the kernel's rows do not
depend on their batch, in every format.

The dot formats (DOT_FORMATS: `--dtype int8-dot`, `bfloat16-dot`) store int8's / bf16's weights and run
them on the CPU's dot-product instructions, which round the activations too (int8-dot: per row in blocks
of INT8_GROUP, cpu_kernels/format_int8_dot.h): each is a model of its own, recorded as such
(precision_label), and they need the kernel (no library fallback computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import DTYPES, resolve_device
from ..errors import DominoError

Q4_DOT = "q4-dot"  # a GGUF's own 4-bit blocks (Blocks) on int8-dot's activations; weights without blocks: int8-dot
WEIGHT_ONLY = ("bfloat16", "int8")  # formats with fp32 activations (the kernel widens the weights)
# formats on the CPU's dot-product instructions -> the weights they store: the kernel rounds the activations too
# (bf16, or int8 per row in blocks of INT8_GROUP), so each is a model of its own
DOT_FORMATS = {"bfloat16-dot": "bfloat16", "int8-dot": "int8", Q4_DOT: "int8"}
CPU_FORMATS = WEIGHT_ONLY + tuple(DOT_FORMATS)  # every format the native CPU kernel packs
INT8 = "int8"
AUTO = "auto"  # --dtype auto on the CPU: the fewest-bytes format that holds the loaded weights (adopt_exact_format_)
INT8_GROUP = 32  # inputs per int8 scale and offset (llama.cpp's Q8_0 and Q4_1 blocks are 32 wide too)


def _per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [N, ceil(K / group), group], a ragged last group padded with its own last value."""
    n, k = x.shape
    pad = -k % group
    if pad:
        x = F.pad(x[None], (0, pad), mode="replicate")[0]
    return x.reshape(n, (k + pad) // group, group)


def _expand(per_group: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[N, G] one value per group -> [N, K], one per input."""
    return per_group.repeat_interleave(group, dim=1)[:, :k]


def quantize_int8(w: torch.Tensor, group: int = INT8_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 per output channel and group of `group` inputs: w [N, K] -> (q [N, K] int8, scale [N, G],
    offset [N, G]) with w ~= scale * q + offset of its group, G = ceil(K / group).

    Each group takes whichever of two grids reconstructs it better (the larger error is compared):
    symmetric (offset 0, q in -127..127, step max|w| / 127) or affine (q in -128..127 spanning
    min..max, step (max - min) / 255). Weights that were 8-bit symmetric or 4-bit affine blocks of
    `group` (a model dequantised from Q8_0 / Q4_1, as the bundled SmolLM2 is) come back exactly."""
    w = w.detach().float()
    g = _per_group(w, group)  # [N, G, group]
    amax = g.abs().amax(dim=2, keepdim=True)
    sym_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    sym_q = torch.round(g / sym_scale).clamp_(-127, 127)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    aff_scale = torch.where(hi > lo, (hi - lo) / 255.0, torch.ones_like(hi))
    aff_q = torch.round((g - lo) / aff_scale).clamp_(0, 255) - 128.0
    aff_offset = lo + 128.0 * aff_scale
    sym_err = (sym_q * sym_scale - g).abs().amax(dim=2, keepdim=True)
    aff_err = (aff_q * aff_scale + aff_offset - g).abs().amax(dim=2, keepdim=True)
    affine = aff_err < sym_err  # [N, G, 1]
    q = torch.where(affine, aff_q, sym_q).flatten(1)[:, : w.shape[1]]
    scale = torch.where(affine, aff_scale, sym_scale)[..., 0]
    offset = torch.where(affine, aff_offset, torch.zeros_like(aff_offset))[..., 0]
    return q.to(torch.int8), scale, offset


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int = INT8_GROUP):
    k = q.shape[1]
    return q.float() * _expand(scale, group, k) + _expand(offset, group, k)  # [N, K]


def format_values(w: torch.Tensor, weight_format: str, blocks: Blocks | None = None) -> torch.Tensor:
    """w [N, K] as the format stores it, back in fp32: what every path of a weight-only target computes with
    (a dot format's weights: those of the format it stores, DOT_FORMATS; q4-dot's: the file's blocks where it
    has them, which dequantise to w itself)."""
    if weight_format == Q4_DOT and blocks is not None:
        return blocks.dequantize()
    weight_format = DOT_FORMATS.get(weight_format, weight_format)
    if weight_format == "bfloat16":
        return w.detach().to(torch.bfloat16).float()
    if weight_format == INT8:
        return dequantize_int8(*quantize_int8(w, INT8_GROUP), INT8_GROUP)
    raise ValueError(f"{weight_format!r} is not a CPU weight format ({', '.join(CPU_FORMATS)})")


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The linears a weight format covers: every nn.Linear of the decoder layers, and the LM head."""
    return [m for _, m in named_linear_layers(model)]


def named_linear_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """linear_layers with their weights' parameter names ("model.layers.0.self_attn.q_proj.weight", ...)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    found = [
        (f"model.layers.{name}.weight", m)
        for name, m in (layers.named_modules() if layers is not None else [])
        if isinstance(m, nn.Linear)
    ]
    head = model.get_output_embeddings()
    return found + ([("lm_head.weight", head)] if isinstance(head, nn.Linear) else [])


def holds(values: torch.Tensor, w: torch.Tensor) -> bool:
    """A format's values are w up to fp32 rounding: within 4 ulps of the largest |w| of each group of
    INT8_GROUP inputs. (The bundled model's int8 values differ from its weights by at most 1 ulp there, the
    rounding of the GGUF's own dequantisation; a random fp32 model's by ~30,000.)"""
    err = _per_group((values - w).abs(), INT8_GROUP).amax(dim=2)  # [N, G]
    top = _per_group(w.abs(), INT8_GROUP).amax(dim=2)
    return bool((err <= 4 * torch.finfo(torch.float32).eps * top).all())


@torch.no_grad()
def apply_weight_format_(model: nn.Module, weight_format: str, blocks: dict[str, Blocks] | None = None) -> bool:
    """Replace, in place, each covered weight by its format's values (fp32 storage; a tied embedding
    is the LM head's tensor and follows it). Returns whether the format held every weight (`holds`).
    blocks: a GGUF's own blocks by parameter name (gguf.read_blocks), for q4-dot."""
    exact = True
    for name, linear in named_linear_layers(model):
        values = format_values(linear.weight, weight_format, (blocks or {}).get(name))
        exact = exact and holds(values, linear.weight)
        linear.weight.copy_(values)
    return exact


@torch.no_grad()
def adopt_exact_format_(model: nn.Module) -> str | None:
    """The fewest-bytes weight-only format that holds every covered weight (int8, else bfloat16; `holds`),
    its values written in place; None (nothing changed) when neither does. A checkpoint dequantised from
    8- or 4-bit groups of 32 (the bundled SmolLM2) fits int8; a bf16 checkpoint loaded in fp32 fits bfloat16:
    either is the same model on a quarter / half of fp32's bytes."""
    linears = linear_layers(model)
    for fmt in (INT8, "bfloat16"):
        values = []
        for linear in linears:  # stops at the first weight the format does not hold
            values.append(format_values(linear.weight, fmt))
            if not holds(values[-1], linear.weight):
                break
        else:
            for linear, v in zip(linears, values):
                linear.weight.copy_(v)
            return fmt
    return None


def weight_only_format(dtype, device: str | torch.device | None, backend: str) -> str | None:
    """The weight-only format `--dtype` asks for on this device and backend, or None for a plain dtype.

    int8 exists only as a weight-only format on the CPU native backend (refused elsewhere, by name);
    bfloat16 on a CPU with the native backend means bf16 weights and fp32 activations, elsewhere (a
    GPU, --backend hf) the whole model in bf16 as transformers runs it.
    """
    if isinstance(dtype, torch.dtype):
        dtype = next((name for name, d in DTYPES.items() if d == dtype), str(dtype))
    dev = resolve_device(device if isinstance(device, str) or device is None else str(device))
    if dtype in (None, AUTO):  # the CPU's fp32 model on the fewest bytes that hold it exactly (Target decides)
        return AUTO if dev.type == "cpu" and backend != "hf" else None
    if dtype in DOT_FORMATS:  # q4-dot included: on a model without GGUF blocks it is int8-dot
        if backend == "hf" or dev.type != "cpu":
            raise DominoError(
                f"--dtype {dtype} runs on the CPU's dot-product instructions in the native backend's kernel "
                f"(device {dev.type}, backend {backend}): use --device cpu with --backend native or auto"
            )
        return dtype
    if dtype == INT8:
        if backend == "hf":
            raise DominoError(
                "--dtype int8 (int8 weights, fp32 activations) runs on the native backend's small-row kernel; "
                "--backend hf (transformers) has no int8 path here: use --backend native or auto"
            )
        if dev.type != "cpu":
            raise DominoError(f"--dtype int8 runs on the CPU (the small-row kernel); device is {dev.type}")
        return INT8
    if DTYPES.get(dtype) == torch.bfloat16 and dev.type == "cpu" and backend != "hf":
        return "bfloat16"
    return None


def precision_label(dtype: torch.dtype, weight_format: str | None, bf16_dot: bool = False) -> str:
    """How a target computes, as identities record it: the dtype for a plain model ("float32",
    "bfloat16"), else "<format>-weights" (fp32 activations), "<stored>-weights-dot" for a dot format
    (int8-dot: "int8-weights-dot"; q4-dot: "q4-weights-dot") or where bf16 runs on the CPU's bf16 dot product through
    DOMINOSPEC_BF16_DOT (both round the activations too)."""
    if weight_format == Q4_DOT:
        return "q4-weights-dot"
    if weight_format in DOT_FORMATS:
        return f"{DOT_FORMATS[weight_format]}-weights-dot"
    if weight_format not in WEIGHT_ONLY:
        return str(dtype).replace("torch.", "")
    return f"{weight_format}-weights" + ("-dot" if bf16_dot and weight_format == "bfloat16" else "")


GGUF_BLOCK = 32  # weights per block of a GGUF Q4_0 / Q4_1 / Q8_0 tensor (INT8_GROUP is the same width)


@dataclass
class Blocks:
    """A linear weight [N, K] as a GGUF file holds it: w = scale * q + offset per row and block of 32 k.

    bits 4 (Q4_1; Q4_0 with offset -8 * scale): q in 0..15, uint8; bits 8 (Q8_0): q in -127..127, int8, offset 0.
    scale and offset are the file's float16 values. `dequantize` is the file's own dequantisation, bit for bit
    (scale * q is exact in fp32, then one rounding for the offset)."""

    bits: int
    q: torch.Tensor  # [N, K]
    scale: torch.Tensor  # [N, K / 32] float16
    offset: torch.Tensor  # [N, K / 32] float16

    def dequantize(self) -> torch.Tensor:
        k = self.q.shape[1]
        return self.q.float() * _expand(self.scale.float(), GGUF_BLOCK, k) + _expand(self.offset.float(), GGUF_BLOCK, k)

    @staticmethod
    def cat(parts: list[Blocks | None]) -> Blocks | None:
        """Blocks stacked by output rows (a fused projection), or None unless every part has blocks of one width."""
        if not parts or any(p is None for p in parts) or len({p.bits for p in parts}) != 1:
            return None
        return Blocks(parts[0].bits, *(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "offset")))
