"""The training step waits for the device only where a human looks: no host sync per step.

A host sync is a read of a tensor's value on the host (`.item()`, `bool()`, `float()`,
`int()`, `.tolist()`, `.nonzero()`). They are counted with a `TorchFunctionMode` while the
real loop trains a tiny Memoria GPT-2 under DeepSpeed (one process, CPU), for two run
lengths: a sync made every step or micro-batch would make the counts differ. Reads made
by DeepSpeed itself (its step checks the gradient norm once per step) and by the host-side
data pipeline (CPU tensors by design) are not ours and are left out.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode

from memoria_ds.train.config import RunConfig
from memoria_ds.train.distributed import init_distributed
from memoria_ds.train.loop import train
from memoria_ds.train.setup import setup
from memoria_ds.train.parse import load

from .launch_util import TINY

PACKAGE = Path(__file__).resolve().parents[2] / "memoria_ds"
SYNCS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "nonzero", "__array__"}


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values by the code site in memoria_ds that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            path = Path(frame.f_code.co_filename) if frame is not None else None
            if path is not None and PACKAGE in path.parents and (PACKAGE / "data") not in path.parents:
                self.sites[f"{path.relative_to(PACKAGE)}:{frame.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _syncs_of_a_run(run_dir: Path, steps: int) -> Counter[str]:
    cfg = load(RunConfig, None, [*TINY, f"run_dir={run_dir}", f"optim.max_steps={steps}", "optim.grad_accum=2",
                                 "log.every=1000", "checkpoint.every=0", "eval.at_end=false"])
    ctx, state = setup(cfg, init_distributed())
    try:
        with SyncCounter() as counter:
            train(ctx, state)
    finally:
        ctx.lock.release()
    return counter.sites


def test_no_host_sync_per_step_or_micro_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    short = _syncs_of_a_run(tmp_path / "short", 3)
    long = _syncs_of_a_run(tmp_path / "long", 7)
    assert short == long, f"host syncs that grow with the number of steps: {dict(long - short)}"
    # the counter does see ours: the reads of the one logging window at the end of the run
    assert any(site.startswith("train/loop.py") for site in short), short
