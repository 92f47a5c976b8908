"""The CPU kernels (cpu_kernels/: the small-row linear, attention, the fused decoder layers): built once per
machine, loaded at first use.

Why: decode multiplies 1 row and verify 2-17 rows by every weight of the model. Library GEMMs
either stream the weights slower for 2+ rows than a GEMV does for one, or re-pack W on every call;
this kernel packs W once into panels and streams it once for all rows (cpu_kernels/linear.cpp), so a
verify pass of a few rows costs about what a decode step costs. Panels hold fp32, bf16 or int8
weights (quant.py: --dtype bfloat16 / int8 on CPU); activations and sums are fp32 in every format.

The sources are split by concern (simd.h, one format_*.h per weight format, pack.cpp, linear.cpp,
attention.cpp, decoder_layers.cpp); module.cpp binds them and states the Python <-> C++ contract once.
The extension is compiled with torch.utils.cpp_extension (-O3 -march=native) into
<cache>/kernels/cpu_kernels_<key>, the key covering every source file, torch's version and the CPU's
flags, and a later process imports the built library directly. Without a compiler (or with
DOMINOSPEC_KERNELS=off) `load_kernels()` returns None and `Linear` keeps its library paths.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from ..errors import DominoError
from ..io import cache_dir, exclusive_lock
from ..log import log, log_once, ticking
from .panel_cache import keep_panels, saved_panels

SOURCES = Path(__file__).with_name("cpu_kernels")  # the C++ sources: *.cpp compiled, *.h included
ENV_SWITCH = "DOMINOSPEC_KERNELS"  # "off": today's library paths only (for A/B runs)

_loaded: dict[str, object] = {}  # "module" -> the extension, or None once a build was refused/failed


def kernels_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def build_key() -> str:
    """What a built kernel is valid for: every source file, this torch, this CPU's instruction sets (once a process)."""
    h = hashlib.sha256()
    sources = [f.name.encode() + b"\0" + f.read_bytes() for f in _source_files()]
    for part in (*sources, torch.__version__.encode(), _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _source_files() -> list[Path]:
    return sorted(f for f in SOURCES.iterdir() if f.suffix in (".cpp", ".h"))


def kernel_dir() -> Path:
    return cache_dir() / "kernels" / f"cpu_kernels_{build_key()}"


def _import_built(name: str, directory: Path):
    so = next(iter(sorted(directory.glob(f"{name}*.so"))), None)
    return None if so is None else import_library(so)


def import_library(so: Path):
    """A built kernel library, imported from its file (its module name is the file's stem)."""
    if not so.is_file():
        raise FileNotFoundError(f"no kernel library at {so}")
    spec = importlib.util.spec_from_file_location(so.name.split(".")[0], so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, directory: Path):
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
    t0 = time.perf_counter()
    log(f"building the CPU kernels into {directory} (once per machine and torch version; ~80 s on one core)")
    with ticking("building the CPU kernels"):
        module = cpp_extension.load(
            name=name,
            sources=[str(f) for f in _source_files() if f.suffix == ".cpp"],
            build_directory=str(directory),
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    log(f"kernel built in {time.perf_counter() - t0:.1f} s")
    return module


def _build_once(name: str, directory: Path):
    """Build under the directory's lock: a second process (a parallel test worker, a second command started
    at once) waits for the first build and imports its library instead of compiling into the same files."""
    directory.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory, "kernel build", wait=True, report=log):
        return _import_built(name, directory) or _build(name, directory)


def load_kernels():
    """The compiled extension (its functions: cpu_kernels/module.cpp), or None where it cannot be had."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    if not kernels_enabled():
        pass
    elif platform.system() != "Linux" or shutil.which(os.environ.get("CXX", "c++")) is None:
        log_once("no C++ compiler found (or not Linux): the CPU kernels are off; library GEMMs are used")
    else:
        directory = kernel_dir()
        name = f"dominospec_cpu_kernels_{build_key()}"
        try:
            module = _import_built(name, directory) or _build_once(name, directory)
        except Exception as exc:  # a broken toolchain must not stop decoding: fall back to the library paths
            log_once(f"the CPU kernels did not build ({type(exc).__name__}: {exc}); library GEMMs are used")
            module = None
    _loaded["module"] = module
    return module


def active_build() -> str:
    """The build key of the kernel this process runs, or "off" where it runs the library paths (switched off,
    no compiler, a failed build, or nothing loaded it yet): what a timing of this process's forwards depends on."""
    if not kernels_enabled() or _loaded.get("module") is None:
        return "off"
    return build_key()


def reset_kernels() -> None:
    """Forget the loaded extension (tests switch DOMINOSPEC_KERNELS within one process)."""
    _loaded.clear()


BF16_DOT_SWITCH = "DOMINOSPEC_BF16_DOT"  # "on": bf16 weights on AVX512-BF16's dot product (rounds activations)


def bf16_dot_requested() -> bool:
    return os.environ.get(BF16_DOT_SWITCH, "off").strip().lower() in ("on", "1", "true", "yes")


def bf16_dot_available(module) -> bool:
    """The switch is on and this build has the native bf16 dot product; says once when it has not."""
    if not bf16_dot_requested():
        return False
    if not module.has_bf16_dot():
        log_once(f"{BF16_DOT_SWITCH}=on, but this CPU has no AVX512-BF16: bf16 weights are widened to fp32 instead")
        return False
    # Decode and verify run attention one query at a time (native.py), so rounding the activations keeps
    # speculative output identical to this format's own plain decoding, in the engine too.
    log_once(
        f"{BF16_DOT_SWITCH}=on: activations are rounded to bf16 too, a model of its own (precision "
        "bfloat16-weights-dot): its answers differ from --dtype bfloat16's, and speculative decoding reproduces its own"
    )
    return True


INT8_DOT_PATH = "DOMINOSPEC_INT8_DOT_PATH"  # auto, avx512-vnni or avx2: which instructions run int8-dot
INT8_DOT_PATHS = ("auto", "avx512-vnni", "avx2")  # the words it takes (a CPU may lack one: refused at load)


def int8_dot_available(module) -> bool:
    """This build has an int8-dot path (AVX512-VNNI or AVX2), the one DOMINOSPEC_INT8_DOT_PATH names if it names one."""
    paths = list(module.int8_dot_paths())
    choice = os.environ.get(INT8_DOT_PATH, "auto").strip().lower()
    if choice not in ("", "auto"):
        if choice not in paths:
            raise DominoError(
                f"{INT8_DOT_PATH}={choice}: this CPU's build has {', '.join(paths) or 'no int8-dot path'}"
            )
        module.set_int8_dot_path(choice)
    elif paths:
        module.set_int8_dot_path(paths[0])
    return bool(paths)


def kernel_format(module, weight_format: str) -> str:
    """The panel layout a weight format packs into: float32, bfloat16, int8, bfloat16_pairs (bfloat16-dot, or
    bfloat16 with DOMINOSPEC_BF16_DOT=on) or int8_quads (int8-dot). A dot format the CPU lacks is refused."""
    if weight_format == "bfloat16" and bf16_dot_available(module):
        return "bfloat16_pairs"
    if weight_format == "bfloat16-dot":
        if not module.has_bf16_dot():
            raise DominoError("bfloat16-dot runs on AVX512-BF16's dot product, which this CPU does not have")
        return "bfloat16_pairs"
    if weight_format in ("int8-dot", "q4-dot"):
        if not int8_dot_available(module):
            raise DominoError(f"{weight_format} runs on AVX512-VNNI or AVX2 integer dot products; this CPU has neither")
        return "int8_quads"
    return weight_format


class PackedLinear:
    """W packed into the kernel's panels once; y = x @ W^T + b for x [..., K] with few rows.

    weight_format: float32 (as given), bfloat16 (rounded to nearest, half the bytes), int8
    (quant.quantize_int8: a quarter of the bytes, plus an fp32 scale and offset per column and
    INT8_GROUP inputs), or the dot-product formats bfloat16-dot / int8-dot (the same weights;
    activations rounded to bf16, or quantised per row to int8 in blocks of INT8_GROUP, by the kernel), or
    q4-dot: int8-dot's activations on a GGUF's own blocks (quant.Blocks): 4-bit ones in 4-bit panels with their
    float16 scales (pack_q4), Q8_0 ones as int8-dot's panels of the file's int8 values; without blocks, int8-dot.
    Activations and accumulation stay fp32 otherwise. The C++ side of this contract: cpu_kernels/module.cpp.
    """

    def __init__(
        self,
        module,
        weight: torch.Tensor | list[torch.Tensor],
        bias: torch.Tensor | None,
        weight_format: str = "float32",
        blocks=None,
    ):
        from .quant import INT8_GROUP, quantize_int8

        self.module = module
        parts = weight if isinstance(weight, list) else [weight]  # row blocks (native.Linear): stacked to pack
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.out_features, self.in_features = shape
        self.format = kernel_format(module, weight_format)
        from_blocks = weight_format == "q4-dot" and blocks is not None  # the file's own blocks, not requantised
        if from_blocks:
            self.format = "q4_octets" if blocks.bits == 4 else "q8_quads"
        self.bias = None if bias is None else bias.detach().contiguous()
        saved = saved_panels(shape, self.format)  # an earlier process's panels of this weight
        if saved is not None:
            self.panels, self.scale, self.group = saved
            return
        if from_blocks:
            self.group = INT8_GROUP
            self.panels, self.scale = pack_q4(blocks, module.panel_width())
        else:
            w = parts[0] if len(parts) == 1 else torch.cat(parts)
            w, self.scale, self.group = w.detach().float().contiguous(), None, 0
            if self.format in ("int8", "int8_quads"):
                q, scale, offset = quantize_int8(w, INT8_GROUP)  # [N, K], [N, G], [N, G]
                w, self.group = q.float(), INT8_GROUP
                # [P, G, 2, NR]: per panel and group, its columns' scales, then their offsets
                self.scale = torch.stack([module.pack(scale, "float32"), module.pack(offset, "float32")], dim=2)
            # [ceil(N / NR), K, NR] (pairs / quads: [.., ceil(K / 2 or 4), NR, 2 or 4])
            self.panels = module.pack(w, self.format)
        keep_panels(shape, self.format, self.panels, self.scale, self.group)

    @property
    def nbytes(self) -> int:
        """Bytes a pass streams: the panels (and int8 scales)."""
        extra = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.panels.numel() * self.panels.element_size() + extra

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self.module.linear(rows, self.panels, self.bias, self.scale, self.group, self.out_features)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)

    def after_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """linear(silu(gate) * up) for gate_up [..., 2I] = [gate | up], the activation fused in."""
        rows = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        y = self.module.linear_silu_mul(rows, self.panels, self.bias, self.scale, self.group, self.out_features)
        return y.view(*gate_up.shape[:-1], self.out_features)


