"""`memoria`: the paper's memory (SPEC section 2) around the backbone's blocks.

    read:   1. WM = abstractor(h_{t-1})          (differentiable; h_{t-1} is detached)
            2. retrieval = remind(state, WM)    (engine; writes WM, no gradient)
            -> engrams [WM, M_rem] for every memory attention
    blocks: self-attention -> memory attention (WM, then M_rem) -> MLP
    write:  3. memorize(state, retrieval, mean contribution over blocks)   (engine)
            4. h_t = ln_f output, detached, kept as fp32 for the next step

Two options beyond the paper (the config's `memory_read` and `engram_loss`; the defaults are
the paper's model): the engrams as key/value slots of every block's self-attention
(`MemoriaSlotRead`), and an auxiliary loss that trains the abstractor to keep the passage
(`passage_reconstruction_loss`).

Read and write run outside the (checkpointable) blocks, exactly once per forward. Rows with
no previous segment (the first after a reset) have no working memory: they compute
exactly the backbone, and their state is returned to fresh after the write.

Notation: B rows, P positions of the previous segment, N working-memory engrams,
R reminded slots, D width, C engram slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...memory import MemoriaConfig, MemoryEngine, MemoryState, MemoryStats, Retrieval
from ...memory.compiled import static_addresses
from ...memory.state import digest_multipliers
from ...rows import BatchRows, rows_field
from ..memory_attention import MemoryInputs
from ..memory_attention import contribution as reminded_contribution
from .base import FORMAT, BlockWrites, MemoryKind, MemoryRead, check_format
from .read_copy import read_copy
from .saved_state import BOOL, FLOAT32, SavedState


@dataclass
class MemoriaMemory(BatchRows):
    """Memoria's recurrent state.

    Attributes:
        prev_hidden: (B, P, D) float32, the previous segment's last hidden states (after
            ln_f, detached): the next step's abstractor input.
        prev_mask: (B, P) bool, True at real positions. A row with none has no previous
            segment: its next segment runs exactly as the plain backbone.
        state: the memory engine's `MemoryState` (fp32 engrams, counts, lifespans).

    Previous segments of other lengths stack and exchange rows (padded at the end).
    """

    prev_hidden: Tensor = rows_field(pad=(1, "right"))
    prev_mask: Tensor = rows_field(pad=(1, "right"))
    state: MemoryState = rows_field()

    @classmethod
    def empty(
        cls, config: MemoriaConfig, batch_size: int, dim: int, device: torch.device | str | None = None,
        length: int = 1,
    ) -> MemoriaMemory:
        """Fresh memory for `batch_size` rows (`length` placeholder positions, marked absent)."""
        return cls(
            prev_hidden=torch.zeros(batch_size, length, dim, device=device),
            prev_mask=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
            state=MemoryState.empty(config, batch_size, dim, device=device),
        )._static()

    def _static(self) -> MemoriaMemory:
        # updated in place by every step: a whole model compiled as CUDA graphs captures those
        # updates only for inputs at static addresses (memoria_ds.memory.compiled)
        static_addresses(self.state, self.prev_hidden, self.prev_mask)
        return self

    @property
    def has_previous(self) -> Tensor:
        """(B,) bool: rows that have a previous segment (hence a working memory this step)."""
        return self.prev_mask.any(dim=1)

    def reset(self, mask: Tensor | None = None) -> None:
        """Make all rows, or the rows where the (B,) bool `mask` is True, fresh, in place."""
        self.state.reset(mask)
        if mask is None:
            self.prev_mask.zero_()
        else:
            self.prev_mask.masked_fill_(mask.to(self.device, torch.bool)[:, None], False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "memoria",
            "format": FORMAT,
            "prev_hidden": self.prev_hidden,
            "prev_mask": self.prev_mask,
            "state": self.state.state_dict(),
        }

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], config: MemoriaConfig | None = None, device: torch.device | str | None = None
    ) -> MemoriaMemory:
        """Rebuild a saved memory, checked against `config` if given."""
        check_format(state_dict, "memoria")
        state = MemoryState.from_state_dict(state_dict["state"], config=config, device=device)
        hidden, mask = state_dict["prev_hidden"], state_dict["prev_mask"]
        if device is not None:
            hidden, mask = hidden.to(device), mask.to(device)
        if hidden.shape[:2] != mask.shape or hidden.shape[0] != state.batch_size or hidden.shape[2] != state.dim:
            raise ValueError(
                f"inconsistent memoria memory: prev_hidden {tuple(hidden.shape)}, prev_mask {tuple(mask.shape)}, "
                f"engine state of {state.batch_size} rows x width {state.dim}"
            )
        return cls(hidden, mask, state)._static()


@dataclass
class MemoriaRead(BatchRows, MemoryRead):
    """What the memory attentions read in one forward (a frozen one serves a whole decode).

    Attributes (the compute dtype; masks bool):
        engrams: (B, N + R, D) the working memory (with the abstractor's gradient), then the
            reminded engrams (constants).
        wm_active: (B,) rows that have a working memory.
        reminded_mask: (B, R) real reminded engrams of active rows.
        reminded_active: (B,) rows with at least one reminded engram.
    """

    engrams: Tensor
    wm_active: Tensor
    reminded_mask: Tensor
    reminded_active: Tensor
    slot_mask: ClassVar[None] = None

    def memory_inputs(self, query_mask: Tensor | None, use_sdpa: bool) -> MemoryInputs:
        R = self.reminded_mask.shape[1]
        return MemoryInputs(self.wm_active, self.reminded_mask, self.reminded_active, query_mask, use_sdpa,
                            num_wm=self.engrams.shape[1] - R, dtype=self.engrams.dtype)


@dataclass
class MemoriaSlotRead(MemoriaRead):
    """`memory_read="self_attention"`: the engrams are key/value slots of every block's own
    self-attention (projected there by the block: `layer.engram_key_values`), masked per row:
    the working memory where the row has one, the reminded engrams that are real."""

    engram_slots: ClassVar[bool] = True

    @property
    def slot_mask(self) -> Tensor:  # type: ignore[override]
        """(B, N + R) bool: which engram slots the tokens may attend to."""
        B, R = self.reminded_mask.shape
        wm = self.wm_active[:, None].expand(B, self.engrams.shape[1] - R)
        return torch.cat([wm, self.reminded_mask], dim=1)


@dataclass
class MemoriaPending:
    """What Memoria's write needs from its read: the engine's retrieval, and the auxiliary
    loss of the working memory (`engram_loss`), if any."""

    retrieval: Retrieval
    loss: Tensor | None = None


def passage_reconstruction_loss(wm: Tensor, passage: Tensor, mask: Tensor, active: Tensor) -> Tensor:
    """The working memory's attention-reconstruction loss (`engram_loss`; an option beyond the paper).

    Every token of the previous segment, as a query, reads the segment itself and, separately,
    the working memory (parameter-free scaled dot-product attention in the model's width,
    `passage` as queries, keys and values); the loss is the mean squared difference of the two
    reads over real tokens of rows that have a working memory, divided by the width. The
    target carries no gradient: only the working memory (the abstractor) learns from it.

    Args:
        wm: (B, N, D) the working memory (with the abstractor's gradient).
        passage: (B, P, D) the previous segment's final hidden states (constants).
        mask: (B, P) bool, its real tokens. active: (B,) bool, rows with a working memory.

    Returns:
        A 0-dim fp32 loss (0 when no row is active).
    """
    P, W = passage.detach().float(), wm.float()
    scale = P.shape[-1] ** -0.5
    blocked = torch.where(mask, 0.0, float("-inf"))[:, None, :]  # (B, 1, P)
    own = torch.softmax(torch.matmul(P, P.transpose(1, 2)) * scale + blocked, dim=-1)  # (B, P, P)
    target = torch.matmul(torch.nan_to_num(own), P)  # (B, P, D); a row without tokens gives NaN, zeroed
    read = torch.matmul(torch.softmax(torch.matmul(P, W.transpose(1, 2)) * scale, dim=-1), W)  # (B, P, D)
    error = (read - target).pow(2).mean(dim=-1)  # (B, P)
    counts = (mask & active[:, None]).to(error.dtype)
    return (error * counts).sum() / counts.sum().clamp(min=1.0)


class MemoriaKind(MemoryKind):
    """Working, short-term and long-term memory of engrams (the memory engine, `memoria_ds.memory`)."""

    name = "memoria"
    places = frozenset({"engrams", "modules"})  # read as self-attention slots: "engram slots" (composition.places)
    memory_class = MemoriaMemory

    def __init__(self, config) -> None:
        super().__init__(config)
        # parsed here, not at the first forward: a compiled forward (`model.compile()`) then
        # reads a cached value instead of tracing the dataclass parsing (a graph break)
        self._parsed: tuple[dict, MemoriaConfig] = (dict(config.memoria), config.memoria_config)
        digest_multipliers(config.n_embd, "cpu")  # the engine's one random draw, made outside any trace
        self._engine = MemoryEngine()

    @property
    def settings(self) -> MemoriaConfig:
        """The engine's typed settings, parsed again only when `config.memoria` changed."""
        raw = self.config.memoria
        if self._parsed[0] != raw:
            self._parsed = (dict(raw), self.config.memoria_config)
        return self._parsed[1]

    @property
    def engine(self) -> MemoryEngine:
        """The memory step, eager or compiled as `config.memory_compile` says (read at each use)."""
        if self._engine.mode != self.config.memory_compile:
            self._engine = MemoryEngine(self.config.memory_compile)
        return self._engine

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MemoriaMemory:
        # a fixed `segment_length`: one segment's placeholder positions, the shape every write leaves (every
        # step then sees the same shapes: a compiled step compiles once)
        return MemoriaMemory.empty(self.settings, batch_size, self.config.n_embd, device=device,
                                   length=self.config.segment_length or 1)

    def check(self, memory: MemoriaMemory) -> None:
        memory.state.check(self.settings)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "memoria", {} if config is None else {"D": config.n_embd})
        s.tensor("prev_hidden", FLOAT32, "B P D")
        s.tensor("prev_mask", BOOL, "B P")
        # the engine's state checks its own fields and values (and its capacity and counts against the settings)
        try:
            state = MemoryState.from_state_dict(state_dict.get("state"), config=None if config is None
                                                else config.memoria_config)
        except ValueError as e:
            raise ValueError(f"saved memoria memory: `state`: {e}") from None
        s.require(state.batch_size == s.sizes["B"] and state.dim == s.sizes["D"], "state",
                  f"holds {state.batch_size} rows of width {state.dim}; `prev_hidden` {s.sizes['B']} of width "
                  f"{s.sizes['D']}")
        if config is not None:
            s.at_most("prev_mask", "P", config.n_positions, "`n_positions`, the longest segment")

    def read(self, memory: MemoriaMemory, dtype: torch.dtype, abstractor: nn.Module) -> tuple[MemoriaRead, MemoriaPending]:
        # copies (`read_copy`): the write overwrites the memory in place; the backward needs what was read
        passage, passage_mask = read_copy(memory.prev_hidden), read_copy(memory.prev_mask)
        active = passage_mask.any(dim=1)  # (B,) rows with a previous segment (`has_previous`, as read)
        wm = abstractor(passage.to(dtype), passage_mask)  # (B, N, D)
        retrieval = self.engine.remind(memory.state, wm, self.settings)
        mask = read_copy(retrieval.reminded_mask) & active[:, None]  # (B, R)
        reminded = read_copy(retrieval.reminded).to(dtype)  # (B, R, D): gathered from a state memorize rewrites
        engrams = torch.cat([wm, reminded], dim=1) if reminded.shape[1] else wm  # (B, N + R, D)
        read_class = MemoriaSlotRead if self.config.memory_read == "self_attention" else MemoriaRead
        loss = None
        if self.config.engram_loss and torch.is_grad_enabled():  # a training signal: not computed for scoring
            loss = self.config.engram_loss * passage_reconstruction_loss(wm, passage, passage_mask,
                                                                         active)
        return read_class(engrams, active, mask, mask.any(dim=1)), MemoriaPending(retrieval, loss)

    def auxiliary_loss(self, pending: MemoriaPending) -> Tensor | None:
        return pending.loss

    def write(
        self,
        memory: MemoriaMemory,
        read: MemoriaRead,
        pending: MemoriaPending,
        writes: BlockWrites,
        hidden: Tensor,
        valid: Tensor,
    ) -> MemoryStats:
        """Memorize with the mean contribution over blocks; keep h_t."""
        if writes.reminded:
            contribution = reminded_contribution(writes.reminded, writes.memory)  # (B, R), every block at once
        else:
            contribution = torch.zeros(pending.retrieval.reminded_slots.shape, device=hidden.device)
        stats = self.engine.memorize(memory.state, pending.retrieval, contribution, self.settings)
        # rows without a previous segment wrote a placeholder WM: return them to fresh
        memory.state.reset(~read.wm_active)
        # in place (the addresses `_static` marked stay): a copy, never an alias of the graph
        memory.store_(prev_hidden=hidden.detach().to(torch.float32), prev_mask=valid)
        return gate_stats(stats, read.wm_active, memory.state.capacity)


def gate_stats(stats: MemoryStats, active: Tensor, capacity: int) -> MemoryStats:
    """Rows that had no previous segment took no memory step: report an empty memory."""
    empty = torch.zeros_like(stats.engrams)
    empty[:, 0] = capacity
    nan = torch.full_like(stats.reminded_ltm_age, float("nan"))
    return dataclasses.replace(
        stats,
        engrams=torch.where(active[:, None], stats.engrams, empty),
        evicted=torch.where(active, stats.evicted, 0),
        reminded_stm=torch.where(active, stats.reminded_stm, 0),
        reminded_ltm=torch.where(active, stats.reminded_ltm, 0),
        found_ltm=torch.where(active, stats.found_ltm, 0),
        reminded_ltm_age=torch.where(active, stats.reminded_ltm_age, nan),
        lifespan_mean=torch.where(active, stats.lifespan_mean, nan),
        lifespan_max=torch.where(active, stats.lifespan_max, 0.0),
    )


__all__ = ["MemoriaMemory", "MemoriaRead", "MemoriaSlotRead", "MemoriaPending", "MemoriaKind", "gate_stats",
           "passage_reconstruction_loss"]
