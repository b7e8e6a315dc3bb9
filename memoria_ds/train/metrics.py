"""Progress and metrics on rank 0: a tqdm bar, a JSONL file, TensorBoard and (opt-in) W&B scalars."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


class MetricsWriter:
    """Writes one record per logging step to `<run_dir>/metrics.jsonl` (appending on resume,
    after dropping the records of steps past the checkpoint resumed from: they are re-run),
    the same scalars to TensorBoard (`<run_dir>/tb`) and, if `wandb` is given, to Weights &
    Biases (one run per run directory, continued on resume), and keeps a tqdm bar. Ranks
    other than 0 get a writer that does nothing.

    Args:
        wandb: `{"project", "mode", "config"}` to log to W&B, or None.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, initial_step: int,
                 tensorboard: bool, progress: bool, resumed_at: int | None = None,
                 wandb: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        self._bar = None
        self._file = None
        if not enabled:
            return
        path = Path(run_dir) / "metrics.jsonl"
        if resumed_at is not None:
            drop_records_after(path, resumed_at)
        self._file = open(path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
        if wandb is not None:
            self._wandb = _wandb_run(Path(run_dir), **wandb)
        if progress:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True, mininterval=1.0)
        self._t0 = time.time()

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time() - self._t0, 3)}
        record.update({k: _jsonable(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        scalars = {k if k.startswith("memory/") else f"{kind}/{k}": float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and math.isfinite(float(v))}  # train/loss, eval_full/ppl, memory/ltm
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None and kind == "train":
            shown = {k: values[k] for k in ("loss", "ppl", "tok/s", "lr") if k in values}
            if "memory/ltm" in values:
                shown["ltm"] = values["memory/ltm"]
            self._bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in shown.items()},
                                  refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def end_progress(self) -> None:
        """Close the bar (it ends its line): what is printed after training starts on a line of its own."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.end_progress()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()


def _wandb_run(run_dir: Path, project: str, mode: str | None, config: dict[str, Any]):
    """A W&B run for this run directory: the same one again on resume (its id is kept in
    `<run_dir>/wandb_id`), its files under `<run_dir>/wandb`."""
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, dir=str(run_dir), name=run_dir.name, id=run_id, resume="allow",
                      mode=mode, config=config)


def drop_records_after(path: Path, step: int) -> int:
    """Remove the records of steps after `step` from a metrics file (atomically); returns how many.

    A run that crashed after its last checkpoint logged steps that the resumed run trains
    again; keeping both would give two records per step. Unreadable lines (a torn last line
    from the crash) go too.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
    return dropped


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
