"""Where a run goes: one GPU, one node, or several nodes of a DeepSpeed hostfile.

A `Topology` gives the data-parallel world size, the `deepspeed` launcher's arguments
and the split of a global batch of token streams over the ranks. Every stream is a
memory row, so the batch is the number of streams and it must divide evenly over the
ranks: the paper's batch of 8 caps data parallelism at 8 ranks.

Multi-node launchers that work with the training entry points:
    pdsh    DeepSpeed's default: run once on the first node; it reaches the others over
            passwordless ssh (the hostfile's names must resolve and accept ssh).
    no-ssh  `deepspeed --no_ssh --node_rank R`: run the same command once on every node
            (e.g. under `srun --ntasks-per-node=1`, see launch/slurm/), no ssh needed.
DeepSpeed's `slurm` / MPI launchers start ranks without the RANK / WORLD_SIZE variables the
training set-up reads (memoria_ds/train/distributed.py), so they are refused here.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

TOPOLOGIES = ("single-gpu", "node", "multinode")
LAUNCHERS = ("pdsh", "no-ssh")


def read_hostfile(path: str | os.PathLike) -> list[tuple[str, int]]:
    """`[(host, slots), ...]` from a DeepSpeed hostfile (`host slots=N` per line, `#` comments).

    Raises:
        ValueError: a missing file, a malformed line, or no host at all.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hostfile {str(p)!r} does not exist; write one line `HOST slots=GPUS` per node")
    hosts: list[tuple[str, int]] = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise ValueError(f"{p}:{n}: expected `HOST slots=N`, got {raw!r}")
        hosts.append((parts[0], int(parts[1][6:])))
    if not hosts:
        raise ValueError(f"hostfile {str(p)!r} lists no host")
    return hosts


def deepspeed_executable() -> str:
    """`deepspeed` if it is on PATH, else the one installed beside this Python."""
    if shutil.which("deepspeed"):
        return "deepspeed"
    beside = Path(sys.executable).parent / "deepspeed"
    return str(beside) if beside.exists() else "deepspeed"


@dataclass(frozen=True)
class Topology:
    """How many ranks, on which machines, started how.

    Args:
        kind: `single-gpu`, `node` (one machine, `gpus` ranks) or `multinode` (a hostfile).
        gpus: ranks on one node (`node` only).
        hostfile: the DeepSpeed hostfile (`multinode` only).
        launcher: `pdsh` or `no-ssh` (`multinode` only).
        node_rank: this node's index for `no-ssh` (default: `$SLURM_NODEID` or `$NODE_RANK`).
        master_port: the rendezvous port.
    """

    kind: str = "single-gpu"
    gpus: int | None = None
    hostfile: str | None = None
    launcher: str = "pdsh"
    node_rank: int | None = None
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.kind!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}; DeepSpeed's slurm/MPI launchers do not "
                "set RANK / WORLD_SIZE for the training script: under SLURM use launch/slurm/repro.sbatch (no-ssh)"
            )
        if self.kind == "multinode":
            if not self.hostfile:
                raise ValueError("--topology multinode needs --hostfile (one line `HOST slots=GPUS` per node)")
            if self.gpus is not None:
                raise ValueError("--gpus does not apply to multinode: the slots of the hostfile say how many GPUs")
            read_hostfile(self.hostfile)  # fail early on a bad file
            if self.launcher == "no-ssh" and self.resolved_node_rank() is None:
                raise ValueError("the no-ssh launcher needs this node's index: --node-rank, $SLURM_NODEID or $NODE_RANK")
        elif self.hostfile is not None:
            raise ValueError(f"--hostfile applies to --topology multinode, not {self.kind}")
        if self.kind == "node" and (self.gpus or 0) < 1:
            raise ValueError("--topology node needs --gpus N (N >= 1)")
        if self.kind == "single-gpu" and self.gpus not in (None, 1):
            raise ValueError(f"--topology single-gpu runs one rank; got --gpus {self.gpus} (use --topology node)")

    @property
    def hosts(self) -> list[tuple[str, int]]:
        """`[(host, slots), ...]`: the hostfile's, or this machine with its ranks."""
        if self.kind == "multinode":
            return read_hostfile(self.hostfile)
        return [("localhost", 1 if self.kind == "single-gpu" else int(self.gpus or 1))]

    @property
    def world_size(self) -> int:
        return sum(slots for _, slots in self.hosts)

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    def resolved_node_rank(self) -> int | None:
        if self.node_rank is not None:
            return self.node_rank
        for var in ("SLURM_NODEID", "NODE_RANK"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return None

    def launcher_args(self, deepspeed: str | None = None) -> list[str]:
        """`deepspeed ...` up to the training script."""
        ds = deepspeed or deepspeed_executable()
        if self.kind == "single-gpu":
            return [ds, "--num_gpus", "1", "--master_port", str(self.master_port)]
        if self.kind == "node":
            return [ds, "--num_gpus", str(self.gpus), "--master_port", str(self.master_port)]
        head = self.hosts[0][0]
        args = [ds, "--hostfile", str(self.hostfile), "--master_addr", head, "--master_port", str(self.master_port)]
        if self.launcher == "no-ssh":
            args += ["--no_ssh", "--node_rank", str(self.resolved_node_rank())]
        return args

    def describe(self) -> str:
        if self.kind == "multinode":
            return (f"{self.num_nodes} nodes x {'/'.join(str(s) for _, s in self.hosts)} GPUs = {self.world_size} "
                    f"ranks ({self.hostfile}, {self.launcher})")
        return f"{self.world_size} rank{'s' if self.world_size > 1 else ''} on one machine"


@dataclass(frozen=True)
class BatchSplit:
    """A global batch of streams over the ranks: `batch = world * micro * accum`."""

    batch: int
    world_size: int
    micro_batch_size: int
    grad_accum: int

    @property
    def rows_per_rank(self) -> int:
        """Streams (= memory rows) each rank owns."""
        return self.micro_batch_size * self.grad_accum

    def overrides(self) -> list[str]:
        return [f"optim.micro_batch_size={self.micro_batch_size}", f"optim.grad_accum={self.grad_accum}"]


def split_batch(batch: int, world_size: int, micro_cap: int | None = None) -> BatchSplit:
    """Split `batch` streams evenly over `world_size` ranks; micro-batches of at most `micro_cap`.

    Raises:
        ValueError: the batch does not divide over the ranks (or into micro-batches).
    """
    if batch % world_size:
        fits = [w for w in range(1, batch + 1) if batch % w == 0]
        raise ValueError(
            f"a global batch of {batch} streams cannot be split over {world_size} ranks (each stream is one memory "
            f"row of one rank): use {fits} ranks, or --global-batch a multiple of {world_size} (departs from the paper)"
        )
    rows = batch // world_size
    micro = rows if micro_cap is None else min(rows, micro_cap)
    if rows % micro:
        raise ValueError(f"{rows} streams per rank do not split into micro-batches of {micro}; choose a divisor of {rows}")
    return BatchSplit(batch, world_size, micro, rows // micro)


__all__ = ["BatchSplit", "LAUNCHERS", "TOPOLOGIES", "Topology", "deepspeed_executable", "read_hostfile",
           "split_batch"]
