"""Results collector: run directories -> the paper's tables with our numbers beside, as markdown and CSV.

    python launch/collect.py runs/repro [more roots or run dirs] [--out DIR] [--tables table1,table5]

A run directory is any directory with a `config.yaml` (written by the training at start).
Which paper experiment it is comes from its `repro.json` (written by the launchers, with
the scale: `paper` or `smoke`), or else from its configuration (entry kind, preset,
backbone, corpus, segment length, sorting segments) matched against
`memoria_ds.repro.experiments`. Our numbers are the latest `eval/step_*_<protocol>.json`
of the run (EvalResult JSON); each is printed with the protocol it was measured under, and
the paper's with the protocol the authors used; where a run was also scored `memoryless`, its
memory gain (`memoria_ds.eval.gain`) stands beside. Smoke runs, shortened runs (`max_steps`),
truncated evaluations and unfinished runs are labelled as such, never passed off as
reproductions.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..eval.gain import MemoryGain, memory_gain
from ..eval.result import EvalResult, read_results
from ..train.config import RunConfig
from ..train.parse import ConfigError, load
from .experiments import ENTRY_BASE_OVERRIDES, EXPERIMENTS, TABLES, Cell, Table

_EVAL_FILE = re.compile(r"^step_(\d{8})_(\w+)\.json$")
_SPLIT_FILE = re.compile(r"^(train|validation|test)_(\w+)\.json$")  # the evaluate command's, the run's settings
_SKIP_DIRS = {"checkpoints", "export", "eval", "tb", "standins", "analysis"}


@dataclass
class Run:
    """One run directory as the collector sees it."""

    path: Path
    config: RunConfig | None
    experiment: str | None
    scale: str  # "paper", "smoke" or "unknown" (not launched by the launchers)
    finished: bool
    results: dict[str, tuple[int, EvalResult]] = field(default_factory=dict)  # protocol -> (step, result)
    split_results: dict[tuple[str, str], EvalResult] = field(default_factory=dict)  # (split, protocol) -> result

    def result(self, protocol: str, split: str | None = None) -> tuple[int | None, EvalResult | None]:
        """(step, result) of `protocol`: the newest the training wrote, if of `split` (None: any), else the
        evaluate command's of `split` (its step unknown: None)."""
        if protocol in self.results and (split is None or self.results[protocol][1].split == split):
            return self.results[protocol]
        if split is not None and (split, protocol) in self.split_results:
            return None, self.split_results[(split, protocol)]
        return None, None

    @property
    def status(self) -> str:
        notes = []
        if self.scale == "smoke":
            notes.append("smoke run (CPU, stand-in data, tiny model): not a reproduction")
        elif self.config is not None and self.config.optim.max_steps is not None:
            notes.append(f"shortened (max_steps={self.config.optim.max_steps})")
        if not self.finished:
            notes.append("unfinished (no summary.json)")
        for _, r in self.results.values():
            notes += [n for n in r.notes if n.startswith("stopped after")]
        return "; ".join(dict.fromkeys(notes)) or "complete"


def identity(cfg: RunConfig) -> tuple:
    """What makes a run one paper experiment (independent of topology, batch split and paths); a
    classifier's includes its seed (Table 3 averages five)."""
    if cfg.model.task == "classification":
        return ("classification", cfg.model.preset, cfg.model.backbone.split("/")[-1], cfg.data.path,
                cfg.data.segment_length, cfg.data.max_segments, cfg.seed)
    sorting = cfg.data.corpus == "sorting"
    return (cfg.model.from_scratch, cfg.model.preset,
            None if cfg.model.from_scratch else cfg.model.backbone.split("/")[-1],
            cfg.data.corpus, cfg.data.segment_length,
            cfg.data.sorting_settings["num_segments"] if sorting else None)


@functools.lru_cache(maxsize=1)
def _experiment_identities() -> dict[tuple, str]:
    out = {}
    for e in EXPERIMENTS.values():
        cfg = load(RunConfig, e.config, [*ENTRY_BASE_OVERRIDES[e.entry_point], *e.overrides])
        out[identity(cfg)] = e.id
    return out


