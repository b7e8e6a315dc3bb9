"""The sorting task (paper 4.1 and Appendix B.1, from the infinity-former paper).

One example, as SPEC section 3 describes it:

1. Draw two weight vectors over the 20 symbols, each entry an integer in 1..9,
   normalised: `p_start`, `p_end`.
2. Symbol j (0-based) of the L-symbol input is drawn from `(1 - r) p_start + r p_end`,
   `r = (j + 1) / L`: the symbol frequencies drift from one distribution to the other.
3. The target: the 20 symbols by descending count in the input; equal counts in the order
   of first occurrence; symbols that never occurred appended in ascending order.

The model reads `input symbols, SEP (id 20), target[0..18]` (L + 20 tokens, vocabulary 21)
and is scored on predicting `target[0..19]` at the positions of SEP and target[0..18]
(teacher forcing), the authors' formulation (`input_ids = prompt + target[:-1]`,
`labels = [-100] * (len(prompt) - 1) + target`). Accuracy = correct argmax predictions over
those 20 positions, summed over examples.

Relation to infinity-former's `sorting/generate_data.py`: the same distributions, drift and
target rule (its `Counter.most_common()` breaks ties by first occurrence, and it appends the
absent symbols in ascending order). Differences: that script draws from numpy's unseeded
global generator, one symbol at a time; here every example has its own generator seeded by
`(seed, split, index)` (`numpy.random.default_rng`), so a dataset is reproducible, identical
for any `num_proc`, and any example can be regenerated alone. The symbols are drawn by
inverse-CDF sampling (the method of `numpy.random.choice`), vectorised over positions.
Its files are text lines `x_1 ... x_L 20 t_1 ... t_20`; here a `datasets.Dataset`.

Lengths: the paper counts an example's length in segments (4 segments of 1024 = 4K);
`input_length_for(num_segments, segment_length)` gives L so that the L + 20 model tokens
exactly fill that many segments.
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import numpy as np

NUM_SYMBOLS = 20
SEPARATOR = 20
VOCAB_SIZE = 21
MAX_WEIGHT = 9
_SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}


def sorting_target(symbols: np.ndarray, num_symbols: int = NUM_SYMBOLS) -> np.ndarray:
    """The target of an input: symbols by descending count, ties by first occurrence, absent ones ascending.

    Args:
        symbols: (L,) integer symbols in [0, num_symbols).

    Returns:
        (num_symbols,) int64, a permutation of 0..num_symbols-1.
    """
    symbols = np.asarray(symbols, dtype=np.int64)
    counts = np.bincount(symbols, minlength=num_symbols)
    first = np.full(num_symbols, symbols.size, dtype=np.int64) + np.arange(num_symbols)  # absent: after all, ascending
    order = np.argsort(symbols, kind="stable")  # equal symbols keep their positions' order
    sorted_syms = symbols[order]
    is_first = np.r_[True, sorted_syms[1:] != sorted_syms[:-1]] if symbols.size else np.zeros(0, bool)
    first[sorted_syms[is_first]] = order[is_first]  # first occurrence of each present symbol
    return np.lexsort((first, -counts)).astype(np.int64)


def generate_sorting_example(
    input_length: int, rng: np.random.Generator, num_symbols: int = NUM_SYMBOLS, max_weight: int = MAX_WEIGHT
) -> tuple[np.ndarray, np.ndarray]:
    """One example: (L,) input symbols and their (num_symbols,) target, drawn from `rng`."""
    p_start = rng.integers(1, max_weight + 1, num_symbols).astype(np.float64)
    p_end = rng.integers(1, max_weight + 1, num_symbols).astype(np.float64)
    p_start /= p_start.sum()
    p_end /= p_end.sum()
    r = (np.arange(input_length) + 1.0) / input_length  # (L,)
    cdf = np.cumsum((1.0 - r)[:, None] * p_start + r[:, None] * p_end, axis=1)  # (L, S)
    u = rng.random(input_length) * cdf[:, -1]
    symbols = (u[:, None] >= cdf).sum(axis=1)  # inverse CDF: first symbol whose cdf exceeds u
    symbols = np.minimum(symbols, num_symbols - 1)
    return symbols.astype(np.int64), sorting_target(symbols, num_symbols)


def sorting_sequence(symbols: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The model's view of an example.

    Returns:
        input_ids (L + 20,) `symbols, SEP, target[:-1]`; targets (L + 20,) aligned (the
        target of position i is `targets[i]`): -100 on the input symbols, `target` on the
        positions of SEP and target[:-1].
    """
    symbols, target = np.asarray(symbols, np.int64), np.asarray(target, np.int64)
    input_ids = np.concatenate([symbols, [SEPARATOR], target[:-1]])
    targets = np.concatenate([np.full(symbols.size, -100, np.int64), target])
    return input_ids, targets


