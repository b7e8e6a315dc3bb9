"""An evaluation-time memory trace: per-segment memory statistics as JSONL, and the final memory.

    trace = MemoryTrace("trace.jsonl", state_path="memory.safetensors", graph_every=50)
    evaluate_lm(model, corpus, paper_protocol(150), on_step=trace)
    trace.close()

Each line is `{"step": t, "memory/ltm": ..., "memory/reminded_ltm_age": ..., ...}`: the
model's `MemoryStats.summary()` after segment t (means over this rank's rows; one stream
under the `paper` protocol), plus the co-retrieval graph's statistics every `graph_every`
segments. NaN (e.g. no LTM engram reminded) is written as null. The paper's Figure 5 is
the `memory/reminded_ltm_age` column over steps. `close()` saves the memory as it is after
the last segment (the paper's Figures 6, 8 and 9 analyse the engrams that survive the
whole test set): `{"kind": TRACE_STATE_KIND, "state": MemoryState.state_dict(), "memoria":
MemoriaConfig fields, "step": last step}`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


from ..memory import MemoriaConfig, graph_stats
from ..safe_io import save_tree

TRACE_STATE_KIND = "memoria_ds.trace_state"
TRACE_STATE_FORMAT = 1


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MemoryTrace:
    """An `on_step` callback for `memoria_ds.eval.evaluate_lm` (see the module docstring).

    Args:
        path: the JSONL file (parent folders are created; an existing file is replaced).
        state_path: where `close()` saves the final memory state (None: not saved).
        memoria_config: the model's memory settings (`model.config.memoria_config`), saved
            with the state; needed when `state_path` is given (creation steps come from uids
            divided by N_wm).
        graph_every: also record graph degree and edge weight every this many segments
            (O(B C^2) each); 0 never.
    """

    def __init__(self, path: str | os.PathLike, *, state_path: str | os.PathLike | None = None,
                 memoria_config: MemoriaConfig | None = None, graph_every: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.state_path = None if state_path is None else Path(state_path)
        self.memoria_config = memoria_config
        self.graph_every = graph_every
        self.steps = 0
        self._last_step: int | None = None
        self._memory: Any = None
        self._file = open(self.path, "w", buffering=1)

    def __call__(self, step: int, batch: Any, out: Any) -> None:
        record: dict[str, Any] = {"step": int(step)}
        stats = getattr(out, "memory_stats", None)
        if stats is not None:
            record.update(stats.summary())
        memory = getattr(out, "memory", None)
        state = getattr(memory, "state", None)
        if state is not None and self.graph_every and step % self.graph_every == 0:
            record.update({f"memory/graph_{k}": float(v.mean()) for k, v in graph_stats(state).items()})
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._memory, self._last_step = memory, int(step)
        self.steps += 1

    def close(self) -> Path | None:
        """Close the JSONL file and save the final memory state; returns the state's path (or None)."""
        if not self._file.closed:
            self._file.close()
        state = getattr(self._memory, "state", None)
        if self.state_path is None or state is None:
            return None
        config = self.memoria_config
        if config is None:
            raise ValueError("MemoryTrace needs `memoria_config` to save the state (the uids' creation steps need N_wm)")
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"kind": TRACE_STATE_KIND, "format": TRACE_STATE_FORMAT, "step": self._last_step,
                   "state": state.to("cpu").state_dict(), "memoria": config.to_dict()}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        save_tree(payload, tmp)  # safetensors + JSON: opening it cannot run code
        os.replace(tmp, self.state_path)
        return self.state_path

    def __enter__(self) -> MemoryTrace:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a trace JSONL (or a training `metrics.jsonl`, its `train` records), NaN restored.

    Values written as null or as the string "nan" (the training's metrics file) become NaN.
    """
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind", "train") != "train":
            continue
        out.append({k: (math.nan if v is None or v in ("nan", "NaN") else v) for k, v in rec.items()})
    return out


__all__ = ["MemoryTrace", "TRACE_STATE_FORMAT", "TRACE_STATE_KIND", "read_trace"]
