"""Which memory should I use? Every kind on one recipe: quality against the plain model, and price.

    python -m memoria_ds.compare run books --variants all --seeds 0,1,2 -- --train plrabn12,lcet10 --heldout alice29,asyoulik
    python -m memoria_ds.compare run sorting --variants transformer,xl,memorizing --seeds 0 -- --segments 8
    python -m memoria_ds.compare run quickstart --variants transformer,xl,memoria --seeds 0,1
    python -m memoria_ds.compare report --from-docs --figure compare.png
    python -m memoria_ds.compare table runs/compare/books-1a2b3c4d5e docs/results/books-canterbury.json

`run TASK` runs what the comparison is missing (a finished run is never run again; one result
file per run under --results; a progress bar with the time left), measures the price per step of
each variant not yet priced (`benchmarks/model_step.py`), then prints the table and writes it
with the figure into the recipe's folder. Options after `--` go to the task's script
(benchmarks/real_text.py for `books` and `quickstart`, benchmarks/sorting.py for `sorting`):
they are the recipe. A variant is a preset with settings and optimiser knobs as the scripts take
them (`memorizing+memory_init='random'`, `compressive+opt.memory_lr=0.1`); `+run.bptt_example=true`
trains a sorting variant through all of an example's segments; `all` is every kind at its
preset. `transformer` is always run: every variant is paired with it, seed by seed.

`report` reads what is on disk, runs nothing: one table per recipe (and one figure of all,
or of --recipes). `--from-docs` adds the results the documentation reports (docs/results/*.json,
transcribed from the lab notebook with their page and section). `table FILE...` makes one table
of the given results and refuses results of different recipes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .recipes import TASKS, MixedRecipes, recipe_from_args, recipe_id, split_variant, split_variants
from .store import DOCS_RESULTS, ROOT, Comparison, load
from .table import CPU_SETTING, build, footnotes, heading, markdown, measured

ALL_KINDS = ("transformer", "xl", "compressive", "infinity", "memorizing", "memorizing_no_cache", "memformer", "memoria",
             "memory_mosaic", "memory_mosaic_carry", "memsizer", "memsizer_carry")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memoria_ds.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run what a comparison is missing, then its table and figure",
                         usage="python -m memoria_ds.compare run TASK [options] [-- the task script's options]")
    run.add_argument("task", choices=sorted(TASKS))
    run.add_argument("--variants", default="transformer,xl,memoria", help="comma-separated; `all`: every kind")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--results", default="runs/compare", help="the results root (default runs/compare)")
    run.add_argument("--threads", type=int, default=1, help="torch threads per run (one is bit-reproducible)")
    run.add_argument("--device", default="cpu", help="sorting runs: cpu or cuda")
    run.add_argument("--price", default=CPU_SETTING, help="price setting (cpu-small, cpu-tiny, gpu-gpt2) or none")
    run.add_argument("--rerun", action="store_true", help="run finished runs again (their files are replaced)")
    run.add_argument("--dry-run", action="store_true", help="say what would run, run nothing")
    report = sub.add_parser("report", help="one table per recipe from what is on disk; runs nothing")
    _outputs(report)
    report.add_argument("--results", nargs="*", default=None,
                        help="results roots or files (default runs/compare where it exists)")
    report.add_argument("--from-docs", action="store_true", help="also the documentation's results (docs/results)")
    report.add_argument("--recipes", help="comma-separated recipe names or ids (default: all)")
    report.add_argument("--update-docs", nargs="*", metavar="MD",
                        help="rewrite the `<!-- compare: NAME [compact] -->` blocks of these pages (default README.md "
                             "and docs/results.md)")
    table = sub.add_parser("table", help="one table of the given results; refuses mixed recipes")
    _outputs(table)
    table.add_argument("paths", nargs="+", help="run files, recipe folders, transcribed files")
    table.add_argument("--prices", nargs="*", default=None, help="price files or folders (default: docs/results)")
    return p


def _outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", help="also write the tables here")
    p.add_argument("--figure", help="write the quality-against-price figure here (PNG)")
    p.add_argument("--price-setting", default=CPU_SETTING, help="which CPU price the tables show (default cpu-small)")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []  # the task script's options: the recipe
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.script_args = script_args
    try:
        if a.command == "run":
            return run(p, a)
        if a.command == "report":
            return report(a)
        return one_table(a)
    except MixedRecipes as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    from . import runner

    task = TASKS[a.task]
    try:
        variants = list(ALL_KINDS) if a.variants == "all" else split_variants(a.variants)
        variants = ["transformer", *[v for v in variants if v != "transformer"]]
        seeds = [int(s) for s in a.seeds.split(",")]
        for v in variants:
            split_variant(v, task)
    except ValueError as e:
        p.error(f"--variants/--seeds: {e}")
    if a.price not in (*runner.PRICE_SETTINGS, "none"):
        p.error(f"--price {a.price}: one of {sorted(runner.PRICE_SETTINGS)} or none")
    args = runner.resolved_args(task, a.script_args, variants, seeds)  # the script's own checks: exit 2 on a mistake
    recipe = recipe_from_args(task, args, ROOT)
    root = Path(a.results)
    folder = root / f"{task.name}-{recipe_id(recipe)}"
    todo = runner.missing(folder, variants, seeds, a.rerun)
    total = len(variants) * len(seeds)
    print(f"recipe {folder.name}: {len(variants)} variants x {len(seeds)} seeds = {total} runs, "
          f"{total - len(todo)} done already, {len(todo)} to run; results in {folder}", flush=True)
    if a.dry_run:
        for v, s in todo:
            print(f"  would run {v} seed {s}")
        return 0
    runner.prepare(folder, recipe)
    failed = runner.run_all(task, recipe, folder, todo, a.script_args, a.threads, a.device, total)
    if a.price != "none":
        keys = runner.price_missing(a.price, variants, load(_price_files(root))[1])
        if keys:
            print(f"price per step ({a.price}): {', '.join(keys)}", flush=True)
            outcome = runner.measure_prices(root, a.price, keys)
            if outcome:
                failed.append(outcome)
                print(outcome, file=sys.stderr)
    comparisons, prices = load([folder, *_price_files(root)])  # after measuring: root/price may be new
    c = comparisons[recipe_id(recipe)]
    cpu_setting = a.price if a.price.startswith("cpu") else CPU_SETTING
    text = render([c], prices, cpu_setting)
    print(text)
    (folder / "table.md").write_text(text + "\n")
    _figure([c], prices, folder / "compare.png", cpu_setting)
    print(f"table: {folder / 'table.md'}\nfigure: {folder / 'compare.png'}")
    if failed:
        print(f"{len(failed)} failed: rerun the same command to retry them", file=sys.stderr)
        return 1
    return 0


def _price_files(root: Path | None = None) -> list[Path]:
    """The price files that exist: those `run` measured under `root`, and the documentation's."""
    found = [*([root / "price"] if root is not None else []), DOCS_RESULTS / "price.json"]
    return [p for p in found if p.exists()]


