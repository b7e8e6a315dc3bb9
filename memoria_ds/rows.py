"""Row operations for a batch of tensors, derived once from a dataclass's fields.

Every recurrent state in the toolkit (the engine's `MemoryState`, the model's memories,
a frozen memory read for decoding) is a dataclass of tensors whose first dimension is the
row (the stream). Moving streams between ranks, stacking evaluation batches, expanding
beams and copying a memory are the same five operations on each of them, so they are
written once here:

    take_rows(idx)      a new state holding copies of rows `idx`, in order
    put_rows(idx, src)  overwrite rows `idx` with `src`'s rows, in place
    to(device)          the same state on `device` (dtypes kept)
    clone()             a deep copy
    cat([a, b, ...])    the rows of several states stacked into one (a classmethod)

and two that keep a state where it is: `store_(name=value, ...)`, a kind's write, copies each
new value into the tensor the field holds (its address unchanged, so a captured step, a CUDA
graph, replays over the same memory); `mark_static_()` tells torch.compile so.

A field takes part when it holds a tensor or another `BatchRows` (None passes through).
`rows_field(pad=(dim, "left" | "right"))` marks a field whose length along `dim` may
differ between states (XL's cached slots, a previous segment's positions): `cat` and
`put_rows` pad the shorter ones there with zeros (False for masks), at the old end for
"left". `rows_field(rows=False)` keeps a field out (e.g. scratch buffers); a new state
gets that field's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T", bound="BatchRows")


def rows_field(*, pad: tuple[int, str] | None = None, rows: bool = True, **kwargs: Any) -> Any:
    """A dataclass field with row metadata (see the module docstring); kwargs go to `field`."""
    if pad is not None and pad[1] not in ("left", "right"):
        raise ValueError(f"pad side must be 'left' or 'right', got {pad[1]!r}")
    return dataclasses.field(metadata={"pad": pad, "rows": rows}, **kwargs)


def pad_to(x: Tensor, length: int, dim: int, side: str) -> Tensor:
    """`x` padded with zeros (False) along `dim` up to `length` (unchanged if long enough)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    pad = x.new_zeros(shape)
    return torch.cat([pad, x] if side == "left" else [x, pad], dim=dim)


def row_index(rows: Tensor | Sequence[int], device: torch.device) -> Tensor:
    return torch.as_tensor(rows, dtype=torch.long, device=device)


