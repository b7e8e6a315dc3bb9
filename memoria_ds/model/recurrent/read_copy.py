"""What a forward reads of a memory that its write then overwrites in place: a copy the backward keeps.

Every kind's write stores the new state into the tensors the memory already holds
(`BatchRows.store_`), so the state keeps its addresses and a captured step (a CUDA graph) can
replay over it. The backward of the step runs after that write, and must see what the forward
read, not the new state:

- eager, autograd's version counters refuse a backward that needs an overwritten tensor;
- compiled, AOTAutograd's partitioner may recompute a cheap read (a `clone`, a comparison of a
  mask) in the backward from the graph's input, which the step's epilogue has overwritten by
  then: silently wrong gradients (torch 2.13; pytorch/pytorch PR 197039, "Don't recompute reads
  of mutated inputs", open). Reproduced here: a mask cloned, used by a `masked_fill`, then
  overwritten gives a weight gradient that differs from eager under both `aot_eager` and inductor.

`read_copy(t)` is a copy the partitioner cannot recompute (an opaque operator), so the backward
saves it; each kind passes the fields it reads through it. On a GPU it is one copy kernel per field.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def held(memory: Any) -> Any:
    """A memory of the same kind whose tensors are `read_copy`s of `memory`'s: what a step reads."""
    return memory.map_tensors(read_copy)


@torch.library.custom_op("memoria_ds::read_copy", mutates_args=())
def read_copy(t: Tensor) -> Tensor:
    """A copy of `t` (a memory field a forward reads) that a compiled backward saves, never recomputes."""
    return t.clone()


@read_copy.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def _backward(ctx, grad: Tensor) -> Tensor:
    return grad


read_copy.register_autograd(_backward)  # a copy: the gradient passes (Memformer's slots inside a training span)


__all__ = ["held", "read_copy"]
