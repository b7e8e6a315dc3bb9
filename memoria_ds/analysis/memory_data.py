"""Figure data from a saved memory: who survived, when they were made, how strongly they are linked.

A memory state comes from an evaluation trace (`MemoryTrace.close()`, the memory after the
last segment of the split: what the paper analyses) or from a training checkpoint shard
(`checkpoints/step_*/rank_XXXXX.safetensors`, every slot's rows concatenated; the memory since the
last periodic reset). Notation: B rows, C slots.

- `ltm_creation_percent`: creation step of every surviving LTM engram, as a percentage of
  its row's steps (paper Figure 6: primacy and recency).
- `edge_weights_by_age`: for every ordered pair (i, j), i != j, of live engrams of a row,
  the edge weight `E[i->j] = counts[i, j] / counts[i, i]` (0 where they never fired
  together) and their creation-step difference (paper Figures 8-9: temporal contiguity).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..memory import MemoriaConfig, MemoryState
from ..memory.state import EMPTY, KIND_NAMES, LTM
from ..model.config import resolve_preset
from ..safe_io import load_tree
from ..eval.trace import TRACE_STATE_KIND


@dataclass
class MemorySnapshot:
    """A memory state with the settings that interpret it, and where it came from."""

    state: MemoryState
    config: MemoriaConfig
    source: str


def memoria_config_of_run(run_config: dict[str, Any]) -> MemoriaConfig:
    """The model's memory settings from a resolved run configuration (as a dict).

    Raises:
        ValueError: the run's model has no Memoria memory.
    """
    model = run_config["model"]
    memoria = (model.get("settings") or {}).get("memoria")
    values = resolve_preset(model.get("preset"), **({"memoria": memoria} if memoria else {}))
    if values.get("memory_type") != "memoria":
        raise ValueError(f"the run's model ({model.get('preset')}) has no Memoria memory to analyse")
    return MemoriaConfig.from_dict(values.get("memoria") or {})


def load_memory(path: str | os.PathLike) -> MemorySnapshot:
    """A trace state file or a checkpoint shard (`rank_*.safetensors`, read with its
    `manifest.json`), read as data (`safe_io.load_tree`: nothing in it is executed).

    Raises:
        PickleRefused: a pickle (older memoria_ds versions wrote them); the message says how to convert it.
        ValueError: a file of another kind, or a shard without Memoria rows.
    """
    path = Path(path)
    obj = load_tree(path)
    try:
        return _memory_of(path, obj)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # fields of the wrong type: damaged or crafted
        raise ValueError(f"{path} is damaged or crafted ({type(e).__name__}: {e})") from None


def _memory_of(path: Path, obj: Any) -> MemorySnapshot:
    if isinstance(obj, dict) and obj.get("kind") == TRACE_STATE_KIND:
        config = MemoriaConfig.from_dict(obj["memoria"])
        return MemorySnapshot(MemoryState.from_state_dict(obj["state"], config=config), config,
                              f"{path.name}: the memory after evaluation step {obj.get('step')}")
    if isinstance(obj, dict) and "memory" in obj and "stream_ids" in obj:
        manifest = path.parent / "manifest.json"
        if not manifest.is_file():
            raise ValueError(f"{path} is a checkpoint shard but {manifest} is missing (its settings are there)")
        run_config = json.loads(manifest.read_text())["meta"]["config"]
        config = memoria_config_of_run(run_config)
        reset = (run_config.get("data") or {}).get("reset", "never")
        states = [MemoryState.from_state_dict(m["state"], config=config) for m in obj["memory"]
                  if m is not None and m.get("kind") == "memoria"]
        if not states:
            raise ValueError(f"{path} holds no Memoria memory rows (no step taken yet?)")
        return MemorySnapshot(MemoryState.cat(states), config,
                              f"{path.parent.name}/{path.name}: training memory at step {obj.get('step')} "
                              + ("(carried since the start of training: data.reset=never)" if reset == "never"
                                 else f"(since each row's last reset; data.reset={reset})"))
    raise ValueError(f"{path} is neither a memory trace state nor a checkpoint shard (rank_XXXXX.safetensors)")


def latest_shard(run_dir: str | os.PathLike) -> Path | None:
    """Rank 0's shard of the newest complete checkpoint of a run, if any."""
    done = sorted(p for p in Path(run_dir, "checkpoints").glob("step_*") if (p / "manifest.json").is_file())
    shard = done[-1] / "rank_00000.safetensors" if done else None
    return shard if shard is not None and shard.is_file() else None


def ltm_creation_percent(snap: MemorySnapshot) -> np.ndarray:
    """(K,) creation step of each surviving LTM engram, in percent of its row's steps (Figure 6)."""
    state = snap.state
    created = state.created_step(snap.config).double()  # (B, C)
    steps = state.step.double().clamp(min=1)[:, None]  # (B, 1) steps since the row's reset
    ltm = state.kind == LTM
    return (100.0 * created / steps)[ltm].numpy()


def edge_weights_by_age(snap: MemorySnapshot) -> tuple[np.ndarray, np.ndarray]:
    """Creation-step difference and edge weight of every ordered pair of live engrams (Figures 8-9).

    Returns:
        age_diff: (P,) int64 `|created_i - created_j|`; weight: (P,) float64
        `counts[i, j] / counts[i, i]` (0 where the two never fired together), over every
        ordered pair i != j of live engrams of each row, rows pooled.
    """
    state = snap.state
    created = state.created_step(snap.config)  # (B, C)
    alive = state.kind != EMPTY
    counts = state.counts.double()  # (B, C, C)
    diag = counts.diagonal(dim1=1, dim2=2).clamp(min=1.0)  # (B, C); a live engram has fired at least once
    pair = alive[:, :, None] & alive[:, None, :] & ~torch.eye(state.capacity, dtype=torch.bool)
    weight = (counts / diag[:, :, None])[pair]
    age = (created[:, :, None] - created[:, None, :]).abs()[pair]
    return age.numpy(), weight.numpy()


def mean_by_age(age: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ages present, mean weight at each, number of pairs at each)."""
    if age.size == 0:
        return age, weight, age
    n = np.bincount(age)
    total = np.bincount(age, weights=weight)
    present = np.flatnonzero(n)
    return present, total[present] / n[present], n[present]


def lifespans_by_kind(snap: MemorySnapshot) -> dict[str, np.ndarray]:
    """Remaining lifespans of the live engrams, per kind (`wm`, `stm`, `ltm`)."""
    state = snap.state
    return {name: state.lifespan[state.kind == k].numpy() for k, name in enumerate(KIND_NAMES) if k != EMPTY}


__all__ = ["MemorySnapshot", "edge_weights_by_age", "latest_shard", "lifespans_by_kind", "load_memory",
           "ltm_creation_percent", "mean_by_age", "memoria_config_of_run"]
