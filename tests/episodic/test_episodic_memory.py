"""EpisodicMemory: write (all, or each with a probability), gather, sample, purity, state dict."""

from __future__ import annotations

import io

import pytest
import torch
from episodic_helpers import random_batch

from memoria_ds.episodic import EpisodicMemory, gather, sample, write

D = 6
PAD = 1


def stream(n_batches: int = 4, seed: int = 0):
    """Batches of different sizes and widths, with garbage ids at the padding positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n_batches):
        n, width = 3 + 2 * b, (5, 9, 3, 7, 4, 8)[b % 6]
        ids, mask = random_batch(n, width, g)
        ids = torch.where(mask.bool(), ids, 99)  # a tokenizer's own padding id must not be stored
        keys = torch.randn(n, D, generator=g)
        labels = torch.randint(0, 3, (n,), generator=g)
        out.append((keys, ids, mask, labels, b))
    return out


def filled(batches, pad: int = PAD, write_prob: float = 1.0, generator=None) -> EpisodicMemory:
    memory = EpisodicMemory.empty(D, pad_token_id=pad)
    for keys, ids, mask, labels, task in batches:
        memory = write(memory, keys, ids, mask, labels, task, write_prob=write_prob, generator=generator)
    return memory


def expected_rows(batches):
    """Per example: (key, real tokens, label, task), in stream order."""
    rows = []
    for keys, ids, mask, labels, task in batches:
        for i in range(keys.shape[0]):
            n = int(mask[i].sum())
            rows.append((keys[i], ids[i, :n].tolist(), int(labels[i]), task))
    return rows


def assert_rows(memory: EpisodicMemory, rows) -> None:
    assert len(memory) == len(rows)
    width = max(len(r[1]) for r in rows)
    assert memory.input_ids.shape == (len(rows), width)
    for i, (key, tokens, label, task) in enumerate(rows):
        assert torch.equal(memory.keys[i], key)
        assert memory.input_ids[i].tolist() == tokens + [memory.pad_token_id] * (width - len(tokens))
        assert int(memory.lengths[i]) == len(tokens)
        assert int(memory.labels[i]) == label and int(memory.task_ids[i]) == task
    assert torch.equal(memory.attention_mask(), (torch.arange(width) < memory.lengths[:, None]).long())


def test_write_all_stores_every_example_in_order():
    batches = stream()
    memory = filled(batches)
    assert_rows(memory, expected_rows(batches))
    assert memory.keys.dtype == torch.float32 and memory.input_ids.dtype == torch.int64


def test_write_many_small_batches_grows_the_store_by_doubling():
    batches = stream(n_batches=60, seed=3)  # 60 writes, 3780 rows, widest batch second
    memory, stores = EpisodicMemory.empty(D, pad_token_id=PAD), []
    for keys, ids, mask, labels, task in batches:
        memory = write(memory, keys, ids, mask, labels, task)
        if not stores or memory._store is not stores[-1]:
            stores.append(memory._store)
    assert_rows(memory, expected_rows(batches))
    capacities = [s.keys.shape[0] for s in stores]
    assert len(stores) <= 10, capacities  # 64 -> 4096 in doublings, plus the widenings of the first writes
    assert capacities[-1] < 2 * len(memory) + 64


def test_write_with_probability_keeps_a_reproducible_subset_of_about_half():
    g = torch.Generator().manual_seed(1)
    n = 400
    keys = torch.randn(n, D, generator=g)
    ids, mask = random_batch(n, 5, g)
    labels = torch.arange(n) % 3
    runs = [write(EpisodicMemory.empty(D), keys, ids, mask, labels, torch.arange(n), 0.5,
                  torch.Generator().manual_seed(seed)) for seed in (7, 7, 8)]
    first, again, other = runs
    assert 140 <= len(first) <= 260  # Binomial(400, 0.5): mean 200, sd 10
    kept = first.task_ids  # task ids were the example numbers
    assert bool((kept[1:] > kept[:-1]).all())  # a subsequence, in stream order
    assert torch.equal(first.keys, keys[kept]) and torch.equal(first.labels, labels[kept])
    assert torch.equal(first.lengths, mask[kept].sum(1))
    for a, b in zip(first.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert not torch.equal(first.task_ids[:50], other.task_ids[:50])
    assert len(write(EpisodicMemory.empty(D), keys, ids, mask, labels, 0, 0.0)) == 0


def test_keys_are_stored_in_float32():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(4, D, generator=g).bfloat16()
    ids, mask = random_batch(4, 3, g)
    memory = write(EpisodicMemory.empty(D), keys, ids, mask, torch.zeros(4, dtype=torch.long), 0)
    assert memory.keys.dtype == torch.float32 and torch.equal(memory.keys, keys.float())


def test_write_leaves_older_memories_unchanged_even_when_branching():
    c, a, b = stream(3, seed=5)  # widths 5, 9, 3: neither later write needs a wider store than `a`'s
    base = filled([a])
    snapshot = base.state_dict()
    left = write(base, *b[:4], task_ids=b[4])
    right = write(base, *c[:4], task_ids=c[4])  # base's store already holds `left`'s rows past its end
    for name, t in snapshot.items():
        assert torch.equal(getattr(base, name), t) if isinstance(t, torch.Tensor) else True
    assert_rows(left, expected_rows([a, b]))
    assert_rows(right, expected_rows([a, c]))
    assert_rows(write(left, *c[:4], task_ids=c[4]), expected_rows([a, b, c]))


@pytest.mark.parametrize("problem, match", [
    ("left_padded", "ones-then-zeros"), ("empty_row", "all zeros"), ("key_width", r"\(B, 6\)"),
    ("nan_key", "non-finite"), ("negative_label", "negative"), ("prob", "write_prob"), ("labels_shape", "labels"),
])
def test_write_rejects_bad_input(problem, match):
    g = torch.Generator().manual_seed(0)
    keys, labels = torch.randn(3, D, generator=g), torch.tensor([0, 1, 2])
    ids, mask = random_batch(3, 4, g, min_len=2)
    prob = 1.0
    if problem == "left_padded":
        mask[1] = torch.tensor([0, 0, 1, 1])
    elif problem == "empty_row":
        mask[2] = 0
    elif problem == "key_width":
        keys = torch.randn(3, D + 1)
    elif problem == "nan_key":
        keys[0, 0] = float("nan")
    elif problem == "negative_label":
        labels = torch.tensor([0, -1, 2])
    elif problem == "prob":
        prob = 1.5
    elif problem == "labels_shape":
        labels = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=match):
        write(EpisodicMemory.empty(D), keys, ids, mask, labels, 0, prob)


def test_gather_trims_to_the_longest_example():
    batches = stream()
    memory = filled(batches)
    rows = torch.tensor([4, 0, 4])
    batch = gather(memory, rows)
    width = int(memory.lengths[rows].max())
    assert batch.input_ids.shape == (3, width)
    assert torch.equal(batch.input_ids, memory.input_ids[rows, :width])
    assert torch.equal(batch.attention_mask, memory.attention_mask()[rows, :width])
    assert torch.equal(batch.labels, memory.labels[rows]) and torch.equal(batch.indices, rows)
    with pytest.raises(ValueError, match="indices must lie in"):
        gather(memory, torch.tensor([len(memory)]))


def test_sample_is_uniform_without_replacement_and_reproducible():
    memory = filled(stream(n_batches=2))  # 3 + 5 = 8 rows
    n = len(memory)
    draws = [sample(memory, 3, torch.Generator().manual_seed(s)).indices for s in range(2000)]
    for rows in draws[:50]:
        assert len(set(rows.tolist())) == 3
    counts = torch.bincount(torch.cat(draws), minlength=n).float()
    expected = 2000 * 3 / n  # 750 per row; sd ~ 22
    assert bool(((counts - expected).abs() < 120).all()), counts
    same = sample(memory, 3, torch.Generator().manual_seed(11)).indices
    assert torch.equal(same, sample(memory, 3, torch.Generator().manual_seed(11)).indices)
    everything = sample(memory, 100, torch.Generator().manual_seed(0))  # more than stored: all of them
    assert sorted(everything.indices.tolist()) == list(range(n))
    with pytest.raises(ValueError, match="empty"):
        sample(EpisodicMemory.empty(D), 1)


def test_state_dict_round_trip_is_exact_and_compact():
    memory = filled(stream(n_batches=5))
    state = memory.state_dict()
    assert all(isinstance(v, (torch.Tensor, int)) for v in state.values())
    assert state["keys"].untyped_storage().nbytes() == state["keys"].numel() * 4  # not the over-allocated store
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = EpisodicMemory.from_state_dict(torch.load(buffer, weights_only=True), key_dim=D)
    assert loaded.pad_token_id == memory.pad_token_id
    for name in ("keys", "input_ids", "lengths", "labels", "task_ids"):
        assert torch.equal(getattr(loaded, name), getattr(memory, name)), name
        assert getattr(loaded, name).dtype == getattr(memory, name).dtype
    again = loaded.state_dict()
    assert again.keys() == state.keys()
    assert all(torch.equal(again[k], v) if isinstance(v, torch.Tensor) else again[k] == v for k, v in state.items())
    extra = stream(n_batches=6)[5]
    assert_rows(write(loaded, *extra[:4], task_ids=extra[4]), expected_rows(stream(n_batches=6)))
    empty = EpisodicMemory.from_state_dict(EpisodicMemory.empty(D).state_dict(), key_dim=D)
    assert len(empty) == 0 and empty.key_dim == D


def _corrupt(state: dict, how: str) -> dict:
    state = dict(state)
    if how == "missing":
        del state["labels"]
    elif how == "unexpected":
        state["momentum"] = torch.zeros(1)
    elif how == "shape":
        state["labels"] = state["labels"][:-1]
    elif how == "dtype":
        state["keys"] = state["keys"].double()
    elif how == "format":
        state["format"] = 99
    elif how == "nan":
        state["keys"] = state["keys"].clone()
        state["keys"][0, 0] = float("inf")
    elif how == "length":
        state["lengths"] = state["lengths"] + state["input_ids"].shape[1]
    elif how == "padding":
        state["input_ids"] = state["input_ids"].clone()
        state["input_ids"][0, -1] = PAD + 5  # a token past row 0's length (the width is at least 3)
        state["lengths"] = state["lengths"].clone()
        state["lengths"][0] = 1
    elif how == "negative_label":
        state["labels"] = -state["labels"] - 1
    elif how == "not_a_tensor":
        state["task_ids"] = state["task_ids"].tolist()
    return state


@pytest.mark.parametrize("how, match", [
    ("missing", r"missing entries \['labels'\]"), ("unexpected", "unexpected entries"),
    ("shape", "shapes do not fit"), ("dtype", "dtype torch.float64"), ("format", "format 99"),
    ("nan", "non-finite"), ("length", "`lengths` outside"), ("padding", "padding positions"),
    ("not_a_tensor", "is a list"), ("negative_label", "`labels` are negative"),
])
def test_from_state_dict_rejects_a_corrupt_state_in_one_line(how, match):
    state = filled(stream(n_batches=3)).state_dict()
    with pytest.raises(ValueError, match=match) as info:
        EpisodicMemory.from_state_dict(_corrupt(state, how), key_dim=D)
    assert "\n" not in str(info.value) and str(info.value).startswith("episodic memory state:")


def test_from_state_dict_rejects_keys_of_another_width():
    state = filled(stream(n_batches=2)).state_dict()
    with pytest.raises(ValueError, match=f"keys are {D} wide but the key encoder makes 768-wide keys"):
        EpisodicMemory.from_state_dict(state, key_dim=768)
    with pytest.raises(ValueError, match="expected a dict"):
        EpisodicMemory.from_state_dict([state])


def test_concat_is_the_memories_rows_in_order():
    """`concat` (every rank's share joined for a search over all): the rows of each memory in turn, as if
    written into one; keys of another width are refused."""
    from memoria_ds.episodic import EpisodicMemory, concat, write

    g = torch.Generator().manual_seed(3)

    def batch(n, t):
        ids = torch.randint(5, 50, (n, t), generator=g)
        mask = torch.ones(n, t, dtype=torch.long)
        mask[0, t - 2:] = 0  # one shorter example
        return torch.randn(n, 4, generator=g), ids, mask, torch.arange(n) % 3

    a_rows, b_rows = batch(3, 6), batch(2, 9)
    a = write(EpisodicMemory.empty(4), *a_rows, 0)
    b = write(EpisodicMemory.empty(4), *b_rows, 1)
    joined = concat([a, b, EpisodicMemory.empty(4)])
    expected = write(write(EpisodicMemory.empty(4), *a_rows, 0), *b_rows, 1)
    assert len(joined) == 5
    for name in ("keys", "input_ids", "lengths", "labels", "task_ids"):
        assert torch.equal(getattr(joined, name), getattr(expected, name)), name
    with pytest.raises(ValueError, match="key widths 4 and 8"):
        concat([a, EpisodicMemory.empty(8)])
