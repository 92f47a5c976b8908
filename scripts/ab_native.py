"""A/B of the native forward with and without the small-M kernel, interleaved in one process.

The same loaded SmolLM2-135M feeds two NativeModels (DOMINOSPEC_KERNELS on, then off); each
repeat runs every (path, context, k) once, so a slow spell on a shared machine hits both paths.
Reports ms per forward of k new tokens after a cached context (median and minimum) and the
multiple of that path's own decode step (k = 1).
Run pinned: `taskset -c 1 python scripts/ab_native.py --threads 1`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dominospec.devices import cpu_model
from dominospec.targets import kernels
from dominospec.targets.hf import Target
from dominospec.targets.native import NativeModel


def build(hf_model, switch: str) -> NativeModel:
    os.environ[kernels.ENV_SWITCH] = switch
    kernels.reset_kernels()
    return NativeModel.from_hf(hf_model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--max-k", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=7)
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
    target = Target.load("smollm2-135m", backend="hf")
    paths = {"kernel": build(target.model, "on"), "today": build(target.model, "off")}
    assert paths["kernel"].lm_head.kernel is not None and paths["today"].lm_head.kernel is None
    contexts = [int(c) for c in args.contexts.split(",")]
    ks = list(range(1, args.max_k + 1))
    gen = torch.Generator().manual_seed(0)
    caches = {}
    with torch.inference_mode():
        for name, nat in paths.items():
            for c in contexts:
                cache = nat.new_cache(1, c + args.max_k + 1)
                nat(torch.randint(0, 49152, (1, c), generator=gen), cache, logits="none")
                caches[(name, c)] = cache
        blocks = {k: torch.randint(0, 49152, (1, k), generator=gen) for k in ks}
        times = {(n, c, k): [] for n in paths for c in contexts for k in ks}
        for r in range(args.repeats + 1):  # the first round warms up, uncounted
            for c in contexts:
                for k in ks:
                    for name, nat in paths.items():
                        cache = caches[(name, c)]
                        t0 = clock()
                        nat(blocks[k], cache, logits="all", feature_layers=[1, 8, 14, 20, 27])
                        if r:
                            times[(name, c, k)].append(clock() - t0)
                        cache.set_length(0, c)
    print(
        f"# {cpu_model()}, {args.threads} thread(s), {args.clock} clock, {args.repeats} interleaved repeats; "
        "ms (x own decode step)"
    )
    for stat, fn in (("median", statistics.median), ("min", min)):
        print(f"\n{stat}:\n| k | " + " | ".join(f"{n} ctx {c}" for c in contexts for n in paths) + " |")
        print("|---:|" + "---:|" * (len(contexts) * len(paths)))
        for k in ks:
            cells = []
            for c in contexts:
                for n in paths:
                    ms, step = 1000 * fn(times[(n, c, k)]), 1000 * fn(times[(n, c, 1)])
                    cells.append(f"{ms:.1f} ({ms / step:.2f})")
            print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
