"""A newcomer's run (issue 47 item 6): the training's export lines after the progress bar, then
launch/evaluate.py on a run without an export, with other settings than the run's, and on a
path that does not exist."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from memoria_ds.eval import read_results
from memoria_ds.train.evaluate import looks_like_a_path

from .launch_util import FINETUNE, ROOT, TINY, free_port
from .test_evaluate_e2e import evaluate


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with its progress bar on, trained, evaluated and exported under the launcher;
    its directory and its output, stdout and stderr together as a terminal (or `tee`) gets them."""
    run = tmp_path_factory.mktemp("newcomer") / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEMORIA_DS_FAULT"):
        env.pop(key, None)
    cmd = [shutil.which("deepspeed") or str(ROOT / ".venv" / "bin" / "deepspeed"), "--num_gpus", "1",
           "--master_port", str(free_port()), FINETUNE, *TINY, f"run_dir={run}", "log.progress=true",
           "checkpoint.export=true", "eval.protocols=[full, memoryless]"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return run, proc.stdout


def _files(run):
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def test_the_export_lines_start_on_their_own_lines(trained):
    """The training bar ends without a newline; it is closed when the steps end, so what the final
    evaluation and the export print starts on a line of its own, in a terminal and in a log file
    alike (no carriage return before it), not glued to the bar's end."""
    _, out = trained
    for start in ("export: ", "exported step "):
        lines = [line for line in out.split("\n") if start in line and "Hugging Face export" not in line]
        assert lines, f"no `{start}` line in:\n{out[-3000:]}"
        for line in lines:
            assert line.startswith(start), repr(line[-300:])


def test_a_run_without_an_export_is_scored_from_its_newest_checkpoint(trained, tmp_path):
    """Without export/, evaluate consolidates the newest checkpoint in memory: the training's own final
    numbers, and nothing in the run changes but the new result files."""
    run, _ = trained
    bare = tmp_path / "run"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("export", "validation_*"))
    before = _files(bare)
    proc = evaluate(str(bare))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"scoring its newest checkpoint, {bare / 'checkpoints' / 'step_00000006'}" in proc.stdout
    assert f"results: {bare / 'eval'} (validation_full.json, validation_memoryless.json)" in proc.stdout
    after = _files(bare)
    assert {k: v for k, v in after.items() if k in before} == before, "the run's files were changed"
    assert sorted(set(after) - set(before)) == ["eval/validation_full.json", "eval/validation_memoryless.json"]
    for name in ("full", "memoryless"):
        (trained_result,) = read_results(bare / "eval" / f"step_00000006_{name}.json")
        (mine,) = read_results(bare / "eval" / f"validation_{name}.json")
        assert mine.scored_tokens == trained_result.scored_tokens
        assert abs(mine.nll - trained_result.nll) < 1e-5, (name, mine.nll, trained_result.nll)


def test_results_with_other_settings_keep_the_runs_own(trained):
    """kNN-LM (settings other than the run's) writes results of its own names, and the closing
    `results:` line names exactly the files each command wrote."""
    run, _ = trained
    eval_dir = run / "eval"
    plain = evaluate(str(run))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert f"results: {eval_dir} (validation_full.json, validation_memoryless.json)" in plain.stdout
    own = {name: (eval_dir / name).read_bytes() for name in ("validation_full.json", "validation_memoryless.json")}

    knn = evaluate(str(run), "eval.knn_lm.enabled=true", "eval.knn_lm.k=8")
    assert knn.returncode == 0, knn.stderr[-3000:]
    assert "settings: eval.knn_lm.enabled=true, eval.knn_lm.k=8 differ from the run's" in knn.stdout
    assert {name: (eval_dir / name).read_bytes() for name in own} == own, "the run's own results were overwritten"
    (line,) = [line for line in knn.stdout.splitlines() if line.startswith("results: ")]
    written = line.removeprefix(f"results: {eval_dir} (").removesuffix(")").split(", ")
    assert [name.split(".")[0] for name in written] == ["validation_full", "validation_memoryless"], line
    assert all(name.startswith("validation_") and ".knn_lm-" in name for name in written), line
    for name in written:
        (result,) = read_results(eval_dir / name)
        assert result.knn_lm is not None and result.knn_lm["k"] == 8
    assert {p.name for p in eval_dir.glob("validation_*")} == {*own, *written}


def test_a_path_that_does_not_exist_is_named_in_one_line():
    proc = evaluate("runs/doesnotexist")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "error: runs/doesnotexist does not exist (give a run directory, a save_pretrained directory or a hub id)"]


@pytest.mark.parametrize("name,path", [
    ("gpt2", False), ("openai-community/gpt2", False), ("runs/doesnotexist", True), ("eval_results/x", True),
    ("./model", True), ("~/model", True), ("/abs/model", True), ("a/b/c", True), ("model/", True),
    ("tests/nothing", True),  # tests/ is a folder here: a path, not a hub owner
])
def test_what_looks_like_a_path(name, path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert looks_like_a_path(name) is path
