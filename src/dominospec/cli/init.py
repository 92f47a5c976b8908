"""`dominospec init`: an untrained drafter shaped for a target."""

from __future__ import annotations

from ..drafter import Drafter
from ..io import ensure_writable_dir
from ..log import log
from .common import add_arch_args, add_target_args, arch_from_args, check_arch_args, target_from_args


def cmd_init(args) -> int:
    check_arch_args(args)  # before loading anything
    ensure_writable_dir(args.out)
    target = target_from_args(args)
    drafter = Drafter.for_target(target, **arch_from_args(args, target))
    drafter.save_pretrained(args.out)
    cfg = drafter.config
    log(
        f"wrote an untrained {cfg.head} drafter ({drafter.num_trainable_parameters() / 1e6:.2f}M parameters, "
        f"{cfg.num_layers} layers, block {cfg.block_size}, feature layers {cfg.target_layer_ids}) to {args.out}"
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "init",
        help="write an untrained drafter for a target",
        description="Write an untrained drafter (config.json + model.safetensors) that fits TARGET; "
        "this is what `dominospec train` starts from.",
    )
    add_target_args(p)
    p.add_argument("--out", required=True, help="output directory")
    add_arch_args(p)
    p.set_defaults(func=cmd_init)
