"""Distributed training helpers (torchrun: gloo on CPU, NCCL on GPU); one process is world 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t

    def all_sum_grads(self, params) -> None:
        if self.world == 1:
            return
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)


def init_distributed(device: torch.device) -> Dist:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend)
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())
