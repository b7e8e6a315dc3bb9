"""The recurrent memory that goes in and out of the model's `forward` (Contract 2).

One small object per memory type, all with the same methods, so the training and
evaluation code can treat them alike:

    NoMemory       `none`: nothing but the batch size
    XLMemory       `xl`: cached keys/values of every layer and which slots hold a token
    MemoriaMemory  `memoria`: the previous segment's last hidden states (the next
                   abstractor's input), which positions are real, and the engine's
                   `MemoryState`

Methods: `empty(...)`, `reset(mask)`, `state_dict()`, `from_state_dict(...)`,
`take_rows(idx)`, `put_rows(idx, other)`, `to(device)`, `clone()`, `cat([...])`,
`batch_size`. `memory_from_state_dict` rebuilds whichever kind was saved.

Notation: B rows, P positions of the previous segment, D width, Y layers, H heads,
M cached slots per layer, hd head width.

The objects are updated *in place* by the model's forward (the engine's `MemoryState`
is, to avoid copying its C x C count matrices every step), and the returned
`out.memory` is the object that was passed in. Keep a copy with `clone()` when an
evaluation must not disturb a training memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from ..memory import MemoriaConfig, MemoryState

FORMAT = 1


def _rows(rows: Tensor | list[int], device: torch.device) -> Tensor:
    return torch.as_tensor(rows, dtype=torch.long, device=device)


def _check_format(state_dict: dict[str, Any], kind: str) -> None:
    if state_dict.get("kind") != kind:
        raise ValueError(f"saved memory is of kind {state_dict.get('kind')!r}, expected {kind!r}")
    if state_dict.get("format") != FORMAT:
        raise ValueError(f"memory format {state_dict.get('format')!r} is not supported (this version reads {FORMAT})")


def _pad_length(x: Tensor, length: int, dim: int, left: bool) -> Tensor:
    """Pad `x` with zeros (False for bool) along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    pad = x.new_zeros(shape)
    return torch.cat([pad, x] if left else [x, pad], dim=dim)


# --------------------------------------------------------------------------- none
@dataclass
class NoMemory:
    """The plain backbone carries nothing across segments; this only keeps the batch size."""

    batch_size: int

    @classmethod
    def empty(cls, batch_size: int) -> NoMemory:
        return cls(batch_size)

    def reset(self, mask: Tensor | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "none", "format": FORMAT, "batch_size": self.batch_size}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], device: torch.device | str | None = None) -> NoMemory:
        _check_format(state_dict, "none")
        return cls(int(state_dict["batch_size"]))

    def take_rows(self, rows: Tensor | list[int]) -> NoMemory:
        return NoMemory(len(rows))

    def put_rows(self, rows: Tensor | list[int], other: NoMemory) -> None:
        if len(rows) != other.batch_size:
            raise ValueError(f"{len(rows)} row indices for a source of {other.batch_size} rows")

    def to(self, device: torch.device | str) -> NoMemory:
        return self

    def clone(self) -> NoMemory:
        return NoMemory(self.batch_size)

    @staticmethod
    def cat(memories: list[NoMemory]) -> NoMemory:
        return NoMemory(sum(m.batch_size for m in memories))