def find_runs(roots: Iterable[str | Path]) -> list[Path]:
    """Run directories (holding `config.yaml`) at or under each root, sorted."""
    found: set[Path] = set()
    for root in map(Path, roots):
        if not root.exists():
            raise ValueError(f"{root} does not exist")
        stack = [root]
        while stack:
            d = stack.pop()
            if (d / "config.yaml").is_file():
                found.add(d)
                continue
            stack += [c for c in d.iterdir() if c.is_dir() and c.name not in _SKIP_DIRS and not c.name.startswith(".")]
    return sorted(found)


def read_run(path: Path) -> Run:
    """The experiment, scale, status and latest evaluation of each protocol of one run directory."""
    try:
        cfg = load(RunConfig, path / "config.yaml")
    except ConfigError:
        cfg = None
    record = json.loads((path / "repro.json").read_text()) if (path / "repro.json").is_file() else {}
    experiment = record.get("experiment") or (_experiment_identities().get(identity(cfg)) if cfg else None)
    run = Run(path, cfg, experiment, record.get("scale", "unknown"), (path / "summary.json").is_file())
    for f in sorted((path / "eval").glob("step_*.json")) if (path / "eval").is_dir() else []:
        m = _EVAL_FILE.match(f.name)
        if m is None:
            continue
        step, name = int(m.group(1)), m.group(2)
        if name not in run.results or step >= run.results[name][0]:
            run.results[name] = (step, read_results(f)[0])
    for f in sorted((path / "eval").glob("*_*.json")) if (path / "eval").is_dir() else []:
        m = _SPLIT_FILE.match(f.name)
        if m is not None:
            run.split_results[(m.group(1), m.group(2))] = read_results(f)[0]
    return run


def metric_value(result: EvalResult, metric: str) -> float | None:
    """The number the paper reports: PPL, BPC, or accuracy or macro-F1 in percent."""
    if metric == "f1":
        return None if result.macro_f1 is None else 100.0 * result.macro_f1
    if metric == "accuracy":
        return None if result.accuracy is None else 100.0 * result.accuracy
    if metric == "bpc":
        return result.bpc
    return result.ppl


def describe_protocol(result: EvalResult) -> str:
    """One line: how this number was measured."""
    p = result.protocol
    if result.macro_f1 is not None:
        return (f"classification {p.get('name')}: {result.split} split, {result.data.get('num_documents', '?')} "
                f"documents, segments of {p.get('segment_length')}, at most {p.get('max_segments', '?')} per document, "
                f"prediction from {p.get('aggregate', 'last')}")
    if p.get("name") == "sorting":
        return (f"sorting: {result.split} split, {result.data.get('num_examples')} examples of "
                f"{p.get('segments_per_example')} segments of {p.get('segment_length')}, {p.get('scored')}")
    reset = p.get("reset", {}).get("policy", "?")
    scored = p.get("scored_per_full_segment")
    return (f"{p.get('name')}: {result.split} split, segments of {p.get('segment_length')}, "
            f"{p.get('num_streams')} stream(s), resets {reset}, {scored} of {p.get('segment_length')} scored per "
            f"segment; {result.scored_tokens:,} {'characters' if result.bpc is not None else 'targets'}")


_GAIN_PAIRS = (("full", "memoryless"), ("sorting", "sorting_memoryless"),
               ("classification_full", "classification_memoryless"))


