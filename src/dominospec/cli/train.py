"""`dominospec train`: train a drafter on prepared data (one process, or under torchrun)."""

from __future__ import annotations

import argparse

import torch

from ..data.dataset import check_data_dir
from ..devices import bf16_warning
from ..drafter.checkpoint import read_checkpoint
from ..drafter.config import DrafterConfig
from ..errors import DominoError
from ..export.plan import why_not_exact
from ..log import log
from ..targets import parse_layer_ids
from ..train.objectives import POSITION_WEIGHTS
from ..train.run import TRAIN_LABELS, TrainJob, train_drafter
from ..train.trainer import TrainConfig
from .common import (
    add_arch_args,
    add_target_args,
    arch_from_args,
    check_arch_args,
    default,
    target_from_args,
)

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
        position_weighting=args.position_weighting,
        accept_loss=args.accept_loss,
        entropy_keep=args.entropy_keep,
        greedy_labels=args.greedy_labels,
        replay=args.replay,
        lambda_start=args.lambda_start,
        lambda_decay=args.lambda_decay,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        save_every=args.save_every,
        val_every=args.val_every,
        val_anchors=args.val_anchors,
        val_walk=args.val_walk,
        packed=args.packed,
        bf16=args.bf16,
    )
    check_arch_args(args)
    init_config = read_checkpoint(args.init)[0] if args.init else None
    if init_config:
        check_init_shape(args, init_config)
    if init_config and args.serve_with:  # --serve-with cannot change a drafter that already exists
        reason = why_not_exact(init_config, args.serve_with)
        if reason:
            raise DominoError(f"--init {args.init} does not export exactly to {args.serve_with}: {reason}")
    job = TrainJob(
        data=args.data,
        out=args.out,
        config=cfg,
        draft_vocab=args.draft_vocab,
        init=args.init,
        init_from_layer=args.init_from_layer,
        val_data=args.val_data,
        val_fraction=args.val_fraction,
        train_samples=args.train_samples,
        train_labels=args.train_labels,
        feature_cache=args.feature_cache,
        features_only=args.features_only,
        resume=args.resume,
        resume_from=args.resume_from,
        save_dtype=SAVE_DTYPES[args.save_dtype],
        allow_other_target=args.allow_other_target,
        memory_gb=args.memory_gb,
    )
    job.check_outputs()
    check_data_dir(args.data, "--data")  # before the model loads
    if args.val_data:
        check_data_dir(args.val_data, "--val-data")
    target = target_from_args(args)
    if args.bf16 and (warning := bf16_warning(target.device)):
        log(warning)
    if not args.init:  # a fresh drafter's shape (--layer-ids also sets the target's feature layers)
        job.arch = arch_from_args(args, target)
    elif args.head:  # --init DIR --head H: DIR's backbone under a new H head (kept where DIR has H already)
        job.init_head = {
            "head": args.head,
            "rank": args.rank,
            "gru_hidden_size": args.gru_hidden_size,
            "path_candidates": args.path_candidates,
        }
    if args.init and args.layers is not None:
        job.init_layers = args.layers
    if args.init and args.fuse_context:
        job.init_fuse = True
    train_drafter(target, job)
    return 0


# shape flag -> (DrafterConfig field, its parser default): with --init, DIR's value stands
INIT_SHAPE = {  # --layers is not among them: more layers than DIR has grows it (fewer are refused)
    "block_size": ("block_size", default(DrafterConfig, "block_size")),
    "intermediate_size": ("intermediate_size", None),
    "mask_token_id": ("mask_token_id", None),
}
HEAD_SHAPE = {  # read only by a new head (--head naming another head than DIR's)
    "gru_hidden_size": ("gru_hidden_size", default(DrafterConfig, "gru_hidden_size")),
    "rank": ("rank", default(DrafterConfig, "rank")),
    "path_candidates": ("path_candidates", default(DrafterConfig, "path_candidates")),
}


