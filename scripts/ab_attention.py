"""The target's forward of k new tokens after a cached context on its three paths, in one process, interleaved:

- fused: every decoder layer in one call of the kernel extension (DecoderLayers), attention one query at a time;
- loop: the same kernels called layer by layer from Python (DOMINOSPEC_FUSED_LAYERS=off);
- sdpa: the Python loop with SDPA's attention (what prefill runs).

    taskset -c 0 python scripts/ab_attention.py --dtype auto --threads 1 --context 256 --ks 1,2,5,9

Prints the median ms per forward (k = 1 is a decode step) for each path, the ratios, and how far the logits
of the paths are apart (~1e-5: other summation orders).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dominospec.devices import cpu_model
from dominospec.targets import Target
from dominospec.targets import native as native_module


def forward_ms(native, cache, context: int, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    logits, _ = native(tokens, cache, logits="all")
    ms = (time.perf_counter() - t0) * 1e3
    cache.crop(context)
    return ms, logits


def forward_setup(doc: str, dtype: str):
    """The options of a forward timing (this script's and step_share.py's): (args, target, a cache holding a random
    context of --context tokens, the generator that drew it), the machine's line printed."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default=dtype, help="float32, bfloat16, int8 or auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--ks", default="1,2,5,9", help="new tokens per forward")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, device="cpu", dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    cache = target.native.new_cache(1, args.context + 64)
    target.native(torch.randint(0, target.vocab_size, (1, args.context), generator=gen), cache, logits="none")
    print(f"{cpu_model()}, {args.threads} thread(s), {target.name} {target.run_precision}, context {args.context}")
    return args, target, cache, gen


def main() -> None:
    args, target, cache, gen = forward_setup(__doc__, "float32")
    native = target.native
    limit = native_module.PER_QUERY_MAX
    paths = {"fused": (limit, "on"), "loop": (limit, "off"), "sdpa": (0, "off")}  # (PER_QUERY_MAX, switch)
    print("| k | fused ms | loop ms | SDPA ms | fused / loop | fused / SDPA | max logit difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for k in [int(x) for x in args.ks.split(",")]:
            tokens = torch.randint(0, target.vocab_size, (1, k), generator=gen)
            times, logits = {p: [] for p in paths}, {}
            for r in range(args.repeats + 3):  # 3 uncounted warm-up rounds
                for path, (per_query, switch) in paths.items():
                    native_module.PER_QUERY_MAX = per_query
                    os.environ[native_module.FUSED_SWITCH] = switch
                    ms, logits[path] = forward_ms(native, cache, args.context, tokens)
                    if r >= 3:
                        times[path].append(ms)
            med = {p: statistics.median(v) for p, v in times.items()}
            diff = max((logits["fused"] - logits[p]).abs().max().item() for p in ("loop", "sdpa"))
            f, lo, sd = med["fused"], med["loop"], med["sdpa"]
            print(f"| {k} | {f:.2f} | {lo:.2f} | {sd:.2f} | {f / lo:.3f} | {f / sd:.3f} | {diff:.1e} |")
    finally:
        native_module.PER_QUERY_MAX = limit
        os.environ.pop(native_module.FUSED_SWITCH, None)


if __name__ == "__main__":
    main()
