"""The analysis command on a short real run: Table 1's smoke run (WikiText-103 stand-in, Memoria),
launched through launch/repro/table1.sh, then launch/analyze.py with a traced test-set
evaluation, then the state + trace form of the command, then the collector."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))  # the launchers' test helpers
from repro_helpers import check, check_finished_run, free_port, run  # noqa: E402

from memoria_ds.repro.collect import collect  # noqa: E402
from memoria_ds.analysis.memory_data import load_memory  # noqa: E402
from memoria_ds.memory.state import LTM  # noqa: E402
from memoria_ds.safe_io import load_tree  # noqa: E402

FIGURES = {"fig5_reminded_ltm_age_train", "memory_kinds_train", "fig5_reminded_ltm_age_test_paper",
           "memory_kinds_test_paper"} | {f"{name}_{source}" for name in ("fig6_ltm_creation", "fig8_edge_weight_age",
                                                                        "fig9_edge_weight_age_300", "lifespans")
                                         for source in ("test_paper", "checkpoint")}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """Table 1's smoke entry for WikiText-103 / Memoria; the overrides after `--` reach the training
    command: STM as large as one step's working memory, so LTM engrams are reminded from the fourth step."""
    root = tmp_path_factory.mktemp("runs")
    check(run(["bash", "launch/repro/table1.sh", "--mode", "smoke", "--corpora", "wikitext103", "--models", "memoria",
               "--run-root", str(root), "--master-port", str(free_port()), "--",
               "model.settings.memoria.stm_capacity=4", "optim.max_steps=8"]))
    return root


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_table1_smoke_run_and_its_plots(smoke_run):
    run_dir = smoke_run / "scratch" / "wikitext103-L150-memoria"
    summary = check_finished_run(run_dir, ("paper", "full"))
    assert summary["steps"] == 8  # the pass-through override came last and won
    assert json.loads((run_dir / "export" / "config.json").read_text())["memoria"]["stm_capacity"] == 4

    proc = check(run([sys.executable, "launch/analyze.py", str(run_dir), "--trace", "test", "--max-steps", "12",
                      "--graph-every", "4"]))
    out = run_dir / "analysis"
    figures = json.loads((out / "figures.json").read_text())
    assert set(figures) == FIGURES
    for info in figures.values():
        png = Path(info["path"])
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.with_suffix(".csv").is_file()
        assert png.name in proc.stdout
    # Figure 5 from the test-set trace: one point per segment, LTM engrams reminded, ages > 1
    fig5 = read_csv(out / "fig5_reminded_ltm_age_test_paper.csv")
    ages = [float(r["reminded_ltm_age"]) for r in fig5]
    assert len(ages) == 12 and all(a >= 2 for a in ages[3:])
    trace = [json.loads(line) for line in (out / "trace_test_paper.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trace] == list(range(12)) and "memory/graph_degree" in trace[4]
    # Figure 6 counts every LTM engram of the final test-set memory once
    snap = load_memory(out / "memory_test_paper.safetensors")
    n_ltm = int((snap.state.kind == LTM).sum())
    assert n_ltm > 0 and sum(int(r["engrams"]) for r in read_csv(out / "fig6_ltm_creation_test_paper.csv")) == n_ltm
    assert figures["fig6_ltm_creation_test_paper"]["points"] == n_ltm
    # --trace adds figures beside the checkpoint's, it does not overwrite them
    assert "training memory at step 8" in figures["fig6_ltm_creation_checkpoint"]["source"]
    # Figures 8-9: weights are probabilities; engrams written in the same step are linked (they fired together)
    fig8 = read_csv(out / "fig8_edge_weight_age_test_paper.csv")
    assert all(0.0 <= float(r["mean_weight_all_pairs"]) <= 1.0 for r in fig8)
    assert float(fig8[0]["age_difference"]) == 0 and float(fig8[0]["mean_weight_linked_pairs"]) > 0
    evaluated = json.loads((out / "eval_test_paper.json").read_text())
    assert evaluated["protocol"]["name"] == "paper" and evaluated["steps"] == 12

    # the same figures from a saved memory (the training checkpoint's shard) and a trace (metrics.jsonl)
    shard = next((run_dir / "checkpoints").glob("step_*/rank_00000.safetensors"))
    files = run_dir / "from_files"
    check(run([sys.executable, "launch/analyze.py", "--state", str(shard), "--trace-file",
               str(run_dir / "metrics.jsonl"), "--out", str(files)]))
    got = json.loads((files / "figures.json").read_text())
    assert {"fig6_ltm_creation_checkpoint", "fig8_edge_weight_age_checkpoint", "fig5_reminded_ltm_age_metrics"} <= set(got)
    train_ages = [float(r["reminded_ltm_age"]) for r in read_csv(files / "fig5_reminded_ltm_age_metrics.csv")]
    assert len(train_ages) == 8 and any(math.isfinite(a) for a in train_ages)  # logged every step
    saved = load_tree(shard)["memory"][0]["state"]["counts"]
    assert torch.equal(load_memory(shard).state.counts, saved)


def test_collector_builds_table1_from_the_smoke_run(smoke_run, tmp_path):
    info = collect([smoke_run], tmp_path, ["table1"])
    md = Path(info["markdown"]).read_text()
    line = next(x for x in md.splitlines() if x.startswith("| Memoria Transformer | WikiText-103 PPL |"))
    assert "smoke run (CPU, stand-in data, tiny model): not a reproduction" in line
    assert line.split("|")[4].strip() != "-"  # our `paper`-protocol number is there


def test_command_line_mistakes_stop_before_any_folder_is_made(tmp_path, capsys):
    from memoria_ds.analysis.analyze import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    (tmp_path / "file").write_text("x")
    for argv, says in [
        ([str(tmp_path / "missing")], "is not a directory; give a training run directory"),
        ([str(tmp_path)], "is not a training run directory (no config.yaml or metrics.jsonl in it)"),
        ([str(run_dir), "--out", str(tmp_path / "file" / "plots")], "is a file; give a folder for the plots"),
        ([str(run_dir), "--max-steps", "0"], "--max-steps (0) must be at least 1"),
        ([str(run_dir), "--graph-every", "-1"], "--graph-every (-1) must be >= 0"),
        (["--state", str(tmp_path / "file"), "--out", str(tmp_path / "file")], "is a file; give a folder"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run"] and not (run_dir / "analysis").exists()
