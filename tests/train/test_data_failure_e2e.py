"""Rank 0 prepares the data while the other ranks wait for it; if it fails, they must stop too.

The ranks are started by hand, one process each, as two nodes started by separate launchers
would be: no launcher stops the survivors when rank 0 dies. Before the fix, rank 1 met rank 0's
death inside a barrier: a gloo connection traceback here, and under NCCL a wait until the
process group's timeout (30 minutes by default)."""

from __future__ import annotations

import os
import subprocess
import sys

from .launch_util import FINETUNE, ROOT, TINY, free_port


def _two_ranks(tmp_path, data_file, fault: str | None = None) -> list[tuple[int, str]]:
    """Start ranks 0 and 1 by hand; (exit status, stderr) of each."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WORLD_SIZE="2", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), HF_DATASETS_CACHE=str(tmp_path / "hf_cache"))
    env.pop("MEMORIA_DS_FAULT", None)
    if fault:
        env["MEMORIA_DS_FAULT"] = fault
    args = [sys.executable, FINETUNE, *TINY, f"run_dir={tmp_path / 'run'}", "data.corpus=files",
            f"data.files={{train: {data_file}}}", "eval.at_end=false"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        procs[0].wait(timeout=300)
        procs[1].wait(timeout=90)  # told at once; 90 s is slack for a loaded machine
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        err = [p.communicate()[1][-2000:] for p in procs]
        raise AssertionError(f"a rank still waited after rank 0 failed:\n--- rank 0\n{err[0]}\n--- rank 1\n{err[1]}")
    return [(p.returncode, p.communicate()[1]) for p in procs]


def _one_error_line(stderr: str, rank: int) -> str:
    said = [line for line in stderr.splitlines() if line.startswith(f"error (rank {rank})")]
    assert len(said) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return said[0]


def test_a_malformed_data_file_stops_every_rank_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine first document"}\n{"text": "the second one is cut off\n')
    (code0, err0), (code1, err1) = _two_ranks(tmp_path, bad)
    for rank, code, err in ((0, code0, err0), (1, code1, err1)):
        assert code == 2, err[-2000:]
        line = _one_error_line(err, rank)
        assert "data.files could not be read (ArrowInvalid: JSON parse error" in line, line
    assert not (tmp_path / "run").exists()


def test_an_unexpected_data_failure_on_rank_0_stops_the_other_ranks(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"text": "document {i} has a few words in it"}}\n' for i in range(20)))
    (code0, err0), (code1, err1) = _two_ranks(tmp_path, good, fault="disk_full_in_data_prep:0")
    assert code0 != 0 and "No space left on device" in err0, err0[-2000:]
    assert code1 == 1, err1[-2000:]
    line = _one_error_line(err1, 1)
    assert "rank 0 could not prepare the data (OSError: [Errno 28] No space left on device" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()
