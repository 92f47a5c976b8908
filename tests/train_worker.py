"""Run a small deterministic training job; used by test_train.py under 1 and 2 processes (torchrun)."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import synthetic_samples, tiny_drafter, tiny_target  # noqa: E402

from dominospec.train.distributed import init_distributed  # noqa: E402
from dominospec.train.trainer import TrainConfig, Trainer  # noqa: E402
from dominospec.train.validate import Validator, split_validation  # noqa: E402


def main(out: str, steps: int, stop_after: int | None, resume: bool, head: str = "domino"):
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, head=head, block_size=4, randomize_head=False, confidence=True)
    drafter.float()  # fp32 master weights as in real training; the target stays float64
    dist = init_distributed(target.device)
    # validation on: the best drafter is exported, and resume must keep the best so far (val at 3 and 6
    # fall between checkpoints at 2, 4, 6, 8)
    cfg = TrainConfig(max_steps=steps, batch_size=4, anchors=6, lr=3e-3, save_every=2, val_every=3, val_anchors=8)
    train, val = split_validation(synthetic_samples(target, n=10), 0.2)
    assert len(train) == 8 and len(val) == 2, (len(train), len(val))
    trainer = Trainer(
        target,
        drafter,
        train,
        Path(out),
        cfg,
        dist=dist,
        progress=False,
        validator=Validator(target, val, cfg.val_anchors),
    )
    if resume:
        trainer.load_checkpoint()

    def die_like_kill_9(step):  # no cleanup, no atexit: what a killed process leaves behind
        if stop_after is not None and step >= stop_after:
            os._exit(137)

    trainer.fit(on_step=die_like_kill_9)
    if dist.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0],
        int(args[1]),
        int(args[2]) if args[2] != "-" else None,
        args[3] == "resume",
        args[4] if len(args) > 4 else "domino",
    )
