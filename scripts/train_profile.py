"""Where a training step's time goes, today's per-sequence step next to the packed one, in one process.

    taskset -c 0 python scripts/train_profile.py --samples 16 --steps 6
    taskset -c 0 python scripts/train_profile.py --anchors 0 --bf16   # dense anchors, bf16 autocast

Both trainers start from the same drafter (the shipped drafter's shape and weights) and train on the
same samples of the committed data with the shipped recipe (batch 4, 32 anchors, distill 0.5); the
target features are computed once into an fp16 feature cache first (timed apart: the feature pass),
so the timed steps compare what a multi-epoch run does after its first epoch. Steps alternate
between the two trainers, and every number is CPU time of this thread (time.thread_time), so a
shared core slows both alike. Prints seconds per step by part and supervised block positions per
CPU-second (one torch thread: per core).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dominospec.data.dataset import load_dataset_dir
from dominospec.drafter import Drafter
from dominospec.drafter.checkpoint import shipped_drafter_dir
from dominospec.target import Target
from dominospec.train.samples import validate_samples
from dominospec.train.trainer import TrainConfig, Trainer

PARTS = ("data", "features", "target_probs", "forward", "loss", "backward", "metrics", "optimizer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-135m")
    ap.add_argument("--samples", type=int, default=16, help="training samples used (the first N)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per trainer (after one warm-up step)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32, help="0: dense (every supervised position)")
    ap.add_argument("--distill", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    samples = load_dataset_dir(args.data, target=target)[1][: args.samples]
    samples = validate_samples(samples, target, 2048, args.data)

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cache").mkdir()
        trainers = {}
        variants = {"per-sequence (today)": (False, False), "packed": (True, False), "packed bf16": (True, True)}
        for name, (packed, bf16) in variants.items():
            cfg = TrainConfig(
                max_steps=10_000,
                batch_size=args.batch_size,
                anchors=args.anchors,
                distill=args.distill,
                packed=packed,
                bf16=bf16,
            )
            d = Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=target)
            trainers[name] = Trainer(
                target,
                d,
                samples,
                Path(tmp) / name.replace(" ", "-"),
                cfg,
                feature_cache=Path(tmp) / "cache",
                progress=False,
            )
        first = next(iter(trainers.values()))
        t0 = time.thread_time()
        first.features(list(range(len(samples))))  # fills the fp16 cache
        feat_s = time.thread_time() - t0
        tokens = sum(len(s["input_ids"]) for s in samples)
        print(
            f"feature pass (target forward, no cache): {feat_s:.2f} s for {tokens} tokens, {tokens / feat_s:.0f} tok/s"
        )

        for t in trainers.values():  # warm-up, one epoch: the packed trainers' in-memory features and lse
            t0 = time.thread_time()
            for _ in range(t.steps_per_epoch):
                t.train_step()
            print(f"first epoch: {time.thread_time() - t0:.2f} s ({t.steps_per_epoch} steps)")
            t.timing, t.positions = {}, 0
        wall = dict.fromkeys(trainers, 0.0)
        for _ in range(args.steps):
            for name, t in trainers.items():
                t0 = time.thread_time()
                t.train_step()
                wall[name] += time.thread_time() - t0

    names = list(trainers)
    print(
        f"\n{args.steps} steps each, batch {args.batch_size}, anchors {args.anchors or 'dense'}, "
        f"distill {args.distill}, {torch.get_num_threads()} thread(s); CPU s/step"
    )
    print(f"{'part':<14}" + "".join(f"{n:>22}" for n in names))
    for part in PARTS:
        row = [trainers[n].timing.get(part, 0.0) / args.steps for n in names]
        print(f"{part:<14}" + "".join(f"{x:>22.3f}" for x in row))
    other = [(wall[n] - sum(trainers[n].timing.values())) / args.steps for n in names]
    print(f"{'python/other':<14}" + "".join(f"{x:>22.3f}" for x in other))
    print(f"{'total':<14}" + "".join(f"{wall[n] / args.steps:>22.3f}" for n in names))
    rate = [trainers[n].positions / wall[n] for n in names]
    print(f"{'positions/s':<14}" + "".join(f"{x:>22.0f}" for x in rate))
    print(f"{'speed-up':<14}" + "".join(f"{x / rate[0]:>21.2f}x" for x in rate))


if __name__ == "__main__":
    main()
