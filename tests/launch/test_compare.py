"""python -m memoria_ds.compare: the table and figure from stored results (values by hand), the
refusal of mixed recipes, the resume of a half-done comparison through the real benchmark
scripts (tiny runs), and the docs' tables being the command's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memoria_ds.compare.__main__ import BLOCK, block_text, main
from memoria_ds.compare.recipes import TASKS, MixedRecipes, price_key, recipe_from_args, recipe_id, slug, split_variant
from memoria_ds.compare.store import DOCS_RESULTS, FORMAT, load
from memoria_ds.compare.table import build, markdown

ROOT = Path(__file__).resolve().parents[2]
BOOKS = {"task": "books", "script": "benchmarks/real_text.py", "train": "a.txt", "heldout": "b,c", "steps": 800,
         "streams": 8, "segment": 64, "layers": 2, "width": 128, "heads": 4, "num_wm": 16, "lr": 0.001,
         "weight_decay": 0.0, "grad_clip": 1.0, "reset": "document_start", "bptt": 1, "eval_segments": 16,
         "eval_windows": 0, "full_vocab": False}
TINY = ["--steps", "4", "--layers", "2", "--width", "32", "--heads", "2", "--streams", "2", "--segment", "16",
        "--eval-segments", "2", "--eval-windows", "2"]


def write_run(root: Path, recipe: dict, variant: str, seed: int, **fields) -> Path:
    folder = root / f"{recipe['task']}-{recipe_id(recipe)}"
    path = folder / slug(variant) / f"seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.json").write_text(json.dumps({"format": FORMAT, "recipe": recipe}))
    path.write_text(json.dumps({"format": FORMAT, "recipe": recipe, "variant": variant, "seed": seed, **fields}))
    return path


def price(variant: str, setting: str, **fields) -> dict:
    return {"variant": variant, "setting": setting, **fields}


def test_the_table_pairs_every_variant_with_the_plain_model_of_its_seed(tmp_path):
    """Two seeds by hand: xl is -10% and -10% on text b, +5% and -10% on text c."""
    for seed, (b, c) in enumerate([(100.0, 200.0), (110.0, 190.0)]):
        write_run(tmp_path, BOOKS, "transformer", seed, ppl={"b": b, "c": c}, memory_gain=0.0, cpu_s=60.0)
    write_run(tmp_path, BOOKS, "xl", 0, ppl={"b": 90.0, "c": 210.0}, memory_gain=0.02, cpu_s=66.0)
    write_run(tmp_path, BOOKS, "xl+opt.memory_lr=0.5", 1, ppl={"b": 121.0, "c": 171.0}, memory_gain=0.04)
    write_run(tmp_path, BOOKS, "xl", 1, ppl={"b": 99.0, "c": 171.0}, memory_gain=0.04, cpu_s=78.0)
    prices = tmp_path / "price.json"
    prices.write_text(json.dumps({"format": FORMAT, "prices": [
        price("transformer", "cpu-small", step_ratio=1.0, compute_ops_ratio=1.0),
        price("xl", "cpu-small", step_ratio=1.02, compute_ops_ratio=1.22),  # also the opt.-knob variant's step
        price("transformer", "gpu-gpt2", step_ratio=1.0), price("xl", "gpu-gpt2", step_ratio=1.29)]}))
    comparisons, found = load([tmp_path])
    (c,) = comparisons.values()
    t = build(c, found)
    rows = {r.variant: r for r in t.rows}
    xl = rows["xl"]
    assert xl.seeds == [0, 1] and xl.quality["b"] == (94.5, 4.5)
    assert (xl.vs_plain["b"].mean, xl.vs_plain["b"].lo, xl.vs_plain["b"].hi) == pytest.approx((-10.0, -10.0, -10.0))
    assert (xl.vs_plain["c"].mean, xl.vs_plain["c"].lo, xl.vs_plain["c"].hi) == pytest.approx((-2.5, -10.0, 5.0))
    assert xl.headline == pytest.approx((6.25, 3.75))  # -(mean over b, c), and the mean of the half-ranges
    assert xl.gain == pytest.approx((0.03, 0.01)) and xl.price["run_cpu_min"] == pytest.approx(1.2)
    assert [r.variant for r in t.rows] == ["transformer", "xl", "xl+opt.memory_lr=0.5"]  # plain first, best next
    lines = markdown(t).splitlines()
    assert lines[0] == ("| variant | seeds | b: ppl, vs plain % (min..max) | c: ppl, vs plain % (min..max) | memory gain "
                        "(nats/token) | CPU step × | compute ops × | GPU step × | run CPU min |")
    assert lines[2] == "| `transformer` | 0, 1 | 105.0 | 195.0 | 0 | 1.00 | 1.00 | 1.00 | 1.0 |"
    assert lines[3] == ("| `xl` | 0, 1 | 94.5, -10.0 (-10.0..-10.0) | 190.5, -2.5 (-10.0..+5.0) | +0.030 ± 0.010 "
                        "| 1.02 | 1.22 | 1.29 | 1.2 |")
    assert lines[4] == "| `xl+opt.memory_lr=0.5` | 1 | 121.0, +10.0 | 171.0, -10.0 | +0.040 | 1.02 | 1.22 | 1.29 |  |"

    figure, table = tmp_path / "f.png", tmp_path / "t.md"
    assert main(["table", str(tmp_path), "--prices", str(prices), "--figure", str(figure), "--markdown", str(table)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    assert lines[3] in table.read_text()


def test_sorting_accuracy_in_points_and_the_memory_gain_where_it_was_read(tmp_path):
    recipe = {"task": "sorting", "script": "benchmarks/sorting.py", "segments": 8}
    write_run(tmp_path, recipe, "transformer", 0, accuracy=0.20, accuracy_memoryless=0.20)
    write_run(tmp_path, recipe, "transformer", 1, accuracy=0.18, accuracy_memoryless=0.18)
    write_run(tmp_path, recipe, "xl", 0, accuracy=0.30, accuracy_memoryless=0.12)
    write_run(tmp_path, recipe, "xl", 1, accuracy=0.31)  # run before the reading without memory existed
    (c,) = load([tmp_path])[0].values()
    xl = next(r for r in build(c, []).rows if r.variant == "xl")
    assert xl.vs_plain["accuracy"].mean == pytest.approx(11.5) and xl.headline == pytest.approx((11.5, 1.5))
    assert xl.gain == pytest.approx((18.0, 0.0)) and xl.gain_seeds == 1
    assert "| `xl` | 0, 1 | 30.5 ± 0.5 | +11.5 (+10.0..+13.0) | +18.0 (1 seed) |" in markdown(build(c, []))


def test_results_of_different_recipes_are_refused_in_one_table(tmp_path, capsys):
    a = write_run(tmp_path / "r", BOOKS, "transformer", 0, ppl={"b": 1.0, "c": 1.0}, memory_gain=0.0)
    b = write_run(tmp_path / "r", {**BOOKS, "bptt": 2, "steps": 400}, "memformer", 0, ppl={"b": 1.0, "c": 1.0},
                  memory_gain=0.0)
    assert main(["table", str(a), str(b), "--prices"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refused: these results were measured under 2 recipes") and "bptt (1 against 2)" in err
    assert "steps (800 against 400)" in err and "one table per recipe" in err
    # `report` puts each recipe in its own table instead
    assert main(["report", "--results", str(tmp_path / "r")]) == 0
    assert capsys.readouterr().out.count("| `transformer` |") == 1
    # a run moved into another recipe's folder
    moved = a.parent.parent.parent / b.parent.parent.name / "transformer" / "seed0.json"
    moved.parent.mkdir(parents=True)
    moved.write_text(a.read_text())
    with pytest.raises(MixedRecipes, match="its recipe is not its folder's"):
        load([moved])
    # one variant and seed twice
    twice = tmp_path / "transcribed.json"
    twice.write_text(json.dumps({"format": FORMAT, "name": "x", "recipe": BOOKS, "results": [
        {"variant": "transformer", "seed": 0, "ppl": {"b": 1.0}}]}))
    with pytest.raises(ValueError, match="keep one of them"):
        load([a, twice])


def test_variants_run_options_and_price_keys():
    sorting, books = TASKS["sorting"], TASKS["books"]
    assert split_variant("memformer+memory_settings={'num_slots':64}+run.bptt_example=true", sorting) == (
        "memformer+memory_settings={'num_slots':64}", ["--bptt-example"])
    with pytest.raises(ValueError, match="run options are none"):
        split_variant("memformer+run.bptt_example=true", books)
    assert price_key("memorizing+memory_init='random'+opt.memory_lr=0.1+run.bptt_example=true") == "memorizing"
    assert price_key("memoria+engram_bias=-4.0") == "memoria+engram_bias=-4.0"
    assert slug("xl") == "xl" and "/" not in slug("a/b") and slug("a'b") != slug("a_b")
    with pytest.raises(ValueError, match=r"\+run.bptt_example=true"):
        recipe_from_args(sorting, {k: 1 for k in sorting.keys} | {"bptt_example": True, "segment_list": [8]}, ROOT)
    with pytest.raises(ValueError, match="one segment count per comparison"):
        recipe_from_args(sorting, {k: 1 for k in sorting.keys} | {"segments": "4,8", "segment_list": [4, 8]}, ROOT)


def test_the_docs_tables_are_the_commands_output_from_the_stored_results():
    """README.md's and results.md's tables are what `report --update-docs` writes from docs/results."""
    comparisons, prices = load([DOCS_RESULTS])
    by_name = {c.name: c for c in comparisons.values()}
    seen = 0
    for page in (ROOT / "README.md", ROOT / "docs" / "results.md"):
        for m in BLOCK.finditer(page.read_text()):
            assert m["body"] == block_text(by_name[m["name"]], prices, "cpu-small", bool(m["style"])), (
                f"{page.name}: the table of {m['name']} is not the stored results'; run "
                f"python -m memoria_ds.compare report --from-docs --update-docs")
            seen += 1
    assert seen >= 8
    names = {m["name"] for m in BLOCK.finditer((ROOT / "README.md").read_text())}
    assert {"sorting-8", "books-canterbury", "books-canterbury-bptt2"} <= names
    # every kind appears in the README's tables
    readme = (ROOT / "README.md").read_text()
    for kind in ("transformer", "xl", "compressive", "infinity", "memorizing", "memformer", "memory_mosaic",
                 "memory_mosaic_carry", "memoria"):
        assert f"`{kind}" in readme


def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "memoria_ds.compare", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_a_half_done_comparison_runs_only_what_is_missing(tmp_path):
    """Tiny real runs of benchmarks/real_text.py on the quickstart's book: seed 0 first; then a run
    of seed 1 is killed half-way (its lock left behind, no result); the same command with seeds 0
    and 1 runs seed 1 only, and the table holds both seeds, with the price of each step."""
    results = tmp_path / "runs"
    first = compare("run", "quickstart", "--variants", "xl", "--seeds", "0", "--results", str(results),
                    "--price", "cpu-tiny", "--", *TINY, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 runs, 0 done already, 2 to run" in first.stdout and "runs [" in first.stderr and "left" in first.stderr
    (folder,) = [p for p in results.iterdir() if p.name != "price"]
    done = {p: p.read_bytes() for p in folder.rglob("seed0.json")}
    assert len(done) == 2
    record = json.loads((folder / "xl" / "seed0.json").read_text())
    assert record["recipe"]["heldout"] == "bundled:validation" and record["recipe"]["steps"] == 4
    assert record["cpu_s"] > 0 and "bundled:validation" in record["ppl"] and "memory_gain" in record
    assert record["source"]["kind"] == "run" and "--variants xl --seeds 0" in record["source"]["command"]
    # a run of seed 1 killed half-way: its log and a lock of a process that is gone, no result
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (folder / "xl" / "seed1.lock").write_text(str(gone.pid))
    (folder / "xl" / "seed1.log").write_text("train: ...\n")

    second = compare("run", "quickstart", "--variants", "xl", "--seeds", "0,1", "--results", str(results),
                     "--price", "cpu-tiny", "--", *TINY, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "4 runs, 2 done already, 2 to run" in second.stdout and "price per step" not in second.stdout
    assert {p: p.read_bytes() for p in folder.rglob("seed0.json")} == done  # untouched
    assert (folder / "xl" / "seed1.json").exists() and not (folder / "xl" / "seed1.lock").exists()
    table = (folder / "table.md").read_text()
    assert "| `xl` | 0, 1 |" in table and "| `transformer` | 0, 1 |" in table
    assert (folder / "compare.png").stat().st_size > 10_000
    (c,) = load([folder])[0].values()
    xl = next(r for r in build(c, load([results / "price"])[1], "cpu-tiny").rows if r.variant == "xl")
    assert xl.price["compute_ops"] > 1 and xl.price["cpu_step"] > 0  # model_step.py's own counts at 2 x 32

    third = compare("run", "quickstart", "--variants", "xl", "--seeds", "0,1", "--results", str(results),
                    "--price", "cpu-tiny", "--", *TINY, cwd=tmp_path)
    assert third.returncode == 0 and "4 done already, 0 to run" in third.stdout
    # another recipe (more steps) is another folder, never mixed into this one
    dry = compare("run", "quickstart", "--variants", "xl", "--seeds", "0", "--results", str(results), "--dry-run",
                  "--", *TINY[:1], "5", *TINY[2:], cwd=tmp_path)
    assert dry.returncode == 0 and "0 done already, 2 to run" in dry.stdout and folder.name not in dry.stdout


def test_a_sorting_comparison_records_accuracy_and_passes_run_options(tmp_path):
    """Tiny real runs of benchmarks/sorting.py: the variant's `+run.bptt_example=true` reaches the
    script as --bptt-example; each run records accuracy with and without its memory."""
    results = tmp_path / "runs"
    done = compare("run", "sorting", "--variants", "memformer+run.bptt_example=true", "--seeds", "0", "--results",
                   str(results), "--price", "none", "--", "--segments", "2", "--segment", "32", "--train-examples", "16",
                   "--test-examples", "8", "--batch", "4", "--epochs", "1", "--layers", "2", "--width", "32",
                   "--heads", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(p.read_text()) for p in results.rglob("memformer*/seed0.json")]
    assert record["recipe"]["segments"] == 2 and "bptt_example" not in record["recipe"]
    assert "--bptt-example" in record["source"]["command"] and 0 <= record["accuracy_memoryless"] <= 1
    assert record["updates"] == 4  # one update per example: 16 examples in batches of 4
    assert "| `memformer+run.bptt_example=true` | 0 |" in done.stdout  # the answer in one segment: the same 4 updates


def test_a_variant_trained_with_other_updates_is_refused_beside_the_plain_model(tmp_path, capsys):
    """Where the answer spans two segments, --bptt-example makes one update per example against the
    plain model's one per scored segment: another schedule, refused."""
    recipe = {"task": "sorting", "script": "benchmarks/sorting.py", "segments": 2}
    write_run(tmp_path, recipe, "transformer", 0, accuracy=0.2, accuracy_memoryless=0.2, updates=8)
    write_run(tmp_path, recipe, "memformer+run.bptt_example=true", 0, accuracy=0.3, accuracy_memoryless=0.2, updates=4)
    assert main(["table", str(tmp_path), "--prices"]) == 2
    assert "made 4 updates, the plain model 8: another update schedule" in capsys.readouterr().err
