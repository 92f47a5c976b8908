"""A/B of the matrix products of one SmolLM2-135M forward at M = 1..17 rows, per kernel path.

Random weights of the model's shapes (30 layers of qkv 576->960, o 576->576, gate/up 576->3072,
down 1536->576, and the LM head 576->49152; ~538 MB fp32). Candidates are interleaved in one
process (each repeat runs every path at every M), and the median per (path, M) is reported in ms.
Run pinned: `taskset -c 1 python scripts/bench_kernels.py --threads 1`.

--formats adds the kernel on bf16 / int8 weights (`bfloat16-dot`: bf16 on AVX512-BF16's dot product,
DOMINOSPEC_BF16_DOT=on) next to fp32, and a second table: GB/s, the bytes each kernel streams (its
panels, plus int8's column scales) over its median time, to set against the machine's streaming
bandwidth (the `read` column: torch.sum over a buffer of the fp32 weights' size, same threads).
`--formats float32,bfloat16,int8,bfloat16-dot --only-kernels` times the kernels (and `read`) alone.
`--baseline LIB.so` adds the same formats on another build of the kernel (say, the cached build of an
earlier source: `$DOMINOSPEC_CACHE/kernels/cpu_kernels_<key>/*.so`), interleaved with this one's.
`--attention` times the attention kernel instead (one forward's 30 calls, SmolLM2's 9 query and 3 kv
heads of 64, after a cached context of 256 and 1024, for 1 and 9 new tokens), on each build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dominospec.devices import cpu_model
from dominospec.targets.kernels import BF16_DOT_SWITCH, PackedLinear, import_library, load_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-m", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", default="float32", help="kernel weight formats: float32,bfloat16,int8,bfloat16-dot")
    ap.add_argument("--only-kernels", action="store_true", help="leave out the library paths")
    ap.add_argument("--baseline", default=None, help="a built kernel library (.so) to time beside this one")
    ap.add_argument("--attention", action="store_true", help="time the attention kernel, not the linears")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (1 thread only): time descheduled on a shared machine is not counted",
    )
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread; use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    modules = {"": load_kernels()}
    if args.baseline:
        modules["baseline-"] = import_library(Path(args.baseline))
    if args.attention:
        return time_attention(modules, args.repeats, clock)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    kernels = {}
    for fmt in args.formats.split(","):
        os.environ[BF16_DOT_SWITCH] = "on" if fmt == "bfloat16-dot" else "off"
        for prefix, module in modules.items():
            kernels[prefix + fmt] = [PackedLinear(module, w, None, fmt.removesuffix("-dot")) for w in weights]
    os.environ[BF16_DOT_SWITCH] = "off"
    streamed = {f"kernel-{fmt}": sum(k.nbytes for k in ks) for fmt, ks in kernels.items()}
    # the machine's streaming bandwidth on the same thread count: one read of a buffer as large as the fp32 weights
    buffer = torch.ones(sum(n * k for n, k in SHAPES))
    streamed["read"] = buffer.numel() * 4
    onednn_w = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    onednn = torch.ops.mkldnn._linear_pointwise.default
    transposed = [w.t().contiguous() if w.shape[0] > w.shape[1] else None for w in weights]

    def run_kernel(ks):
        def run(xs):
            for f, x in zip(ks, xs):
                f(x)

        return run

    def run_onednn(xs):
        for p, x in zip(onednn_w, xs):
            onednn(x, p, None, "none", [], "")

    def run_m1(xs):  # today's single-row path: MKL GEMV on a transposed copy, else F.linear
        for w, wt, x in zip(weights, transposed, xs):
            torch.matmul(x, wt) if wt is not None else F.linear(x, w)

    def run_flinear(xs):
        for w, x in zip(weights, xs):
            F.linear(x, w)

    paths = {f"kernel-{fmt}": run_kernel(ks) for fmt, ks in kernels.items()}
    paths["read"] = lambda xs: buffer.sum()  # the same bytes whatever M
    if not args.only_kernels:
        paths |= {"onednn": run_onednn, "m1_path": run_m1, "F.linear": run_flinear}
    ms = list(range(1, args.max_m + 1))
    inputs = {m: [torch.randn(m, k) for _, k in SHAPES] for m in ms}
    times = {(p, m): [] for p in paths for m in ms}
    with torch.inference_mode():
        for f in paths.values():  # warm-up
            f(inputs[1])
        for _ in range(args.repeats):
            for m in ms:
                for p, f in paths.items():
                    t0 = clock()
                    f(inputs[m])
                    times[(p, m)].append(clock() - t0)
    med = {key: 1000 * statistics.median(v) for key, v in times.items()}
    print(
        f"# {cpu_model()}, {args.threads} thread(s), {args.clock} clock, median of {args.repeats}, "
        f"ms for all {len(SHAPES)} matmuls"
    )
    print("| M | " + " | ".join(paths) + " |")
    print("|---:|" + "---:|" * len(paths))
    for m in ms:
        print(f"| {m} | " + " | ".join(f"{med[(p, m)]:.1f}" for p in paths) + " |")
    print(f"\n# GB/s streamed by each kernel ({', '.join(f'{p}: {b / 1e6:.0f} MB' for p, b in streamed.items())})")
    print("| M | " + " | ".join(streamed) + " |")
    print("|---:|" + "---:|" * len(streamed))
    for m in ms:
        print(f"| {m} | " + " | ".join(f"{streamed[p] / med[(p, m)] / 1e6:.1f}" for p in streamed) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f"{p}@{m}": v for (p, m), v in med.items()}, fh, indent=1)


def time_attention(modules: dict, repeats: int, clock) -> None:
    """ms of one forward's attention (30 calls) per build, medians; and the largest difference from this build."""
    print(f"# {cpu_model()}, {torch.get_num_threads()} thread(s), median of {repeats}, ms for 30 attention calls")
    names = [f"{prefix}attend" for prefix in modules]
    print("| context | new tokens | " + " | ".join(names) + " | max abs difference |")
    print("|---:|---:|" + "---:|" * (len(names) + 1))
    for context in (256, 1024):
        for new in (1, 9):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, new, 9, 64, generator=g)
            k, v = (torch.randn(1, 3, context + new, 64, generator=g) for _ in range(2))
            starts = torch.tensor([context])
            outs = [m.attend(q, k, v, starts, 0.125) for m in modules.values()]
            times = {name: [] for name in names}
            for _ in range(repeats):
                for name, m in zip(names, modules.values()):
                    t0 = clock()
                    for _ in range(30):
                        m.attend(q, k, v, starts, 0.125)
                    times[name].append(clock() - t0)
            diff = max((o - outs[0]).abs().max().item() for o in outs)
            cells = " | ".join(f"{1000 * statistics.median(times[n]):.2f}" for n in names)
            print(f"| {context} | {new} | {cells} | {diff:.1e} |")


if __name__ == "__main__":
    main()
