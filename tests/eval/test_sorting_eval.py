"""Sorting accuracy: scored positions, memory across segments, reset per example."""

from __future__ import annotations

import pytest
from known_models import SortingOracle

from memoria_ds.data import generate_sorting
from memoria_ds.eval import evaluate_sorting, memory_gain


@pytest.fixture(scope="module")
def sorting(tmp_path_factory):
    return generate_sorting(7, 45, seed=9, cache_dir=str(tmp_path_factory.mktemp("s")))


@pytest.mark.parametrize("segment_length", [8, 13, 65, 100])
def test_an_oracle_that_remembers_every_segment_is_perfect(sorting, segment_length: int) -> None:
    r = evaluate_sorting(SortingOracle(), sorting, segment_length=segment_length, batch_size=3, progress=False)
    assert r.scored_tokens == 20 * len(sorting)  # the padding rows of the last batch score nothing
    assert r.correct == r.scored_tokens and r.accuracy == 1.0
    assert r.protocol["name"] == "sorting" and r.protocol["reset"]["at_document_start"]
    assert r.data["example_length"] == 65


def test_forgetting_earlier_segments_costs_accuracy(sorting) -> None:
    r = evaluate_sorting(SortingOracle(forget=True), sorting, segment_length=8, progress=False)
    assert r.scored_tokens == 140 and r.accuracy < 0.5


def test_memory_does_not_leak_across_examples(sorting) -> None:
    # One example per batch: without the reset at each example's first segment the oracle
    # would count the previous example's symbols (and its answer) too.
    r = evaluate_sorting(SortingOracle(), sorting, segment_length=10, batch_size=1, progress=False)
    assert r.accuracy == 1.0


@pytest.mark.parametrize("segment_length", [8, 13])
def test_memoryless_reads_each_segment_alone(sorting, segment_length: int) -> None:
    # reset before every segment = an oracle that forgets at every segment, number for number
    bare = evaluate_sorting(SortingOracle(), sorting, segment_length=segment_length, batch_size=3, progress=False,
                            memoryless=True)
    forgetful = evaluate_sorting(SortingOracle(forget=True), sorting, segment_length=segment_length, batch_size=3,
                                 progress=False)
    assert (bare.correct, bare.scored_tokens, bare.nll_sum) == (forgetful.correct, forgetful.scored_tokens,
                                                                forgetful.nll_sum)
    assert bare.protocol["memoryless"] and bare.protocol["reset"]["policy"] == "every:1"
    full = evaluate_sorting(SortingOracle(), sorting, segment_length=segment_length, batch_size=3, progress=False)
    assert not full.protocol["memoryless"]
    gain = memory_gain([full, bare])
    assert (gain.accuracy_with, gain.accuracy_without) == (1.0, bare.accuracy) and bare.accuracy < 1.0
    assert gain.nats_per_token == bare.nll - full.nll > 0
    assert gain.describe().startswith(f"memory gain test: {gain.nats_per_token:+.4f} nats/answer symbol (accuracy "
                                      f"1.0000 with the memory, {bare.accuracy:.4f} with it reset")
