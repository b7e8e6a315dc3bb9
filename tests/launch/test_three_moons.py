"""benchmarks/three_moons.py: its memory against slow loops, its data, the paper's analytic
solution's behaviour (one unit needs lcm(p) observations, three units fewer), and a smoke run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bench_util import load_benchmark

moons_bench = load_benchmark("three_moons.py", "three_moons_benchmark")


def test_the_period_sets_are_the_references():
    """The 9 triples of {0.5..3.5} with the smallest lcm, ordered as numpy's argsort orders them."""
    train, val = moons_bench.period_sets()
    assert len(train) == 8 and val == (1.0, 2.0, 3.0) and val not in train
    assert train[moons_bench.TRAIN_SHOWN] == (0.5, 1.0, 2.5)
    assert moons_bench.lcm_tenths((0.5, 1.0, 2.5)) == 5.0 and moons_bench.lcm_tenths(val) == 6.0
    assert max(moons_bench.lcm_tenths(t) for t in train) <= 6.0


def test_observations_are_three_moons_on_their_circles():
    moons = moons_bench.Moons(120)
    x, y = moons.batch([moons.val], 3, np.random.default_rng(0))
    assert x.shape == y.shape == (3, 120, 6)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # y is x one step ahead
    z = torch.complex(x[..., 1::2].double(), x[..., 0::2].double())  # cos + i sin per moon
    torch.testing.assert_close(z.abs(), torch.ones(3, 120, 3, dtype=torch.float64), atol=1e-6, rtol=0)
    step = (z[:, 1:] / z[:, :-1]).angle()  # each moon turns by 2 pi / (period in steps) per observation
    _, periods = moons.in_steps(moons.val)
    want = torch.tensor([2 * math.pi / p for p in periods], dtype=torch.float64)
    torch.testing.assert_close(step, want.expand_as(step), atol=1e-5, rtol=0)


def test_complex_linear_is_complex_multiplication():
    lin = moons_bench.ComplexLinear(3, torch.Generator().manual_seed(0))
    x = torch.randn(5, 6)
    w = torch.complex(lin.re, lin.im).to(torch.complex64)
    want = torch.complex(x[:, 0::2], x[:, 1::2]) @ w.T
    out = lin(x)
    torch.testing.assert_close(torch.complex(out[:, 0::2], out[:, 1::2]), want, atol=1e-6, rtol=1e-6)
    assert sum(p.numel() for p in moons_bench.MoonMemory(3, 0).parameters()) == 54  # the paper's count


@pytest.mark.parametrize("heads", [1, 3])
def test_the_memory_reads_the_strict_past_by_kernel_smoothing(heads):
    """Eq. 3, one query at a time: z_T = W_z sum_{t<T} softmax_t(50 k_T.k_t) W_psi x_{t+1}; z_0 = 0."""
    model = moons_bench.MoonMemory(heads, 1)
    x = torch.randn(2, 9, 6)
    k = model.split(model.w_phi(x))
    v = model.split(model.w_psi(x))  # v_t is W_psi x_{t+1}: index t + 1 here
    y = torch.zeros(2, heads, 9, 6 // heads)
    for T in range(1, 9):
        w = torch.softmax(50 * k[:, :, T : T + 1] @ k[:, :, :T].transpose(-1, -2), -1)
        y[:, :, T] = (w @ v[:, :, 1 : T + 1])[:, :, 0]
    want = model.w_z(y.transpose(1, 2).reshape(2, 9, 6))
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    att = model.attention(x)
    assert torch.all(att[:, :, 0] == 0) and torch.allclose(att[:, :, 1:].sum(-1), torch.ones(2, heads, 8))
    assert torch.all(att.triu() == 0)


@pytest.mark.parametrize("heads", [1, 3])
def test_rollout_equals_rereading_the_whole_generated_sequence(heads):
    """The incremental rollout = feeding each prediction back and running the whole sequence again."""
    model = moons_bench.MoonMemory(heads, 2)
    x = torch.randn(2, 12, 6) * 0.5
    got = model.rollout(x, 7, 4)
    seq = x[:, :7]
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1:]], 1)
    torch.testing.assert_close(got, seq[:, 7:], atol=1e-5, rtol=1e-5)


def test_the_analytic_solution_one_unit_waits_for_the_lcm_three_units_do_not():
    """W_phi = W_psi = W_z = identity (the paper's analytic solution): one C^3 unit predicts only once
    a full set of configurations (lcm = 133 observations here) is stored; three C^1 units already
    do far better past the slowest period (67)."""
    moons = moons_bench.Moons(400)
    x, _ = moons.batch([moons.val], 16, np.random.default_rng(0))
    errors = {}
    for heads in (1, 3):
        model = moons_bench.MoonMemory(heads, 0)
        with torch.no_grad():
            for lin in (model.w_phi, model.w_psi, model.w_z):
                lin.re.copy_(torch.eye(3))
                lin.im.zero_()
        errors[heads] = moons_bench.generation_error(model, x, [80, 140], 25)
    assert errors[1][0] > 0.5 and errors[1][1] < 0.05  # the sharp transition after lcm
    assert errors[3][0] < 0.5 * errors[1][0]


@pytest.mark.slow
def test_smoke_run_writes_the_figure_and_the_numbers(tmp_path):
    results = moons_bench.main(["--iters", "3", "--block", "120", "--batch", "4", "--eval-batch", "4",
                                "--stride", "20", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "three_moons.json").read_text())
    assert (tmp_path / "three_moons.png").stat().st_size > 10_000
    assert set(saved["models"]) == {"1 head", "3 heads"} and saved["contexts"] == results["contexts"]
    for r in saved["models"].values():
        assert len(r["train_loss"]) == 3 and len(r["error_validation"]) == len(saved["contexts"])
        assert r["parameters"] == 54


def test_bad_arguments_stop_with_status_2():
    with pytest.raises(SystemExit) as e:
        moons_bench.main(["--block", "40"])
    assert e.value.code == 2
