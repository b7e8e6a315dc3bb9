"""Fault injection for tests of the failure paths (a process killed mid-save, a NaN loss).

Set `MEMORIA_DS_FAULT=<kind>:<step>` in the environment of a run:

    kill_after_step:N    every rank exits (code 17) right after optimiser step N
    kill_during_save:N   every rank exits while checkpoint N is half written (engine state
                         and shards on disk, no manifest, not renamed into place)
    nan_loss:N           rank 0's loss at step N (first micro-batch) becomes NaN
    disk_full_during_save:N   writing checkpoint N fails as on a full disk (ENOSPC) after
                         the engine state was written
    disk_full_in_engine_save:N   rank 0's write of its ZeRO optimizer state in checkpoint N
                         fails as on a full disk, inside DeepSpeed's own save (`torch.save`
                         raises ENOSPC after writing part of the file; `install` arms it)
    disk_full_in_data_prep:0  rank 0's data preparation fails as on a full disk (ENOSPC)
    sigterm_after_step:N rank 0 sends itself SIGTERM right after optimiser step N (as a
                         cluster preempting the job would; preemption.py)

Nothing happens when the variable is unset. The hooks exist so the atomic-save guarantee,
resume-after-kill and the NaN policies are tested with the real launcher, not described.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import sys

EXIT_CODE = 17


def active(kind: str, step: int) -> bool:
    return os.environ.get("MEMORIA_DS_FAULT", "") == f"{kind}:{step}"


def kill(where: str) -> None:
    print(f"fault injection: killed {where}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def signal_self(where: str) -> None:
    print(f"fault injection: SIGTERM {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def install() -> None:
    """Arm the faults that act inside other libraries' code (called once at start-up; nothing
    happens unless `MEMORIA_DS_FAULT` names one of them)."""
    kind, _, step = os.environ.get("MEMORIA_DS_FAULT", "").partition(":")
    if kind == "disk_full_in_engine_save" and os.environ.get("RANK", "0") == "0":
        import torch

        torch.save = _failing_save(torch.save, re.compile(rf"step_{int(step):08d}/.*optim_states"))


def _failing_save(save, target: re.Pattern):
    @functools.wraps(save)
    def failing(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and target.search(str(f)):
            with open(f, "wb") as out:  # a full disk fails part-way: a partial file is left behind
                out.write(b"\0" * 4096)
            print(f"fault injection: ENOSPC writing {f}", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return save(obj, f, *args, **kwargs)

    return failing
