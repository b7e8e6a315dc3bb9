"""Smoke modes of the table launchers, end to end on CPU: the real scripts, planner, DeepSpeed
launcher, training loop, checkpoint, export and evaluation, at tiny scale on stand-in data.

Default tier, one representative run per table: Table 5 here (fine-tuning a local backbone),
Table 4 by running the command its dry run printed (two ranks), Table 7 here; Table 2 runs
through the SLURM template on two simulated nodes (test_slurm_template.py) and Table 1
under the analysis command (tests/analysis/test_analyze_run.py). `-m slow` runs every entry
of every table.
"""

from __future__ import annotations

import io
import json
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from memoria_ds.repro.collect import find_runs, read_run
from memoria_ds.repro.experiments import TABLES
from memoria_ds.repro.plan import main as plan_main

from repro_helpers import check, check_finished_run, free_port, run


def smoke(table: str, root: Path, *flags: str) -> str:
    proc = check(run(["bash", f"launch/repro/{table}.sh", "--mode", "smoke", "--run-root", str(root),
                      "--master-port", str(free_port()), *flags]))
    return proc.stdout + proc.stderr


def test_table5_smoke_finetunes_a_pretrained_style_backbone(tmp_path):
    out = smoke("table5", tmp_path, "--sizes", "gpt2-xl", "--models", "memoria")
    run_dir = tmp_path / "finetune" / "wikitext103-L150-gpt2-xl-memoria"
    summary = check_finished_run(run_dir, ("paper", "full", "memoryless"))
    assert summary["steps"] == 3
    assert out.count("+ ") >= 2 and "+ deepspeed --num_gpus 1" in out  # planner and training command echoed
    assert "export: " in (run_dir / "launch.log").read_text()  # the output was kept (tee)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["from_scratch"] is False and cfg["model"]["backbone"].endswith("standins/gpt2-tiny")
    assert cfg["data"]["corpus"] == "wikitext103" and cfg["data"]["path"].endswith("standins/wikitext103")
    record = json.loads((run_dir / "repro.json").read_text())
    assert record["scale"] == "smoke" and record["experiment"] == "finetune/wikitext103-L150-gpt2-xl-memoria"
    collected = read_run(run_dir)
    assert collected.status.startswith("smoke run") and set(collected.results) == {"paper", "full", "memoryless"}


@pytest.mark.slow
def test_table4_dry_run_command_runs_as_printed_on_two_ranks(tmp_path):
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--table", "table4", "--scale", "smoke", "--topology", "node", "--gpus", "2",
                          "--segment-lengths", "256", "--segments", "4", "--models", "memoria",
                          "--run-root", str(tmp_path), "--master-port", str(free_port())]) == 0
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("  command   ")]
    command = line.split("command   ", 1)[1]
    assert shlex.split(command)[1:3] == ["--num_gpus", "2"]
    check(run(["bash", "-c", command]))
    run_dir = tmp_path / "sorting" / "L256-n4-memoria"
    summary = check_finished_run(run_dir, ("sorting", "sorting_memoryless"))
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (4, 2)  # 4 streams over 2 ranks
    result = json.loads(next((run_dir / "eval").glob("step_*_sorting.json")).read_text())
    assert 0.0 <= result["accuracy"] <= 1.0 and result["scored_tokens"] == 8 * 20  # 8 test examples x 20 answers
    assert result["protocol"]["segments_per_example"] == 4
    # read a second time with the memory reset before every segment, on both ranks
    bare = json.loads(next((run_dir / "eval").glob("step_*_sorting_memoryless.json")).read_text())
    assert bare["scored_tokens"] == result["scored_tokens"] and bare["protocol"]["memoryless"]
    gain = summary["memory_gain"]
    assert (gain["accuracy_with"], gain["accuracy_without"]) == (result["accuracy"], bare["accuracy"])


@pytest.mark.slow
def test_table7_smoke_runs_the_ablation(tmp_path):
    smoke("table7", tmp_path, "--segments", "4", "--models", "memoria_wm_stm")
    run_dir = tmp_path / "sorting" / "L1024-n4-memoria_wm_stm"
    check_finished_run(run_dir, ("sorting",))
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["memoria"]["use_ltm"] is False and exported["memoria"]["use_stm"] is True
    assert exported["memoria"]["num_wm"] == 64 // 8  # the paper's rule at the smoke segment of 64
    assert [r.experiment for r in map(read_run, find_runs([tmp_path]))] == ["sorting/L1024-n4-memoria_wm_stm"]


@pytest.mark.slow
def test_table3_smoke_classifies_then_scores_the_test_split(tmp_path):
    """Memoria RoBERTa (segments, the memory) and Longformer (one long sequence, HF's class) through the
    launcher: trained, evaluated on validation, then on test by the evaluate command; run again, both
    are skipped as done."""
    out = smoke("table3", tmp_path, "--models", "memoria_roberta,longformer", "--seeds", "43")
    for model in ("memoria_roberta", "longformer"):
        run_dir = tmp_path / "classify" / f"hyperpartisan-{model}" / "seed43"
        check_finished_run(run_dir, ("classification_full", "classification_memoryless"))
        test = json.loads((run_dir / "eval" / "test_classification_full.json").read_text())
        assert test["split"] == "test" and test["macro_f1"] is not None
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["seed"] == 43 and cfg["data"]["path"].endswith("standins/hyperpartisan")
    export = json.loads((tmp_path / "classify/hyperpartisan-longformer/seed43/export/config.json").read_text())
    assert export["model_type"] == "longformer"  # a plain HF checkpoint
    assert out.count("launch/evaluate.py") == 2
    again = smoke("table3", tmp_path, "--models", "memoria_roberta,longformer", "--seeds", "43")
    assert again.count("skip classify/") == 2 and "launch/evaluate.py" not in again


@pytest.mark.slow
@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_smoke_entry(table, tmp_path):
    seeded = table == "table3"  # one seed of each model: the others differ by `seed=` alone
    smoke(table, tmp_path, *(("--seeds", "42") if seeded else ()))
    for eid in TABLES[table].experiment_ids():
        if seeded and not eid.endswith("/seed42"):
            continue
        protocols = (("sorting",) if eid.startswith("sorting/") else
                     ("classification_full", "classification_memoryless") if eid.startswith("classify/") else
                     ("paper", "full"))
        check_finished_run(tmp_path / eid, protocols)
        if eid.startswith("classify/"):  # then scored on the test split by the evaluate command
            assert (tmp_path / eid / "eval" / "test_classification_full.json").is_file()
