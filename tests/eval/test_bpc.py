"""enwik8 end to end: bytes -> 204 symbols -> streams -> bits per character."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from known_models import UnigramLM

from memoria_ds.data import ENWIK8_SYMBOLS, prepare_corpus
from memoria_ds.eval import evaluate_lm, evaluate_protocols, full_protocol

RAW = np.array(ENWIK8_SYMBOLS + (10,), dtype=np.uint8)[np.random.default_rng(0).integers(0, 205, 3_000)].tobytes()


@pytest.fixture(scope="module")
def enwik8_like(tmp_path_factory):
    path = tmp_path_factory.mktemp("enwik8") / "enwik8"
    path.write_bytes(RAW)
    return prepare_corpus("enwik8", path=path, num_test_bytes=500)


def test_uniform_model_scores_log2_204_bits_per_character(enwik8_like) -> None:
    test = enwik8_like["test"]
    assert test.metadata["unit"] == "character" and test.metadata["vocab_size"] == 204
    assert not test.metadata["eos_between_documents"]
    uniform = UnigramLM(torch.full((204,), 1 / 204))
    paper, full = evaluate_protocols(uniform, test, ("paper", "full"), segment_length=512, progress=False)
    for r in (paper, full):
        assert r.bpc == pytest.approx(math.log2(204), rel=1e-6)
        assert r.data["corpus"] == "enwik8" and r.split == "test"
    # The test split is the last 500 bytes less their newlines (the paper's 204 symbols).
    assert test.num_tokens == 500 - RAW[-500:].count(b"\n") < 500
    assert full.scored_tokens == test.num_tokens - 1


def test_bpc_normalises_by_scored_characters(enwik8_like) -> None:
    valid = enwik8_like["validation"]
    p = torch.rand(204, generator=torch.Generator().manual_seed(0)) + 0.5
    p = p / p.sum()
    r = evaluate_lm(UnigramLM(p), valid, full_protocol(64, 2), progress=False)
    t = np.asarray(valid.tokens, dtype=np.int64)
    expected_bits = -np.log2(p.double().numpy()[t[1:]]).sum()
    assert r.bpc == pytest.approx(expected_bits / (t.size - 1), rel=1e-6)
