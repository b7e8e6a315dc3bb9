"""launch/setup.sh decides what to install from its stamps: the main job (quickstart.sh) gets
the project without extras, the test command adds `test`, and neither reinstalls what the
other already put in for the same pyproject.toml.

The decision is what is tested: `python` on PATH is a recorder that answers `import torch`
as installed and writes down every pip command instead of running it (the real installs are
the fresh-clone runs recorded in docs/guide.md).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.train.launch_util import ROOT

RECORDER = """#!/usr/bin/env bash
echo "$*" >> "$PIP_LOG"
"""


@pytest.fixture()
def venv(tmp_path):
    """An active-looking virtual environment whose `python` records its arguments."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(RECORDER)
    python.chmod(0o755)
    return tmp_path / "venv"


def _source(venv: Path, extras: str = "main", caller_args: str = "") -> list[str]:
    """Source setup.sh with `extras` from a script called with `caller_args`; the pip installs
    it ran, in order."""
    log = venv / "pip.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{os.environ['PATH']}", PIP_LOG=str(log))
    script = f'set -- {caller_args}; source "{ROOT}/launch/setup.sh" {extras}; echo sourced'
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("sourced"), proc.stdout + proc.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("-m pip install")]


def _want() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]


def test_the_main_job_installs_no_extras_and_the_test_command_adds_them(venv):
    assert _source(venv) == [f"-m pip install --quiet -e {ROOT}"]
    assert (venv / ".memoria_ds-main.stamp").read_text().strip() == _want()
    assert _source(venv) == []  # nothing changed: nothing installed
    assert _source(venv, "test") == [f"-m pip install --quiet -e {ROOT}[test]"]
    assert (venv / ".memoria_ds-test.stamp").read_text().strip() == _want()
    assert _source(venv, "test") == [] and _source(venv) == []


def test_the_callers_arguments_are_not_extras(venv):
    """quickstart.sh passes its own arguments to the training; the setup it sources names
    `main`, so `bash launch/quickstart.sh optim.epochs=2` installs no extra called that."""
    assert _source(venv, caller_args="optim.epochs=2") == [f"-m pip install --quiet -e {ROOT}"]
    assert "setup.sh\" main" in (ROOT / "launch" / "quickstart.sh").read_text()
    log = venv / "pip.log"
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{os.environ['PATH']}", PIP_LOG=str(log))
    bare = subprocess.run(["bash", "-c", f'source "{ROOT}/launch/setup.sh"'], env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "name the pip extras to install, or main for none" in bare.stderr


def test_a_test_install_covers_the_main_job(venv):
    """After the test command (or CI), the quickstart installs nothing."""
    assert _source(venv, "test") == [f"-m pip install --quiet -e {ROOT}[test]"]
    assert _source(venv) == []
    assert not (venv / ".memoria_ds-main.stamp").exists()


def test_a_changed_pyproject_installs_again(venv):
    (venv / ".memoria_ds-test.stamp").write_text("0123456789abcdef\n")  # another pyproject.toml's
    (venv / ".memoria_ds-main.stamp").write_text("0123456789abcdef\n")
    assert _source(venv) == [f"-m pip install --quiet -e {ROOT}"]
    assert _source(venv, "test") == [f"-m pip install --quiet -e {ROOT}[test]"]
