"""launch/quickstart.sh picks the run directory and its log (issue 47 item 6): another preset gets a
directory of its own (resuming runs/quickstart as another model fails), and the log lies beside the
run directory it describes, not always in runs/quickstart.log.

The script runs from a copy of launch/ with a `deepspeed` on PATH that records its arguments
(the training itself is tested in tests/train), in a virtual environment whose stamp says the
main job is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from tests.train.launch_util import ROOT

RECORDER = """#!/usr/bin/env bash
echo "training with: $*"
printf '%s\\n' "$@" > "$ARGS_FILE"
"""
NO_GPU = "#!/usr/bin/env bash\nexit 1\n"  # `python -c "import torch; ... cuda"`: no GPU here


@pytest.fixture()
def clone(tmp_path):
    root = tmp_path / "clone"
    (root / "launch").mkdir(parents=True)
    for name in ("quickstart.sh", "setup.sh"):
        shutil.copy(ROOT / "launch" / name, root / "launch" / name)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in (("deepspeed", RECORDER), ("python", NO_GPU)):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    want = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (venv / ".memoria_ds-main.stamp").write_text(want + "\n")
    return root, venv


def quickstart(clone, *args: str) -> list[str]:
    """Run the script with `args`; the arguments the training got after the quickstart's own."""
    root, venv = clone
    record = venv / "args.txt"
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               ARGS_FILE=str(record))
    proc = subprocess.run(["bash", str(root / "launch" / "quickstart.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = record.read_text().splitlines()
    base = ["--num_gpus", "1", "launch/finetune.py", "--deepspeed", "ds_configs/cpu.json",
            "--config", "launch/configs/quickstart.yaml"]
    assert got[: len(base)] == base, got
    return got[len(base):]


def logs(clone) -> dict[str, str]:
    root, _ = clone
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*.log")}


def test_the_default_run_logs_to_runs_quickstart_log(clone):
    assert quickstart(clone) == []
    (log,) = logs(clone).items()
    assert log[0] == "runs/quickstart.log"
    assert log[1].startswith("+ deepspeed --num_gpus 1 launch/finetune.py") and "training with:" in log[1]


def test_another_preset_gets_its_own_run_directory_and_log(clone):
    assert quickstart(clone, "model.preset=xl") == ["model.preset=xl", "run_dir=runs/quickstart_xl"]
    assert list(logs(clone)) == ["runs/quickstart_xl.log"]
    assert quickstart(clone, "model.preset=memoria", "optim.epochs=2") == ["model.preset=memoria", "optim.epochs=2"]
    assert sorted(logs(clone)) == ["runs/quickstart.log", "runs/quickstart_xl.log"]


@pytest.mark.parametrize("args,log", [
    (["model.preset=xl", "run_dir=runs/xl"], "runs/xl.log"),
    (["run_dir=elsewhere/mine/"], "elsewhere/mine.log"),
    (["--run-dir", "runs/other", "model.preset=transformer"], "runs/other.log"),
    (["--run-dir=runs/third"], "runs/third.log"),
])
def test_a_named_run_directory_is_kept_and_logged_beside_it(clone, args, log):
    assert quickstart(clone, *args) == args
    assert list(logs(clone)) == [log]
