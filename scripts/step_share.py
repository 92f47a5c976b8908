"""What share of a decode step (and of a k-token verify) is not the weights' matrix products.

For k new tokens after a cached context, interleaved in one process: the whole forward (`logits="all"`, as
decode and verify run it), every packed linear of it alone on k rows (q/k/v, o, gate/up, SiLU-mul down per
layer, and the LM head), and the attention kernel alone over the same cache (one call per layer). The rest
of the forward (norms, RoPE, cache writes, residuals, the embedding, dispatch) is the forward minus the two.
Medians in ms.

    taskset -c 0 python scripts/step_share.py --dtype auto --threads 1 --context 256 --ks 1,2,5,9
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from ab_attention import forward_setup  # scripts/ is on the path when a script runs


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_linears(native, inputs: dict) -> None:
    """Every packed linear of one forward on the rows of `inputs` (by input width)."""
    for b in native.blocks:
        b.qkv.kernel(inputs[b.qkv.kernel.in_features])
        b.o.kernel(inputs[b.o.kernel.in_features])
        b.gate_up.kernel(inputs[b.gate_up.kernel.in_features])
        b.down.kernel.after_silu_mul(inputs[2 * b.down.kernel.in_features])
    native.lm_head.kernel(inputs[native.lm_head.kernel.in_features])


def run_attention(native, cache, q: torch.Tensor, starts: torch.Tensor) -> None:
    """The attention kernel once per layer over the cache."""
    module, scale = native.lm_head.kernel.module, native.blocks[0].scale
    for i in range(native.cfg.num_layers):
        module.attend(q, cache.k[i], cache.v[i], starts, scale)


def run_forward(native, tokens: torch.Tensor, cache, context: int) -> None:
    native(tokens, cache, logits="all")
    cache.crop(context)


def main() -> None:
    args, target, cache, gen = forward_setup(__doc__, "auto")
    native = target.native
    if native.lm_head.kernel is None:
        raise SystemExit("this needs the small-row kernel built")
    blocks = native.blocks
    linears = [native.lm_head] + [getattr(b, n) for b in blocks for n in ("qkv", "o", "gate_up", "down")]
    cfg = native.cfg
    print("| k | forward ms | linears ms | attention ms | rest ms | not matmul | linears GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    weight_bytes = sum(lin.kernel.nbytes for lin in linears)
    with torch.inference_mode():
        for k in [int(x) for x in args.ks.split(",")]:
            tokens = torch.randint(0, target.vocab_size, (1, k), generator=gen)
            inputs = {}
            for lin in linears:  # down reads gate_up's [k, 2I] through its fused SiLU-mul
                width = lin.kernel.in_features * (2 if lin in [b.down for b in blocks] else 1)
                inputs.setdefault(width, torch.randn(k, width, generator=gen))

            q = torch.randn(1, k, cfg.num_heads, cfg.head_dim, generator=gen)
            starts = torch.tensor([args.context])
            parts = {
                "forward": functools.partial(run_forward, native, tokens, cache, args.context),
                "linears": functools.partial(run_linears, native, inputs),
                "attention": functools.partial(run_attention, native, cache, q, starts),
            }
            times = {p: [] for p in parts}
            for r in range(args.repeats + 3):  # 3 uncounted warm-up rounds
                for name, fn in parts.items():
                    ms = timed(fn)
                    if r >= 3:
                        times[name].append(ms)
            f, lin, att = (statistics.median(times[p]) for p in parts)
            rest = f - lin - att
            print(
                f"| {k} | {f:.2f} | {lin:.2f} | {att:.2f} | {rest:.2f} | {(f - lin) / f:.0%} | "
                f"{weight_bytes / lin / 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
