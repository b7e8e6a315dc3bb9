"""Figure data from memory states against hand computations, the evaluation trace, and the plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from memoria_ds.analysis import plots
from memoria_ds.analysis.memory_data import (MemorySnapshot, edge_weights_by_age, lifespans_by_kind, load_memory,
                                             ltm_creation_percent, mean_by_age, memoria_config_of_run)
from memoria_ds.eval.trace import MemoryTrace, read_trace
from memoria_ds.data import TokenCorpus
from memoria_ds.eval import evaluate_lm, full_protocol, paper_protocol
from memoria_ds.memory import MemoriaConfig, MemoryState
from memoria_ds.memory.state import EMPTY, LTM, STM
from memoria_ds.safe_io import save_tree

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one thread is ~30x faster than two contending ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def snapshot() -> MemorySnapshot:
    """One row, 8 slots: five live engrams written at steps 0, 0, 1, 1, 3 (N_wm = 2), a dead slot
    with stale counts, four steps taken."""
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=1, num_ltm_reminded=1, stm_capacity=2, capacity=8)
    s = MemoryState.empty(cfg, batch_size=1, dim=4)
    s.kind[0, :6] = torch.tensor([LTM, LTM, STM, LTM, STM, EMPTY], dtype=torch.int8)
    s.uid[0, :6] = torch.tensor([0, 1, 2, 3, 6, -1])  # a dead slot's uid is -1, as the engine leaves it
    s.lifespan[0, :5] = torch.tensor([3.0, 1.0, 7.5, 2.0, 8.0])
    c = torch.zeros(8, 8, dtype=s.counts.dtype)
    for i, n in enumerate([2, 1, 3, 1, 1]):
        c[i, i] = n
    c[0, 1] = c[1, 0] = 1
    c[0, 2] = c[2, 0] = 2
    c[3, 4] = c[4, 3] = 1
    c[5, 0] = c[0, 5] = 7  # slot 5 is dead: its stale counts must not count
    s.counts[0] = c
    s.step[0] = 4
    return MemorySnapshot(s, cfg, "hand-built")


def test_ltm_creation_percent(snapshot):
    # LTM slots 0, 1, 3 were written at steps 0, 0, 1 of 4
    assert sorted(ltm_creation_percent(snapshot).tolist()) == [0.0, 0.0, 25.0]


def test_edge_weights_against_a_plain_double_loop(snapshot):
    age, weight = edge_weights_by_age(snapshot)
    created = [0, 0, 1, 1, 3]
    c = snapshot.state.counts[0].double()
    want = sorted((abs(created[i] - created[j]), float(c[i, j] / c[i, i])) for i in range(5) for j in range(5) if i != j)
    assert sorted(zip(age.tolist(), weight.tolist())) == want
    ages, mean, n = mean_by_age(age, weight)
    # age 0: pairs (0,1), (1,0), (2,3), (3,2) with weights 1/2, 1, 0, 0
    assert ages.tolist() == [0, 1, 2, 3] and n.tolist() == [4, 8, 4, 4]
    assert mean[0] == pytest.approx((0.5 + 1.0) / 4)
    # age 1: (0,2) = 2/2 and (2,0) = 2/3, six unlinked
    assert mean[1] == pytest.approx((1.0 + 2 / 3) / 8)


def test_lifespans_by_kind(snapshot):
    got = lifespans_by_kind(snapshot)
    assert sorted(got["ltm"].tolist()) == [1.0, 2.0, 3.0] and sorted(got["stm"].tolist()) == [7.5, 8.0]
    assert got["wm"].size == 0


def test_memoria_config_of_a_run_follows_the_preset():
    run = {"model": {"preset": "memoria_wm_stm", "settings": {"memoria": {"num_wm": 8, "stm_capacity": 16,
                                                                          "num_stm_reminded": 8}}}}
    cfg = memoria_config_of_run(run)
    assert (cfg.num_wm, cfg.use_ltm, cfg.use_stm) == (8, False, True)
    with pytest.raises(ValueError, match="no Memoria memory"):
        memoria_config_of_run({"model": {"preset": "xl", "settings": {}}})


def test_checkpoint_shard_is_read_with_its_manifest(tmp_path, snapshot):
    from memoria_ds.model import MemoriaMemory

    memory = MemoriaMemory(prev_hidden=torch.zeros(1, 3, 4), prev_mask=torch.ones(1, 3, dtype=torch.bool),
                           state=snapshot.state)
    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    save_tree({"stream_ids": [0, 1], "micro_batch_size": 1, "memory": [memory.state_dict(), memory.state_dict()],
               "step": 4}, step / "rank_00000.safetensors")
    mem = snapshot.config.to_dict()
    (step / "manifest.json").write_text(json.dumps({"meta": {"config": {"model": {"preset": "memoria", "settings": {
        "memoria": {k: mem[k] for k in ("num_wm", "num_stm_reminded", "num_ltm_reminded", "stm_capacity",
                                         "capacity")}}}}}}))
    loaded = load_memory(step / "rank_00000.safetensors")
    assert loaded.state.batch_size == 2 and torch.equal(loaded.state.counts[1], snapshot.state.counts[0])
    assert sorted(ltm_creation_percent(loaded).tolist()) == [0.0, 0.0, 0.0, 0.0, 25.0, 25.0]
    with pytest.raises(ValueError, match="neither a memory trace state nor a checkpoint shard"):
        save_tree({"x": 1}, tmp_path / "other.safetensors")
        load_memory(tmp_path / "other.safetensors")


def test_trace_records_every_segment_and_saves_the_final_memory(tmp_path, tiny_gpt2_config):
    from memoria_ds.model import build_model

    model = build_model(tiny_gpt2_config, "memoria", memoria={"num_wm": 4, "num_stm_reminded": 4,
                                                               "num_ltm_reminded": 4, "stm_capacity": 4})
    g = torch.Generator().manual_seed(0)
    corpus = TokenCorpus.from_token_lists([torch.randint(0, 257, (300,), generator=g).tolist()],
                                          metadata={"corpus": "toy", "split": "test"})
    trace = MemoryTrace(tmp_path / "t.jsonl", state_path=tmp_path / "m.safetensors", memoria_config=model.config.memoria_config,
                        graph_every=5)
    with trace:
        traced = evaluate_lm(model, corpus, paper_protocol(16), on_step=trace, progress=False)
    plain = evaluate_lm(model, corpus, paper_protocol(16), progress=False)
    assert traced.nll_sum == plain.nll_sum  # tracing changes nothing
    records = read_trace(tmp_path / "t.jsonl")
    assert [r["step"] for r in records] == list(range(traced.steps)) == list(range(19))
    assert "memory/graph_degree" in records[5] and "memory/graph_degree" not in records[6]
    # with C_stm = K_stm = N_wm the whole STM is reminded each step and the previous step's engrams are in
    # LTM with an edge to it: from the fourth segment on, LTM engrams are reminded
    ages = [r["memory/reminded_ltm_age"] for r in records]
    assert all(math.isnan(a) for a in ages[:3]) and all(a >= 2 for a in ages[3:])
    snap = load_memory(tmp_path / "m.safetensors")
    # 19 segments, 18 memory steps: the first segment has no previous one, its row is reset after it
    assert int(snap.state.step[0]) == 18 and snap.config == model.config.memoria_config
    assert (snap.state.kind == LTM).sum().item() == records[-1]["memory/ltm"]
    # a baseline model has no memory statistics: the trace keeps the steps only
    base = build_model(tiny_gpt2_config, "xl")
    with MemoryTrace(tmp_path / "xl.jsonl") as t:
        evaluate_lm(base, corpus, full_protocol(16, 1), on_step=t, progress=False, max_steps=3)
    assert read_trace(tmp_path / "xl.jsonl") == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_plots_write_png_and_their_data(tmp_path, snapshot):
    age, weight = edge_weights_by_age(snapshot)
    paths = [
        plots.reminded_ltm_age([0, 1, 2, 3], [math.nan, 2.0, 2.5, 3.0], tmp_path / "f5.png"),
        plots.ltm_creation(ltm_creation_percent(snapshot), tmp_path / "f6.png", bins=4),
        plots.edge_weight_age(age, weight, tmp_path / "f8.png"),
        plots.edge_weight_zoom(age, weight, tmp_path / "f9.png", max_age=2),
        plots.memory_kinds([{"step": 1, "memory/wm": 0, "memory/stm": 4, "memory/ltm": 2, "memory/evicted": 0}],
                           tmp_path / "k.png"),
        plots.lifespans(lifespans_by_kind(snapshot), tmp_path / "l.png"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.with_suffix(".csv").is_file()
    f6 = (tmp_path / "f6.csv").read_text().splitlines()
    assert f6[1:] == ["0.0,25.0,2", "25.0,50.0,1", "50.0,75.0,0", "75.0,100.0,0"]
    f9 = (tmp_path / "f9.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in f9[1:]] == ["0", "1", "2"]  # ages up to max_age only
    f8 = np.loadtxt(tmp_path / "f8.csv", delimiter=",", skiprows=1)
    assert f8[:, 2].sum() == len(age)  # every pair counted once
    # empty inputs still give a labelled figure, not an error
    assert plots.reminded_ltm_age([0, 1], [math.nan, math.nan], tmp_path / "e5.png").is_file()
    assert plots.ltm_creation(np.array([]), tmp_path / "e6.png").is_file()
    assert plots.edge_weight_age(np.array([], dtype=np.int64), np.array([]), tmp_path / "e8.png").is_file()
