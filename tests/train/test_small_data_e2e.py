"""Too little text is bad input: refused after the data is read and before any model work or run
directory (the evaluated split too: otherwise the run fails only after training)."""

from __future__ import annotations

import pytest

from .launch_util import run_training

ALICE = "memoria_ds/assets/alice29.txt"


@pytest.mark.parametrize("train,validation,says", [
    ("empty.txt", ALICE, "the training split is too small for this run (0 tokens cannot fill 2 streams"),
    ("short.txt", ALICE, "the training split is too small for this run (with tail='drop' every stream needs one full segment"),
    (ALICE, "empty.txt", "eval.split 'validation' has 0 tokens, too few for the evaluation's 1 stream(s)"),
])
def test_too_little_text_is_one_line_and_exit_2(tmp_path, train, validation, says):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("Only a few words here.")
    files = {name: path if path == ALICE else str(tmp_path / path) for name, path in
             (("train", train), ("validation", validation))}
    run = tmp_path / "run"
    proc = run_training(run, "data.corpus=files", f"data.files={{train: {files['train']}, validation: "
                        f"{files['validation']}}}", "data.tail=drop", launcher="python")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not run.exists()
