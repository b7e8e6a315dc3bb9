"""benchmarks/real_text.py with the field's memories: `memorizing` trains as a variant, and its
`--knn-lm` scores are the evaluation's kNN-LM (memoria_ds.eval.evaluate_lm) on the same windows."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

from memoria_ds.data import TokenCorpus
from memoria_ds.eval import evaluate_lm, full_protocol
from memoria_ds.eval.knn_lm import KNNLMSettings
from memoria_ds.model import build_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("real_text_benchmark", ROOT / "benchmarks" / "real_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["memorizing", "memoria", "transformer"])
def test_knn_lm_scores_of_a_window_are_the_evaluations(bench, preset):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_layer=2, n_embd=16, n_head=2)
    own = {"memory_settings": {"memorizing": {"size": 12, "topk": 4}}} if preset == "memorizing" else {}
    model = build_model(config, preset, memory_init="random", **own,
                        memoria={"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 4})
    base = torch.randint(0, 40, (9,)).tolist()
    docs = [base * 3 + torch.randint(0, 40, (30,)).tolist()]
    a = argparse.Namespace(eval_segments=3, segment=8, eval_windows=0, eval_batch=2)
    knn = KNNLMSettings(k=6, lmbda=0.4)
    sums = bench.score(model, docs, a, knn=knn)
    plain = bench.score(model, docs, a)
    windows = bench.eval_windows(docs, 25)
    want = [evaluate_lm(model, TokenCorpus.from_token_lists([w]), full_protocol(8, 1), progress=False, knn=knn)
            for w in windows]
    assert sum(n for _, n in sums) == sum(r.scored_tokens for r in want) == 24 * len(windows)
    assert sum(s for s, _ in sums) == pytest.approx(sum(r.nll_sum for r in want), rel=1e-5)
    assert sum(s for s, _ in plain) == pytest.approx(sum(r.knn_lm["lm_nll"] * r.scored_tokens for r in want), rel=1e-5)
    assert sums[0][0] != plain[0][0]


def test_memorizing_is_a_variant(bench):
    preset, settings, _ = bench.parse_variant("memorizing+memory_settings={'size':256,'topk':8}")
    assert preset == "memorizing" and settings == {"memory_settings": {"size": 256, "topk": 8}}


@pytest.mark.parametrize("preset", ["xl", "xl+memoria"])
def test_a_text_read_whole_is_its_windows_where_it_is_one_window(bench, preset):
    """`--whole` reads each text as one stream through the evaluator; a text of exactly one window
    scores what the windows score, with its memory and reset before every segment."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_layer=2, n_embd=16, n_head=2)
    model = build_model(config, preset, memory_init="random", segment_length=8,
                        memoria={"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 4})
    docs = [torch.randint(0, 40, (25,), generator=torch.Generator().manual_seed(1)).tolist()]  # 3 segments + 1
    a = argparse.Namespace(eval_segments=3, segment=8, eval_windows=0, eval_batch=2)
    whole = bench.score_whole(model, {"t": docs}, a)
    for protocol, use_memory in (("full", True), ("memoryless", False)):
        sums = bench.score(model, docs, a, use_memory=use_memory)
        nll, n = whole["nll_sums"]["t"][protocol]
        assert n == sum(k for _, k in sums) == 24
        assert nll == pytest.approx(sum(s for s, _ in sums), rel=1e-5), protocol
    assert whole["memory_gain"] == pytest.approx(whole["memory_gain_by_text"]["t"]) and whole["memory_gain"] != 0
