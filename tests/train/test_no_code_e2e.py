"""Code hidden in data is never run (issue 19 item 4), through the real launcher.

Each case replaces one file of a real run with a pickle whose unpickling would create a
marker file, and rewrites the manifest's size and checksum for it (an attacker writes the
manifest too). Resuming and analysing must refuse, say why, exit non-zero, and the marker
must never appear.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from .launch_util import ROOT, check, run_training
from .test_safe_io import plant


def _forge(ckpt, rel, marker):
    """Replace `rel` of checkpoint `ckpt` by a marker pickle and make the manifest agree."""
    target = ckpt / rel
    plant(target, marker)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][rel] = target.stat().st_size
    manifest["sha256"][rel] = hashlib.sha256(target.read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("engine,rel,says", [
    pytest.param("deepspeed", "rank_00000.safetensors", "is a pickle, not safetensors: not read", marks=pytest.mark.slow),
    pytest.param("deepspeed", "engine/mp_rank_00_model_states.pt", "would import io.open when loaded, which DeepSpeed never writes",
                 marks=pytest.mark.slow),
    ("torch", "engine/engine.safetensors", "is a pickle, not safetensors: not read"),
])
def test_a_forged_checkpoint_file_is_refused_unread(tmp_path, engine, rel, says):
    run, marker = tmp_path / "run", tmp_path / "ran"
    check(run_training(run, f"engine={engine}", "eval.at_end=false", launcher="python" if engine == "torch" else "deepspeed"))
    ckpt = run / "checkpoints" / "step_00000006"
    _forge(ckpt, rel, marker)
    proc = run_training(run, "optim.max_steps=9", f"engine={engine}", "eval.at_end=false", f"checkpoint.resume={ckpt}",
                        launcher="python" if engine == "torch" else "deepspeed")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors and says in errors[0] and "people you trust" in errors[0], errors
    # `auto` skips it like a corrupt checkpoint and resumes from the one before
    proc = check(run_training(run, "optim.max_steps=9", f"engine={engine}", "eval.at_end=false",
                              launcher="python" if engine == "torch" else "deepspeed"))
    assert says in proc.stdout + proc.stderr and "step_00000003" in proc.stdout + proc.stderr
    assert not marker.exists()


def test_analysing_a_forged_memory_file_is_refused(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "ran"
    check(run_training(run, "eval.trace=true", "eval.protocols=[full]"))
    state = run / "eval" / "memory_full.safetensors"
    assert state.is_file()
    plant(state, marker)
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "analyze.py"), "--state", str(state), "--out",
                           str(tmp_path / "fig")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is a pickle" in proc.stderr and "memoria_ds.safe_io convert" in proc.stderr, \
        proc.stderr[-2000:]
    assert not marker.exists()


def test_a_checkpoint_from_a_python_that_pickles_enums_with_getattr_resumes(tmp_path, monkeypatch):
    """Python 3.11.0-3.11.3 (Debian 12's 3.11.2) write DeepSpeed's ZeroStageEnum as
    getattr(ZeroStageEnum, "gradients"): a genuine checkpoint of theirs must resume anywhere."""
    import torch
    from deepspeed.runtime.zero.config import ZeroStageEnum

    run = tmp_path / "run"
    check(run_training(run, "eval.at_end=false"))
    ckpt = run / "checkpoints" / "step_00000006"
    monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
    rewritten = []
    for path in sorted((ckpt / "engine").rglob("*.pt")):
        state = torch.load(path, weights_only=False)  # our own run's file
        torch.save(state, path)
        if "builtins.getattr" in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
            rewritten.append(path.relative_to(ckpt).as_posix())
    assert rewritten, "no engine file holds the ZeRO stage enum"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel in rewritten:
        manifest["files"][rel] = (ckpt / rel).stat().st_size
        manifest["sha256"][rel] = hashlib.sha256((ckpt / rel).read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = check(run_training(run, "optim.max_steps=9", "eval.at_end=false", f"checkpoint.resume={ckpt}"))
    assert "would import" not in proc.stdout + proc.stderr