def input_length_for(num_segments: int, segment_length: int, num_symbols: int = NUM_SYMBOLS) -> int:
    """L such that the L + 20 model tokens fill exactly `num_segments` segments."""
    length = num_segments * segment_length - num_symbols
    if length < 1:
        raise ValueError(f"{num_segments} segments of {segment_length} cannot hold the {num_symbols}-symbol answer")
    return length


def _examples(shards: list[tuple[int, int, int, int, int]]) -> Iterator[dict[str, np.ndarray]]:
    for seed, split_id, start, stop, length in shards:
        for index in range(start, stop):
            symbols, target = generate_sorting_example(length, np.random.default_rng([seed, split_id, index]))
            yield {"index": index, "symbols": symbols.astype(np.int8), "target": target.astype(np.int8)}


def generate_sorting(
    num_examples: int,
    input_length: int,
    *,
    seed: int = 0,
    split: str = "train",
    num_proc: int | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """`num_examples` seeded sorting examples as a `datasets.Dataset` (cached by `datasets`).

    Args:
        num_examples: rows.
        input_length: L, input symbols per example (see `input_length_for`).
        seed: the dataset seed; example i of split s is drawn from
            `default_rng([seed, s, i])`, so splits never share examples.
        split: "train", "validation" or "test" (part of each example's seed).
        num_proc: generator processes; the data do not depend on it.
        cache_dir: `datasets` cache directory.

    Returns:
        Columns `index` (int64), `symbols` (L int8), `target` (20 int8). Turn a row into
        model inputs with `sorting_sequence(row["symbols"], row["target"])`.
    """
    if split not in _SPLIT_IDS:
        raise ValueError(f"`split` must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
    if num_examples < 1 or input_length < 1:
        raise ValueError(f"need num_examples >= 1 and input_length >= 1, got {num_examples}, {input_length}")
    n_shards = max(1, num_proc or 1)
    bounds = np.linspace(0, num_examples, n_shards + 1).astype(int)
    shards = [(seed, _SPLIT_IDS[split], int(a), int(b), input_length) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    features = datasets.Features({
        "index": datasets.Value("int64"),
        "symbols": datasets.List(datasets.Value("int8")),
        "target": datasets.List(datasets.Value("int8")),
    })
    fingerprint = datasets.fingerprint.Hasher.hash(["sorting/1", seed, split, num_examples, input_length])
    return datasets.Dataset.from_generator(
        _examples, features=features, gen_kwargs={"shards": shards}, num_proc=num_proc if len(shards) > 1 else None,
        fingerprint=fingerprint, cache_dir=cache_dir, split=split,
    )


def sorting_dataset(
    input_length: int,
    *,
    num_train: int = 80_000,
    num_validation: int = 1_000,
    num_test: int = 1_000,
    seed: int = 0,
    num_proc: int | None = None,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """Train / validation / test sorting splits (the paper trains on 80,000 examples)."""
    sizes = {"train": num_train, "validation": num_validation, "test": num_test}
    return datasets.DatasetDict({
        split: generate_sorting(n, input_length, seed=seed, split=split, num_proc=num_proc, cache_dir=cache_dir)
        for split, n in sizes.items() if n > 0
    })
