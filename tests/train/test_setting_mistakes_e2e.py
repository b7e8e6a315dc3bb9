"""Issue 47 items 4 and 5a through the real launcher: a memory setting, a kNN-LM index or a bptt
span that cannot work stops every rank before any data work, with exit status 2 and one line per
rank naming the key; no traceback, nothing written.

"Before any data work" is shown by a fault in the data preparation (`disk_full_in_data_prep`):
had the run reached it, it would end with exit status 1 and "No space left on device", as the
same run with a good setting does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .launch_util import FINETUNE, ROOT, TINY, free_port, run_training

FAULT = "disk_full_in_data_prep:0"


def _stopped_before_the_data(tmp_path, proc_or_outputs, ranks: int) -> list[str]:
    """The one error line of each rank; checks exit status 2 and that nothing was prepared or written."""
    outputs = proc_or_outputs if isinstance(proc_or_outputs, list) else [
        (proc_or_outputs.returncode, proc_or_outputs.stdout + proc_or_outputs.stderr)]
    lines = []
    for code, out in outputs:
        assert code == 2, out[-3000:]
        assert "Traceback" not in out and "No space left on device" not in out, out[-3000:]
        lines += [line for line in out.splitlines() if line.startswith("error")]
    assert len(lines) == ranks, lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf_cache").exists()
    return lines


@pytest.mark.parametrize("overrides, says", [
    # caught when the configuration loads
    (["model.settings.engram_loss=-1"], "error: `model.settings.engram_loss` (-1) must be a finite weight >= 0"),
    # caught in setup, from the model's shape or the machine, before the corpora
    (["model.preset=memformer", "optim.bptt_segments=100000"],
     "error (rank 0): `optim.bptt_segments` (100000) keeps the activations of 100000 segments for one backward"),
    (["eval.knn_lm.enabled=true", "eval.knn_lm.train_datastore=true", "eval.knn_lm.index=IVF4096,Flat",
      "eval.knn_lm.train_max_entries=500"], "error (rank 0): `eval.knn_lm.index` ('IVF4096,Flat') is trained on the "
                                            "training-text datastore and needs at least 4096 entries"),
])
def test_setting_mistakes_stop_the_launcher_before_any_work(tmp_path, overrides, says):
    cache = {"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    proc = run_training(tmp_path / "run", *overrides, fault=FAULT, env=cache)
    (line,) = _stopped_before_the_data(tmp_path, proc, ranks=1)
    assert line.startswith(says), line


def test_a_setting_the_backbone_rules_out_stops_every_rank_before_the_data(tmp_path):
    """`layer=9` on a 2-block model: each rank builds the model's config (no weights) in setup and
    stops with the same line; the ranks are started by hand, so no launcher stops one for the other."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WORLD_SIZE="2", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
               MEMORIA_DS_FAULT=FAULT)
    args = [sys.executable, FINETUNE, *TINY, f"run_dir={tmp_path / 'run'}", "model.preset=memorizing_no_cache",
            "model.settings.memory_settings.layer=9"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [(p.wait(timeout=300), p.communicate()[0]) for p in procs]
    lines = _stopped_before_the_data(tmp_path, outputs, ranks=2)
    for rank, line in enumerate(lines):
        assert line == (f"error (rank {rank}): `model.settings.memory_settings.layer` (9) must be a block index in "
                        f"[0, 2) (the model has 2 blocks), or None for the block at three quarters of the depth"), line


def test_the_same_run_with_a_good_setting_reaches_the_data(tmp_path):
    """The control: the fault above ends a run that gets as far as its data."""
    proc = run_training(tmp_path / "run", "model.preset=memorizing_no_cache", "model.settings.memory_settings.layer=1",
                        fault=FAULT, launcher="python")
    assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr[-3000:]


def test_an_uncapped_datastore_too_small_for_its_index_stops_before_training(tmp_path):
    """Without `train_max_entries` the datastore is the training split: an index that needs more
    entries than the split has tokens (IVF65536 on the bundled book) is refused once the split is
    read, before any step; nothing but the lock's directory is left."""
    proc = run_training(tmp_path / "run", "eval.knn_lm.enabled=true", "eval.knn_lm.train_datastore=true",
                        "eval.knn_lm.index=IVF65536,Flat", launcher="python")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert "`eval.knn_lm.index` ('IVF65536,Flat')" in line and "needs at least 65536 entries" in line, line
    assert "the training split (" in line and not (tmp_path / "run").exists()
