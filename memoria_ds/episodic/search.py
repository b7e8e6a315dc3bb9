"""Exact K-nearest-neighbour search over an EpisodicMemory's keys (Euclidean distance).

MbPA++ retrieves the K = 32 stored examples whose keys are closest to the test example's
key in Euclidean distance (de Masson d'Autume et al. 2019; K from the survey in
shared/papers, "K = 32 and L = 30"). Note: one public port (h3lio5/episodic-lifelong-
learning, `ReplayMemory.get_neighbours`) ranks by inner product instead, which is not the
same order for keys of different norms.

Shapes: N stored keys, D key width, Q queries, K neighbours (notation of memory.py).

Exactness. Each distance is computed from the coordinate differences (`torch.cdist` without
the matrix-product shortcut), so a key's distance does not depend on where it sits in the
memory and equal keys get equal distances. Ties are broken by the smaller memory row: the
search ranks the int64 `(float32 bits of the distance) << 32 | row`, which orders exactly as
(distance, row) because the bits of a non-negative float increase with its value. The
memory is scanned in chunks, so the working set stays bounded for any N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .memory import EpisodicMemory

_CHUNK_ELEMENTS = 1 << 22  # distances per chunk (16 MB of float32)
_ROW_BITS = 32


def nearest(memory: EpisodicMemory, query_keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `k` stored keys closest to each query, nearest first.

    Args:
        memory: the memory to search (N >= 1 examples).
        query_keys: (Q, D) query keys (any float dtype; compared in float32).
        k: neighbours per query; more than N is clamped to N (every stored example).

    Returns:
        indices: (Q, min(k, N)) int64 memory rows, by increasing distance, ties by row.
        distances: (Q, min(k, N)) float32 Euclidean distances.

    Raises:
        ValueError: an empty memory, `k < 1`, or queries that are not (Q, D).
    """
    if k < 1:
        raise ValueError(f"`k` must be at least 1, got {k}")
    n = len(memory)
    if n == 0:
        raise ValueError("cannot search an empty episodic memory; write examples first")
    if n >= 1 << _ROW_BITS:
        raise ValueError(f"the search indexes rows with {_ROW_BITS} bits; the memory holds {n}")
    if query_keys.dim() != 2 or query_keys.shape[1] != memory.key_dim:
        raise ValueError(f"query keys must be (Q, {memory.key_dim}), got {tuple(query_keys.shape)}")
    k = min(k, n)
    queries = query_keys.to(device=memory.device, dtype=torch.float32)  # (Q, D)
    Q = queries.shape[0]
    chunk = max(k, _CHUNK_ELEMENTS // max(Q, 1))
    best = []
    for lo in range(0, n, chunk):
        keys = memory.keys[lo : lo + chunk]  # (c, D)
        dist = torch.cdist(queries[None], keys[None], compute_mode="donot_use_mm_for_euclid_dist")[0]  # (Q, c)
        rows = torch.arange(lo, lo + keys.shape[0], device=memory.device)  # (c,)
        ranked = (dist.view(torch.int32).to(torch.int64) << _ROW_BITS) | rows  # (Q, c), all distinct
        best.append(torch.topk(ranked, min(k, keys.shape[0]), dim=1, largest=False, sorted=True).values)
    ranked = torch.cat(best, dim=1)  # (Q, <= k * chunks)
    if len(best) > 1:
        ranked = torch.topk(ranked, k, dim=1, largest=False, sorted=True).values  # (Q, k)
    indices = ranked & ((1 << _ROW_BITS) - 1)
    distances = (ranked >> _ROW_BITS).to(torch.int32).view(torch.float32)
    return indices, distances


__all__ = ["nearest"]
