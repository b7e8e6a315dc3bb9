"""Command line of the training entry points (launch/finetune.py, launch/pretrain.py).

    deepspeed launch/finetune.py --deepspeed ds_configs/zero2.json [--config run.yaml] [key=value ...]
    python launch/finetune.py --config run.yaml            # one process, no launcher
    torchrun --nproc_per_node 2 launch/finetune.py ...     # also works

Overrides are dotted keys of `RunConfig` (`optim.lr=3e-5`, `model.preset=xl`,
`data.corpus=wikitext103`). Mistakes in the configuration stop the run before anything
starts, with a message that says what to change.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..eval.gain import memory_gain, part_gains
from .checkpoints import CheckpointError
from .config import RunConfig
from .run_lock import RunDirInUse, RunDirUnusable
from .run_lock import probe as probe_run_dir
from .sources import check_sources
from .parse import ConfigError, load


# What launch/classify.py adds before the command line's overrides (docs/encoders.md): the task,
# RoBERTa-base, the paper's segments of 512, and one optimiser step per batch of documents
# (`optim.bptt_segments` = the default `data.max_segments`, 8: the authors' loop).
CLASSIFY_OVERRIDES = ["model.task=classification", "data.corpus=documents", "model.backbone=roberta-base",
                      "data.segment_length=512", "eval.protocols=[full, memoryless]", "data.reset=document_start",
                      "optim.bptt_segments=8"]


def parse(argv: list[str] | None, description: str, base_overrides: list[str]) -> RunConfig:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--config", help="YAML or JSON run configuration (see memoria_ds/train/config.py)")
    p.add_argument("--deepspeed", help="DeepSpeed JSON (ds_configs/); same as deepspeed=PATH")
    p.add_argument("--resume", help="auto | a checkpoint path | none; same as checkpoint.resume=...")
    p.add_argument("--run-dir", help="same as run_dir=PATH")
    p.add_argument("--engine", choices=["deepspeed", "torch"], help="same as engine=...")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-5 model.preset=xl")
    a = p.parse_intermixed_args(argv)  # overrides may stand before or after the options
    overrides = list(a.overrides)  # the entry point's `base_overrides` are defaults: the user's file and overrides win
    if a.deepspeed:
        overrides.append(f"deepspeed={a.deepspeed}")
    if a.resume:
        overrides.append(f"checkpoint.resume={'null' if a.resume == 'none' else a.resume}")
    if a.run_dir:
        overrides.append(f"run_dir={a.run_dir}")
    if a.engine:
        overrides.append(f"engine={a.engine}")
    return load(RunConfig, a.config, overrides, defaults=list(base_overrides))


def describe_summary(summary: dict) -> str:
    """A few lines for the terminal; the whole summary is in <run_dir>/summary.json."""
    loss = summary["final_train_loss"]
    lines = [f"done: {summary['steps']} steps, final train loss {'n/a' if loss is None else f'{loss:.4f}'}"]
    for r in summary["eval"]:
        p = r["protocol"]
        metric = f"accuracy {r['accuracy']:.4f}" if r.get("accuracy") is not None else (
            f"bpc {r['bpc']:.4f}" if r.get("bpc") is not None else f"ppl {r['ppl']:.3f}")
        if r.get("macro_f1") is not None:  # a classifier: over documents
            lines.append(f"eval [{p['name']}] {r['split']}: {metric}, macro-F1 {r['macro_f1']:.4f} over "
                         f"{r['scored_tokens']} documents")
            continue
        lines.append(f"eval [{p['name']}] {r['split']}: {metric} over {r['scored_tokens']} scored tokens")
    gain = memory_gain(summary["eval"])
    if gain is not None:
        lines.append(gain.describe())
    lines += [g.describe() for g in part_gains(summary["eval"]).values()]
    lines.append(f"run directory: {summary['run_dir']} (summary.json, metrics.jsonl, eval/, checkpoints/)")
    if summary.get("export"):
        lines.append(f"Hugging Face export: {summary['export']}")
    return "\n".join(lines)


def _error_line(text: str) -> None:
    """An error on stderr in one write: the ranks' messages, printed at the same moment into one
    terminal or log, stay whole (a print writes the text and its newline separately)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (text + "\n").encode(errors="replace"))


def main(argv: list[str] | None = None, description: str = "Train Memoria GPT-2",
         base_overrides: list[str] | None = None) -> None:
    try:
        cfg = parse(argv, description, base_overrides or [])
        check_sources(cfg)  # a backbone or corpus on an unreachable hub: a few lines now, not a traceback later
        probe_run_dir(cfg.run_dir)  # another live run in this directory: refuse before any work
    except (ConfigError, RunDirInUse, RunDirUnusable) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    from . import faults

    faults.install()  # test-only fault injection; nothing unless MEMORIA_DS_FAULT names one
    if cfg.deterministic:  # before any CUDA work, in every rank's process
        from .determinism import make_deterministic

        make_deterministic()
    from . import distributed as dist_utils
    from .build import DataPreparationFailed
    from .health import DivergedState
    from .loop import NonFiniteLoss, run
    from .preemption import EXIT_STOPPED, Stopped

    info = dist_utils.init_distributed(use_deepspeed=cfg.engine == "deepspeed")
    if cfg.deterministic and info.is_main:
        print(f"deterministic: torch's deterministic algorithms on "
              f"(CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']})", flush=True)
    code = 0
    try:
        summary = run(cfg, info)
        if info.is_main:
            print(describe_summary(summary), flush=True)
    except Stopped as e:  # SIGTERM / SIGUSR1: the step's checkpoint is written; resume to continue
        if info.is_main:
            print(str(e), file=sys.stderr, flush=True)
        code = EXIT_STOPPED
    except ConfigError as e:  # found before training started: a mistake in the configuration
        _error_line(f"error (rank {info.rank}): {e}")
        code = 2
    except (CheckpointError, NonFiniteLoss, DivergedState, DataPreparationFailed) as e:
        _error_line(f"error (rank {info.rank}): {e}")
        code = 1
    dist_utils.leave(code)
