"""Stop on request: SIGTERM or SIGUSR1 ends the run after the current step, with a checkpoint.

A cluster that preempts a job, or a time limit that is near, sends SIGTERM (SLURM: `scancel`,
preemption, and the end of `--time`; `#SBATCH --signal=TERM@180` to be told three minutes
early), then SIGKILL after a grace period (SLURM's KillWait, 30 s by default; the `deepspeed`
launcher forwards SIGTERM to its ranks and also kills them after 30 s, and dies of SIGUSR1
itself: docs/training.md). Without a handler the run loses everything since its last
checkpoint. With it:

    stop = StopRequest.install()     # the loop's start, every rank
    ...one optimiser step...
    if stop.agreed():                # every rank, every step: one tiny CPU all-reduce
        save a checkpoint, raise Stopped

The ranks agree (a maximum over ranks), so the rank that was told first and the others stop
after the same step and write one checkpoint together, whichever rank got the signal.
The agreement is a one-integer all-reduce on a CPU (gloo) group: it never waits for the GPU.
A second signal changes nothing (the launcher forwards SIGTERM to ranks that already got
it); SIGKILL after the grace period is the hard stop. The run is then resumed with
`--resume auto`. Ctrl-C (SIGINT) still interrupts at once.

A stop that is still running `DUMP_AFTER_S` seconds after this rank learnt of it prints every
thread's Python stack to stderr (`faulthandler`), once: when SIGKILL comes at 30 s, the log
already says where each rank was waiting (a checkpoint's disk writes, a rank that never
reached the next collective).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, resume to continue
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUMP_AFTER_S = 20.0  # seconds into a stop: print every thread's stack (the launcher's SIGKILL comes at 30)


class Stopped(RuntimeError):
    """The run stopped on request after a step, with a checkpoint of that step."""


class StopRequest:
    """The signal flag of this process, and the ranks' agreement on it."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.since: float | None = None  # time.monotonic() when this rank learnt of the request
        self._group = None
        self._previous: dict[int, object] = {}

    @classmethod
    def install(cls) -> StopRequest:
        """Handle SIGTERM / SIGUSR1 from now on (main thread only; elsewhere nothing is installed)."""
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                stop._previous[sig] = signal.signal(sig, stop._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # every rank builds it here, at the same point; NCCL's default group would need a device tensor
            stop._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return stop

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self._started()

    def _started(self) -> None:
        """This rank learnt of the stop now: start its clock and the stack dump's timer."""
        self.since = time.monotonic()
        try:
            faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=False, file=sys.stderr)
        except (ValueError, AttributeError, OSError):  # stderr without a file descriptor: no dump
            pass

    def finished(self) -> None:
        """The stop is done (checkpoint written): no stack dump."""
        faulthandler.cancel_dump_traceback_later()

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (a collective when several ranks run)."""
        if self._group is None:
            return self.signal is not None
        flag = torch.tensor([self.signal or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.signal = self.signal or int(flag.item()) or None  # a CPU tensor: no device sync
        if self.signal is not None and self.since is None:
            self._started()
        return self.signal is not None

    def seconds(self) -> float:
        """Seconds since this rank learnt of the request (0 if it was not asked)."""
        return time.monotonic() - self.since if self.since is not None else 0.0

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "none"

    def uninstall(self) -> None:
        """Put the previous handlers back (the loop's end)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self.finished()


__all__ = ["StopRequest", "Stopped", "EXIT_STOPPED", "SIGNALS"]
