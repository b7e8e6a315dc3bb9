"""The planner behind launch/repro/table*.sh: which runs a table needs, and their exact commands.

    python -m memoria_ds.repro.plan --table table5 --topology node --gpus 8 [--print report]
    python -m memoria_ds.repro.plan --table table4 --scale smoke --print commands -- optim.lr=1e-4

`--print report` (the launchers' dry run) shows, per run: the command, the resolved
configuration (every setting that differs from `RunConfig`'s defaults), the per-rank batch,
the estimated GPU memory per rank (model states under the chosen ZeRO stage, activations,
the engram state), the steps, and an A100-80GB GPU-hours estimate; then a summary.
`--print commands` (what the launchers execute) prints one `LOG<TAB>COMMAND` line per
run, shell-quoted, after creating each run directory with a `repro.json` record of what was
launched; finished runs (a `summary.json`) are skipped unless `--rerun`. At `--scale smoke`
the planner first writes the stand-in data the smoke runs read (memoria_ds.repro.standins,
under RUN_ROOT/standins; small local files, written once).

Everything after `--` (and any bare `key=value`) is appended to every training command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
import yaml

from ..train.cli import parse as parse_training_args
from ..train.config import RunConfig
from ..train.parse import ConfigError, to_dict
from . import encoder_estimates as enc
from . import footprint as fp
from .cost import Cost, Schedule, estimate_cost, schedule
from .experiments import ENTRY_BASE_OVERRIDES, EVALUATE, FILTERS, SMOKE_COMMON, TABLES, Experiment, select
from .standins import write_standins
from .topology import LAUNCHERS, TOPOLOGIES, BatchSplit, Topology, split_batch

ROOT = Path(__file__).resolve().parents[2]
SMOKE_DS = {"3": "ds_configs/cpu_zero3.json", "3-offload": "ds_configs/cpu_zero3.json"}
SMOKE_DS_DEFAULT = "ds_configs/cpu.json"  # ZeRO-2 over gloo


def repo_path(rel: str) -> str:
    """A repository file as the command should name it: relative from the repository root, else absolute."""
    return rel if Path.cwd().resolve() == ROOT else str(ROOT / rel)


@dataclass
class PlannedRun:
    experiment: Experiment
    run_dir: Path
    log: Path
    argv: list[str]
    cfg: RunConfig
    split: BatchSplit
    footprint: fp.Footprint
    schedule: Schedule
    cost: Cost
    done: bool
    evaluations: list[tuple[list[str], bool]]  # after training: (the evaluate command, done)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def plan_run(e: Experiment, *, topology: Topology, run_root: Path, smoke: bool, zero: str, gpu_memory_gib: float,
             global_batch: int | None, micro_batch: int | None, passthrough: list[str], count: bool) -> PlannedRun:
    """Resolve one experiment into its command and estimates.

    Raises:
        ValueError: the batch does not split over the ranks, nothing fits in GPU memory, or
            the configuration is invalid (ConfigError's message names the setting).
    """
    world = topology.world_size
    split = split_batch(global_batch or (e.smoke_batch if smoke else e.batch), world, micro_batch)
    run_dir = run_root / e.id
    standins = str(run_root / "standins")
    smoke_args = [a.replace("{standins}", standins) for a in (*SMOKE_COMMON, *e.smoke)] if smoke else []

    def args(ds: str) -> list[str]:
        return ["--config", repo_path(e.config), *e.overrides, f"run_dir={run_dir}", *split.overrides(),
                f"deepspeed={ds}", *smoke_args, *passthrough]

    base = ENTRY_BASE_OVERRIDES[e.entry_point]
    cfg = parse_training_args(args(repo_path(fp.SINGLE_GPU_CONFIG)), "", base)
    config = fp.model_config(cfg)
    if smoke:
        chosen = fp.estimate(cfg, world, "3" if zero in SMOKE_DS else "2", config)
        ds = SMOKE_DS.get(zero, SMOKE_DS_DEFAULT)
    elif zero == "auto":
        chosen = fp.choose_zero(cfg, world, gpu_memory_gib, config=config)
        ds = fp.ds_config_for(chosen.zero, world)
    else:
        chosen = fp.estimate(cfg, world, zero, config)
        ds = fp.ds_config_for(zero, world)
    final = args(repo_path(ds))
    cfg = parse_training_args(final, "", base)  # what the run will see (a passthrough `deepspeed=` wins)
    chosen = fp.estimate(cfg, world, chosen.zero, config)
    stage, offload, _ = fp.ZERO_CHOICES[chosen.zero]
    if cfg.model.task == "classification":
        sched = enc.schedule(cfg, world, e.eval_splits)
        cost = enc.estimate_cost(config, chosen.params["total"], sched, cfg, world, topology.num_nodes, stage, offload)
    else:
        sched = schedule(cfg, world, count=count)
        cost = estimate_cost(config, chosen.params["total"], sched, cfg, world, topology.num_nodes, stage, offload)
    node = topology.resolved_node_rank() if topology.launcher == "no-ssh" and topology.kind == "multinode" else None
    log = run_dir / ("launch.log" if node is None else f"launch.node{node}.log")
    argv = [*topology.launcher_args(), repo_path(e.entry_point), *final]
    # the evaluate command after training, once (on the first node under no-ssh)
    evaluations = [([sys.executable, repo_path(EVALUATE), str(run_dir), f"eval.split={split}"],
                    any((run_dir / "eval").glob(f"{split}_*.json"))) for split in e.eval_splits if not node]
    return PlannedRun(e, run_dir, log, argv, cfg, split, chosen, sched, cost, (run_dir / "summary.json").exists(),
                      evaluations)


# ------------------------------------------------------------------------------ output

def changed_settings(cfg: RunConfig) -> dict[str, Any]:
    """Dotted settings of `cfg` that differ from `RunConfig()`'s defaults."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict) and d and not prefix.endswith("memoria."):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: d}

    have, default = flat(to_dict(cfg)), flat(to_dict(RunConfig()))
    return {k: v for k, v in have.items() if default.get(k, object()) != v}


def report(runs: list[PlannedRun], topology: Topology, *, full_config: bool, gpu_memory_gib: float,
           standins: dict[str, Path], out=None) -> None:
    """The dry run: every run's command, configuration, batch, memory, steps and cost."""
    w = (out or sys.stdout).write
    w(f"topology: {topology.describe()}\n")
    for kind, path in standins.items():
        w(f"stand-in {kind} (smoke scale: not the paper's data): {path}\n")
    for i, r in enumerate(runs, 1):
        e, f, s, c = r.experiment, r.footprint, r.schedule, r.cost
        w(f"\n[{i}/{len(runs)}] {e.id}{'   (done: skipped unless --rerun)' if r.done else ''}\n")
        w(f"  run dir   {r.run_dir}   (output also in {r.log.name})\n")
        w(f"  command   {r.command}\n")
        for argv, done in r.evaluations:
            w(f"  then      {shlex.join(argv)}{'   (done)' if done else ''}\n")
        if full_config:
            w("  config    (resolved)\n")
            w("".join(f"              {line}\n" for line in yaml.safe_dump(to_dict(r.cfg), sort_keys=False).splitlines()))
        else:
            w("  config    (resolved: every setting that differs from RunConfig's defaults)\n")
            for k, v in changed_settings(r.cfg).items():
                w(f"              {k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}\n")
        b = r.split
        ranks = f"{b.world_size} rank{'s' if b.world_size > 1 else ''}"
        w(f"  batch     {b.batch} streams (memory rows) = {ranks} x {b.rows_per_rank} (micro-batch {b.micro_batch_size} "
          f"x accumulation {b.grad_accum}); {s.tokens_per_step:,} tokens per optimiser step\n")
        p = f.params
        w(f"  model     {p['total']:,} parameters (backbone {p['backbone']:,} + memory modules {p['memory']:,}); "
          f"{r.cfg.optim.precision}; ZeRO {f.zero} ({r.cfg.deepspeed})\n")
        row = f.engram_row
        if "vectors" in row:
            previous = (f", previous segment {fp.fmt_bytes(row['previous_segment'])}" if "previous_segment" in row
                        else "")
            mem = (f"engram state {f.rows_per_rank} rows x {fp.fmt_bytes(f.engram_bytes / f.rows_per_rank)} = "
                   f"{fp.fmt_bytes(f.engram_bytes)} (C = {row['capacity']} slots: vectors {fp.fmt_bytes(row['vectors'])} "
                   f"fp32, counts {fp.fmt_bytes(row['counts'])}{previous})")
        elif "keys_values" in row:
            mem = f"XL cache {f.rows_per_rank} rows x {fp.fmt_bytes(row['keys_values'])} = {fp.fmt_bytes(f.engram_bytes)}"
        elif len(row) > 1:  # a kind's own state (memory_kind(config).row_bytes)
            parts = ", ".join(f"{k} {fp.fmt_bytes(v)}" for k, v in row.items() if k != "capacity")
            mem = (f"recurrent state {f.rows_per_rank} rows x {fp.fmt_bytes(f.engram_bytes / f.rows_per_rank)} = "
                   f"{fp.fmt_bytes(f.engram_bytes)} ({parts})")
        else:
            mem = "no recurrent memory"
        cpu = f" (CPU {fp.fmt_bytes(f.model_states['cpu'])} per node)" if f.model_states["cpu"] else ""
        w(f"  memory    per rank (estimate): model states {fp.fmt_bytes(f.model_states['gpu'])}{cpu}; "
          f"activations {fp.fmt_bytes(f.activations)}; {mem}; total {fp.fmt_bytes(f.total)} "
          f"of {gpu_memory_gib:g} GiB\n")
        epochs = (f"{r.cfg.optim.epochs} epochs x {s.steps_per_epoch:,} = " if r.cfg.optim.max_steps is None
                  and s.steps_per_epoch else "max_steps: ")
        w(f"  steps     {epochs}{s.total_steps:,} optimiser steps; final evaluation {s.eval_steps:,} segments "
          f"({s.source})\n")
        w(f"  estimate  {c.step_s * 1e3:.1f} ms/step (compute {c.compute_s * 1e3:.1f}, latency {c.latency_s * 1e3:.1f}, "
          f"comms {c.comms_s * 1e3:.1f}) -> {c.hours:,.1f} h wall, {c.gpu_hours:,.1f} GPU-hours on A100 80GB "
          f"(rough: within about 2x, method in memoria_ds/repro/cost.py)\n")
    total = sum(r.cost.gpu_hours for r in runs)
    hours = sum(r.cost.hours for r in runs)
    w(f"\n{len(runs)} run{'s' if len(runs) != 1 else ''}, {hours:,.1f} h if run one after another, "
      f"{total:,.1f} GPU-hours in all (estimate)\n")


def write_record(run: PlannedRun, table: str, scale: str, topology: Topology) -> None:
    """`<run_dir>/repro.json`: which paper experiment this run is, at which scale, launched how."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "experiment": run.experiment.id, "table": table,
        "tables": [t.name for t in TABLES.values() if run.experiment.id in t.experiment_ids()],
        "scale": scale, "command": run.command, "topology": topology.describe(), "world_size": topology.world_size,
        "planned": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_commit": _git_commit(),
        "estimate": {"steps": run.schedule.total_steps, "gpu_hours_a100": round(run.cost.gpu_hours, 2)},
    }
    tmp = run.run_dir / f".repro.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run.run_dir / "repro.json")


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------ CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/repro/tableN.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The table scripts add --mode run | dry-run | smoke (launch/repro/common.sh) and pass --table "
               "themselves; docs/reproduction.md has examples.")
    p.add_argument("--table", required=True, choices=sorted(TABLES))
    p.add_argument("--print", dest="output", choices=["report", "commands"], default="report",
                   help="report: the dry run; commands: LOG<TAB>COMMAND lines for the launcher")
    p.add_argument("--scale", choices=["paper", "smoke"], default="paper",
                   help="paper settings, or the same pipeline scaled down for CPU (stand-in data, tiny model)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="single-gpu")
    p.add_argument("--gpus", type=int, help="ranks on the node (--topology node)")
    p.add_argument("--hostfile", help="DeepSpeed hostfile, `HOST slots=N` per line (--topology multinode)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="pdsh",
                   help="multinode: pdsh (ssh from the first node) or no-ssh (run on every node, e.g. under srun)")
    p.add_argument("--node-rank", type=int, help="this node's index for --launcher no-ssh (default $SLURM_NODEID)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--run-root", default="runs/repro", help="runs go to RUN_ROOT/<family>/<run> (default runs/repro)")
    p.add_argument("--zero", choices=["auto", *fp.ZERO_CHOICES], default="auto",
                   help="ZeRO stage; auto: the cheapest that fits --gpu-memory-gb by the estimate")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory per rank in GiB (A100 80GB)")
    p.add_argument("--global-batch", type=int, help="streams in all (default: the paper's; changing it departs from it)")
    p.add_argument("--micro-batch", type=int, help="at most this many streams per micro-batch (gradient accumulation)")
    for tag, flag in FILTERS.items():
        p.add_argument(flag, dest=tag, help=f"comma-separated {tag.replace('_', ' ')} values to run (default: all)")
    p.add_argument("--entries", help="comma-separated globs on run ids, e.g. 'sorting/L1024-*'")
    p.add_argument("--count-tokens", action="store_true",
                   help="prepare the corpora to count tokens exactly (else the documented approximations)")
    p.add_argument("--rerun", action="store_true", help="launch runs that already finished again")
    p.add_argument("--full-config", action="store_true", help="print the whole resolved configuration")
    p.add_argument("passthrough", nargs="*", help="overrides for every training command (after --)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_intermixed_args(argv)
    transformers.logging.set_verbosity_error()  # config warnings about GPT-2's token ids in small vocabularies
    try:
        topology = Topology(a.topology, a.gpus, a.hostfile, a.launcher, a.node_rank, a.master_port)
        filters = {t: getattr(a, t).split(",") for t in FILTERS if getattr(a, t)}
        experiments = select(a.table, filters, a.entries.split(",") if a.entries else ())
        smoke = a.scale == "smoke"
        kinds = sorted({k for e in experiments for k in e.standins}) if smoke else []
        standins = write_standins(Path(a.run_root) / "standins", kinds) if kinds else {}
        runs = []
        for e in experiments:
            try:
                runs.append(plan_run(e, topology=topology, run_root=Path(a.run_root), smoke=smoke, zero=a.zero,
                                     gpu_memory_gib=a.gpu_memory_gb, global_batch=a.global_batch,
                                     micro_batch=a.micro_batch, passthrough=a.passthrough, count=a.count_tokens))
            except (ValueError, ConfigError) as err:
                raise ValueError(f"{e.id}: {err}") from err
    except (ValueError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.output == "report":
        report(runs, topology, full_config=a.full_config, gpu_memory_gib=a.gpu_memory_gb, standins=standins)
        return 0
    for kind, path in standins.items():
        print(f"stand-in {kind} (smoke data, not the paper's): {path}", file=sys.stderr)
    for r in runs:
        if r.done and not a.rerun:
            print(f"skip {r.experiment.id}: finished ({r.run_dir / 'summary.json'}); --rerun to run it again",
                  file=sys.stderr)
        else:
            write_record(r, a.table, a.scale, topology)
            print(f"{r.log}\t{r.command}")
        for argv, done in r.evaluations:  # after its training (the launcher stops at a failed one)
            if not done or a.rerun or not r.done:
                print(f"{r.log}\t{shlex.join(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
