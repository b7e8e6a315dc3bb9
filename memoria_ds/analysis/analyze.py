"""The analysis command: a run (or a saved memory plus its trace) -> PNG plots of the memory.

    python launch/analyze.py RUN_DIR [--trace test] [--protocol paper] [--max-steps N] [--out DIR]
    python launch/analyze.py --state MEMORY.safetensors [--trace-file TRACE.jsonl] --out DIR

From a run directory it plots what is there: the training's memory statistics
(`metrics.jsonl`, every log step), every evaluation trace in the output folder, and the
memory states (each traced evaluation's final memory and the newest checkpoint shard, each
figure named after its source: `fig6_ltm_creation_test_paper`, `fig6_ltm_creation_checkpoint`). `--trace SPLIT` first evaluates the run's exported model on SPLIT with
the memory traced (one stream, memory carried through the split, as the paper's Figure 5
was measured on the test set) and saves the final memory, so the Figure 6/8/9 plots show
the engrams that survive the whole split. Output (default `RUN_DIR/analysis/`): the PNGs,
a CSV of each plot's data, and `figures.json` naming each figure's source.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from . import plots
from .memory_data import (MemorySnapshot, edge_weights_by_age, latest_shard, lifespans_by_kind, load_memory,
                          ltm_creation_percent)
from ..eval.trace import MemoryTrace, read_trace
from ..train.run_lock import nearest_existing


def traced_evaluation(run_dir: Path, out: Path, split: str, protocol: str = "paper", max_steps: int | None = None,
                      device: str | None = None, graph_every: int = 50) -> tuple[Path, Path | None]:
    """Evaluate the run's export on `split` with the memory traced; returns (trace, final state) paths.

    Raises:
        ValueError: a sorting run, a run without `export/`, or a model without Memoria memory.
    """
    import torch

    from ..eval import evaluate_lm, protocol_from_name
    from ..model import MemoriaGPT2LMHeadModel
    from ..train.build import load_corpora
    from ..train.config import RunConfig
    from ..train.parse import load

    cfg = load(RunConfig, run_dir / "config.yaml")
    if cfg.data.corpus == "sorting":
        raise ValueError("the memory trace reads a language-modelling split; the sorting task resets memory per example")
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        raise ValueError(f"{run_dir} has no export/ to evaluate (train with checkpoint.export=true)")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = MemoriaGPT2LMHeadModel.from_pretrained(export, dtype=torch.float32 if dev.type == "cpu" else None).to(dev)
    if model.config.memory_type != "memoria":
        raise ValueError(f"the run's model is `{model.config.memory_type}`: no engrams to trace")
    corpus = load_corpora(cfg.data, (split,), rank=0)[split]
    name = f"{split}_{protocol}"
    trace = MemoryTrace(out / f"trace_{name}.jsonl", state_path=out / f"memory_{name}.safetensors",
                        memoria_config=model.config.memoria_config, graph_every=graph_every)
    with trace:
        result = evaluate_lm(model, corpus, protocol_from_name(protocol, cfg.data.segment_length, 1, "never"),
                             model_name=str(run_dir), device=dev, max_steps=max_steps, on_step=trace,
                             output_path=str(out / f"eval_{name}.json"))
    print(f"traced evaluation: {result.summary()}", file=sys.stderr)
    return trace.path, trace.state_path


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    rows = [r for r in records if key in r]
    return [r["step"] for r in rows], [float(r[key]) for r in rows]


def plot_trace(records: list[dict[str, Any]], out: Path, name: str, xlabel: str, what: str) -> dict[str, Any]:
    """Figure 5 and the engram counts from trace or metrics records."""
    figures = {}
    steps, ages = _series(records, "memory/reminded_ltm_age")
    if steps:
        figures[f"fig5_reminded_ltm_age_{name}"] = {
            "path": str(plots.reminded_ltm_age(steps, ages, out / f"fig5_reminded_ltm_age_{name}.png", xlabel=xlabel,
                                               title=f"Mean age of reminded LTM engrams ({what})")),
            "source": what, "points": sum(1 for a in ages if math.isfinite(a))}
        figures[f"memory_kinds_{name}"] = {
            "path": str(plots.memory_kinds(records, out / f"memory_kinds_{name}.png", xlabel=xlabel,
                                           title=f"Engrams per kind ({what})")), "source": what}
    return figures


def state_tag(path: Path) -> str:
    """The name a memory file's figures carry: `checkpoint` for a checkpoint shard, the trace's
    name (`test_paper`) for a trace state, else the file's stem."""
    stem = Path(path).stem
    if stem.startswith("rank_"):
        return "checkpoint"
    return stem[len("memory_"):] if stem.startswith("memory_") else stem