@dataclass
class Line:
    """One number of a table (a cell, and one of our runs or none); a seeded cell's line holds every
    seed's run in `seed_runs` (its number their mean)."""

    table: Table
    cell: Cell
    run: Run | None
    seed_runs: list[Run] = field(default_factory=list)

    def ours(self, protocol: str) -> tuple[float | None, EvalResult | None, int | None]:
        """(our number, its result, its step); for a seeded cell the mean over the seeds that have it."""
        if self.seed_runs:
            values = self.seed_values(protocol)
            first = next((r for run in self.seed_runs if (r := run.result(protocol, self.cell.split)[1])), None)
            return (sum(values) / len(values) if values else None), first, None
        if self.run is None:
            return None, None, None
        step, r = self.run.result(protocol, self.cell.split)
        return (None if r is None else metric_value(r, self.cell.metric)), r, step

    def seed_values(self, protocol: str) -> list[float]:
        """The seeds' numbers (those that have one)."""
        out = []
        for run in self.seed_runs:
            r = run.result(protocol, self.cell.split)[1]
            v = None if r is None else metric_value(r, self.cell.metric)
            if v is not None:
                out.append(v)
        return out

    def spread(self, protocol: str) -> float | None:
        """The seeds' sample standard deviation (None below two)."""
        values = self.seed_values(protocol)
        if len(values) < 2:
            return None
        mean = sum(values) / len(values)
        return (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5

    def gain(self) -> MemoryGain | None:
        """The run's memory gain at its latest step, if it was also scored without its memory: `memoryless`
        beside `full`, or the sorting task's or a classifier's memoryless reading beside its own."""
        return _run_gain(self.run, self.cell.split) if self.run is not None else None

    def seed_gain(self) -> float | None:
        """A seeded classifier cell's mean memory gain in accuracy points (None if no seed has one)."""
        gains = [g for run in self.seed_runs if (g := _run_gain(run, self.cell.split)) and g.accuracy_with is not None]
        return (100 * sum(g.accuracy_with - g.accuracy_without for g in gains) / len(gains)) if gains else None


def _run_gain(run: Run, split: str | None) -> MemoryGain | None:
    for carried, bare in _GAIN_PAIRS:
        (step, a), (bare_step, b) = run.result(carried, split), run.result(bare, split)
        if a is not None and b is not None:
            return memory_gain([a, b]) if step == bare_step else None
    return None


def build_lines(runs: list[Run], tables: Iterable[str]) -> list[Line]:
    """Every cell of the chosen tables, once per run that reproduces it (once with no run if none)."""
    by_experiment: dict[str, list[Run]] = {}
    for r in runs:
        if r.experiment:
            by_experiment.setdefault(r.experiment, []).append(r)
    lines = []
    for name in tables:
        table = TABLES[name]
        for cell in table.cells:
            if cell.seeds:
                lines.append(Line(table, cell, None, [r for i in cell.run_ids() for r in by_experiment.get(i, [])]))
                continue
            matches = by_experiment.get(cell.experiment, []) if cell.experiment else []
            lines += [Line(table, cell, r) for r in matches] or [Line(table, cell, None)]
    return lines


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if metric in ("accuracy", "f1") else f"{v:.3f}"


def _fmt_seeds(line: Line, protocol: str) -> str:
    """A seeded cell: `mean ± sd (n of N)`."""
    values, sd = line.seed_values(protocol), line.spread(protocol)
    if not values:
        return "-"
    mean = _fmt(sum(values) / len(values), line.cell.metric)
    return f"{mean}{f' ± {sd:.2f}' if sd is not None else ''} ({len(values)} of {len(line.cell.seeds)})"


def _fmt_gain(gain: MemoryGain | None) -> str:
    if gain is None:
        return "-"
    if gain.accuracy_with is not None:
        return f"{100 * (gain.accuracy_with - gain.accuracy_without):+.2f} points"
    return f"{gain.nats_per_token:+.4f} nats/token"


def to_markdown(lines: list[Line], runs: list[Run]) -> str:
    out = io.StringIO()
    w = out.write
    w("# Results beside the paper's\n\n")
    w("Written by `launch/collect.py`. Smoke runs train a tiny model for a few steps on stand-in data: their "
      "numbers only show that the pipeline runs.\n")
    for table in dict.fromkeys(line.table for line in lines):
        rows = [line for line in lines if line.table is table]
        protocols = table.our_protocols
        w(f"\n## {table.title}\n\nPaper's numbers: {table.paper_protocol}.\n\n")
        gains = any(line.gain() is not None or line.seed_gain() is not None for line in rows)
        head = (["Model", "Column", "Paper"] + [f"Ours (`{p}`)" for p in protocols]
                + (["Memory gain"] if gains else []) + ["Status", "Run"])
        w("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        seen: dict[str, str] = {}
        for line in rows:
            cell, ours = line.cell, []
            for p in protocols:
                v, r, _ = line.ours(p)
                ours.append(_fmt(v, cell.metric))
                if r is not None:
                    seen.setdefault(describe_protocol(r), "")
            if line.seed_runs:
                ours = [_fmt_seeds(line, p) for p in protocols]
            if cell.experiment is None:
                status, run = "not implemented in memoria_ds (paper only)", "-"
            elif cell.seeds:
                found = {r.status for r in line.seed_runs}
                status = (f"{len(line.seed_runs)} of {len(cell.seeds)} seeds run"
                          + (f"; {'; '.join(sorted(found))}" if found else ""))
                run = f"`{cell.experiment}/seed*`"
            elif line.run is None:
                status, run = "not run", f"`{cell.experiment}`"
            else:
                status, run = line.run.status, f"`{line.run.path}`"
            if gains:
                if cell.seeds:
                    g = line.seed_gain()
                    ours.append("-" if g is None else f"{g:+.2f} points (mean)")
                else:
                    ours.append(_fmt_gain(line.gain()))
            paper = _fmt(cell.paper, cell.metric) + (f" ± {cell.paper_std:g}" if cell.paper_std is not None else "")
            w("| " + " | ".join([cell.row, cell.column, paper, *ours, status, run]) + " |\n")
        if seen:
            w("\nOur protocols, as recorded with the results:\n\n" + "".join(f"- {d}\n" for d in seen))
        if gains:
            w("\nMemory gain: the run's NLL with its memory reset before every segment (`memoryless`) minus its "
              "NLL with the memory carried (`full`), per scored token (sorting and classification: the accuracy with "
              "the memory minus without it, in points): what the memory is worth to that model.\n")
        if any(c.seeds for c in table.cells):
            w("\nSeeded cells: the mean over the seeds run, ± their sample standard deviation, (how many of the "
              "table's seeds). The paper's ± is printed as the paper prints it.\n")
    other = [r for r in runs if r.experiment is None]
    if other:
        w("\n## Runs that match no paper experiment\n\n" + "".join(f"- `{r.path}`\n" for r in other))
    return out.getvalue()


CSV_FIELDS = ["table", "row", "column", "metric", "paper", "paper_protocol", "ours", "protocol", "protocol_detail",
              "split", "scored", "step", "memory_gain", "scale", "status", "experiment", "run_dir"]


def to_csv(lines: list[Line]) -> str:
    """One line per number: every cell, under each of our protocols."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    singles = [Line(line.table, line.cell, r) for line in lines for r in line.seed_runs] + [
        line for line in lines if not line.seed_runs]
    for line in singles:
        cell, run, gain = line.cell, line.run, line.gain()
        for p in line.table.our_protocols:
            v, r, step = line.ours(p)
            writer.writerow({
                "table": line.table.name, "row": cell.row, "column": cell.column, "metric": cell.metric,
                "paper": cell.paper, "paper_protocol": line.table.paper_protocol,
                "ours": "" if v is None else f"{v:.6g}", "protocol": p,
                "protocol_detail": json.dumps(r.protocol, sort_keys=True) if r else "",
                "split": r.split if r else "", "scored": r.scored_tokens if r else "",
                "step": "" if step is None else step,
                "memory_gain": "" if gain is None else f"{gain.nats_per_token:.6g}", "scale": run.scale if run else "",
                "status": run.status if run else "", "experiment": (run.experiment if run else cell.experiment) or "",
                "run_dir": str(run.path) if run else "",
            })
    return out.getvalue()


def collect(roots: Iterable[str | Path], out_dir: str | Path, tables: Iterable[str] | None = None) -> dict[str, Any]:
    """Read every run under `roots`; write `results.md` and `results.csv` into `out_dir`.

    Returns:
        `{"markdown": path, "csv": path, "runs": n, "filled": cells with at least one number}`.

    Raises:
        ValueError: a root that does not exist, or an unknown table.
    """
    names = list(tables or TABLES)
    unknown = [t for t in names if t not in TABLES]
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}; choose from {sorted(TABLES)}")
    runs = [read_run(p) for p in find_runs(roots)]
    lines = build_lines(runs, names)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(to_markdown(lines, runs))
    (out / "results.csv").write_text(to_csv(lines))
    filled = sum(1 for line in lines if any(line.ours(p)[0] is not None for p in line.table.our_protocols))
    return {"markdown": str(out / "results.md"), "csv": str(out / "results.csv"), "runs": len(runs), "filled": filled}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("roots", nargs="+", help="run directories or folders holding them (e.g. runs/repro)")
    p.add_argument("--out", help="where results.md and results.csv go (default: the first root)")
    p.add_argument("--tables", help=f"comma-separated, default all: {','.join(TABLES)}")
    a = p.parse_args(argv)
    try:
        info = collect(a.roots, a.out or a.roots[0], a.tables.split(",") if a.tables else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(info["markdown"]).read_text())
    print(f"{info['runs']} runs read; {info['filled']} numbers filled; wrote {info['markdown']} and {info['csv']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
