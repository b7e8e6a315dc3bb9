"""Helpers shared by the model tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import torch

# Small enough that STM fills and LTM is reached within a handful of segments.
SMALL_MEMORIA = dict(
    num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, initial_lifespan=3.0, alpha=2.0, search_depth=2
)
VOCAB = 257


def segments(batch: int = 3, length: int = 12, count: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """`count` random segments of one batch of streams: a list of (batch, length) int64."""
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, VOCAB, (batch, length * count), generator=gen).split(length, dim=1))


def run_stream(model, segs, memory=None, **kwargs):
    """Feed segments in order, carrying memory; returns (list of outputs, final memory)."""
    outs = []
    for x in segs:
        out = model(x, memory=memory, **kwargs)
        memory = out.memory
        outs.append(out)
    return outs, memory
