"""Can a drafter fit a few conversations at all? Train on a handful, judge on the same ones (issue 53).

    taskset -c 1 python scripts/fit_small.py --data data/smollm2-135m/part-028 --samples 64 \
        --store runs/fit-store --out runs/fit/fresh --steps 400 [--init DIR | shape flags] [recipe flags]

A set-up without a cap drives a drafter's judges towards perfect on its own training data: the target's
distribution is a fixed function of the context, and a few thousand positions are easy to memorise. If
the drafter cannot get there, what caps it is the model, the features it reads or the labels it learns
from, not the amount of data.

The target runs once per sample over every usable decoder layer (0..L-2) and its final state; that pass
is stored in --store (fp16, keyed by content, as the training cache) and every later run, whatever its
--layer-ids, slices it instead of running the target again. Training is the library's Trainer with the
run's layer set, validated (walked greedy tau) on the same samples it trains on; it checkpoints every
--save-every steps and `--resume` continues a run. The judge at the end, on the same samples:

  kl         KL(target || drafter) in nats, on the draft vocabulary renormalised (as the training log's
             `kl`), over the supervised slots of 64 evenly spaced anchors a sample, slot 0 alone and all slots
  tau, p1    walked greedy acceptance (what a greedy decode of these answers would accept)
  sure       first-draft acceptance where the target is >= 0.9 sure of its token (scripts/where_lost.py)
  bands      first-draft acceptance in every band of the target's confidence

The labels are the data's sampled tokens (T=0.7), so even a perfect copy of the target's greedy choice
misses where the sample differs from it: `ceiling` gives that share per band (the target's own argmax
against the sampled token), the most a drafter that learnt the target exactly would be accepted there.
--json writes everything; a line per run goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dominospec.data.dataset import load_dataset_dir
from dominospec.drafter import Drafter
from dominospec.targets import Target
from dominospec.targets.features import FeatureCache, parse_layer_ids
from dominospec.train.blocks import IGNORE, teacher_forced_blocks
from dominospec.train.run import TrainJob
from dominospec.train.samples import fresh_drafter, validate_samples
from dominospec.train.trainer import TrainConfig, Trainer
from dominospec.train.validate import ANCHOR_CHUNK, Validator, split_validation, validation_anchors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import where_lost  # noqa: E402  (a sibling script: its judge, unchanged)

KL_ANCHORS = 64  # per sample: the KL needs the target's distribution over the draft vocabulary at every slot


def small_set(data: str, n: int, target, held_out: bool = False) -> list[dict]:
    """The first n on-policy samples of a data directory (or one part of a data set); held_out: the last n of its
    validation split (what `train` holds out at the default --val-fraction, which no drafter trained on; the
    last, so from the newest parts, the same kind of prompts as part-028's)."""
    _, samples = load_dataset_dir(data, target=target)
    samples = [s for s in samples if s.get("labels", "on-policy") == "on-policy"]
    if held_out:
        return validate_samples(split_validation(samples, TrainJob.val_fraction)[1], target, 2048, data)[-n:]
    return validate_samples(samples, target, 2048, data)[:n]


def all_layers(target) -> list[int]:
    return list(range(target.num_layers - 1))  # the last decoder layer's state is post-norm: never a feature


def fill_store(target, samples: list[dict], store: FeatureCache) -> int:
    """Every usable layer's output and the final state of each sample, once; returns how many were computed."""
    layers, computed = all_layers(target), 0
    for s in samples:
        if store.holds(layers, s["input_ids"]):
            continue
        feats, final = target.sequence_features([s["input_ids"]], layers)
        store.write(layers, s["input_ids"], feats[0], final[0])
        computed += 1
    return computed


def features_for(target, samples: list[dict], store: FeatureCache, cache: FeatureCache, layer_ids, rows="") -> None:
    """The run's layer set written into `cache` (what the Trainer and Validator read), sliced from the all-layer
    rows of `store`, with the final state and its log-normaliser as `train --features-only` writes them.
    rows "see-anchor": row t holds the target's state at t+1 (the last row repeated), so a block anchored at a sees
    the target's state at a itself, which decoding has not computed when it drafts: an upper bound, not a drafter;
    "no-features": every row zero, a drafter that reads nothing of the target's state (what the features carry)."""
    layers, h = all_layers(target), target.hidden_size
    cols = torch.cat([torch.arange(j * h, (j + 1) * h) for j in layer_ids])
    for s in samples:
        if cache.holds(layer_ids, s["input_ids"], final=True, lse=True):
            continue
        feats, final = store.read(layers, s["input_ids"])
        feats = feats[:, cols]
        if rows == "see-anchor":
            feats = torch.cat([feats[1:], feats[-1:]])
        elif rows == "no-features":
            feats = torch.zeros_like(feats)
        final16 = final.to(torch.float16)
        with torch.no_grad():
            lse = torch.logsumexp(target.lm_head(final16.to(target.dtype)).float(), -1)
        cache.write(layer_ids, s["input_ids"], feats, final16, lse)


@torch.no_grad()
def kl_per_slot(drafter, target, samples: list[dict], store: FeatureCache) -> list[float]:
    """Mean KL(target || drafter) [B] per block slot over the supervised slots of KL_ANCHORS evenly spaced anchors
    per sample, on the draft vocabulary renormalised (the training log's `kl`)."""
    block = drafter.config.block_size
    total, count = torch.zeros(block, dtype=torch.float64), torch.zeros(block, dtype=torch.float64)
    head = target.output_embeddings().weight
    rows = drafter.draft_vocab if drafter.config.draft_vocab_size else None
    for s in samples:
        feats, final = store.read(drafter.config.target_layer_ids, s["input_ids"])
        ids, mask = torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])
        for part in validation_anchors(mask, KL_ANCHORS).split(ANCHOR_CHUNK):
            tf = teacher_forced_blocks(drafter, feats.float(), ids, mask, part)
            pos = (part.unsqueeze(1) + torch.arange(block)).clamp(max=ids.numel() - 1)  # slot k reads final[a+k]
            w = head if rows is None else head[rows]
            q = torch.softmax(final[pos].float() @ w.float().T, -1)  # [N, B, V'], renormalised on V'
            kl = (q * (q.clamp_min(1e-12).log() - torch.log_softmax(tf.final.float(), -1))).sum(-1)
            valid = tf.labels != IGNORE
            total += (kl * valid).sum(0).double()
            count += valid.sum(0).double()
    return (total / count.clamp_min(1)).tolist()


