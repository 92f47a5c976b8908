"""Device and dtype policy, shared by the target, the drafter, decoding and the benchmark."""

from __future__ import annotations

import ctypes
import glob
import os
import platform
from pathlib import Path

import torch

from .errors import DominoError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


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
        # bf16 on GPUs; fp32 on CPU: the lossless default (reduced precision flips near-ties)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DominoError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}, or int8 (CPU weights)")
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16, AMX): oneDNN's own answer; True if it cannot say."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def bf16_warning(device: torch.device) -> str | None:
    """What to tell a user who asks for bf16 autocast where it is emulated, or None."""
    if device.type != "cpu" or native_bf16():
        return None
    return (
        f"warning: --bf16 on a CPU without native bf16 matmuls ({cpu_model()}, torch capability "
        f"{torch.backends.cpu.get_cpu_capability()}): they are emulated, and a training step measured ~5x slower "
        "than fp32 on such a CPU (docs/training.md); drop --bf16 here"
    )


def physical_cores() -> int:
    """Physical CPU cores this process may run on (hyperthread siblings counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    try:
        for cpu in allowed:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
    except OSError:
        return max(1, len(allowed))
    return max(1, len(cores))


def default_threads() -> int:
    """torch's CPU threads unless told otherwise: OMP_NUM_THREADS when set, else every physical core.

    Decoding is memory-bound: a hyperthread sibling adds no bandwidth, and an oversubscribed core
    stalls the whole forward (every matmul waits for its slowest thread).
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores()


def allowed_cpus() -> int:
    """Logical CPUs this process may run on (its affinity: taskset, a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_to_use(asked: int | None) -> tuple[int, str | None]:
    """torch's CPU threads for --threads `asked` (None: default_threads()), capped at the CPUs this process
    may use, and a note when the cap applied: threads beyond them only wait on each other (a matmul waits
    for its slowest thread), so 999 threads on one CPU ran for minutes."""
    n = asked if asked is not None else default_threads()
    cpus = allowed_cpus()
    if n <= cpus:
        return n, None
    source = f"--threads {asked}" if asked is not None else f"OMP_NUM_THREADS={n}"
    return cpus, f"{source}: this process may use {cpus} CPU(s) (its affinity), so {cpus} thread(s) are used"


def describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    if dev.type == "cpu":
        return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
    return str(dev)


def release_openmp_workers() -> bool:
    """Release the calling thread's OpenMP worker threads (OpenMP 5 `omp_pause_resource_all`, soft).

    With GNU OpenMP, a second thread that runs torch's parallel regions (the engine's) while the first
    one's idle workers are still parked gets throttled worker wake-ups: on 2 cores a SmolLM2 decode
    step took 33 ms instead of 23. Call it from the thread that ran torch before handing the work to
    another one; it recreates its workers if it runs parallel work again. False where the OpenMP
    runtime has no such call (or torch uses none).
    """
    for lib in _openmp_libraries():
        pause = getattr(lib, "omp_pause_resource_all", None)
        if pause is not None:
            return pause(1) == 0  # omp_pause_soft
    return False


def _openmp_libraries():
    yield ctypes.CDLL(None)  # the process's global symbols first
    here = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(here, "libgomp*")) + glob.glob(os.path.join(here, "libiomp*"))):
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


def available_bytes(device) -> int | None:
    """Memory free for new tensors on `device` now (CUDA: free device memory; CPU: MemAvailable), or None."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
