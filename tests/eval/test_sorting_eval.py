"""Sorting accuracy: scored positions, memory across segments, reset per example."""

from __future__ import annotations

import pytest
from known_models import SortingOracle

from memoria_ds.data import generate_sorting
from memoria_ds.eval import evaluate_sorting


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