# --------------------------------------------------------------------------- xl
@dataclass
class XLMemory:
    """Transformer-XL memory: detached keys/values of the last M tokens, per layer.

    Attributes:
        keys: (B, Y, H, M, hd) cached keys (the backbone's dtype; detached).
        values: (B, Y, H, M, hd) cached values.
        mask: (B, M) bool, True where a slot holds a token of this row's stream (the
            oldest slots come first; a reset row has none).
        segments: (B,) int64, segments written since the row's last reset (its parity
            picks the position bank of the next segment, `xl_positions="alternate"`).
            None (a memory saved before it existed) reads as zeros.
    """

    keys: Tensor
    values: Tensor
    mask: Tensor
    segments: Tensor | None = None

    def __post_init__(self) -> None:
        if self.segments is None:
            self.segments = torch.zeros(self.mask.shape[0], dtype=torch.int64, device=self.mask.device)

    @classmethod
    def empty(
        cls,
        batch_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        length: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> XLMemory:
        shape = (batch_size, num_layers, num_heads, length, head_dim)
        return cls(
            keys=torch.zeros(shape, device=device, dtype=dtype),
            values=torch.zeros(shape, device=device, dtype=dtype),
            mask=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.mask.device

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or the rows where the (B,) bool `mask` is True, in place.

        The keys/values of a reset row are zeroed, not only masked: attention gives a masked
        slot probability 0, and 0 * NaN is NaN, so a row left non-finite by a diverged step
        (the training loop resets those without a host sync) must hold zeros, as a fresh one.
        """
        if mask is None:
            self.mask.zero_()
            self.keys.zero_()
            self.values.zero_()
            self.segments.zero_()
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        self.segments.masked_fill_(mask, 0)
        rows = mask[:, None, None, None, None]  # (B, 1, 1, 1, 1) over (B, Y, H, M, hd)
        self.keys.masked_fill_(rows, 0.0)
        self.values.masked_fill_(rows, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "xl", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask,
                "segments": self.segments}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], device: torch.device | str | None = None) -> XLMemory:
        _check_format(state_dict, "xl")
        out = cls(state_dict["keys"], state_dict["values"], state_dict["mask"], state_dict.get("segments"))
        if (
            out.keys.shape != out.values.shape
            or out.keys.shape[0] != out.mask.shape[0]
            or out.keys.shape[3] != out.mask.shape[1]
            or out.segments.shape != out.mask.shape[:1]
        ):
            raise ValueError(
                f"inconsistent xl memory: keys {tuple(out.keys.shape)}, values {tuple(out.values.shape)}, "
                f"mask {tuple(out.mask.shape)}, segments {tuple(out.segments.shape)}"
            )
        return out.to(device) if device is not None else out

    def take_rows(self, rows: Tensor | list[int]) -> XLMemory:
        idx = _rows(rows, self.device)
        return XLMemory(
            self.keys.index_select(0, idx),
            self.values.index_select(0, idx),
            self.mask.index_select(0, idx),
            self.segments.index_select(0, idx),
        )

    def put_rows(self, rows: Tensor | list[int], other: XLMemory) -> None:
        """Overwrite `rows` with `other`'s rows in place (shorter memories are padded at the old end)."""
        idx = _rows(rows, self.device)
        if idx.numel() != other.batch_size:
            raise ValueError(f"{idx.numel()} row indices for a source of {other.batch_size} rows")
        if other.keys.shape[1:3] != self.keys.shape[1:3] or other.keys.shape[4] != self.keys.shape[4]:
            raise ValueError(f"cannot put xl rows of shape {tuple(other.keys.shape)} into {tuple(self.keys.shape)}")
        length = max(self.length, other.length)
        if self.length < length:
            self.keys, self.values = (_pad_length(t, length, 3, left=True) for t in (self.keys, self.values))
            self.mask = _pad_length(self.mask, length, 1, left=True)
        keys, values = (
            _pad_length(t, length, 3, left=True).to(self.device, self.keys.dtype) for t in (other.keys, other.values)
        )
        self.keys.index_copy_(0, idx, keys)
        self.values.index_copy_(0, idx, values)
        self.mask.index_copy_(0, idx, _pad_length(other.mask, length, 1, left=True).to(self.device))
        self.segments.index_copy_(0, idx, other.segments.to(self.device))

    def to(self, device: torch.device | str) -> XLMemory:
        return XLMemory(self.keys.to(device), self.values.to(device), self.mask.to(device), self.segments.to(device))

    def clone(self) -> XLMemory:
        return XLMemory(self.keys.clone(), self.values.clone(), self.mask.clone(), self.segments.clone())

    @staticmethod
    def cat(memories: list[XLMemory]) -> XLMemory:
        """Stack the rows of several memories (shorter ones padded at the old end)."""
        length = max(m.length for m in memories)
        return XLMemory(
            torch.cat([_pad_length(m.keys, length, 3, left=True) for m in memories]),
            torch.cat([_pad_length(m.values, length, 3, left=True) for m in memories]),
            torch.cat([_pad_length(m.mask, length, 1, left=True) for m in memories]),
            torch.cat([m.segments for m in memories]),
        )


# --------------------------------------------------------------------------- memoria
@dataclass
class MemoriaMemory:
    """Memoria's recurrent state.

    Attributes:
        prev_hidden: (B, P, D) float32, the previous segment's last hidden states (after
            ln_f, detached): the next step's abstractor input.
        prev_mask: (B, P) bool, True at real positions. A row with none has no previous
            segment: its next segment runs exactly as the plain backbone.
        state: the memory engine's `MemoryState` (fp32 engrams, counts, lifespans).
    """

    prev_hidden: Tensor
    prev_mask: Tensor
    state: MemoryState

    @classmethod
    def empty(
        cls, config: MemoriaConfig, batch_size: int, dim: int, device: torch.device | str | None = None
    ) -> MemoriaMemory:
        """Fresh memory for `batch_size` rows (one placeholder position, marked absent)."""
        return cls(
            prev_hidden=torch.zeros(batch_size, 1, dim, device=device),
            prev_mask=torch.zeros(batch_size, 1, dtype=torch.bool, device=device),
            state=MemoryState.empty(config, batch_size, dim, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.prev_mask.shape[0]

    @property
    def device(self) -> torch.device:
        return self.prev_mask.device

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
        _check_format(state_dict, "memoria")
        state = MemoryState.from_state_dict(state_dict["state"], config=config, device=device)
        hidden, mask = state_dict["prev_hidden"], state_dict["prev_mask"]
        if device is not None:
            hidden, mask = hidden.to(device), mask.to(device)
        if hidden.shape[:2] != mask.shape or hidden.shape[0] != state.batch_size or hidden.shape[2] != state.dim:
            raise ValueError(
                f"inconsistent memoria memory: prev_hidden {tuple(hidden.shape)}, prev_mask {tuple(mask.shape)}, "
                f"engine state of {state.batch_size} rows x width {state.dim}"
            )
        return cls(hidden, mask, state)

    def take_rows(self, rows: Tensor | list[int]) -> MemoriaMemory:
        idx = _rows(rows, self.device)
        return MemoriaMemory(
            self.prev_hidden.index_select(0, idx), self.prev_mask.index_select(0, idx), self.state.take_rows(idx)
        )

    def put_rows(self, rows: Tensor | list[int], other: MemoriaMemory) -> None:
        """Overwrite `rows` with `other`'s rows in place (previous segments of other lengths are padded)."""
        idx = _rows(rows, self.device)
        if idx.numel() != other.batch_size:
            raise ValueError(f"{idx.numel()} row indices for a source of {other.batch_size} rows")
        self.state.put_rows(idx, other.state)
        length = max(self.prev_mask.shape[1], other.prev_mask.shape[1])
        if self.prev_mask.shape[1] < length:
            self.prev_hidden = _pad_length(self.prev_hidden, length, 1, left=False)
            self.prev_mask = _pad_length(self.prev_mask, length, 1, left=False)
        self.prev_hidden.index_copy_(0, idx, _pad_length(other.prev_hidden, length, 1, left=False).to(self.device))
        self.prev_mask.index_copy_(0, idx, _pad_length(other.prev_mask, length, 1, left=False).to(self.device))

    def to(self, device: torch.device | str) -> MemoriaMemory:
        return MemoriaMemory(self.prev_hidden.to(device), self.prev_mask.to(device), self.state.to(device))

    def clone(self) -> MemoriaMemory:
        return MemoriaMemory(self.prev_hidden.clone(), self.prev_mask.clone(), self.state.clone())

    @staticmethod
    def cat(memories: list[MemoriaMemory]) -> MemoriaMemory:
        length = max(m.prev_mask.shape[1] for m in memories)
        return MemoriaMemory(
            torch.cat([_pad_length(m.prev_hidden, length, 1, left=False) for m in memories]),
            torch.cat([_pad_length(m.prev_mask, length, 1, left=False) for m in memories]),
            MemoryState.cat([m.state for m in memories]),
        )


RecurrentMemory = Union[NoMemory, XLMemory, MemoriaMemory]


def memory_from_state_dict(
    state_dict: dict[str, Any], config: MemoriaConfig | None = None, device: torch.device | str | None = None
) -> RecurrentMemory:
    """Rebuild a memory of any kind from its `state_dict()`."""
    kind = state_dict.get("kind")
    if kind == "memoria":
        return MemoriaMemory.from_state_dict(state_dict, config=config, device=device)
    if kind == "xl":
        return XLMemory.from_state_dict(state_dict, device=device)
    if kind == "none":
        return NoMemory.from_state_dict(state_dict)
    raise ValueError(f"unknown memory kind {kind!r}; expected 'none', 'xl' or 'memoria'")


__all__ = ["NoMemory", "XLMemory", "MemoriaMemory", "RecurrentMemory", "memory_from_state_dict"]
