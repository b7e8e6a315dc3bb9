"""The sorting generator: targets on hand-made inputs, seeding, the drift, the model's view."""

from __future__ import annotations

import numpy as np
import pytest

from memoria_ds.data import (
    SEPARATOR,
    generate_sorting,
    generate_sorting_example,
    input_length_for,
    sorting_dataset,
    sorting_sequence,
    sorting_target,
)


@pytest.mark.parametrize(
    "symbols,head",
    [
        ([3, 1, 3, 1, 2, 5], [3, 1, 2, 5]),  # 3 and 1 tie at two: 3 was seen first
        ([1, 3, 3, 1, 2, 5], [1, 3, 2, 5]),  # ... and here 1 was
        ([7, 7, 7, 0, 0, 19], [7, 0, 19]),
        ([4], [4]),
    ],
)
def test_target_by_count_then_first_occurrence_then_absent_ascending(symbols, head) -> None:
    target = sorting_target(np.array(symbols))
    absent = [s for s in range(20) if s not in symbols]
    assert target.tolist() == head + absent


def test_target_matches_counter_most_common_like_infinity_former() -> None:
    from collections import Counter

    rng = np.random.default_rng(0)
    for _ in range(50):
        seq = rng.integers(0, 20, rng.integers(1, 60)).tolist()
        ref = [s for s, _ in Counter(seq).most_common()]
        ref += [s for s in range(20) if s not in ref]
        assert sorting_target(np.array(seq)).tolist() == ref


def test_seeding_reproduces_and_separates(tmp_path) -> None:
    a = generate_sorting(6, 50, seed=3, cache_dir=str(tmp_path / "a"))
    b = generate_sorting(6, 50, seed=3, num_proc=2, cache_dir=str(tmp_path / "b"))  # fresh cache, 2 workers
    assert a["symbols"] == b["symbols"] and a["target"] == b["target"]
    c = generate_sorting(6, 50, seed=4, cache_dir=str(tmp_path / "c"))
    assert a["symbols"] != c["symbols"]
    val = generate_sorting(6, 50, seed=3, split="validation", cache_dir=str(tmp_path / "d"))
    assert a["symbols"] != val["symbols"], "splits never share examples"
    row = a[2]
    assert len(row["symbols"]) == 50 and row["index"] == 2
    assert row["target"] == sorting_target(np.array(row["symbols"])).tolist()
    symbols, target = generate_sorting_example(50, np.random.default_rng([3, 0, 2]))
    assert symbols.tolist() == row["symbols"] and target.tolist() == row["target"]


def test_symbol_frequencies_drift_from_p_start_to_p_end() -> None:
    length = 400_000
    rng = np.random.default_rng(11)
    symbols, _ = generate_sorting_example(length, rng)
    replay = np.random.default_rng(11)  # the same draws as the generator's first two
    p_start = replay.integers(1, 10, 20).astype(float)
    p_end = replay.integers(1, 10, 20).astype(float)
    p_start, p_end = p_start / p_start.sum(), p_end / p_end.sum()
    window = 20_000
    for lo in (0, length // 2 - window // 2, length - window):
        r = (np.arange(lo, lo + window) + 1) / length
        expected = ((1 - r)[:, None] * p_start + r[:, None] * p_end).mean(axis=0)
        observed = np.bincount(symbols[lo : lo + window], minlength=20) / window
        assert np.abs(observed - expected).max() < 0.01  # ~5 standard errors at this window


def test_model_view_and_lengths() -> None:
    symbols, target = np.array([2, 2, 0]), sorting_target(np.array([2, 2, 0]))
    input_ids, targets = sorting_sequence(symbols, target)
    assert input_ids.tolist() == [2, 2, 0, SEPARATOR] + target[:-1].tolist()
    assert targets.tolist() == [-100, -100, -100] + target.tolist()
    assert input_ids.size == targets.size == 3 + 20
    assert input_length_for(4, 1024) == 4076 and input_length_for(4, 1024) + 20 == 4 * 1024
    with pytest.raises(ValueError, match="cannot hold"):
        input_length_for(1, 10)


def test_sorting_dataset_splits(tmp_path) -> None:
    dsd = sorting_dataset(30, num_train=4, num_validation=2, num_test=0, cache_dir=str(tmp_path))
    assert {k: len(v) for k, v in dsd.items()} == {"train": 4, "validation": 2}
    with pytest.raises(ValueError, match="split"):
        generate_sorting(2, 5, split="dev")
