"""A saved memory read as untrusted input: the checks each kind's `check_state` is made of.

A memory's `state_dict` comes back from a file (a checkpoint shard, a snapshot) that anyone
may have written, checksum included. Before a memory is rebuilt from it, its kind checks
every field with a `SavedState` (`MemoryKind.check_state`): present and a tensor, of the
dtype the kind writes, of a shape that fits the other fields and the model, and with values
the kind can hold. Sizes are named once per kind (`B` rows, `Y` layers, `H` heads, `M` slots,
`hd` head width, ...): those the model fixes are given up front, the others are bound where
first seen, so every field must agree with every other. Each failure is one ValueError that
names the kind, the field and what was expected.

    s = SavedState(state_dict, "xl", {"Y": 2, "H": 2, "hd": 16})
    keys = s.tensor("keys", FLOATS, "B Y H M hd")
    s.tensor("mask", BOOL, "B M")
    s.at_most("mask", "M", 24, "`xl_memory_length`")
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import Tensor

from .base import check_format

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a cache in the backbone's dtype
FLOAT32 = (torch.float32,)
BOOL = (torch.bool,)
INT64 = (torch.int64,)


class SavedState:
    """The fields of one saved memory of `kind`, checked one at a time.

    Args:
        state_dict: the saved memory (anything: it is checked to be a mapping of this kind and format).
        kind: the kind's name (in messages, and the `kind` the mapping must say).
        sizes: the sizes the model fixes, by name (e.g. {"H": 12, "hd": 64}); none without a model.

    Raises:
        ValueError: not a mapping, or a memory of another kind or format.
    """

    def __init__(self, state_dict: Any, kind: str, sizes: dict[str, int] | None = None) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(f"a saved memory must be a mapping, got a {type(state_dict).__name__}")
        check_format(state_dict, kind)
        self.state_dict, self.kind = state_dict, kind
        self.sizes: dict[str, int] = dict(sizes or {})
        self.model_sizes = frozenset(self.sizes)

    def fail(self, name: str, problem: str) -> NoReturn:
        raise ValueError(f"saved {self.kind} memory: `{name}` {problem}")

    def require(self, ok: bool | Tensor, name: str, problem: str) -> None:
        """Fail naming `name` unless `ok` (a bool, or a 0-dim bool tensor)."""
        if not bool(ok):
            self.fail(name, problem)

    def tensor(self, name: str, dtypes: tuple[torch.dtype, ...], dims: str) -> Tensor:
        """The field `name`: a tensor of one of `dtypes` whose dimensions are the sizes named by
        `dims` (space separated; a number is a size itself), finite if floating-point."""
        value = self.state_dict.get(name)
        if not isinstance(value, Tensor):
            self.fail(name, "is missing" if name not in self.state_dict else
                      f"is a {type(value).__name__}, expected a tensor")
        if value.dtype not in dtypes:
            self.fail(name, f"has dtype {value.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
        names = dims.split()
        if value.dim() != len(names):
            self.fail(name, f"has shape {tuple(value.shape)}, expected ({', '.join(names)})")
        for size_name, size in zip(names, value.shape):
            want = int(size_name) if size_name.isdigit() else self.sizes.setdefault(size_name, size)
            if size != want:
                whose = " for this model" if size_name in self.model_sizes else ""
                expected = ", ".join(n if n.isdigit() else f"{n}={self.sizes.get(n, '?')}" for n in names)
                self.fail(name, f"has shape {tuple(value.shape)}, expected ({expected}){whose}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            self.fail(name, "holds non-finite values")
        return value

    def at_most(self, name: str, size_name: str, cap: int, what: str) -> None:
        """Fail naming the field `name` unless its size `size_name` is at most `cap` (`what` says whose cap)."""
        size = self.sizes[size_name]
        if size > cap:
            self.fail(name, f"has {size_name}={size}, more than this model ever holds ({cap}: {what})")


def backbone_sizes(config: Any) -> dict[str, int]:
    """The sizes the backbone fixes: `Y` layers, `H` heads, `hd` head width, `D` width; {} without a model."""
    if config is None:
        return {}
    return {"Y": config.n_layer, "H": config.n_head, "hd": config.n_embd // config.n_head, "D": config.n_embd}


def vector_lengths(x: Tensor) -> Tensor:
    """(..., d) -> (...) the L2 norm of each vector, computed in float64 (no overflow of a crafted value)."""
    return torch.linalg.vector_norm(x.to(torch.float64), dim=-1)


__all__ = ["BOOL", "FLOAT32", "FLOATS", "INT64", "SavedState", "backbone_sizes", "vector_lengths"]
