"""Exact Euclidean K-nearest neighbours against a brute-force loop over the memory."""

from __future__ import annotations

import math

import pytest
import torch

from memoria_ds.episodic import EpisodicMemory, nearest, search, write


def memory_of(keys: torch.Tensor) -> EpisodicMemory:
    n = keys.shape[0]
    ids = torch.ones(n, 2, dtype=torch.long)
    return write(EpisodicMemory.empty(keys.shape[1]), keys, ids, torch.ones_like(ids), torch.zeros(n, dtype=torch.long), 0)


def brute_force(keys: torch.Tensor, query: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """Every stored row's exact distance (float64, Python loop), sorted by (distance, row)."""
    scored = []
    for row in range(keys.shape[0]):
        sq = sum((float(a) - float(b)) ** 2 for a, b in zip(keys[row].tolist(), query.tolist()))
        scored.append((math.sqrt(sq), row))
    return sorted(scored)[:k]


def test_matches_brute_force_on_random_keys():
    g = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(60, 8, generator=g), torch.randn(5, 8, generator=g)
    rows, dist = nearest(memory_of(keys), queries, k=7)
    assert rows.shape == dist.shape == (5, 7) and rows.dtype == torch.int64 and dist.dtype == torch.float32
    for q in range(5):
        ref = brute_force(keys, queries[q], 7)
        assert rows[q].tolist() == [r for _, r in ref]
        assert torch.allclose(dist[q].double(), torch.tensor([d for d, _ in ref], dtype=torch.float64), atol=1e-5)


def test_ties_go_to_the_smaller_row():
    g = torch.Generator().manual_seed(1)
    # integer keys on a small grid: every squared distance is an exact small integer, many are equal,
    # and rows 10..19 repeat rows 0..9 exactly
    base = torch.randint(-2, 3, (10, 3), generator=g).float()
    keys = torch.cat([base, base, torch.randint(-2, 3, (15, 3), generator=g).float()])
    queries = torch.randint(-2, 3, (6, 3), generator=g).float()
    rows, dist = nearest(memory_of(keys), queries, k=12)
    for q in range(6):
        ref = brute_force(keys, queries[q], 12)
        assert rows[q].tolist() == [r for _, r in ref]
        assert dist[q].tolist() == [pytest.approx(d, abs=1e-6) for d, _ in ref]


def test_equal_keys_get_equal_distances_wherever_they_sit():
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(200, 64, generator=g)
    twins = [3, 57, 101, 150, 199]
    keys[twins] = torch.randn(64, generator=g)
    query = keys[twins[0]] + 0.5 * torch.randn(64, generator=g)
    rows, dist = nearest(memory_of(keys), query[None], k=200)
    position = {r: i for i, r in enumerate(rows[0].tolist())}
    at = [position[r] for r in twins]
    assert at == list(range(at[0], at[0] + len(twins)))  # adjacent, in row order
    assert len({dist[0, i].item() for i in at}) == 1  # bit-equal distances


def test_chunked_scan_gives_the_same_answer(monkeypatch):
    g = torch.Generator().manual_seed(2)
    keys = torch.randint(-2, 3, (50, 4), generator=g).float()  # ties across chunk borders
    queries = torch.randint(-2, 3, (3, 4), generator=g).float()
    memory = memory_of(keys)
    whole = nearest(memory, queries, k=9)
    monkeypatch.setattr(search, "_CHUNK_ELEMENTS", 3 * 11)  # 11 rows per chunk for 3 queries
    chunked = nearest(memory, queries, k=9)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    for q in range(3):
        assert chunked[0][q].tolist() == [r for _, r in brute_force(keys, queries[q], 9)]


def test_k_larger_than_the_memory_returns_everything_sorted():
    keys = torch.tensor([[3.0], [0.0], [1.0]])
    rows, dist = nearest(memory_of(keys), torch.tensor([[0.2]]), k=32)
    assert rows.tolist() == [[1, 2, 0]]
    assert torch.allclose(dist, torch.tensor([[0.2, 0.8, 2.8]]))


@pytest.mark.parametrize("k, queries, match", [
    (0, torch.zeros(1, 2), "at least 1"), (1, torch.zeros(1, 3), r"\(Q, 2\)"), (1, torch.zeros(2), r"\(Q, 2\)"),
])
def test_bad_arguments_are_refused(k, queries, match):
    with pytest.raises(ValueError, match=match):
        nearest(memory_of(torch.zeros(4, 2)), queries, k)
    with pytest.raises(ValueError, match="empty"):
        nearest(EpisodicMemory.empty(2), torch.zeros(1, 2), 1)
