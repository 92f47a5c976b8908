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
from dominospec.targets import Target
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
    ap.add_argument(
        "--tau-steps",
        type=int,
        default=0,
        help="then train a fresh drafter (the shipped shape) this many packed steps in fp32 and in bf16 from the "
        "same start, and print each one's validation tau on held-out conversations",
    )
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
    if args.tau_steps:
        compare_bf16_tau(target, args.data, args.tau_steps, args.batch_size, args.anchors, args.distill)


def compare_bf16_tau(target, data: str, steps: int, batch_size: int, anchors: int, distill: float) -> None:
    """Validation tau after `steps` packed steps in fp32 and in bf16, the same data, start and anchors."""
    from dominospec.drafter.checkpoint import read_checkpoint
    from dominospec.train.samples import fresh_drafter
    from dominospec.train.validate import Validator, split_validation

    train, val = split_validation(load_dataset_dir(data, target=target)[1], 0.05)
    train = validate_samples(train[: steps * batch_size], target, 2048, data)
    shape = read_checkpoint(shipped_drafter_dir("smollm2-135m"))[0]
    arch = {k: getattr(shape, k) for k in ("head", "num_layers", "block_size", "confidence_head")}
    validator = Validator(target, val[:16], 64)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cache").mkdir()
        for bf16 in (False, True):
            d = fresh_drafter(target, train, arch, shape.draft_vocab_size, seed=0)
            cfg = TrainConfig(max_steps=steps, batch_size=batch_size, anchors=anchors, distill=distill, bf16=bf16)
            t = Trainer(target, d, train, Path(tmp) / str(bf16), cfg, feature_cache=Path(tmp) / "cache", progress=False)
            t0 = time.thread_time()
            for _ in range(steps):
                rec = t.train_step()
            secs = time.thread_time() - t0
            r = validator.evaluate(d)
            print(
                f"{'bf16' if bf16 else 'fp32'}: {steps} steps in {secs:.0f} CPU s, "
                f"last train tau {rec['tau_greedy']:.3f}, validation tau {r.tau:.3f} "
                f"(p1 {r.conditional[0]:.3f}, {r.blocks} blocks)"
            )


if __name__ == "__main__":
    main()