@torch.no_grad()
def greedy_ceiling(target, samples: list[dict], store: FeatureCache, layer_ids: list[int]) -> list[float]:
    """Per confidence band, how often the target's own argmax equals the data's sampled next token."""
    bands = torch.tensor(where_lost.BANDS[1:-1])
    n = len(where_lost.BANDS) - 1
    same, seen = torch.zeros(n), torch.zeros(n)
    for s in samples:
        _, final = store.read(layer_ids, s["input_ids"])
        ids, mask = torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])
        pos = validation_anchors(mask, 0)
        probs = torch.softmax(target.lm_head(final[pos].to(target.dtype)).float(), -1)
        conf, top = probs.max(-1)
        band = torch.bucketize(conf, bands, right=True)
        hit = (top == ids[pos + 1]).float()
        same.index_add_(0, band, hit)
        seen.index_add_(0, band, torch.ones_like(hit))
    return (same / seen.clamp_min(1)).tolist()


def judge(drafter, target, samples: list[dict], store: FeatureCache) -> dict:
    layer_ids = drafter.config.target_layer_ids
    got = [store.read(layer_ids, s["input_ids"]) for s in samples]
    feats, finals = [f.float() for f, _ in got], [fin.to(target.dtype) for _, fin in got]
    with torch.no_grad():
        counts = where_lost.merged(where_lost.judge(drafter, target, samples, finals, feats))
    walk = where_lost.walked(counts, "walk")
    first = counts["first"]
    reached = first["band_reached"]
    kl = kl_per_slot(drafter, target, samples, store)
    return {
        "tau": walk.tau,
        "p1": walk.conditional[0],
        "first_accepted": sum(first["band_accepted"]) / max(1, sum(reached)),
        "sure": first["band_accepted"][-1] / max(1, reached[-1]),
        "bands": [a / r if r else None for a, r in zip(first["band_accepted"], reached)],
        "band_share": [r / max(1, sum(reached)) for r in reached],
        "ranks": [k / max(1, sum(reached)) for k in first["rank"]],
        "kl_slot0": kl[0],
        "kl": sum(kl) / len(kl),
        "kl_by_slot": kl,
        "ceiling": greedy_ceiling(target, samples, store, layer_ids),
    }