def plot_state(snap: MemorySnapshot, out: Path, tag: str) -> dict[str, Any]:
    """Figures 6, 8, 9 and the lifespans from one memory state, named `<figure>_<tag>`
    (so the figures of a traced evaluation's memory and of a checkpoint's stand side by side)."""
    src = snap.source
    age, weight = edge_weights_by_age(snap)
    percent = ltm_creation_percent(snap)

    def path(name: str) -> Path:
        return out / f"{name}_{tag}.png"

    return {
        f"fig6_ltm_creation_{tag}": {"path": str(plots.ltm_creation(percent, path("fig6_ltm_creation"), source=src)),
                                     "source": src, "points": int(len(percent))},
        f"fig8_edge_weight_age_{tag}": {"path": str(plots.edge_weight_age(age, weight, path("fig8_edge_weight_age"),
                                                                         source=src)),
                                        "source": src, "points": int(len(age))},
        f"fig9_edge_weight_age_300_{tag}": {"path": str(plots.edge_weight_zoom(
            age, weight, path("fig9_edge_weight_age_300"), source=src)), "source": src},
        f"lifespans_{tag}": {"path": str(plots.lifespans(lifespans_by_kind(snap), path("lifespans"), source=src)),
                             "source": src},
    }


def analyze_run(run_dir: str | Path, out: str | Path | None = None, *, trace_split: str | None = None,
                protocol: str = "paper", max_steps: int | None = None, device: str | None = None,
                graph_every: int = 50) -> dict[str, Any]:
    """Every plot a run directory supports (see the module docstring); returns figure name -> info."""
    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    if trace_split:
        traced_evaluation(run_dir, out, trace_split, protocol, max_steps, device, graph_every)
    figures: dict[str, Any] = {}
    if (run_dir / "metrics.jsonl").is_file():
        figures.update(plot_trace(read_trace(run_dir / "metrics.jsonl"), out, "train", "optimiser step",
                                  "training, at log steps, mean over the rows of one micro-batch"))
    for trace in sorted(out.glob("trace_*.jsonl")):
        name = trace.stem[len("trace_"):]
        figures.update(plot_trace(read_trace(trace), out, name, "segment (memory step)", f"evaluation, {name}"))
    # every traced evaluation's final memory, and the newest checkpoint's: each under its own name
    states = sorted(out.glob("memory_*.safetensors")) + [s for s in [latest_shard(run_dir)] if s is not None]
    for state_file in states:
        try:
            figures.update(plot_state(load_memory(state_file), out, state_tag(state_file)))
        except ValueError as e:  # a baseline run: nothing to draw from
            print(f"no memory plots from {state_file}: {e}", file=sys.stderr)
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def analyze_files(out: str | Path, state: str | Path | None = None, trace: str | Path | None = None) -> dict[str, Any]:
    """Plots from a saved memory state and/or a trace (JSONL of per-step statistics)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {}
    if trace is not None:
        figures.update(plot_trace(read_trace(trace), out, Path(trace).stem, "step", str(trace)))
    if state is not None:
        figures.update(plot_state(load_memory(state), out, state_tag(Path(state))))
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def _check_arguments(a: argparse.Namespace) -> None:
    """Mistakes in the command line stop before any folder is made or model loaded (ValueError)."""
    if a.run_dir:
        run = Path(a.run_dir)
        if not run.is_dir():
            raise ValueError(f"{run} is not a directory; give a training run directory (config.yaml, metrics.jsonl)")
        if not ((run / "config.yaml").is_file() or (run / "metrics.jsonl").is_file()):
            raise ValueError(f"{run} is not a training run directory (no config.yaml or metrics.jsonl in it)")
    out = Path(a.out) if a.out else (Path(a.run_dir) / "analysis" if a.run_dir else None)
    if out is not None and not nearest_existing(out).is_dir():
        raise ValueError(f"--out {out}: {nearest_existing(out)} is a file; give a folder for the plots")
    if a.max_steps is not None and a.max_steps < 1:
        raise ValueError(f"--max-steps ({a.max_steps}) must be at least 1")
    if a.graph_every < 0:
        raise ValueError(f"--graph-every ({a.graph_every}) must be >= 0 (0: never)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", help="a training run directory")
    p.add_argument("--out", help="output folder (default RUN_DIR/analysis)")
    p.add_argument("--trace", dest="trace_split", help="evaluate the export on this split with the memory traced first")
    p.add_argument("--protocol", choices=["paper", "full"], default="paper", help="the traced evaluation's scoring")
    p.add_argument("--max-steps", type=int, help="trace at most this many segments")
    p.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    p.add_argument("--graph-every", type=int, default=50, help="graph statistics every N traced segments (0: never)")
    p.add_argument("--state", help="a memory state: a trace's memory_*.safetensors or a checkpoint's rank_XXXXX.safetensors")
    p.add_argument("--trace-file", help="a trace JSONL (or a metrics.jsonl) to plot with --state")
    a = p.parse_args(argv)
    try:
        _check_arguments(a)
        if a.run_dir:
            figures = analyze_run(a.run_dir, a.out, trace_split=a.trace_split, protocol=a.protocol,
                                  max_steps=a.max_steps, device=a.device, graph_every=a.graph_every)
        elif a.state or a.trace_file:
            if not a.out:
                p.error("--out is needed with --state / --trace-file")
            figures = analyze_files(a.out, a.state, a.trace_file)
        else:
            p.error("give a run directory, or --state and/or --trace-file")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, info in figures.items():
        print(f"{name}: {info['path']}  ({info['source']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
