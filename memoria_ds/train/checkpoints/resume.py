"""Deciding what to resume from, and carrying a checkpoint across a world-size change.

Same world size: every rank loads the engine state and its own shard: the run continues
exactly (losses and memory equal to an uninterrupted run).

Different world size (2 -> 1, 1 -> 2, ...): DeepSpeed refuses to re-partition ZeRO
optimizer state with plain `load_checkpoint` (DeepSpeed issues #2898, #3810). memoria_ds
converts the engine folder to DeepSpeed's *universal checkpoint* once (rank 0 runs
`deepspeed.checkpoint.ds_to_universal --inject_missing_state`, ~seconds, written next to
the original as `engine_universal/`) and loads it with `checkpoint.load_universal`:
weights, optimizer moments and the schedule carry over. Memory rows and data streams are
re-sharded by global stream id (shards.py). RNG states cannot be mapped between different
numbers of ranks: they are re-seeded from (seed, step, rank), and the run says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import distributed as dist_utils
from .store import ENGINE_TAG, CheckpointError, CheckpointInfo, find_latest, list_checkpoints, step_of, validate
from ..config import RunConfig
from ...model.config import resolve_preset
from ..engine import memory_groups_apart, to_universal
from ..parse import to_dict

UNIVERSAL_TAG = "engine_universal"


def fingerprint(cfg: RunConfig) -> dict[str, str]:
    """Hashes of what must match for a checkpoint to be resumed: the model and the data layout."""
    # `compile` is how the model runs, not what it is: a compiled run resumes eagerly and back
    # (and checkpoints made before the field existed keep their hash)
    model = {k: v for k, v in to_dict(cfg.model).items() if k != "compile"} | {"lora": to_dict(cfg.lora)}
    data = {k: v for k, v in to_dict(cfg.data).items() if k not in ("num_proc", "reset")}
    # the classification task's fields count only where they act, so that a language model's
    # checkpoints made before they existed keep their hashes
    if model.get("task") == "lm":
        del model["task"]
    if data.get("corpus") != "documents":
        data.pop("label_field", None)
        data.pop("max_segments", None)
    if not data.get("in_order"):  # (added later: the default order keeps the hashes of earlier checkpoints)
        data.pop("in_order", None)
    data["train_batch_size"] = None  # checked by the stream state itself, with a clearer message
    return {
        "model": hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16],
        "data": hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16],
    }


def choose_checkpoint(cfg: RunConfig, log) -> CheckpointInfo | None:
    """The checkpoint to resume from per `checkpoint.resume`, or None to start fresh.

    Raises:
        CheckpointError: a named checkpoint that is unusable, or a fresh start over a run
            directory that already has checkpoints (it would be overwritten).
    """
    root = Path(cfg.run_dir) / "checkpoints"
    want = cfg.checkpoint.resume
    if want is None:
        if any(p is None for _, p in list_checkpoints(root)):
            raise CheckpointError(
                f"{cfg.run_dir} already has checkpoints; resume with `checkpoint.resume=auto` (or --resume auto), "
                f"or choose another run_dir"
            )
        return None
    if want == "auto":
        info, skipped = find_latest(root)
        if info is None and skipped:  # checkpoints, none usable: a silent fresh start would overwrite them
            raise CheckpointError(
                f"{root} holds checkpoints but none is usable: " + "; ".join(skipped) + ". Nothing was "
                f"overwritten. To start this run afresh on purpose, move {root} aside (or delete it) or choose "
                f"another run_dir; to try one of them anyway, --resume PATH says what is wrong with it"
            )
        for note in skipped:
            log(f"resume: skipping a newer unusable checkpoint: {note}")
        return info
    return validate(Path(want))


def set_aside_newer(info: CheckpointInfo, run_dir: Path, log) -> Path | None:
    """Move this run's checkpoints newer than the one resumed from into `checkpoints/abandoned/`.

    A rollback (an explicit older checkpoint, or `auto` past newer unusable ones) starts a new
    timeline: left in place, the newer checkpoints of the old one would be picked by the next
    `--resume auto` and would make pruning delete the checkpoint resumed from. They are moved,
    not deleted, and the log says where. Returns the folder they went to (None if none).
    """
    root = Path(run_dir) / "checkpoints"
    if Path(info.path).resolve().parent != root.resolve():
        return None  # resumed from another run's directory: nothing here to set aside
    newer = [p for p, _ in list_checkpoints(root) if step_of(p) > info.step]
    if not newer:
        return None
    target = root / "abandoned" / time.strftime("%Y%m%d-%H%M%S") / f"after_step_{info.step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    for p in newer:
        os.rename(p, target / p.name)
    log(f"resume: from step {info.step}, so the newer checkpoint(s) {', '.join(p.name for p in newer)} of the "
        f"abandoned timeline were set aside in {target} (not resumed by auto, not pruned; delete them when sure)")
    return target


# What a run writes into its directory besides checkpoints (the records a fresh start would mix into)
RUN_RECORDS = ("config.yaml", "ds_config.json", "metrics.jsonl", "summary.json", "eval", "tb", "export", "analysis",
               "wandb", "wandb_id")


def set_aside_records(run_dir: Path, log) -> Path | None:
    """Move an earlier run's records out of the way of a run that starts afresh in `run_dir`.

    A fresh start over checkpoints is refused (`choose_checkpoint`); a directory whose run left
    records but no checkpoint (killed before its first one, or its checkpoints deleted) would
    otherwise get the new run's records appended to or written over the old ones (metrics of two
    runs in one file, the old summary and export beside the new config). They are moved into
    `abandoned/<time>/`, not deleted, and the log says where. Returns that folder (None if none).
    """
    run_dir = Path(run_dir)
    found = [run_dir / name for name in RUN_RECORDS if (run_dir / name).exists()]
    if not found:
        return None
    target = run_dir / "abandoned" / time.strftime("%Y%m%d-%H%M%S")
    while target.exists():  # two fresh starts within a second
        target = target.with_name(target.name + "+")
    target.mkdir(parents=True)
    for p in found:
        os.rename(p, target / p.name)
    log(f"note: {run_dir} held the records of an earlier run but no checkpoint to resume; this run starts afresh "
        f"and set them aside in {target} ({', '.join(p.name for p in found)}; delete them when sure)")
    return target


def saved_streams(info: CheckpointInfo) -> int | None:
    """How many token streams the checkpoint's run had (`micro_batch_size * grad_accum * ranks`),
    from its manifest; None if the manifest does not say."""
    optim = info.manifest.get("meta", {}).get("config", {}).get("optim", {})
    micro, accum = optim.get("micro_batch_size"), optim.get("grad_accum")
    if type(micro) is not int or type(accum) is not int:
        return None
    return micro * accum * info.world_size


def check_compatible(info: CheckpointInfo, cfg: RunConfig, world_size: int) -> None:
    """Raise CheckpointError if this run cannot continue `info` on `world_size` ranks (read from
    the manifest only: before any conversion, engine or data work)."""
    streams = saved_streams(info)
    mine = cfg.optim.micro_batch_size * cfg.optim.grad_accum * world_size
    if streams is not None and streams != mine:
        optim = info.manifest["meta"]["config"]["optim"]
        raise CheckpointError(
            f"checkpoint {info.path} carries the memory of {streams} token streams (optim.micro_batch_size "
            f"{optim['micro_batch_size']} x optim.grad_accum {optim['grad_accum']} x {info.world_size} rank(s)) and this "
            f"run has {mine} ({cfg.optim.micro_batch_size} x {cfg.optim.grad_accum} x {world_size}): a resume keeps "
            f"micro_batch_size * grad_accum * ranks; choose values whose product is {streams}, or start a new run_dir"
        )
    # the optimizer's groups: the memory modules have their own only with memory_lr_scale != 1
    # or memory_delay_steps > 0
    optim = info.manifest.get("meta", {}).get("config", {}).get("optim", {})
    was_scale, was_delay = optim.get("memory_lr_scale", 1.0), optim.get("memory_delay_steps", 0)
    was, now = memory_groups_apart(was_scale, was_delay), memory_groups_apart(cfg.optim.memory_lr_scale,
                                                                              cfg.optim.memory_delay_steps)
    if was != now:
        raise CheckpointError(
            f"checkpoint {info.path} was made with optim.memory_lr_scale={was_scale} and "
            f"optim.memory_delay_steps={was_delay}, which "
            + ("gives the memory modules optimizer groups of their own" if was else
               "keeps one learning rate for all parameters")
            + f"; optim.memory_lr_scale={cfg.optim.memory_lr_scale} with optim.memory_delay_steps="
            f"{cfg.optim.memory_delay_steps} cannot continue its optimizer state: resume with "
            + ("a memory_lr_scale other than 1 or a memory_delay_steps above 0" if was else
               "memory_lr_scale=1 and memory_delay_steps=0")
            + " (any such values apply from the next step), or start a new run_dir"
        )
    # the PKM values have a group of their own only with optim.pkm_value_lr set (a model whose settings
    # name PKM layers; checkpoints made before the setting have no PKM layer)
    # (a language model's: an encoder's presets are not GPT-2's, and it has no PKM layer)
    if cfg.model.task == "lm" and resolve_preset(cfg.model.preset, **cfg.model.settings).get("pkm_layers"):
        was_values = optim.get("pkm_value_lr") is not None
        if was_values != (cfg.optim.pkm_value_lr is not None):
            raise CheckpointError(
                f"checkpoint {info.path} was made with optim.pkm_value_lr={optim.get('pkm_value_lr')}, which "
                + ("gives the PKM values an optimizer group of their own" if was_values else
                   "trains the PKM values with the other memory parameters")
                + f"; optim.pkm_value_lr={cfg.optim.pkm_value_lr} cannot continue its optimizer state: resume with "
                + ("a pkm_value_lr (any value applies from the next step)" if was_values else "pkm_value_lr=null")
                + ", or start a new run_dir"
            )
    saved = info.manifest.get("meta", {}).get("fingerprint", {})
    mine = fingerprint(cfg)
    for key in ("model", "data"):
        if saved.get(key) != mine[key]:
            raise CheckpointError(
                f"checkpoint {info.path} was made with a different `{key}` configuration "
                f"(saved {saved.get(key)}, now {mine[key]}); resume with the run's own config "
                f"({info.path.parent.parent / 'config.yaml'}) or start a new run_dir"
            )


def ensure_universal(info: CheckpointInfo, rank: int) -> str:
    """Convert the engine folder to a universal checkpoint once (rank 0); return its tag."""
    target = info.path / UNIVERSAL_TAG
    if rank == 0 and not (target / ".complete").is_file():
        tmp = info.path / f".{UNIVERSAL_TAG}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        error = to_universal(info.path / ENGINE_TAG, tmp)
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not convert {info.path} to a universal checkpoint for a new world size:\n{error}"
            )
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
        # the converter names its output folder (the temporary one) in `latest_universal`: name the final one
        (info.path / "latest_universal").write_text(UNIVERSAL_TAG)
    dist_utils.barrier()
    return UNIVERSAL_TAG


def describe_resume(info: CheckpointInfo, world_size: int) -> dict[str, Any]:
    return {"from": str(info.path), "step": info.step, "saved_world_size": info.world_size,
            "world_size": world_size, "resharded": info.world_size != world_size}
