"""Per-step memory statistics, as (B,) tensors: nothing here synchronises with the host.

`MemoryStats.summary()` (which does synchronise) averages over rows for logging. The mean
age of reminded LTM engrams is the quantity of the paper's Figure 5.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
import torch
from torch import Tensor

from .config import MemoriaConfig
from .retrieval import Retrieval
from .state import EMPTY, KIND_NAMES, LTM, MemoryState


@dataclass
class MemoryStats:
    """Statistics of one memory step, one value per row.

    Attributes:
        engrams: (B, 4) slots per kind after the step, columns `KIND_NAMES`
            (empty, wm, stm, ltm); the empty column is the free room.
        evicted: (B,) LTM engrams evicted for lack of room this step.
        reminded_stm: (B,) STM engrams reminded to the model.
        reminded_ltm: (B,) LTM engrams reminded to the model.
        found_ltm: (B,) LTM engrams found by the search (before the top-K_ltm).
        reminded_ltm_age: (B,) mean age in steps of the reminded LTM engrams (NaN if none).
        lifespan_mean: (B,) mean remaining lifespan of the engrams alive after the step.
        lifespan_max: (B,) largest remaining lifespan (0 if the row is empty).
    """

    engrams: Tensor
    evicted: Tensor
    reminded_stm: Tensor
    reminded_ltm: Tensor
    found_ltm: Tensor
    reminded_ltm_age: Tensor
    lifespan_mean: Tensor
    lifespan_max: Tensor

    def copy(self) -> "MemoryStats":
        """The statistics in tensors of their own: a CUDA graph's outputs are overwritten by its next
        replay, and a training step keeps its micro-batches' statistics until it logs them."""
        return MemoryStats(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def summary(self) -> dict[str, float]:
        """Means over rows as Python floats (one host synchronisation), for loggers."""
        out: dict[str, float] = {}
        for i, name in enumerate(KIND_NAMES):
            out[f"memory/{name}"] = self.engrams[:, i].float().mean().item()
        for f in fields(self):
            if f.name == "engrams":
                continue
            v = getattr(self, f.name).float()
            out[f"memory/{f.name}"] = v.nanmean().item() if v.numel() else float("nan")
        return out


def reminded_ltm_age(state: MemoryState, retrieval: Retrieval, config: MemoriaConfig) -> Tensor:
    """(B,) mean age (current step - creation step) of the reminded LTM engrams; NaN if none.

    Call before `memorize` changes the state (engrams that die this step lose their uid).
    """
    slots = retrieval.ltm_slots
    real = slots >= 0
    created = torch.div(state.uid.gather(1, slots.clamp(min=0)), config.num_wm, rounding_mode="floor")
    age = (state.step[:, None] - created).to(torch.float32) * real
    n = real.sum(dim=1)
    return torch.where(n > 0, age.sum(dim=1) / n.clamp(min=1), float("nan"))


def collect(state: MemoryState, retrieval: Retrieval, ltm_age: Tensor, config: MemoriaConfig) -> MemoryStats:
    """Statistics after `memorize` has finished the step."""
    kinds = torch.arange(len(KIND_NAMES), device=state.device, dtype=state.kind.dtype)
    engrams = (state.kind[:, :, None] == kinds).sum(dim=1)  # (B, 4)
    alive = state.kind != EMPTY
    n_alive = alive.sum(dim=1)
    life = state.lifespan * alive
    zeros = torch.zeros_like(retrieval.evicted)
    return MemoryStats(
        engrams=engrams,
        evicted=retrieval.evicted,
        reminded_stm=(retrieval.stm_slots >= 0).sum(dim=1) if config.use_stm else zeros,
        reminded_ltm=(retrieval.ltm_slots >= 0).sum(dim=1),
        found_ltm=retrieval.num_found,
        reminded_ltm_age=ltm_age,
        lifespan_mean=torch.where(n_alive > 0, life.sum(dim=1) / n_alive.clamp(min=1), float("nan")),
        lifespan_max=life.amax(dim=1) if state.capacity else torch.zeros(state.batch_size, device=state.device),
    )


def graph_stats(state: MemoryState) -> dict[str, Tensor]:
    """Degree and edge weight of the co-retrieval graph among live engrams, per row.

    O(B * C^2): call it when logging, not every step.

    Returns:
        `degree`: (B,) mean number of other live engrams each live engram has a positive
        count with; `ltm_degree`: (B,) the same over LTM engrams; `edge_weight`: (B,) mean
        edge weight `E[i->j] = counts[i, j] / counts[i, i]` over positive off-diagonal edges.
    """
    alive = state.kind != EMPTY  # (B, C)
    pair = alive[:, :, None] & alive[:, None, :]
    eye = torch.eye(state.capacity, dtype=torch.bool, device=state.device)
    counts = state.counts.to(torch.float32)
    edges = (counts > 0) & pair & ~eye  # (B, C, C)
    degree = edges.sum(dim=2).to(torch.float32)  # (B, C)
    n_alive = alive.sum(dim=1).clamp(min=1)
    ltm = state.kind == LTM
    diag = counts.diagonal(dim1=1, dim2=2).clamp(min=1.0)  # (B, C)
    weight = torch.where(edges, counts / diag[:, :, None], 0.0).sum(dim=(1, 2))
    n_edges = edges.sum(dim=(1, 2)).clamp(min=1)
    return {
        "degree": (degree * alive).sum(dim=1) / n_alive,
        "ltm_degree": (degree * ltm).sum(dim=1) / ltm.sum(dim=1).clamp(min=1),
        "edge_weight": weight / n_edges,
    }