def render(comparisons: list[Comparison], prices: list[dict], cpu_setting: str, level: str = "###") -> str:
    """Markdown: per recipe a heading, the recipe stated once, its table and its footnotes."""
    out = []
    for c in comparisons:
        t = build(c, prices, cpu_setting)
        out += [f"{level} {c.title or c.name}", "", f"{heading(t)} {measured(t)}".strip(), "", markdown(t)]
        notes = footnotes(t)
        if notes:
            out += ["", notes]
        out.append("")
    return "\n".join(out).rstrip()


def _figure(comparisons: list[Comparison], prices: list[dict], path: Path, cpu_setting: str) -> None:
    from .figure import draw

    left_out = draw([build(c, prices, cpu_setting) for c in comparisons], path)
    if left_out:
        print(f"not in the figure (no price per step or no plain model to pair with): {'; '.join(left_out)}")


def _selected(comparisons: dict[str, Comparison], names: str | None) -> list[Comparison]:
    if not names:
        return list(comparisons.values())
    out = []
    for name in names.split(","):
        match = [c for c in comparisons.values() if name in (c.name, c.id) or c.id.startswith(name)]
        if not match:
            raise ValueError(f"--recipes: no recipe {name!r}; found: {', '.join(c.name for c in comparisons.values())}")
        out += match
    return out


