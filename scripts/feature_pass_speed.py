"""What the trainer's separate feature pass costs a sample, per target weight format (issue 53).

    taskset -c 0 python scripts/feature_pass_speed.py --samples 8 --formats float32,int8,int8-dot,bfloat16-dot

The pass `train --features-only` runs on a sample it has no captured features for: the native forward over
the whole sample (every decoder layer: the final state the distilling loss reads is the last one's), the
feature layers and the final state kept in fp16, and the log-normaliser of the target's logits at every
position (the full LM head). Each part is timed on this thread's CPU clock, per sample, one torch thread.
float32 and int8 compute the same model (the bundled model's weights are int8-exact); the dot formats round
the activations too, so their features are another model's: the error columns say by how much, against
float32's (relative Frobenius error of each sample's features and final state, and the largest
log-normaliser difference in nats), beside the fp16 rounding every cached feature gets anyway.
"""

from __future__ import annotations

import argparse
import time

import torch

from dominospec.data.dataset import load_dataset_dir
from dominospec.targets import Target


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-135m/part-028")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--formats", default="float32,int8,int8-dot,bfloat16-dot")
    ap.add_argument("--layer-ids", default="1,8,14,20,27", help="the shipped drafter's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = [int(x) for x in args.layer_ids.split(",")]
    ref = None
    print(f"{'format':<14}{'layers s':>10}{'lse s':>8}{'total s':>9}  (CPU s a sample)  feat err  final err  lse err")
    for fmt in args.formats.split(","):
        target = Target.load("smollm2-135m", device="cpu", dtype=fmt)
        samples = [s["input_ids"] for s in load_dataset_dir(args.data, target=target)[1][: args.samples]]
        target.sequence_features(samples[:1], layers)  # warm-up: kernel panels, allocator
        out, t_layers, t_lse = [], 0.0, 0.0
        for ids in samples:
            c0 = time.thread_time()
            feats, final = target.sequence_features([ids], layers)
            feats, final = feats[0].to(torch.float16), final[0].to(torch.float16)
            c1 = time.thread_time()
            lse = torch.logsumexp(target.lm_head(final.to(target.dtype)).float(), -1)
            t_layers, t_lse = t_layers + c1 - c0, t_lse + time.thread_time() - c1
            out.append((feats, final, lse))
        n = len(samples)
        errors = ""
        if ref is None:
            ref = out
            errors = "reference (fp16 storage alone: ~2.8e-4 relative)"
        else:
            fe = max(rel(a[0], b[0]) for a, b in zip(out, ref))
            fi = max(rel(a[1], b[1]) for a, b in zip(out, ref))
            le = max(float((a[2] - b[2]).abs().max()) for a, b in zip(out, ref))
            errors = f"{fe:9.2e}  {fi:9.2e}  {le:7.4f}"
        tokens = sum(map(len, samples))
        print(
            f"{fmt:<14}{t_layers / n:>10.3f}{t_lse / n:>8.3f}{(t_layers + t_lse) / n:>9.3f}  "
            f"({tokens / n:.0f} tokens a sample)  {errors}",
            flush=True,
        )


if __name__ == "__main__":
    main()
