"""Process-group set-up for every way of starting a run.

`deepspeed script.py`, `torchrun script.py` and plain `python script.py` all end up here:
the launchers set RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Launchers
that do not (`srun` directly, DeepSpeed's `--launcher slurm`, `mpirun`) are recognised by
SLURM's or Open MPI's own variables, so N processes never silently become N copies of
rank 0. Plain `python` gets a single-rank group on a free local port. Backend: NCCL on
CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def _first_slurm_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        raise RuntimeError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not; set MASTER_ADDR")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"cannot expand SLURM_JOB_NODELIST={nodes!r} with scontrol ({e}); set MASTER_ADDR") from e
    return out.stdout.split()[0]


def discover_launcher_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """RANK / LOCAL_RANK / WORLD_SIZE (/ MASTER_ADDR) from whatever started this process.

    torchrun / the deepspeed launcher set them; Open MPI (`OMPI_COMM_WORLD_*`) and SLURM
    (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, with more than one task) are
    translated; otherwise a single process. Returns the variables to add.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    if "OMPI_COMM_WORLD_RANK" in env:
        add = {"RANK": env["OMPI_COMM_WORLD_RANK"], "WORLD_SIZE": env["OMPI_COMM_WORLD_SIZE"],
               "LOCAL_RANK": env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")}
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        add = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
               "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
        if "MASTER_ADDR" not in env:
            add["MASTER_ADDR"] = _first_slurm_host()
    else:
        return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": env.get("MASTER_PORT") or str(_free_port())}
    if "MASTER_ADDR" not in env and "MASTER_ADDR" not in add:
        raise RuntimeError("this launcher did not set MASTER_ADDR: export the first node's address")
    add.setdefault("MASTER_PORT", env.get("MASTER_PORT", "29500"))
    return add


def init_distributed(use_deepspeed: bool = True) -> DistInfo:
    """Initialise (once) the default process group and pick this rank's device."""
    os.environ.update(discover_launcher_env())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if use_deepspeed:
            from .engine import init_process_group

            init_process_group(cuda)
        else:
            dist.init_process_group("nccl" if cuda else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_sum_tensor(values: torch.Tensor) -> list[float]:
    """Element-wise sum of a 1-D device tensor over ranks, read back once (float64)."""
    t = values.to(torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def average_running_statistics(module: torch.nn.Module) -> None:
    """Make every batch norm's running mean and variance the mean over data-parallel ranks, in place.

    Each rank moves its running statistics towards its own batch (a Product-Key Memory's query
    batch norm, `model/pkm.py`); without this the ranks drift apart, a checkpoint (rank 0's module)
    resumes every rank with rank 0's, and evaluation normalises each rank's shard differently. The
    update is linear in the batch statistics, so the mean of the ranks' updates is one update towards
    the ranks' mean statistics. One all-reduce per batch norm; nothing without several ranks.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world = dist.get_world_size()
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            both = torch.cat([m.running_mean, m.running_var])  # (2 F,)
            dist.all_reduce(both)
            both /= world
            m.running_mean.copy_(both[: m.num_features])
            m.running_var.copy_(both[m.num_features:])


def all_max_tensor(values: torch.Tensor) -> list[float]:
    """Element-wise maximum of a 1-D device tensor over ranks, read back once."""
    t = values.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_min(value: torch.Tensor) -> int:
    """The minimum of a 0-dim int64 device tensor over ranks, read back once."""
    t = value.detach().clone().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), on every rank; [obj] without a process group. For rare,
    small agreements (a failed save), not for the step."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj, src: int = 0):
    """`obj` from rank `src` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def leave(code: int) -> None:
    """End a launcher process: flush, tear the group down after a success, and `os._exit`.

    A rank can abort in interpreter teardown after a finished DeepSpeed run (see
    shared notes on DeepSpeed on CPU); leaving right away avoids it."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        shutdown() if code == 0 else None
    finally:
        os._exit(code)


def shutdown() -> None:
    """Tear the group down. The caller should `os._exit` soon after on launcher runs
    (see shared notes: a rank can abort in teardown otherwise)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
