"""The benchmark scripts refuse bad options before any work: argparse's usage, one line, exit 2."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from tests.train.launch_util import ROOT

CASES = [
    ("sorting.py", ["--variants", "memoria,foo"], "--variants: unknown preset 'foo'"),
    ("sorting.py", ["--variants", "memoria+opt.memory_lr=0"], "opt.memory_lr=0 in 'memoria+opt.memory_lr=0': a number above 0"),
    ("sorting.py", ["--variants", "memoria+memory_delay"], "'memory_delay' in 'memoria+memory_delay' is not key=value"),
    ("sorting.py", ["--variants", "transformer+pkm_layers=[0,1"], "a bracket or quote is not closed"),
    ("real_text.py", ["--variants", "xl+opt.pkm_value_lr=0"], "opt.pkm_value_lr=0 in 'xl+opt.pkm_value_lr=0': a number above 0"),
    ("sorting.py", ["--segments", "4,0"], "--segments '4,0': every value must be at least 1"),
    ("sorting.py", ["--seeds", "0,x"], "--seeds '0,x': give comma-separated integers"),
    ("sorting.py", ["--jobs", "0"], "--jobs 0: must be at least 1"),
    ("sorting.py", ["--table", "{tmp}/missing.json"], "--table: cannot read {tmp}/missing.json"),
    ("sorting.py", ["--table", "{tmp}/other.json"], "is not a benchmark's --json output"),
    ("real_text.py", ["--seeds", "1,1"], "--seeds '1,1': a value is given twice"),
    ("real_text.py", ["--train", "nosuch"], "--train: no such text 'nosuch'"),
    ("real_text.py", ["--reset", "every:x"], "--reset 'every:x': unknown reset policy part"),
    ("real_text.py", ["--json", "{tmp}/no/out.json"], "the folder {tmp}/no does not exist"),
    ("real_text.py", ["--merge", "{tmp}/broken.json"], "--merge: {tmp}/broken.json is not JSON"),
]


def _run(script: str, args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """The script as `python benchmarks/SCRIPT ARGS` runs it (as __main__, its argv, from the checkout), in
    this process: the libraries are imported once for all cases instead of once per case (10 s each)."""
    path = ROOT / "benchmarks" / script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(path), run_name="__main__")
    out, err = capsys.readouterr()
    return stop.value.code, out, err


@pytest.mark.parametrize("script,args,says", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_a_bad_option_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, script, args, says):
    (tmp_path / "other.json").write_text('{"rows": []}')
    (tmp_path / "broken.json").write_text('{"results": [')
    before = sorted(tmp_path.iterdir())
    code, out, err = _run(script, [a.format(tmp=tmp_path) for a in args], capsys, monkeypatch)
    errors = [line for line in err.splitlines() if line.startswith(f"{script}: error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert says.format(tmp=tmp_path) in errors[0], errors[0]
    assert "Traceback" not in err and out == "", err[-2000:]
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("script", ["sorting.py", "real_text.py"])
def test_a_bad_option_ends_the_process_with_exit_2_and_one_line(tmp_path, script):
    """The same as a separate process (what a user's shell sees), one case a script."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--seeds", "0,x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{script}: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "--seeds '0,x': give comma-separated integers" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]


def test_variants_split_at_the_commas_outside_a_settings_list_or_dict():
    from memoria_ds.compare.recipes import split_variants

    text = "transformer,transformer+pkm_layers=[0,1]+pkm={'n_keys':128,'knn':8},xl+tag='a,b',memoria"
    assert split_variants(text) == ["transformer", "transformer+pkm_layers=[0,1]+pkm={'n_keys':128,'knn':8}",
                                    "xl+tag='a,b'", "memoria"]
    assert split_variants("xl") == ["xl"]
    for bad in ("xl+pkm={'n_keys':1", "xl+pkm_layers=[0]]", "xl+tag='a"):
        with pytest.raises(ValueError):
            split_variants(bad)
