"""benchmarks/memory_quality.py: its task is what it says, its bound is right, and it runs."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from bench_util import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def load_probe():
    return load_benchmark("memory_quality.py", "memory_quality")  # it imports model_step's variant names


def args(**kw) -> argparse.Namespace:
    base = dict(vocab=64, topic=4, p_topic=0.9, segment=8, segments=3)
    base.update(kw)
    return argparse.Namespace(**base)


def test_documents_follow_their_topic():
    probe = load_probe()
    a = args()
    docs = probe.documents(400, a, seed=0)
    assert docs.shape == (400, 24) and docs.dtype == torch.int64
    assert torch.equal(docs, probe.documents(400, a, seed=0))  # seeded
    # the most frequent `topic` tokens of a document carry about p_topic + (1-p_topic)*topic/vocab of it
    counts = torch.stack([torch.bincount(d, minlength=a.vocab) for d in docs])
    share = counts.topk(a.topic, dim=1).values.sum(dim=1).float() / docs.shape[1]
    assert 0.85 < share.mean().item() < 0.98
    assert docs.min() >= 0 and docs.max() < a.vocab


def test_bound_is_the_entropy_of_the_topic_mixture():
    probe = load_probe()
    a = args()
    p = torch.full((a.vocab,), (1 - a.p_topic) / a.vocab)
    p[: a.topic] += a.p_topic / a.topic
    assert math.isclose(probe.bound_nll(a), -(p * p.log()).sum().item(), rel_tol=1e-6)


def test_probe_runs_end_to_end(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_quality.py"), "--variants", "transformer,memoria",
           "--train-docs", "32", "--eval-docs", "16", "--segments", "3", "--segment", "8", "--width", "32",
           "--heads", "2", "--num-wm", "2", "--vocab", "64", "--topic", "4", "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == ["transformer", "memoria"]
    bound = load_probe().bound_nll(args())
    for r in results:
        # a per-token NLL of the 64-token vocabulary after a few steps: between the topic-known
        # bound (1.95) and a little above uniform (ln 64 = 4.16); a sum or a wrong vocabulary is not
        assert len(r["nll_per_segment"]) == 3
        assert all(bound < v < math.log(64) + 0.5 for v in r["nll_per_segment"]), r["nll_per_segment"]
        assert math.isclose(r["nll_later"], sum(r["nll_per_segment"][1:]) / 2)


def _writer_after_training(probe, bptt: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    a = args(bptt=bptt, layers=2, width=32, heads=2, num_wm=2, init="random", segments=4, batch=4)
    model = probe.make_model("memformer", a, seed=0).train()
    before = model.memory_net.write_query.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: steps.append(i) or 1.0)
    probe.run_documents(model, probe.documents(4, a, seed=0), a, True, opt, sched)
    return before, model.memory_net.write_query.weight.detach(), len(steps) - 1  # LambdaLR calls once at init


def test_a_span_of_segments_trains_memformers_writer_and_counts_its_updates():
    probe = load_probe()
    before, after, updates = _writer_after_training(probe, bptt=1)
    assert torch.equal(before, after) and updates == 4, "one segment per update: no loss reaches the write"
    before, after, updates = _writer_after_training(probe, bptt=3)
    assert not torch.equal(before, after), "a span of 3: the later segments' losses train the writer"
    assert updates == 2 == probe.updates_per_document(args(bptt=3, segments=4)), "spans of 3 and 1"
