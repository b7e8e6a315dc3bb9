"""Evaluation over 2 real gloo ranks gives the single-process totals exactly."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from known_models import CountingMemoryLM, SortingOracle

from memoria_ds.data import TokenCorpus, generate_sorting
from memoria_ds.eval import evaluate_lm, evaluate_sorting, full_protocol, paper_protocol

W = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4])


def toy_corpus() -> TokenCorpus:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 5, (n,), generator=g).tolist() for n in (23, 9, 31, 14)]
    return TokenCorpus.from_token_lists(docs, metadata={"corpus": "toy", "split": "test"})


def _run(rank: int, world: int, port: int, out_dir: str, sorting_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        c = toy_corpus()
        results = {
            "full4": evaluate_lm(CountingMemoryLM(W), c, full_protocol(5, 4, "document_start"), progress=False),
            "paper": evaluate_lm(CountingMemoryLM(W), c, paper_protocol(5), progress=False),
            "sorting": evaluate_sorting(SortingOracle(), generate_sorting(5, 23, seed=2, cache_dir=sorting_dir),
                                        segment_length=8, batch_size=4, progress=False),
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({k: v.to_dict() for k, v in results.items()}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
def test_two_ranks_reduce_to_the_single_process_totals(tmp_path) -> None:
    sorting_dir = str(tmp_path / "sorting")
    generate_sorting(5, 23, seed=2, cache_dir=sorting_dir)  # build the cache once, before the ranks read it
    mp.spawn(_run, args=(2, _free_port(), str(tmp_path), sorting_dir), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    c = toy_corpus()
    single = {
        "full4": evaluate_lm(CountingMemoryLM(W), c, full_protocol(5, 4, "document_start"), progress=False),
        "paper": evaluate_lm(CountingMemoryLM(W), c, paper_protocol(5), progress=False),
        "sorting": evaluate_sorting(SortingOracle(), generate_sorting(5, 23, seed=2, cache_dir=sorting_dir),
                                    segment_length=8, batch_size=4, progress=False),
    }
    for key, ref in single.items():
        for got in ranks:
            r = got[key]
            assert r["world_size"] == 2
            assert r["scored_tokens"] == ref.scored_tokens and r["input_tokens"] == ref.input_tokens
            assert r["nll_sum"] == pytest.approx(ref.nll_sum, rel=1e-12)
            assert r["correct"] == ref.correct
    assert ranks[0]["paper"]["notes"] == ["one stream read by each of 2 ranks, counted once"]
    assert ranks[0]["sorting"]["accuracy"] == 1.0
