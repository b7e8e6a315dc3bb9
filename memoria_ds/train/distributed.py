"""Process-group set-up for every way of starting a run.

`deepspeed script.py`, `torchrun script.py` and plain `python script.py` all end up here:
the launchers set RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; plain
`python` gets a single-rank group on a free local port. Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(use_deepspeed: bool = True) -> DistInfo:
    """Initialise (once) the default process group and pick this rank's device."""
    if "RANK" not in os.environ:  # plain `python`: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if use_deepspeed:
            import deepspeed

            if not cuda:
                # DeepSpeed compiles a shared-memory comm op on first use (25-65 s on CPU);
                # gloo does the same job for CPU runs, so mark the op unavailable.
                deepspeed.ops.__compatible_ops__ = dict(deepspeed.ops.__compatible_ops__, deepspeed_shm_comm=False)
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        else:
            dist.init_process_group("nccl" if cuda else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def any_true(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of `values` over ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    """`obj` from rank `src` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    """Tear the group down. The caller should `os._exit` soon after on launcher runs
    (see shared notes: a rank can abort in teardown otherwise)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
