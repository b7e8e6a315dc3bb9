"""The one training loop: DeepSpeed or plain PyTorch, one rank or many, fine-tuning or scratch.

Per optimiser step, every rank reads segment t of its `micro_batch_size * grad_accum`
streams and feeds them as `grad_accum` micro-batches, each with its own memory slot
(memory rows = streams; the memory never crosses ranks and adds no collective). Memory
rows are reset per the data reset policy (every 500 steps by default, optionally at
document starts, always at an epoch's first segment).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..data import VOCAB_SIZE, ExampleStreams, TokenStreams
from ..eval import EvalResult
from ..eval.configured import describe, evaluate_split
from ..eval.segments import forward_segment
from ..memory import graph_stats
from . import distributed as dist_utils
from . import faults
from .build import build_run_model, check_pretrained_settings, load_corpora, resolve_precision, unwrap
from .checkpoints import (CheckpointError, CheckpointInfo, check_compatible, choose_checkpoint, describe_resume,
                          ensure_universal, fingerprint, list_checkpoints, load_all_shards, load_shard, make_shard,
                          restore_memories, save_checkpoint, seed_everything, set_aside_newer, set_rng_state)
from .config import RunConfig
from .distributed import DistInfo
from .ds_config import read_ds_config, resolve_ds_config
from .engine import (DeepSpeedEngine, TorchEngine, TrainEngine, check_ds_config, guard_loss, versions,
                     zero3_construction)
from .export import export_hf
from .health import check_before_save, weights_magnitude
from .metrics import MetricsWriter
from .run_lock import RunDirInUse, RunLock
from .parse import ConfigError, dump, to_dict


class NonFiniteLoss(RuntimeError):
    """A loss was NaN or infinite and `optim.nan_policy` is `stop`."""


class _Window:
    """Training sums of one logging window, kept on the device (no host sync per step).

    A micro-batch whose loss is not finite adds nothing to the loss, scored-token and token
    sums; it is counted in `skipped`, and (if `track_first`) `first_bad` keeps the earliest
    one as `step * grad_accum + micro_batch` (`NONE` if there was none since the run started).
    """

    NONE = 2**62

    def __init__(self, device: torch.device, track_first: bool) -> None:
        self.track_first = track_first  # only `nan_policy=stop` names the first bad step
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_sum, self.scored, self.tokens, self.skipped = (zero.clone() for _ in range(4))
        self.first_bad = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.clear()

    def add(self, loss: torch.Tensor, bad: torch.Tensor, scored: torch.Tensor, tokens: torch.Tensor,
            code: int) -> None:
        good = ~bad
        self.loss_sum += torch.where(good, loss.double() * scored, 0.0)  # the same doubles as float(loss) * scored
        self.scored += torch.where(good, scored, 0)
        self.tokens += torch.where(good, tokens, 0)
        self.skipped += bad
        if self.track_first:
            torch.minimum(self.first_bad, torch.where(bad, code, self.NONE), out=self.first_bad)

    def clear(self) -> None:
        for t in (self.loss_sum, self.scored, self.tokens, self.skipped):
            t.zero_()
        self.skipped_steps, self.t0 = 0, time.time()
        self.last_step_applied = True  # the window's last optimizer step was applied (else no grad norm)


class Trainer:
    """Owns one run: build, resume, train, evaluate, checkpoint, export."""

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        self.run_dir = Path(cfg.run_dir)
        self.lock = RunLock(self.run_dir)
        self.device = info.device
        self.precision = resolve_precision(cfg.optim.precision, info.device)
        self.micro, self.accum = cfg.optim.micro_batch_size, cfg.optim.grad_accum
        self.num_streams = self.micro * self.accum * info.world_size
        if cfg.engine == "torch" and info.world_size != 1:
            raise ValueError("engine `torch` runs on one process; use engine `deepspeed` for several ranks")

    def log(self, text: str) -> None:
        """A message from rank 0 (before the progress bar exists)."""
        if self.info.is_main:
            print(text, flush=True)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        cfg, info = self.cfg, self.info
        check_pretrained_settings(cfg.model)  # before any data work
        self.resume_from: CheckpointInfo | None = dist_utils.broadcast_object(
            choose_checkpoint(cfg, self.log) if info.is_main else None
        )
        if self.resume_from is not None:
            check_compatible(self.resume_from, cfg)
        # DeepSpeed config mistakes (batch arithmetic, fp16 on CPU) stop the run before any data work
        self.ds_config = self._resolve_ds_config() if cfg.engine == "deepspeed" else None

        splits = ("train",) + ((cfg.eval.split,) if (cfg.eval.at_end or cfg.eval.every) else ())
        self.corpora = load_corpora(cfg.data, splits, info.rank)
        train = self.corpora["train"]
        self.sorting = cfg.data.corpus == "sorting"
        if self.sorting:
            self.streams = ExampleStreams(
                train, batch_size=self.num_streams, segment_length=cfg.data.segment_length, rank=info.rank,
                world_size=info.world_size, shuffle=True, seed=cfg.seed, drop_last=True,
            )
            vocab = VOCAB_SIZE
        else:
            self.streams = TokenStreams(
                train, num_streams=self.num_streams, segment_length=cfg.data.segment_length, rank=info.rank,
                world_size=info.world_size, tail=cfg.data.tail, shuffle_documents=cfg.data.shuffle_documents,
                seed=cfg.seed,
            )
            vocab = train.metadata.get("vocab_size")
        self.stream_ids = [int(s) for s in self.streams.stream_ids]  # global ids of this rank's rows
        self.vocab_size = vocab
        self.total_steps = cfg.optim.max_steps or cfg.optim.epochs * self.streams.steps_per_epoch
        # optimizer updates (the learning-rate schedule's length): steps whose segment holds targets
        self.update_steps = self.streams.count_target_steps(self.total_steps)

        seed_everything(cfg.seed)  # the same initial weights on every rank
        with zero3_construction(self.ds_config):  # under ZeRO-3: built straight into partitions
            model = build_run_model(cfg, self.vocab_size)
        self.lora = cfg.lora.enabled
        self.engine = self._build_engine(model)
        self.model = self.engine.module
        self.memoria_config = (unwrap(self.model).config.memoria_config
                               if unwrap(self.model).config.memory_type == "memoria" else None)

        self.start_step = 0
        self.memories: list[Any] = [None] * self.accum
        # discard[j]: micro-batch slot j's last loss was not finite; its memory rows start
        # fresh at the next step (a device flag, OR-ed into the reset mask: no host sync)
        self._no = torch.zeros((), dtype=torch.bool, device=self.device)
        self.discard = [self._no] * self.accum
        seed_everything(cfg.seed + 1000 * (info.rank + 1))  # dropout streams differ per rank
        if self.resume_from is not None:
            self._resume(self.resume_from)
        # the largest weight the run started from (kept across resumes): the baseline of the
        # divergence check before each checkpoint (health.py)
        start = (self.resume_from.manifest.get("meta", {}) if self.resume_from is not None else {}).get("weights_at_start")
        self.weights_at_start = float(start) if start is not None else weights_magnitude(self.model, self.device)
        # created (and locked: one run per directory) only now that the run can start; the
        # outcome is collective so that every rank stops if another run took the directory first
        in_use = None
        if info.is_main:
            try:
                self.lock.acquire()
            except RunDirInUse as e:
                in_use = str(e)
        in_use = dist_utils.broadcast_object(in_use)
        if in_use is not None:
            raise ConfigError(in_use)
        if info.is_main:
            if self.resume_from is not None:
                set_aside_newer(self.resume_from, self.run_dir, self.log)
            dump(cfg, self.run_dir / "config.yaml")
            if isinstance(self.engine, DeepSpeedEngine):
                (self.run_dir / "ds_config.json").write_text(json.dumps(self.engine.config, indent=1))
        dist_utils.barrier()

    def _resolve_ds_config(self) -> dict[str, Any]:
        ds = resolve_ds_config(read_ds_config(self.cfg.deepspeed), self.cfg.optim, world_size=self.info.world_size,
                               precision=self.precision, device_type=self.device.type)
        check_ds_config(ds)
        if self.resume_from is not None and self.resume_from.world_size != self.info.world_size:
            ds["checkpoint"] = dict(ds.get("checkpoint", {}), load_universal=True)
        return ds

    def _build_engine(self, model) -> TrainEngine:
        if self.cfg.engine == "torch":
            return TorchEngine(model, self.device, self.cfg.optim, self.update_steps, self.precision)
        model.to(self.device)
        return DeepSpeedEngine(model, self.ds_config, self.cfg.optim, self.update_steps)

    def _resume(self, ckpt: CheckpointInfo) -> None:
        info = self.info
        same = ckpt.world_size == info.world_size
        note = describe_resume(ckpt, info.world_size)
        if same:
            self.engine.load(ckpt.path, "engine", strict=not self.lora)
            shards = [load_shard(ckpt, info.rank)]
        else:
            if not isinstance(self.engine, DeepSpeedEngine):
                raise CheckpointError("a world-size change needs the DeepSpeed engine")
            tag = ensure_universal(ckpt, info.rank)
            self.engine.load(ckpt.path, tag, strict=not self.lora)
            shards = load_all_shards(ckpt)
        for name, (was, now) in self.engine.apply_hyperparameters(self.cfg.optim).items():
            self.log(f"resume: optim.{name} changed since the checkpoint ({was} -> {now}): applied from step "
                     f"{ckpt.step + 1}, over the restored optimizer state and schedule position")
        mine = shards[0] if same else next(s for s in shards if s["rank"] == 0)
        self.streams.load_state_dict(mine["streams"])
        self.memories = restore_memories(shards, self.stream_ids, self.micro, self.device, self.memoria_config)
        if same:
            set_rng_state(shards[0]["rng"])
        else:
            seed_everything(self.cfg.seed + 7919 * ckpt.step + info.rank)
            self.log(f"resume: {ckpt.world_size} -> {info.world_size} ranks: weights, optimizer and schedule via "
                     f"DeepSpeed's universal checkpoint; memory rows and streams re-sharded by stream id; "
                     f"RNG states re-seeded (they cannot be mapped between world sizes)")
        self.start_step = ckpt.step
        self.log(f"resume: {json.dumps(note)}")

    # ------------------------------------------------------------------ training
    def train(self) -> dict[str, Any]:
        """The loop. Nothing in a step waits for the device: losses, token counts and
        non-finite losses accumulate as device tensors (`_Window`) and are read once per
        logging window (and before an evaluation or a checkpoint), as nanoGPT reads its loss
        only at log steps. A non-finite loss is back-propagated as NaN (`guard_loss`), so the
        engine's own check skips that optimizer step, and the memory rows of its micro-batch
        start fresh at the next step."""
        cfg, info = self.cfg, self.info
        if self.start_step >= self.total_steps:
            return self._already_done()
        writer = MetricsWriter(self.run_dir, enabled=info.is_main, total_steps=self.total_steps,
                               initial_step=self.start_step, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress,
                               resumed_at=self.start_step if self.resume_from is not None else None,
                               wandb=({"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode,
                                       "config": to_dict(cfg)} if cfg.log.wandb else None))
        policy = cfg.data.reset_policy
        window = _Window(self.device, track_first=cfg.optim.nan_policy == "stop")
        batches = iter(self.streams)
        step_stats: list = []  # the memory statistics of the step's micro-batches
        last_loss: float | None = None
        self.engine.train()
        for step in range(self.start_step, self.total_steps):
            batch = next(batches, None)
            if batch is None:  # epoch finished: the streams move to the next one
                batches = iter(self.streams)
                batch = next(batches)
            batch = batch.to(self.device)
            reset = policy.reset_mask(batch, step)
            step_stats = []
            # A segment without targets (the sorting task's input) runs forward only, to write
            # the memory: no loss, no gradient, no optimizer step (it would be all zeros).
            update = self.streams.has_targets(batch.step)
            for j in range(self.accum):
                rows = slice(j * self.micro, (j + 1) * self.micro)
                micro = batch.rows(rows)
                targets = micro.targets
                with torch.set_grad_enabled(update):
                    out = forward_segment(self.engine, micro, self.memories[j], reset[rows] | self.discard[j],
                                          labels=targets if update else None)
                if out.memory_stats is not None:
                    step_stats.append(out.memory_stats)
                if not update:
                    self.memories[j], self.discard[j] = out.memory, self._no
                    window.tokens += micro.attention_mask.sum()
                    continue
                loss = out.loss
                if j == 0 and info.rank == 0 and faults.active("nan_loss", step + 1):
                    loss = loss * float("nan")
                scored = (targets != -100).sum()
                loss, bad = guard_loss(loss, scored)
                self.engine.backward(loss)
                self.memories[j], self.discard[j] = out.memory, bad
                window.add(loss.detach(), bad, scored, micro.attention_mask.sum(), step * self.accum + j)
            if update:
                window.last_step_applied = self.engine.step()
                window.skipped_steps += not window.last_step_applied
            done = step + 1
            writer.advance()
            if done % cfg.log.every == 0 or done == self.total_steps:
                last_loss = self._log_window(writer, done, window, step_stats)
            if cfg.eval.every and done % cfg.eval.every == 0 and done != self.total_steps:
                self._stop_if_nonfinite(window)
                self.evaluate(writer, done)
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == self.total_steps:
                self._stop_if_nonfinite(window)
                self.save(done)
            if faults.active("kill_after_step", done):
                faults.kill(f"after step {done}")
        self._stop_if_nonfinite(window)
        results = self.evaluate(writer, self.total_steps) if cfg.eval.at_end else []
        export_dir = None
        if cfg.checkpoint.export:
            export_dir = export_hf(self.cfg, self.engine, self.model, vocab_size=self.vocab_size,
                                   is_main=self.info.is_main, log=self.log, step=self.total_steps, results=results)
        writer.close()
        summary = {"steps": self.total_steps, "final_train_loss": last_loss,
                   "eval": [r.to_dict() for r in results], "export": str(export_dir) if export_dir else None,
                   "run_dir": str(self.run_dir)}
        if info.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _already_done(self) -> dict[str, Any]:
        """Resumed at the last step: nothing to train, evaluate or export again; the records stand."""
        self.log(f"the run already reached step {self.total_steps} (its last); nothing to do. To train further, "
                 f"raise optim.max_steps (or optim.epochs) and resume")
        path = self.run_dir / "summary.json"
        if path.exists():
            return json.loads(path.read_text())
        return {"steps": self.total_steps, "final_train_loss": None, "eval": [], "export": None,
                "run_dir": str(self.run_dir)}

    def _stop_if_nonfinite(self, window: _Window) -> None:
        """Under `optim.nan_policy=stop`, raise if any rank saw a non-finite loss (one host sync).

        Called before an evaluation or a checkpoint, at log steps and at the end, so no
        checkpoint is written after the first non-finite loss. The update of that step was
        already skipped by the engine (`guard_loss`)."""
        if self.cfg.optim.nan_policy != "stop":
            return
        first = dist_utils.all_min(window.first_bad)
        if first == _Window.NONE:
            return
        step, micro = divmod(first, self.accum)
        where = f"rank {self.info.rank}" if int(window.first_bad) == first else "another rank"
        raise NonFiniteLoss(
            f"non-finite loss at step {step + 1} (micro-batch {micro}, {where}); stopped by optim.nan_policy=stop. "
            f"The last good checkpoint is kept in {self.run_dir / 'checkpoints'}; lower optim.lr or use "
            f"nan_policy=skip"
        )

    def _log_window(self, writer: MetricsWriter, step: int, w: _Window, stats: list) -> float | None:
        """Log the window's means (one host read); the loss is None if every micro-batch was skipped."""
        self._stop_if_nonfinite(w)
        loss_sum, scored, tokens, skipped, skipped_steps = dist_utils.all_sum_tensor(
            torch.stack([w.loss_sum, w.scored, w.tokens, w.skipped, w.loss_sum.new_tensor(w.skipped_steps)]))
        elapsed = max(time.time() - w.t0, 1e-9)
        loss = loss_sum / scored if scored else None
        values = {"loss": loss, "ppl": math.exp(min(loss, 50.0)) if scored else None,
                  "tok/s": tokens / elapsed, "lr": self.engine.lr(), "skipped_micro_batches": skipped,
                  "skipped_steps": skipped_steps, "epoch": (step - 1) // self.streams.steps_per_epoch}
        norm = self.engine.grad_norm() if w.last_step_applied else None  # a skipped step has none
        if norm is not None:
            values["grad_norm"] = norm
        if self.device.type == "cuda":
            values["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        # memory statistics of this step, averaged over every micro-batch slot of rank 0
        summaries = [s.summary() for s in stats]
        for key in summaries[0] if summaries else ():
            finite = [x[key] for x in summaries if x[key] == x[key]]
            values[key] = sum(finite) / len(finite) if finite else float("nan")
        graphs = [graph_stats(m.state) for m in self.memories if m is not None and hasattr(m, "state")]
        for key in graphs[0] if graphs else ():  # O(C^2) per row: only at logging steps
            values[f"memory/graph_{key}"] = float(torch.cat([g[key] for g in graphs]).mean())
        writer.log(step, values)
        w.clear()
        return loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, writer: MetricsWriter, step: int) -> list[EvalResult]:
        cfg = self.cfg
        corpus = self.corpora.get(cfg.eval.split)
        if corpus is None:
            return []
        self.engine.eval()
        results = evaluate_split(
            self.model, corpus, data=cfg.data, evaluation=cfg.eval, rank=self.info.rank,
            world_size=self.info.world_size, device=self.device, out_dir=self._eval_dir(),
            label=(f"{cfg.model.preset}@step_{step:08d}" if self.sorting
                   else f"{cfg.model.backbone}:{cfg.model.preset}@step_{step:08d}"),
            sorting_batch_size=self.num_streams, trace=self._trace if step == self.total_steps else None,
        )
        for result in results:
            line, values = describe(result)
            kind = "eval_sorting" if result.accuracy is not None else f"eval_{result.protocol['name']}"
            writer.log(step, values, kind=kind)
            writer.message(f"eval step {step} {line}")
        self.engine.train()
        return results

    def _trace(self, protocol: str):
        """A memory trace of the final evaluation (rank 0's streams), if `eval.trace`."""
        if not (self.cfg.eval.trace and self.info.is_main and self.memoria_config is not None):
            return None
        from ..eval.trace import MemoryTrace

        d = self._eval_dir()
        return MemoryTrace(d / f"trace_{protocol}.jsonl", state_path=d / f"memory_{protocol}.safetensors",
                           memoria_config=self.memoria_config, graph_every=10)

    def _eval_dir(self) -> Path:
        path = self.run_dir / "eval"
        path.mkdir(exist_ok=True)
        return path

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        for j, memory in enumerate(self.memories):
            if memory is not None:  # a slot whose last loss was not finite is saved fresh
                memory.reset(self.discard[j].expand(memory.batch_size))
                self.discard[j] = self._no
        root = self.run_dir / "checkpoints"
        good = [path.name for path, problem in list_checkpoints(root) if problem is None]
        limits = self.cfg.checkpoint
        check_before_save(step, self.model, self.memories, device=self.device, checkpoints=root,
                          last_good=good[-1] if good else None, max_memory=limits.max_abs,
                          max_weight=limits.max_weight_growth * max(1.0, self.weights_at_start))
        shard = make_shard(self.stream_ids, self.memories, self.streams.state_dict(), step, self.micro)
        meta = {"fingerprint": fingerprint(self.cfg), "config": to_dict(self.cfg), "versions": versions(),
                "engine": self.cfg.engine, "precision": self.precision,
                "zero_stage": getattr(self.engine, "zero_stage", None), "lora": self.lora,
                "weights_at_start": self.weights_at_start}
        return save_checkpoint(
            root, step, self.engine, shard, rank=self.info.rank,
            world_size=self.info.world_size, exclude_frozen=self.lora, meta=meta, keep_last=self.cfg.checkpoint.keep_last,
        )


def run(cfg: RunConfig, info: DistInfo) -> dict[str, Any]:
    """Build, resume if asked, train, evaluate, checkpoint and export one run."""
    warnings.filterwarnings("ignore", message=".*torch.utils._pytree._register_pytree_node.*")
    trainer = Trainer(cfg, info)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.lock.release()