def make_drafter(args, target, samples: list[dict]) -> Drafter:
    if args.init:
        drafter = Drafter.from_pretrained(args.init, target=target)
        return drafter.with_fusion().attach(target) if args.fuse_context and drafter.fuse is None else drafter
    arch = {
        "head": args.head,
        "num_layers": args.layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "confidence_head": False,
        "fuse_context": args.fuse_context,
        "block_size": 8,
    }
    if args.layer_ids:
        arch["target_layer_ids"] = parse_layer_ids(args.layer_ids, target.num_layers)
    return fresh_drafter(target, samples, arch, args.draft_vocab, args.seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-135m/part-028", help="a data directory or one part of a set")
    ap.add_argument("--samples", type=int, default=64, help="train and judge on the first N on-policy samples")
    ap.add_argument("--held-out", action="store_true", help="the last N of the data's validation split instead")
    ap.add_argument("--store", type=Path, required=True, help="all-layer features of the samples (and run caches)")
    ap.add_argument("--out", type=Path, required=True, help="the run: checkpoint, metrics.jsonl, drafter, fit.json")
    ap.add_argument("--init", default=None, help="start from this drafter (e.g. the shipped one)")
    ap.add_argument("--judge-only", action="store_true", help="judge --init (or --out's drafter) without training")
    ap.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    # shape of a fresh drafter (the shipped one's by default, without its confidence head)
    ap.add_argument("--head", default="domino")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--layer-ids", default=None, help="target feature layers, e.g. 28 or 1,8,14,20,27,28")
    ap.add_argument("--fuse-context", action="store_true", help="the last context row fused into the block")
    ap.add_argument(
        "--rows",
        choices=("see-anchor", "no-features"),
        default="",
        help="context rows changed: see-anchor, an upper bound where blocks also see the target's state at the "
        "anchor; no-features, all zero (what the target's state is worth to the drafter)",
    )
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: the target's)")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    # the recipe
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--distill", type=float, default=0.5)
    ap.add_argument("--greedy-labels", action="store_true")
    ap.add_argument("--lambda-start", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None, help="default: OUT/fit.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.process_time()
    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    samples = small_set(args.data, args.samples, target, args.held_out)
    store = FeatureCache(args.store, target)
    cache_dir = args.store / args.rows if args.rows else args.store  # changed rows under keys of their own
    cache = FeatureCache(cache_dir, target)
    computed = fill_store(target, samples, store)
    tokens = sum(len(s["input_ids"]) for s in samples)
    supervised = sum(sum(s["loss_mask"]) for s in samples)
    print(f"{len(samples)} samples, {tokens} tokens ({supervised} supervised); {computed} target passes", flush=True)
    t_feat = time.process_time() - t0
    trained = 0.0
    if args.judge_only:
        drafter = Drafter.from_pretrained(args.init or args.out, target=target)
        features_for(target, samples, store, cache, drafter.config.target_layer_ids, args.rows)
    else:
        drafter = make_drafter(args, target, samples)
        features_for(target, samples, store, cache, drafter.config.target_layer_ids, args.rows)
        cfg = TrainConfig(
            max_steps=args.steps,
            batch_size=args.batch_size,
            anchors=args.anchors,
            distill=args.distill,
            lr=args.lr,
            warmup=args.warmup,
            lambda_start=args.lambda_start,
            greedy_labels=args.greedy_labels,
            seed=args.seed,
            val_every=args.val_every,
            save_every=args.save_every,
        )
        validator = Validator(target, samples, walk=True, feature_cache=cache)
        trainer = Trainer(
            target, drafter, samples, args.out, cfg, feature_cache=cache_dir, validator=validator, progress=False
        )
        if args.resume:
            trainer.load_checkpoint()
        t1 = time.process_time()
        trainer.fit()
        trained = time.process_time() - t1
        drafter = trainer.drafter
    drafter.eval()
    t2 = time.process_time()
    result = judge(drafter.float(), target, samples, cache)
    result.update(
        samples=len(samples),
        tokens=tokens,
        layer_ids=drafter.config.target_layer_ids,
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        cpu_minutes={
            "features": t_feat / 60,
            "train": trained / 60,
            "judge": (time.process_time() - t2) / 60,
        },
    )
    path = args.json or args.out / "fit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    bands = " / ".join("-" if b is None else f"{b:.3f}" for b in result["bands"])
    ceiling = " / ".join(f"{c:.3f}" for c in result["ceiling"])
    print(
        f"{args.out}: kl {result['kl']:.3f} (slot 0 {result['kl_slot0']:.3f})  tau {result['tau']:.3f}  "
        f"p1 {result['p1']:.3f}  sure {result['sure']:.3f}  bands {bands}  (ceiling {ceiling})  "
        f"train {trained / 60:.1f} CPU-min",
        flush=True,
    )


if __name__ == "__main__":
    main()