class BatchRows:
    """Mixin for a dataclass of row-first tensors: the five row operations."""

    def _row_fields(self) -> list[tuple[str, Any, tuple[int, str] | None]]:
        return [
            (f.name, getattr(self, f.name), f.metadata.get("pad"))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.metadata.get("rows", True)
        ]

    def _first_tensor(self) -> Tensor:
        for _, value, _ in self._row_fields():
            if isinstance(value, Tensor):
                return value
            if isinstance(value, BatchRows):
                return value._first_tensor()
        raise TypeError(f"{type(self).__name__} holds no tensor")

    @property
    def batch_size(self) -> int:
        return self._first_tensor().shape[0]

    @property
    def device(self) -> torch.device:
        return self._first_tensor().device

    def _map(self: T, fn) -> T:
        """A new state whose row fields are `fn(value)` (None kept)."""
        values = {name: None if value is None else fn(value) for name, value, _ in self._row_fields()}
        return type(self)(**values)

    def map_tensors(self: T, fn) -> T:
        """A new state whose row tensors are `fn(tensor)` (nested states mapped the same way)."""
        return self._map(lambda v: v.map_tensors(fn) if isinstance(v, BatchRows) else fn(v))

    def take_rows(self: T, rows: Tensor | Sequence[int]) -> T:
        idx = row_index(rows, self.device)
        return self._map(lambda v: v.take_rows(idx) if isinstance(v, BatchRows) else v.index_select(0, idx.to(v.device)))

    def to(self: T, device: torch.device | str) -> T:
        return self._map(lambda v: v.to(device))

    def clone(self: T) -> T:
        return self._map(lambda v: v.clone())

    def detach_(self: T) -> T:
        """Cut the autograd graph of every row tensor that has one, in place; returns self.

        The training loop calls it at the end of each span of `optim.bptt_segments` segments.
        A state that holds no graph (every kind that detaches what it carries) is left as is.
        """
        for name, value, _ in self._row_fields():
            if isinstance(value, BatchRows):
                value.detach_()
            elif isinstance(value, Tensor) and value.requires_grad:
                setattr(self, name, value.detach())
        return self

    def store_(self, **values: Tensor) -> None:
        """Set fields to `values` in place: each is copied into the tensor its field holds, whose
        address then never changes (a CUDA graph that reads and writes the state replays; a compiled
        step sees a mutated input, not a new one). A field is replaced instead where the copy cannot
        be: another shape or dtype (a memory still filling, on CPU eager), or a value that carries a
        graph (a kind that trains across segments keeps it; a copy would cut it).
        A value must not overlap the tensor it is copied into (torch refuses such a copy); a state
        that shares its tensors with another (`to` its own device, a kind's `from_state_dict` of the
        other's `state_dict()`) is written through both: `recurrent.memory_from_state_dict` copies.
        """
        for name, value in values.items():
            held = getattr(self, name)
            if (isinstance(held, Tensor) and held.shape == value.shape and held.dtype == value.dtype
                    and held.device == value.device and not value.requires_grad and not held.requires_grad):
                held.copy_(value)
            else:
                setattr(self, name, value)

    def mark_static_(self: T) -> T:
        """Mark every row tensor as an input at a fixed address (`torch._dynamo.mark_static_address`):
        CUDA graph trees capture a step that mutates an input only then ("skipping cudagraphs due to
        mutated inputs" otherwise). Nothing inside a traced region (the tensors are the graph's own
        there); elsewhere the mark changes nothing. Returns self."""
        if torch.compiler.is_compiling():
            return self
        for _, value, _ in self._row_fields():
            if isinstance(value, BatchRows):
                value.mark_static_()
            elif isinstance(value, Tensor) and not value.requires_grad:
                torch._dynamo.mark_static_address(value)
        return self

    @classmethod
    def cat(cls: type[T], states: Sequence[T]) -> T:
        if not states:
            raise ValueError(f"need at least one {cls.__name__} to concatenate")
        values: dict[str, Any] = {}
        for name, first, pad in states[0]._row_fields():
            parts = [getattr(s, name) for s in states]
            if first is None:
                values[name] = None
            elif isinstance(first, BatchRows):
                values[name] = type(first).cat(parts)
            else:
                if pad is not None:
                    length = max(p.shape[pad[0]] for p in parts)
                    parts = [pad_to(p, length, pad[0], pad[1]) for p in parts]
                values[name] = torch.cat([p.to(first.device) for p in parts])
        return cls(**values)

    def put_rows(self, rows: Tensor | Sequence[int], source: BatchRows) -> None:
        """Overwrite `rows` with `source`'s rows, in order, in place.

        Raises:
            ValueError: a count or shape that does not fit (nothing is written then).
        """
        idx = row_index(rows, self.device)
        if type(source) is not type(self):
            raise TypeError(f"cannot put rows of a {type(source).__name__} into a {type(self).__name__}")
        if idx.numel() != source.batch_size:
            raise ValueError(f"{idx.numel()} row indices for a source of {source.batch_size} rows")
        plan = []
        for (name, mine, pad), theirs in zip(self._row_fields(), (v for _, v, _ in source._row_fields())):
            if mine is None or theirs is None:
                if (mine is None) != (theirs is None):
                    raise ValueError(f"`{name}` is set in one {type(self).__name__} and not in the other")
                continue
            if isinstance(mine, BatchRows):
                plan.append((name, mine, theirs, None))
                continue
            if pad is not None:
                length = max(mine.shape[pad[0]], theirs.shape[pad[0]])
                mine, theirs = pad_to(mine, length, *pad), pad_to(theirs, length, *pad)
            if mine.shape[1:] != theirs.shape[1:]:
                raise ValueError(
                    f"cannot put rows of `{name}` shaped {tuple(theirs.shape)} into {tuple(mine.shape)}"
                    f" ({type(self).__name__})"
                )
            plan.append((name, mine, theirs, pad))
        plan.sort(key=lambda item: not isinstance(item[1], BatchRows))  # nested states check themselves first
        for name, mine, theirs, pad in plan:  # every check passed: write
            if isinstance(mine, BatchRows):
                mine.put_rows(idx, theirs)
                continue
            mine.index_copy_(0, idx.to(mine.device), theirs.to(mine.device, mine.dtype))
            if pad is not None:
                setattr(self, name, mine)


__all__ = ["BatchRows", "rows_field", "pad_to", "row_index"]
