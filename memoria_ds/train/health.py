"""Is the training state fit to be checkpointed? (issue 17 item 3)

A run whose learning rate is far too high can write checkpoints whose weights or memory are
already diverging before the first non-finite loss: the memory's engram vectors grow by
orders of magnitude a step, and a resume from such a checkpoint fails again however sane
its new settings. Before a checkpoint is written, every rank measures the largest magnitude
of its weights (its own partition under ZeRO-3) and of its memory's activations (engram
vectors, hidden states, cached keys and values). If anything is not finite, if a weight
grew beyond `checkpoint.max_weight_growth` times the largest weight the run started from
(at least 1; a diverging learning rate multiplies it by hundreds in one step, healthy
training barely moves it), or if a memory activation is beyond `checkpoint.max_abs`,
nothing is written and the run stops with the last good checkpoint named.

One reduction over ranks and one host read per checkpoint; nothing in the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import distributed as dist_utils


class DivergedState(RuntimeError):
    """The weights or the memory are not finite or beyond `checkpoint.max_abs` at a checkpoint."""


def local_weights(module: torch.nn.Module) -> Iterator[Tensor]:
    """The floating-point parameters this rank holds (a ZeRO-3 partition if partitioned)."""
    for p in module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p.data if t is None else t
        if t.is_floating_point() and t.numel():
            yield t.detach()


# Memory fields that hold activations (engram vectors, the previous segment's hidden states,
# cached keys and values): their magnitude is checked. The others (squared norms, lifespans,
# co-retrieval counts) are derived or counters and are only checked for finiteness.
ACTIVATIONS = ("vectors", "prev_hidden", "keys", "values")


def memory_tensors(state: Any, name: str = "") -> Iterator[tuple[str, Tensor]]:
    """(field name, tensor) for every floating-point tensor of a memory (its state dict, walked)."""
    if isinstance(state, Tensor):
        if state.is_floating_point() and state.numel():
            yield name, state.detach()
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from memory_tensors(value, str(key))
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from memory_tensors(value, name)
    elif hasattr(state, "state_dict"):
        yield from memory_tensors(state.state_dict(), name)


def _peak(t: Tensor, device: torch.device) -> Tensor:
    """max |t| as a 0-dim float32 tensor on `device`; NaN if any value is NaN."""
    return torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32).to(device)


def largest_magnitude(tensors: Iterable[Tensor], device: torch.device, finite_only: Iterable[Tensor] = ()) -> Tensor:
    """max |x| over `tensors` as a 0-dim float32 tensor on `device`; +inf if any value of
    `tensors` or `finite_only` is not finite (NaN included); 0 if there are none. No host sync."""
    peaks = [_peak(t, device) for t in tensors]
    peaks += [torch.where(torch.isfinite(p), 0.0, math.inf) for p in (_peak(t, device) for t in finite_only)]
    if not peaks:
        return torch.zeros((), device=device)
    return torch.nan_to_num(torch.stack(peaks).amax(), nan=math.inf, posinf=math.inf)


def memory_magnitude(memories: list[Any], device: torch.device) -> Tensor:
    """`largest_magnitude` of the memories' activations, +inf if any of their fields is not finite."""
    fields = list(memory_tensors([m for m in memories if m is not None]))
    return largest_magnitude([t for n, t in fields if n in ACTIVATIONS], device,
                             finite_only=[t for n, t in fields if n not in ACTIVATIONS])


def weights_magnitude(module: torch.nn.Module, device: torch.device) -> float:
    """The largest weight magnitude over every rank (+inf if any is not finite): the run's
    baseline for `checkpoint.max_weight_growth`."""
    return dist_utils.all_max_tensor(largest_magnitude(local_weights(module), device).reshape(1))[0]


def check_before_save(
    step: int, module: torch.nn.Module, memories: list[Any], *, max_weight: float, max_memory: float,
    device: torch.device, checkpoints: Path, last_good: str | None,
) -> None:
    """Raise `DivergedState` on every rank if any rank's weights or memory are not fit to keep.

    Args:
        max_weight: the largest weight magnitude allowed (from `checkpoint.max_weight_growth`).
        max_memory: the largest memory activation allowed (`checkpoint.max_abs`).
        last_good: the newest complete checkpoint's folder name under `checkpoints`, if any.
    """
    local = torch.stack([largest_magnitude(local_weights(module), device), memory_magnitude(memories, device)])
    weights, memory = dist_utils.all_max_tensor(local)
    measured = (("weights", weights, max_weight, "checkpoint.max_weight_growth"),
                ("memory values", memory, max_memory, "checkpoint.max_abs"))
    bad = [(name, v, limit, key) for name, v, limit, key in measured if not v <= limit]
    if not bad:
        return
    parts = "; ".join(f"{name} {'are not finite' if math.isinf(v) else f'reach {v:.3g}'} (limit {limit:.3g}, {key})"
                      for name, v, limit, key in bad)
    fine = ", ".join(f"{name} up to {v:.3g}" for name, v, limit, _ in measured if v <= limit)
    advice = (f"resume from the last good checkpoint, {checkpoints / last_good}, with a lower optim.lr (a changed "
              f"optim.lr is applied on resume)" if last_good else "there is no earlier checkpoint: start again with a "
              "lower optim.lr")
    raise DivergedState(
        f"the training state at step {step} is diverging: {parts}{'; ' + fine if fine else ''}. No checkpoint was "
        f"written for step {step} and the run stopped. {advice[0].upper() + advice[1:]}; or raise the limit if such "
        f"values are expected"
    )
