"""The collector on fixture run directories: identification (record or configuration), the latest
evaluation, metric and protocol of every number, statuses, markdown and CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from memoria_ds.repro.collect import collect, find_runs, main, read_run
from memoria_ds.repro.experiments import ENTRY_BASE_OVERRIDES, EXPERIMENTS, TABLES
from memoria_ds.eval import EvalResult, paper_protocol
from memoria_ds.eval.protocols import full_protocol, memoryless_protocol
from memoria_ds.train.config import RunConfig
from memoria_ds.train.parse import dump, load

N = 1000  # scored tokens of every fixture result


def result(protocol: str, value: float, metric: str, split: str = "test") -> EvalResult:
    common = dict(model="m", data={"corpus": "x"}, split=split, world_size=1, steps=7, input_tokens=N)
    if metric == "accuracy":
        return EvalResult.from_sums(nll_sum=0.5 * N, scored_tokens=N, correct=round(value * N), **common,
                                    protocol={"name": "sorting", "segment_length": 1024, "num_streams": 32,
                                              "segments_per_example": 4, "scored": "the 20 answer positions",
                                              "memoryless": protocol == "sorting_memoryless"})
    p = {"paper": paper_protocol(150), "full": full_protocol(150, 1),
         "memoryless": memoryless_protocol(150, 1)}[protocol].to_dict()
    if metric == "bpc":
        return EvalResult.from_sums(nll_sum=value * math.log(2) * N, scored_tokens=N, character_level=True,
                                    protocol=p, **common)
    return EvalResult.from_sums(nll_sum=math.log(value) * N, scored_tokens=N, protocol=p, **common)


def make_run(root: Path, eid: str | None, evals: dict[tuple[int, str], float], *, metric: str = "ppl",
             scale: str | None = "paper", finished: bool = True, overrides: tuple[str, ...] = (),
             name: str | None = None) -> Path:
    run_dir = root / (name or eid)
    (run_dir / "eval").mkdir(parents=True)
    if eid is not None:
        e = EXPERIMENTS[eid]
        cfg = load(RunConfig, e.config, [*ENTRY_BASE_OVERRIDES[e.entry_point], *e.overrides, f"run_dir={run_dir}",
                                         *overrides])
    else:
        cfg = load(RunConfig, None, [f"run_dir={run_dir}", *overrides])
    dump(cfg, run_dir / "config.yaml")
    if scale is not None and eid is not None:
        (run_dir / "repro.json").write_text(json.dumps({"experiment": eid, "scale": scale}))
    for (step, protocol), value in evals.items():
        result(protocol, value, metric).save(run_dir / "eval" / f"step_{step:08d}_{protocol}.json")
    if finished:
        (run_dir / "summary.json").write_text("{}")
    return run_dir


@pytest.fixture
def runs(tmp_path) -> Path:
    root = tmp_path / "runs"
    make_run(root, "finetune/wikitext103-L150-gpt2-memoria",
             {(100, "paper"): 25.0, (200, "paper"): 19.5, (200, "full"): 19.25})  # the newest evaluation counts
    make_run(root, "scratch/enwik8-L512-memoria", {(9, "paper"): 1.25, (9, "full"): 1.2}, metric="bpc",
             scale=None)  # no launcher record: identified by its configuration
    make_run(root, "sorting/L1024-n4-memoria", {(5, "sorting"): 0.8}, metric="accuracy")
    make_run(root, "scratch/wikitext103-L150-xl", {(3, "paper"): 900.0}, scale="smoke")
    make_run(root, "scratch/pg19-L150-transformer", {}, finished=False)
    make_run(root, "scratch/wikitext103-L50-transformer", {(50, "paper"): 40.0}, overrides=("optim.max_steps=50",))
    make_run(root, None, {(1, "paper"): 3.0}, name="other/bundled", overrides=("data.corpus=bundled",))
    return root


def rows(csv_text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(csv_text)))


def test_runs_are_identified_by_record_or_configuration(runs):
    found = {str(p.relative_to(runs)): read_run(p) for p in find_runs([runs])}
    assert len(found) == 7
    assert found["scratch/enwik8-L512-memoria"].experiment == "scratch/enwik8-L512-memoria"
    assert found["scratch/enwik8-L512-memoria"].scale == "unknown"
    assert found["other/bundled"].experiment is None
    assert found["finetune/wikitext103-L150-gpt2-memoria"].results["paper"][0] == 200


def test_tables_beside_the_papers_numbers(runs, tmp_path):
    info = collect([runs], tmp_path / "out")
    assert info["runs"] == 7
    table = rows(Path(info["csv"]).read_text())
    assert len(table) == sum(len(t.cells) * len(t.our_protocols) for t in TABLES.values())
    get = {(r["table"], r["row"], r["column"], r["protocol"]): r for r in table}

    t5 = get[("table5", "Memoria GPT-2", "WikiText-103 PPL", "paper")]
    assert (float(t5["paper"]), float(t5["ours"]), t5["step"], t5["status"]) == (18.986, 19.5, "200", "complete")
    assert json.loads(t5["protocol_detail"])["scored_per_full_segment"] == 149 and t5["split"] == "test"
    assert "149 of 150 tokens" in t5["paper_protocol"]
    assert float(get[("table5", "Memoria GPT-2", "WikiText-103 PPL", "full")]["ours"]) == 19.25

    e8 = get[("table1", "Memoria Transformer", "enwik8 BPC", "full")]
    assert (float(e8["paper"]), float(e8["ours"]), e8["metric"]) == (1.16, 1.2, "bpc")

    # one run, two tables: Table 4's Memoria at 1024 x 4 is Table 7's "+ Long-term Memory"
    assert float(get[("table4", "Memoria Transformer", "4 segments of 1024", "sorting")]["ours"]) == 80.0
    t7 = get[("table7", "+ Long-term Memory", "4 segments of 1024", "sorting")]
    assert (float(t7["ours"]), float(t7["paper"])) == (80.0, 82.27)

    assert "smoke run" in get[("table1", "Transformer-XL", "WikiText-103 PPL", "paper")]["status"]
    assert "unfinished" in get[("table1", "Transformer", "PG-19 PPL", "paper")]["status"]
    assert "shortened (max_steps=50)" in get[("table2", "Transformer", "WikiText-103 PPL (segment 50)", "paper")]["status"]
    assert get[("table1", "infinity-former", "PG-19 PPL", "paper")]["ours"] == ""
    assert info["filled"] == 6  # T5, T1 enwik8 and wt103-xl, T2, T4, T7 (the unfinished pg19 run has none)

    md = Path(info["markdown"]).read_text()
    assert "| Memoria GPT-2 | WikiText-103 PPL | 18.986 | 19.500 | 19.250 | complete |" in md
    assert "| + Long-term Memory | 4 segments of 1024 | 82.27 | 80.00 | complete |" in md
    assert "| not run | `scratch/pg19-L150-infinity` |" in md  # every model of the paper's tables has a run
    assert "- paper: test split, segments of 150, 1 stream(s), resets never, 149 of 150 scored per segment" in md
    assert "## Runs that match no paper experiment" in md and "other/bundled" in md


def test_collect_cli(runs, tmp_path, capsys):
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([str(runs), "--out", str(tmp_path / "o"), "--tables", "table5"]) == 0
    assert out.getvalue().startswith("# Results beside the paper's") and "## Table 5" in out.getvalue()
    assert "## Table 1" not in out.getvalue()
    assert (tmp_path / "o" / "results.csv").is_file()
    assert main([str(runs), "--tables", "table9"]) == 2
    assert "unknown table(s) ['table9']" in capsys.readouterr().err


def test_the_memory_gain_stands_beside_a_run_scored_without_its_memory(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "finetune/wikitext103-L150-gpt2-memoria",
             {(200, "paper"): 19.5, (200, "full"): 19.25, (200, "memoryless"): 20.5})
    make_run(root, "finetune/wikitext103-L150-gpt2-transformer", {(200, "paper"): 21.0, (200, "full"): 20.75})
    make_run(root, "scratch/wikitext103-L150-xl", {(100, "memoryless"): 22.0, (200, "full"): 20.0})  # stale
    make_run(root, "sorting/L1024-n4-memoria", {(5, "sorting"): 0.8, (5, "sorting_memoryless"): 0.36},
             metric="accuracy")
    info = collect([root], tmp_path / "out", tables=["table5", "table1", "table7"])
    gain = math.log(20.5) - math.log(19.25)
    md = Path(info["markdown"]).read_text()
    assert f"| Memoria GPT-2 | WikiText-103 PPL | 18.986 | 19.500 | 19.250 | {gain:+.4f} nats/token | complete |" in md
    assert "| GPT-2 | WikiText-103 PPL | 20.498 | 21.000 | 20.750 | - | complete |" in md  # no memoryless result
    assert "Memory gain: the run's NLL with its memory reset before every segment" in md
    assert "| + Long-term Memory | 4 segments of 1024 | 82.27 | 80.00 | +44.00 points | complete |" in md
    table = {(r["row"], r["column"], r["protocol"]): r for r in rows(Path(info["csv"]).read_text())}
    column = "WikiText-103 PPL"
    assert float(table[("Memoria GPT-2", column, "full")]["memory_gain"]) == pytest.approx(gain, rel=1e-5)
    assert float(table[("Memoria GPT-2", column, "paper")]["memory_gain"]) == pytest.approx(gain, rel=1e-5)
    assert table[("GPT-2", column, "full")]["memory_gain"] == ""
    assert table[("Transformer-XL", column, "full")]["memory_gain"] == ""  # memoryless of another step: no gain


def classification(value: float, split: str, memoryless: bool = False) -> EvalResult:
    """A classifier's result of 100 documents with accuracy `value` (its macro-F1 given as accuracy - 0.01)."""
    correct = round(100 * value)
    return EvalResult.from_sums(
        nll_sum=30.0, scored_tokens=100, correct=correct, model="m", split=split, world_size=1, steps=8,
        input_tokens=4096, data={"corpus": "documents", "num_documents": 100},
        protocol={"name": "memoryless" if memoryless else "full", "segment_length": 512, "num_streams": 8,
                  "max_segments": 8, "memoryless": memoryless, "aggregate": "last"},
        macro_f1=value - 0.01)


