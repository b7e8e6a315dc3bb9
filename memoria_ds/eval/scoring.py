"""Scoring pieces shared by every evaluation: NLL from logits, the model call, exact reduction.

Notation: B rows, L segment length, V vocabulary, K scored positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from memoria_ds.data.batch import IGNORE_INDEX, StreamBatch
from memoria_ds.data.segments import forward_segment, logits_and_memory


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL of the scored targets, computed in float32 from the logits.

    A model's own mean loss is not used: it may be taken over other tokens, in another
    precision, or averaged per row.

    Args:
        logits: (B, L, V) in any float dtype.
        targets: (B, L) int64, aligned with `logits` (the target of position i is
            `targets[:, i]`); -100 is not scored.

    Returns:
        nll: (K,) float32 `-log p(target)` of the scored positions, in row-major order.
        mask: (B, L) bool, where they are.

    Raises:
        ValueError: mismatched shapes or a target outside the vocabulary.
    """
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    mask = targets != IGNORE_INDEX
    scored = logits[mask]  # (K, V)
    tgt = targets[mask]  # (K,)
    if tgt.numel() and (int(tgt.max()) >= logits.shape[-1] or int(tgt.min()) < 0):
        raise ValueError(
            f"a target id ({int(tgt.max())}) is outside the model's vocabulary of {logits.shape[-1]}; "
            "evaluate with the tokenizer the model was trained with"
        )
    logp = torch.log_softmax(scored.float(), dim=-1)  # (K, V), float32
    return -logp.gather(1, tgt.unsqueeze(1)).squeeze(1), mask


def call_model(model: Any, batch: StreamBatch, memory: Any, reset: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One segment through a Contract-2 model: returns (logits (B, L, V), the memory to carry)."""
    return logits_and_memory(forward_segment(model, batch, memory, reset))


def all_reduce_sums(sums: torch.Tensor) -> torch.Tensor:
    """Sum a float64 vector of totals over all ranks (exact for counts below 2**53).

    Sums, not means, are reduced, so the result is the token-weighted total over every
    rank whatever each rank holds.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sums = sums.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """No gradients and eval mode for the duration; the model's training mode is restored after."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training and hasattr(model, "train"):
            model.train()


def dist_coordinates(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one; a value given wins."""
    found = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    return (found[0] if rank is None else rank, found[1] if world_size is None else world_size)


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless model)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
