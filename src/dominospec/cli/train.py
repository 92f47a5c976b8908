"""`dominospec train`: train a drafter on prepared data (one process, or under torchrun)."""

from __future__ import annotations

import torch

from ..data.dataset import check_data_dir, load_dataset_dir
from ..drafter import Drafter
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
from ..train.distributed import init_distributed
from ..train.samples import draft_vocab_coverage, fresh_drafter, init_from_target_layer, validate_samples
from ..train.trainer import TrainConfig, Trainer
from ..train.validate import Validator, shared_sequences, split_validation
from .common import add_arch_args, add_target_args, arch_from_args, check_arch_args, require_at_least, target_from_args

SAVE_DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cmd_train(args) -> int:
    # every number and the output locations are checked before the target or the data load
    cfg = TrainConfig(
        max_steps=args.max_steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=args.lr,
        distill=args.distill,
        gamma=args.gamma,
        lambda_start=args.lambda_start,
        lambda_decay=args.lambda_decay,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        save_every=args.save_every,
        val_every=args.val_every,
        val_anchors=args.val_anchors,
    )
    check_arch_args(args)
    require_at_least(args, 0, "draft_vocab")
    require_at_least(args, 1, "val_every")
    require_at_least(args, 0, "val_anchors")
    if not 0 <= args.val_fraction < 1:
        raise DominoError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    check_data_dir(args.data, "--data")
    if args.val_data:
        check_data_dir(args.val_data, "--val-data")
    out = ensure_writable_dir(args.out)
    cache = ensure_writable_dir(args.feature_cache, "--feature-cache") if args.feature_cache else None
    target = target_from_args(args)
    meta, samples = load_dataset_dir(args.data, target=target, allow_other_target=args.allow_other_target)
    samples = validate_samples(samples, target, cfg.max_seq_len, str(args.data))
    if args.val_data:
        val_samples = load_dataset_dir(args.val_data, target=target, allow_other_target=args.allow_other_target)[1]
        val_samples = validate_samples(val_samples, target, cfg.max_seq_len, str(args.val_data))
        shared = shared_sequences(samples, val_samples)
        if shared:
            log(
                f"warning: {shared} of the {len(val_samples)} samples in {args.val_data} also appear in {args.data}; "
                f"validation on them overstates acceptance"
            )
    else:
        samples, val_samples = split_validation(samples, args.val_fraction)
    dev = target.device
    dist = init_distributed(dev)
    if dist.world > 1 and dev.type == "cuda":
        torch.cuda.set_device(dist.rank % torch.cuda.device_count())
    if (out / "train_state").exists() and not args.resume:
        raise DominoError(
            f"{out} already holds a training checkpoint; pass --resume to continue it or choose another --out"
        )
    if args.init and args.init_from_layer is not None:
        raise DominoError("--init-from-layer starts a fresh drafter; it cannot be combined with --init")
    if args.init:
        drafter = Drafter.from_pretrained(args.init, target=target)
    else:
        drafter = fresh_drafter(target, samples, arch_from_args(args, target), args.draft_vocab, args.seed)
        if args.init_from_layer is not None:
            copied = init_from_target_layer(drafter, target, args.init_from_layer)
            log(f"draft layers start from target layer(s) {args.init_from_layer}..: {len(copied)} weights copied")
        if args.draft_vocab and dist.main:
            log(
                f"draft vocabulary: {args.draft_vocab} tokens cover {draft_vocab_coverage(drafter, samples):.1%} "
                f"of the supervised training tokens"
            )
    validator = Validator(target, val_samples, cfg.val_anchors) if val_samples else None
    trainer = Trainer(
        target,
        drafter,
        samples,
        out,
        cfg,
        dist=dist,
        feature_cache=cache,
        save_dtype=SAVE_DTYPES[args.save_dtype],
        validator=validator,
    )
    if cache and dist.main:
        tokens = sum(len(s["input_ids"]) for s in samples)
        rows = len(drafter.config.target_layer_ids) + trainer.needs_target_probs  # + the final hidden state
        per_token = 2 * target.hidden_size * rows
        log(
            f"feature cache {cache}: {tokens} tokens x {per_token} bytes = {tokens * per_token / 1e9:.2f} GB "
            f"(fp16, {len(drafter.config.target_layer_ids)} layers)"
        )
    if args.resume:
        resumed = trainer.load_checkpoint()
        if dist.main:
            log(
                f"resumed {out} at step {trainer.step}/{trainer.total}"
                if resumed
                else f"--resume: no checkpoint found in {out / 'train_state'}, starting fresh"
            )
    if dist.main:
        n = drafter.num_trainable_parameters()
        log(
            f"training a {drafter.config.head} drafter ({n / 1e6:.2f}M parameters) on {len(samples)} samples "
            f"for {trainer.total} steps ({trainer.steps_per_epoch} per epoch), {dist.world} process(es) on {dev}"
        )
        if val_samples:
            where = args.val_data or f"held out by conversation id hash (--val-fraction {args.val_fraction})"
            log(
                f"validation: {len(val_samples)} samples ({where}) every {cfg.val_every} steps; "
                f"the best drafter by validation tau is exported"
            )
        else:
            log("validation: none (no sample held out at this --val-fraction); the last step is exported")
    last = trainer.fit()
    if dist.main and last:
        log(f"done: {out} (simulated greedy tau {last['tau_greedy']:.2f}); metrics in {out / 'metrics.jsonl'}")
    if dist.main and trainer.best.result is not None:
        log(
            f"exported the best drafter by validation: step {trainer.best.step}, validation tau "
            f"{trainer.best.result.tau:.2f}; acceptance by position in {out / 'acceptance.json'}"
        )
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a drafter on prepared data",
        description="Train a drafter for TARGET on data from `dominospec prepare-data`, with target "
        "features computed online. Works under torchrun (DDP: gloo on CPU, NCCL on GPU).",
    )
    add_target_args(p)
    p.add_argument("--data", required=True, help="directory written by prepare-data")
    p.add_argument(
        "--allow-other-target",
        action="store_true",
        help="train on data written by another target (same tokenizer); normally refused, as a "
        "drafter learns to predict the model that wrote its data",
    )
    p.add_argument("--out", required=True, help="output directory: the drafter, metrics.jsonl, training.png")
    add_arch_args(p)
    p.add_argument("--init", help="start from this drafter directory instead of a fresh one")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="score only the N most frequent supervised tokens of the data (0: full vocabulary); "
        "lossless, and much cheaper per draft on CPU",
    )
    p.add_argument("--max-steps", type=int, default=0, help="optimiser steps (default: from --epochs)")
    p.add_argument("--epochs", type=float, default=1.0, help="default %(default)s")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step, all processes (default %(default)s)")
    p.add_argument(
        "--anchors",
        type=int,
        default=32,
        help="blocks per sequence, drawn anew each step; 0: every supervised position (default %(default)s)",
    )
    p.add_argument(
        "--distill",
        type=float,
        default=0.0,
        help="weight in [0, 1] of the soft-label loss, KL(target || draft) at each block slot on the draft "
        "vocabulary, mixed with the head's own loss (default %(default)s: token CE only)",
    )
    p.add_argument(
        "--init-from-layer",
        type=int,
        default=None,
        metavar="J",
        help="start the draft layer(s) from the target's decoder layers J, J+1, ... (fresh drafters only)",
    )
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--gamma", type=float, default=None, help="position-decay constant (default 7*block/16)")
    p.add_argument("--lambda-start", type=float, default=1.0, help="domino curriculum start (default %(default)s)")
    p.add_argument(
        "--lambda-decay",
        type=float,
        default=1.0,
        help="fraction of the run over which lambda falls to 0 (default %(default)s)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="samples are cut to this many tokens (or the target's context, if shorter) (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps (default %(default)s)")
    p.add_argument(
        "--save-dtype",
        default="float32",
        choices=list(SAVE_DTYPES),
        help="dtype of the exported drafter weights (default %(default)s)",
    )
    p.add_argument("--feature-cache", default=None, help="cache target features here (fp16) for multi-epoch runs")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="hold out this fraction of the conversations for validation (by id hash, the same in "
        "every run; at least one; none while fraction x samples < 1) (default %(default)s)",
    )
    p.add_argument(
        "--val-data", default=None, help="validate on this prepare-data directory instead of holding out part of --data"
    )
    p.add_argument(
        "--val-every",
        type=int,
        default=50,
        help="validation interval in steps, plus the last step (default %(default)s)",
    )
    p.add_argument(
        "--val-anchors",
        type=int,
        default=64,
        help="validation blocks per held-out sample, evenly spaced (0: all) (default %(default)s)",
    )
    p.set_defaults(func=cmd_train)