def test_table3_averages_the_seeds_and_reads_the_test_evaluation(tmp_path):
    """A seeded cell: the mean of the seeds' numbers ± their sample sd, (n of 5); validation from the
    training's final evaluation, test from the evaluate command's file; the mean memory gain."""
    root = tmp_path / "runs"
    accuracies = {42: (0.80, 0.90), 43: (0.84, 0.94)}  # seed -> (validation, test), with the memory
    for seed, (val, test) in accuracies.items():
        run_dir = make_run(root, f"classify/hyperpartisan-memoria_roberta/seed{seed}", {})
        classification(val, "validation").save(run_dir / "eval" / "step_00001300_classification_full.json")
        classification(val - 0.1, "validation", True).save(
            run_dir / "eval" / "step_00001300_classification_memoryless.json")
        classification(test, "test").save(run_dir / "eval" / "test_classification_full.json")
        classification(test - 0.2, "test", True).save(run_dir / "eval" / "test_classification_memoryless.json")
    # a run launched without the record is still found, by its configuration and seed
    (root / "classify/hyperpartisan-memoria_roberta/seed43/repro.json").unlink()
    assert read_run(root / "classify/hyperpartisan-memoria_roberta/seed43").experiment == \
        "classify/hyperpartisan-memoria_roberta/seed43"

    info = collect([root], tmp_path / "out", ["table3"])
    md = Path(info["markdown"]).read_text()
    line = {(r.split(" | ")[0].lstrip("| "), r.split(" | ")[1]): r.split(" | ") for r in md.splitlines()
            if r.startswith("| Memoria RoBERTa")}
    assert line[("Memoria RoBERTa [512]", "Validation Acc")][2:5] == ["87.19 ± 0.01", "82.00 ± 2.83 (2 of 5)",
                                                                      "72.00 ± 2.83 (2 of 5)"]
    assert line[("Memoria RoBERTa [512]", "Test Acc")][3] == "92.00 ± 2.83 (2 of 5)"
    assert line[("Memoria RoBERTa [512]", "Test F1")][3] == "91.00 ± 2.83 (2 of 5)"
    assert line[("Memoria RoBERTa [512]", "Test Acc")][5] == "+20.00 points (mean)"
    assert line[("Memoria RoBERTa [512]", "Validation F1")][6].startswith("2 of 5 seeds run")
    assert "| BERT [512] | Test F1 | 91.67 ± 0.01 | - | - | - | 0 of 5 seeds run |" in md
    lines = rows(Path(info["csv"]).read_text())
    test_acc = [r for r in lines if r["row"] == "Memoria RoBERTa [512]" and r["column"] == "Test Acc"
                and r["protocol"] == "classification_full"]
    assert sorted((r["experiment"], r["ours"], r["split"]) for r in test_acc) == [
        ("classify/hyperpartisan-memoria_roberta/seed42", "90", "test"),
        ("classify/hyperpartisan-memoria_roberta/seed43", "94", "test")]