def report(a: argparse.Namespace) -> int:
    paths = [Path(x) for x in a.results] if a.results is not None else (
        [Path("runs/compare")] if Path("runs/compare").exists() else [])
    if a.from_docs:
        paths.append(DOCS_RESULTS)
    if not paths:
        raise ValueError("no results: give --results DIR, --from-docs, or run a comparison first")
    comparisons, prices = load(paths)
    chosen = _selected(comparisons, a.recipes)
    text = render(chosen, prices, a.price_setting)
    if a.update_docs is not None:
        pages = [Path(x) for x in a.update_docs] or [ROOT / "README.md", ROOT / "docs" / "results.md"]
        for page in pages:
            changed = update_blocks(page, comparisons, prices, a.price_setting)
            print(f"{page}: {changed} block{'s' if changed != 1 else ''} rewritten")
    else:
        print(text)
    _write_outputs(a, text, chosen, prices)
    return 0


def _write_outputs(a: argparse.Namespace, text: str, chosen: list, prices: list[dict]) -> None:
    """The table into `--markdown`, the figure into `--figure`, where asked."""
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    if a.figure:
        _figure(chosen, prices, Path(a.figure), a.price_setting)


def one_table(a: argparse.Namespace) -> int:
    from .recipes import check_one_recipe

    comparisons, prices = load([Path(x) for x in a.paths])
    check_one_recipe({rid: (c.recipe, c.where or [c.name]) for rid, c in comparisons.items()})
    price_paths = [Path(x) for x in a.prices] if a.prices is not None else _price_files()
    if price_paths:
        prices += load(price_paths)[1]
    chosen = list(comparisons.values())
    text = render(chosen, prices, a.price_setting)
    print(text)
    _write_outputs(a, text, chosen, prices)
    return 0


BLOCK = re.compile(r"(<!-- compare: (?P<name>[\w.-]+)(?P<style> compact)? -->\n)(?P<body>.*?)(<!-- /compare -->)", re.S)


def block_text(c: Comparison, prices: list[dict], cpu_setting: str, compact: bool) -> str:
    """What a marked block of a page holds: the table of one recipe (and its footnotes)."""
    t = build(c, prices, cpu_setting)
    notes = footnotes(t)
    recipe = f"{heading(t)} {measured(t)}".strip()
    return f"{recipe}\n\n{markdown(t, 'compact' if compact else 'full')}\n" + (f"\n{notes}\n" if notes else "")


def update_blocks(page: Path, comparisons: dict[str, Comparison], prices: list[dict], cpu_setting: str) -> int:
    """Rewrite every `<!-- compare: NAME -->...<!-- /compare -->` block of `page` from the stored results.

    Raises:
        ValueError: a block names a recipe that is not loaded.
    """
    by_name = {c.name: c for c in comparisons.values()}
    text, count = page.read_text(), 0

    def fill(m: re.Match) -> str:
        nonlocal count
        if m["name"] not in by_name:
            raise ValueError(f"{page}: the block `compare: {m['name']}` names no loaded recipe; loaded: "
                             f"{', '.join(sorted(by_name))}")
        count += 1
        return m[1] + block_text(by_name[m["name"]], prices, cpu_setting, bool(m["style"])) + m[5]

    new = BLOCK.sub(fill, text)
    if new != text:
        page.write_text(new)
    return count


if __name__ == "__main__":
    sys.exit(main())
