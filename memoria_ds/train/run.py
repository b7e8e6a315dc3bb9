"""A run as two records: what stays fixed (`RunContext`) and what a step changes (`RunState`).

`RunState` is the engine (weights, optimizer, schedule), the streams' position, the memory
of every micro-batch slot and the step. It is saved and loaded as one checkpoint
(`save` / `load`): the engine's own files plus this rank's shard (checkpoints/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import ExampleStreams, TokenStreams
from ..memory import MemoriaConfig
from .checkpoints import (CheckpointError, CheckpointInfo, describe_resume, ensure_universal, fingerprint,
                          list_checkpoints, load_all_shards, load_shard, make_shard, restore_memories,
                          save_checkpoint, seed_everything, set_rng_state)
from .build import run_label_names, unwrap
from .config import RunConfig
from .distributed import DistInfo
from .engine import DeepSpeedEngine, TrainEngine, versions
from .episodic import EpisodicTraining
from .health import check_before_save
from .parse import to_dict
from .run_lock import RunLock


@dataclass
class RunContext:
    """What a run knows once it is set up and does not change while it trains.

    Attributes:
        total_steps: steps of the run (segments of every stream).
        update_steps: the steps among them whose segment holds targets (the schedule's length).
        memoria_config: the memory's settings (None for `transformer` / `xl`).
        weights_at_start: the largest weight the run started from (kept across resumes), the
            baseline of the divergence check before each checkpoint (health.py).
        resumed: the checkpoint this run continued from, if any.
        task_ends: the steps after which a task's last document has been read (`eval.after_each_task`).
    """

    cfg: RunConfig
    info: DistInfo
    lock: RunLock
    precision: str
    corpora: dict[str, Any]
    vocab_size: int
    total_steps: int
    update_steps: int
    memoria_config: MemoriaConfig | None
    weights_at_start: float = 0.0
    resumed: CheckpointInfo | None = None
    task_ends: frozenset[int] = frozenset()

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def micro(self) -> int:
        return self.cfg.optim.micro_batch_size

    @property
    def accum(self) -> int:
        return self.cfg.optim.grad_accum

    @property
    def num_streams(self) -> int:
        return self.micro * self.accum * self.info.world_size

    @property
    def lora(self) -> bool:
        return self.cfg.lora.enabled

    def log(self, text: str) -> None:
        """A message from rank 0 (before the progress bar exists)."""
        rank0_print(self.info, text)


def rank0_print(info: DistInfo, text: str) -> None:
    if info.is_main:
        print(text, flush=True)


@dataclass
class RunState:
    """What a training step changes; checkpointed and restored as one.

    Attributes:
        memories: the memory of each micro-batch slot j (rows = its streams), None = fresh.
        discard: per slot, a device flag: its last loss was not finite, so its memory rows
            start fresh at the next step (OR-ed into the reset mask: no host sync).
        step: steps done.
        episodic: this rank's MbPA++ episodic memory and replay schedule (`episodic.enabled`), or None.
    """

    engine: TrainEngine
    streams: TokenStreams | ExampleStreams
    stream_ids: list[int]
    memories: list[Any]
    discard: list[torch.Tensor]
    step: int = 0
    episodic: EpisodicTraining | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    @classmethod
    def fresh(cls, engine: TrainEngine, streams: TokenStreams | ExampleStreams, slots: int,
              device: torch.device, episodic: EpisodicTraining | None = None) -> RunState:
        no = torch.zeros((), dtype=torch.bool, device=device)
        return cls(engine, streams, [int(s) for s in streams.stream_ids], [None] * slots, [no] * slots,
                   episodic=episodic)

    def save(self, ctx: RunContext, step: int) -> Path:
        """Checkpoint the engine and this rank's shard at `step` (every rank calls)."""
        for j, memory in enumerate(self.memories):
            if memory is not None:  # a slot whose last loss was not finite is saved fresh
                memory.reset(self.discard[j].expand(memory.batch_size))
                self.discard[j] = torch.zeros_like(self.discard[j])
        cfg = ctx.cfg
        root = ctx.run_dir / "checkpoints"
        good = [path.name for path, problem in list_checkpoints(root) if problem is None]
        check_before_save(step, self.model, self.memories, device=ctx.device, checkpoints=root,
                          last_good=good[-1] if good else None, max_memory=cfg.checkpoint.max_abs,
                          max_weight=cfg.checkpoint.max_weight_growth * max(1.0, ctx.weights_at_start))
        shard = make_shard(self.stream_ids, self.memories, self.streams.state_dict(), step, ctx.micro,
                           episodic=self.episodic.state_dict() if self.episodic is not None else None)
        meta = {"fingerprint": fingerprint(cfg), "config": to_dict(cfg), "versions": versions(),
                "engine": cfg.engine, "precision": ctx.precision,
                "zero_stage": getattr(self.engine, "zero_stage", None), "lora": ctx.lora,
                "weights_at_start": ctx.weights_at_start, "label_names": run_label_names(cfg, self.model)}
        return save_checkpoint(root, step, self.engine, shard, rank=ctx.info.rank, world_size=ctx.info.world_size,
                               exclude_frozen=ctx.lora, meta=meta, keep_last=cfg.checkpoint.keep_last)

    def load(self, ctx: RunContext, ckpt: CheckpointInfo) -> None:
        """Restore everything from `ckpt`; a world-size change goes through DeepSpeed's universal
        checkpoint and re-shards memory rows and streams by global stream id."""
        info = ctx.info
        same = ckpt.world_size == info.world_size
        note = describe_resume(ckpt, info.world_size)
        if same:
            tag = "engine"
        elif self.episodic is not None:
            raise CheckpointError(f"checkpoint {ckpt.path} holds an episodic memory sharded over {ckpt.world_size} "
                                  f"ranks (each rank's own documents): resume it on {ckpt.world_size} ranks")
        elif not isinstance(self.engine, DeepSpeedEngine):
            raise CheckpointError("a world-size change needs the DeepSpeed engine")
        else:
            tag = ensure_universal(ckpt, info.rank)
        try:
            self.engine.load(ckpt.path, tag, strict=not ctx.lora)
        except (ValueError, KeyError, TypeError) as e:  # engine state of the wrong shape (the plain engine's is ours)
            raise CheckpointError(f"checkpoint {ckpt.path}: its engine state cannot be loaded ({type(e).__name__}: "
                                  f"{e})") from None
        shards = [load_shard(ckpt, info.rank)] if same else load_all_shards(ckpt)
        for name, (was, now) in self.engine.apply_hyperparameters(ctx.cfg.optim).items():
            ctx.log(f"resume: optim.{name} changed since the checkpoint ({was} -> {now}): applied from step "
                    f"{ckpt.step + 1}, over the restored optimizer state and schedule position")
        mine = shards[0] if same else next(s for s in shards if s["rank"] == 0)
        try:
            self.streams.load_state_dict(mine["streams"])
            self.memories = restore_memories(shards, self.stream_ids, ctx.micro, ctx.device, ctx.memoria_config,
                                             model_config=unwrap(self.model).config)
            if self.episodic is not None:
                self.episodic.load(mine.get("episodic"))
        except (ValueError, KeyError, TypeError) as e:  # a shard that does not fit this run's streams or model
            raise CheckpointError(f"checkpoint {ckpt.path} cannot be resumed by this run: {e}") from None
        if same:
            set_rng_state(shards[0]["rng"])
        else:
            seed_everything(ctx.cfg.seed + 7919 * ckpt.step + info.rank)
            ctx.log(f"resume: {ckpt.world_size} -> {info.world_size} ranks: weights, optimizer and schedule via "
                    f"DeepSpeed's universal checkpoint; memory rows and streams re-sharded by stream id; "
                    f"RNG states re-seeded (they cannot be mapped between world sizes)")
        self.step = ckpt.step
        ctx.log(f"resume: {json.dumps(note)}")