def pack_q4(blocks, nr: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [N, K] -> q4-dot's panels (cpu_kernels/format_q4_dot.h) and float16 scales as the blocks hold them
    (padded columns: q, scale and offset 0). 4 bits: nibble pairs [P, K / 32, 4, NR, 4] uint8, byte (p, g, o, j, t) =
    q[p*NR + j, 32g + 8o + t] | q[.., 32g + 8o + 4 + t] << 4, scales and offsets [P, K / 32, 2, NR]; 8 bits (Q8_0):
    [P, K / 32, 8, NR, 4] uint8 holding q + 128 (int8-dot's bias), scales [P, K / 32, 1, NR] (the offset is 0)."""
    n, k = blocks.q.shape
    p, g = -(-n // nr), k // 32
    eight = blocks.bits == 8
    q = torch.zeros(p * nr, k, dtype=torch.int16 if eight else torch.uint8)
    q[:n] = blocks.q
    if eight:
        panels = (q + 128).to(torch.uint8).view(p, nr, g, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    else:
        q = q.view(p, nr, g, 4, 2, 4)  # [P, NR, G, octet, low / high, t]
        panels = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [P, G, 4, NR, 4]
    values = [blocks.scale] if eight else [blocks.scale, blocks.offset]
    so = torch.zeros(p * nr, g, len(values), dtype=torch.float16)
    for i, v in enumerate(values):
        so[:n, :, i] = v
    return panels, so.view(p, nr, g, len(values)).permute(0, 2, 3, 1).contiguous()  # [P, G, 1 or 2, NR]
