"""benchmarks/model_step.py --ops: the `compute` column leaves out exactly the operations that launch no kernel."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_util import load_benchmark


def test_views_are_metadata_and_kernels_are_not():
    bench = load_benchmark("model_step.py", "model_step_bench")
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, bench.is_metadata_only(func)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(4, 5)
    with Record():
        y = x.transpose(0, 1).reshape(3, 8)  # transpose is a view; reshape of a transposed tensor copies
        z = (x.view(6, 4) @ w).t().unsqueeze(0).detach()
        z = torch.where(z > 0, z, 0.0).sum()
    got = dict(seen)
    for name in ("transpose", "view", "t", "unsqueeze", "detach", "_unsafe_view"):
        assert got[name] is True, name
    for name in ("clone", "mm", "gt", "where", "sum"):
        assert got[name] is False, name
    assert y.shape == (3, 8) and z.dim() == 0


def test_a_variant_that_fails_is_left_out_and_the_others_are_measured(monkeypatch, tmp_path, capsys):
    # on an H200 one compiled variant's failure (a Triton compile error) lost the whole
    # `gpt2` table: the failure is now reported beside the others' figures, exit status 1
    import json
    import sys

    bench = load_benchmark("model_step.py", "model_step_bench_failing")
    real_step = bench.Runner.step

    def step(self, timed):
        if self.name == "xl":
            raise RuntimeError("at 28:4:\n    tl.atomic_add(out_ptr0 + tmp4, tmp20)\n\natomic_add does not support int16")
        return real_step(self, timed)

    monkeypatch.setattr(bench.Runner, "step", step)
    out = tmp_path / "steps.json"
    monkeypatch.setattr(sys, "argv", ["model_step.py", "--shape", "small", "--segment", "8", "--rounds", "1",
                                      "--warmup", "1", "--variants", "transformer,xl,memoria", "--json", str(out)])
    assert bench.main() == 1
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["results"]] == ["transformer", "memoria"]
    # a Triton error's cause is its last line, its first says where: both are kept, with the
    # innermost frame of ours and the whole traceback (on an H200 a bare `AssertionError:` was all)
    failure = data["failed"]["xl"]
    assert failure["error"] == "RuntimeError: at 28:4: ... atomic_add does not support int16"
    assert failure["where"].startswith("benchmarks/model_step.py:") and "r.step(timed=False)" in failure["where"]
    assert failure["detail"].startswith("Traceback (most recent call last):")
    assert "tl.atomic_add(out_ptr0 + tmp4, tmp20)" in failure["detail"]
    captured = capsys.readouterr()
    assert "xl                  failed: RuntimeError" in captured.out
    assert "Traceback (most recent call last):" in captured.err and "in step" in captured.err


def test_a_variant_names_model_settings_as_real_text_and_sorting_do():
    import pytest

    bench = load_benchmark("model_step.py", "model_step_bench_settings")
    preset, settings = bench.variant_settings("memoria+memory_read='self_attention'+engram_bias=-4.0+opt.memory_lr=0.1", 2)
    assert preset == "memoria" and settings == {"memory_read": "self_attention", "engram_bias": -4.0}
    model = bench.build_model(bench.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64), preset, **settings)
    assert model.config.memory_read == "self_attention" and model.config.engram_bias == -4.0
    with pytest.raises(SystemExit, match="unknown preset 'nope'"):
        bench.variant_settings("nope+engram_bias=1.0", 2)


def test_a_shape_is_a_name_or_layers_width_heads():
    import argparse

    import pytest

    bench = load_benchmark("model_step.py", "model_step_bench_shapes")
    assert bench.shape_of("small") == bench.SHAPES["small"]
    assert bench.shape_of("2x32x2") == dict(n_layer=2, n_embd=32, n_head=2)
    for bad in ("2x33x2", "2x32", "0x32x2", "big"):
        with pytest.raises(argparse.ArgumentTypeError, match="LxWxH"):
            bench.shape_of(bad)