def check_init_shape(args, config: DrafterConfig) -> None:
    """--init DIR keeps DIR's shape (`config`): a shape flag set to something else is refused, not ignored."""
    flags = dict(INIT_SHAPE)
    if not args.head or args.head == config.head:
        flags |= HEAD_SHAPE
    bad = [
        f"--{name.replace('_', '-')} {getattr(args, name)} (it has {field} {getattr(config, field)})"
        for name, (field, unset) in flags.items()
        if getattr(args, name) != unset and getattr(args, name) != getattr(config, field)
    ]
    if args.layers is not None and args.layers < config.num_layers:
        bad.append(f"--layers {args.layers} (it has {config.num_layers}; a drafter can grow, not shrink)")
    if args.confidence_head and not config.confidence_head:
        bad.append("--confidence-head (it has none)")
    if args.layer_ids and parse_layer_ids(args.layer_ids, config.target_num_layers) != list(config.target_layer_ids):
        bad.append(f"--layer-ids {args.layer_ids} (it reads {','.join(map(str, config.target_layer_ids))})")
    if bad:
        raise DominoError(
            f"--init {args.init} keeps the drafter's own shape; these flags ask for another: {'; '.join(bad)} "
            f"(drop them, or train a fresh drafter without --init)"
        )


def _samples_spec(text: str):
    """--train-samples N or N,M."""
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M (integers), got {text!r}") from None
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected N or N,M, got {text!r}")
    return parts if len(parts) == 2 else parts[0]


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
    p.add_argument(
        "--init",
        help="start from this drafter directory instead of a fresh one; with --head naming another head, its "
        "backbone under a new untrained head of that kind (what compares heads on one backbone)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=default(TrainJob, "draft_vocab"),
        help="score only the N most frequent supervised tokens of the data (0: full vocabulary); "
        "lossless, and much cheaper per draft on CPU. Default: 0 for a fresh drafter; with --init, the "
        "drafter's own vocabulary, and a given N chooses it again from this data (its head's rows follow "
        "their tokens; new tokens start at the mean row)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=default(TrainConfig, "max_steps"),
        help="optimiser steps (default: from --epochs)",
    )
    p.add_argument("--epochs", type=float, default=default(TrainConfig, "epochs"), help="default %(default)s")
    p.add_argument(
        "--batch-size",
        type=int,
        default=default(TrainConfig, "batch_size"),
        help="sequences per step, all processes (default %(default)s)",
    )
    p.add_argument(
        "--anchors",
        type=int,
        default=default(TrainConfig, "anchors"),
        help="blocks per sequence, drawn anew each epoch (each step with --no-packed), deterministic per "
        "(--seed, epoch); 0: dense, every supervised position (default %(default)s)",
    )
    p.add_argument(
        "--distill",
        type=float,
        default=default(TrainConfig, "distill"),
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
    p.add_argument(
        "--lr", type=float, default=default(TrainConfig, "lr"), help="peak learning rate (default %(default)s)"
    )
    p.add_argument(
        "--gamma",
        type=float,
        default=default(TrainConfig, "gamma"),
        help="position-decay constant (default 7*block/16)",
    )
    p.add_argument(
        "--position-weighting",
        choices=POSITION_WEIGHTS,
        default=default(TrainConfig, "position_weighting"),
        help="slot weights of a block: decay, exp(-k/gamma); dpace, 0.5 + 0.5 x the chance the current "
        "drafter's draft survives to the slot (D-PACE) (default %(default)s)",
    )
    p.add_argument(
        "--accept-loss",
        type=float,
        default=default(TrainConfig, "accept_loss"),
        help="weight in [0, 1] of an acceptance-aligned loss, -log sum_v min(p_target, q_draft) per slot "
        "(LK-style), mixed with the head's own loss (default %(default)s: off)",
    )
    p.add_argument(
        "--entropy-keep",
        type=float,
        default=default(TrainConfig, "entropy_keep"),
        help="train on this fraction of the supervised slots of each micro-batch, those where the target is "
        "least certain (highest entropy), weighted 1/F (default %(default)s: all)",
    )
    p.add_argument(
        "--greedy-labels",
        action="store_true",
        help="train the token loss on the target's greedy token at each slot (what greedy verification keeps) "
        "instead of the data's sampled one; the blocks' inputs stay the data's tokens",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=default(TrainJob, "memory_gb"),
        help="keep at most this many GB of the samples' target features (fp16) in memory between epochs; the "
        "rest is read from --feature-cache (or recomputed) each epoch; 0: none (default %(default)s)",
    )
    p.add_argument(
        "--replay",
        type=float,
        default=default(TrainConfig, "replay"),
        help="on-policy replay: this share of each sample's anchors is drawn where the drafter's own greedy draft "
        "was rejected the last time the sample was trained (its first miss becomes slot 0); the rest as usual "
        "(default %(default)s: off; packed step with sampled anchors)",
    )
    p.add_argument(
        "--lambda-start",
        type=float,
        default=default(TrainConfig, "lambda_start"),
        help="domino curriculum start (default %(default)s)",
    )
    p.add_argument(
        "--lambda-decay",
        type=float,
        default=default(TrainConfig, "lambda_decay"),
        help="fraction of the run over which lambda falls to 0 (default %(default)s)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=default(TrainConfig, "max_seq_len"),
        help="samples are cut to this many tokens (or the target's context, if shorter) (default %(default)s)",
    )
    p.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=default(TrainConfig, "packed"),
        help="all blocks of a step in a few large drafter forwards, features kept in memory (fp16), the "
        "target's log-normaliser computed once per sample; --no-packed: the older per-sequence step, "
        "same loss and gradients, 1.7-2.3x slower (docs/training.md) (default %(default)s)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast of the drafter's forward and backward (packed only; about 1.5x faster on CPUs "
        "with native bf16 such as AVX512-BF16 / AMX, several times slower where it is emulated, e.g. AVX2; "
        "see docs/training.md for its effect on tau)",
    )
    p.add_argument("--seed", type=int, default=default(TrainConfig, "seed"))
    p.add_argument(
        "--save-every",
        type=int,
        default=default(TrainConfig, "save_every"),
        help="checkpoint interval in steps (default %(default)s)",
    )
    p.add_argument(
        "--save-dtype",
        default="float32",
        choices=list(SAVE_DTYPES),
        help="dtype of the exported drafter weights (default %(default)s)",
    )
    p.add_argument("--feature-cache", default=None, help="cache target features here (fp16) for multi-epoch runs")
    p.add_argument(
        "--features-only",
        action="store_true",
        help="fill --feature-cache with the target features of every training sample (the final hidden state "
        "too) and stop without training: run it once before trainings that share the cache, so they read the "
        "features instead of each computing them",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out; on a data set grown since (prepare-data --extend: its first "
        "samples unchanged) the new samples join from the next epoch, and the rest of --epochs counts over all",
    )
    p.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="continue from DIR, a copy of a run's OUT/train_state kept elsewhere (in a repository, say: a run "
        "that outlives its machine); the same command and data as the run that wrote it, a new --out; the target "
        "features are recomputed (or read from --feature-cache)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=default(TrainJob, "val_fraction"),
        help="hold out this fraction of the conversations for validation (by id hash, the same in "
        "every run; at least one; none while fraction x samples < 1) (default %(default)s)",
    )
    p.add_argument(
        "--train-labels",
        choices=TRAIN_LABELS,
        default="all",
        help="train only on the on-policy samples (answers the target wrote) or only on the off-policy ones "
        "(texts it read, e.g. pydoc:N); the validation set is the same either way (default %(default)s)",
    )
    p.add_argument(
        "--train-samples",
        type=_samples_spec,
        default=None,
        metavar="N[,M]",
        help="train on the first N training samples only (data set order, after the validation split and "
        "--train-labels): the points of a scaling curve, all judged on the same held-out conversations; "
        "N,M: the first N on-policy and the first M off-policy samples (a mix of the two)",
    )
    p.add_argument(
        "--val-data", default=None, help="validate on this prepare-data directory instead of holding out part of --data"
    )
    p.add_argument(
        "--val-every",
        type=int,
        default=default(TrainConfig, "val_every"),
        help="validation interval in steps, plus the last step (default %(default)s)",
    )
    p.add_argument(
        "--val-anchors",
        type=int,
        default=default(TrainConfig, "val_anchors"),
        help="with --no-val-walk: validation blocks per held-out sample, evenly spaced (0: all) (default %(default)s)",
    )
    p.add_argument(
        "--val-walk",
        action=argparse.BooleanOptionalAction,
        default=default(TrainConfig, "val_walk"),
        help="validate at the anchors a greedy decode of each held-out answer visits (each block starts right "
        "after the previous one's first miss), as `bench` counts; --no-val-walk: --val-anchors evenly spaced "
        "anchors, which overstate live tau by 3-7%% (docs/training.md) (default %(default)s)",
    )
    p.set_defaults(func=cmd_train)
