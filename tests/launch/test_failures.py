"""Failures that explain themselves (issue 49): every benchmark keeps what was raised, the
innermost frame of our code that raised it (the operation and file:line) and the whole
traceback or child's stderr; the GPU check names each in its report with the log that holds
it. The failures here are real: a worker asked for CUDA on a torch without it, a model
asked for a kind that does not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench_util import ROOT, load_benchmark

failures = load_benchmark("failures.py", "failures_under_test")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot reach CUDA")


def _unknown_kind() -> Exception:
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    try:
        build_model(GPT2Config(n_layer=1, n_embd=8, n_head=2), "no_such_kind")
    except Exception as e:  # noqa: BLE001  (the test wants whatever our code raises)
        return e
    raise AssertionError("build_model accepted an unknown kind")


def test_an_exception_names_what_and_where_in_our_code():
    e = _unknown_kind()
    f = failures.from_exception(e)
    assert f.error.startswith(type(e).__name__ + ": ") and "no_such_kind" in f.error
    path, _, rest = f.where.partition(":")
    assert path.startswith("memoria_ds/model/") and rest.split(" ")[0].isdigit(), f.where
    assert "`" in f.where  # the source line of the raise
    assert f.detail.startswith("Traceback (most recent call last):") and "no_such_kind" in f.detail
    assert f.line("logs/x.log").endswith("(full traceback: logs/x.log)")


def test_a_chain_is_named_by_its_root_cause_and_a_capture_by_the_user_code():
    try:
        try:
            _unknown_kind_raise()
        except ValueError as cause:
            raise RuntimeError("wrapped") from cause
    except RuntimeError as e:
        chained = failures.from_exception(e)
    assert chained.error == "RuntimeError: wrapped" and chained.where.startswith("memoria_ds/model/"), chained.where
    # torch.compile lists the user's frames in its message, after its own: those name the operation
    retrieve = ROOT / "memoria_ds" / "memory" / "retrieve.py"
    text = ("Traceback (most recent call last):\n"
            f'  File "{ROOT / "benchmarks" / "model_step.py"}", line 400, in main\n    r.step(timed=False)\n'
            '  File "/usr/lib/python3/site-packages/torch/_dynamo/eval_frame.py", line 9, in _fn\n    return fn()\n'
            "torch._dynamo.exc.Unsupported: data-dependent branching\n\nfrom user code:\n"
            f'   File "{retrieve}", line 88, in _pick\n    if mask.any():\n')
    assert failures.where(text) == "memoria_ds/memory/retrieve.py:88 in _pick: `if mask.any():`"
    assert failures.where('  File "/elsewhere/x.py", line 1, in f\n    g()\n') is None  # none of ours


def _unknown_kind_raise() -> None:
    raise _unknown_kind()


def test_a_child_that_raises_is_named_by_its_last_exception():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); print('started'); "
            "from transformers import GPT2Config; from memoria_ds.model import build_model; "
            "build_model(GPT2Config(n_layer=1, n_embd=8, n_head=2), 'no_such_kind')")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True)
    f = failures.from_child(proc, "the probe")
    assert f.error.startswith("the probe exit 1: ") and "no_such_kind" in f.error, f.error
    assert f.where.startswith("memoria_ds/model/") and f.detail == proc.stderr
    with pytest.raises(failures.ChildFailed, match="the probe exit 1: .*no_such_kind.* at memoria_ds/model/"):
        failures.run_child([sys.executable, "-c", code, str(ROOT)], "the probe")
    # through the deepspeed launcher every line of a rank's stderr carries its `[rankN]: ` prefix
    ranked = "".join(f"[rank0]: {line}\n" for line in proc.stderr.splitlines())
    f = failures.from_child(subprocess.CompletedProcess(["deepspeed"], 1, "", ranked))
    assert f.error.startswith("exit 1: ") and "no_such_kind" in f.error and f.where.startswith("memoria_ds/model/")
    quiet = failures.from_child(subprocess.CompletedProcess(["x"], 2, "", "run_dir: in use by another run\n"), "x")
    assert quiet.error == "x exit 2: run_dir: in use by another run" and quiet.where is None


@no_cuda
def test_a_memory_step_worker_that_raises_leaves_its_traceback(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_step.py"), "--device", "cuda",
                           "--steps", "2", "--batch-size", "1", "--skip-official", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = json.loads(out.read_text())["failed"]["ours"]
    assert "AssertionError: Torch not compiled with CUDA enabled" in failed["error"]
    assert failed["where"].startswith("memoria_ds/memory/state.py:") and "in empty" in failed["where"]
    assert "Traceback (most recent call last):" in failed["detail"]
    assert "Traceback (most recent call last):" in proc.stderr  # the log of whoever ran it keeps it too
    assert "failed: the 'ours' worker exit 1: AssertionError" in proc.stdout


@no_cuda
def test_the_gpu_check_reports_a_raising_worker_with_where_and_its_log(tmp_path):
    gpu_check = load_benchmark("gpu_check.py", "gpu_check_failing_worker")
    a = SimpleNamespace(out=str(tmp_path / "check"), tiny=True, presets=["transformer", "memoria"], backbone=None,
                        deterministic=False, eager_only=False, only=["memory"], budget=None, probe_deadline=None,
                        probe_kinds=None)
    check = gpu_check.Check(a)
    check.cuda = True  # a CUDA run on a torch without CUDA: each memory-step worker really raises
    assert check.run() == 1
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    log = tmp_path / "check" / "logs" / "memory_b4.log"
    line = next(f for f in report["failures"] if f.startswith("memory_b4: "))
    assert "AssertionError: Torch not compiled with CUDA enabled at memoria_ds/memory/state.py:" in line, line
    assert line.endswith(f"(full traceback: {log})")
    assert "Traceback (most recent call last):" in log.read_text()
    assert "memoria_ds/memory/state.py:" in (tmp_path / "check" / "report.md").read_text()
