"""The one training loop: DeepSpeed or plain PyTorch, one rank or many, fine-tuning or scratch.

    ctx, state = setup(cfg, info)        # setup.py: what stays fixed, what a step changes (run.py)
    summary = train(ctx, state)          # this file: a plain function over the run state

Per optimiser step, every rank reads segment t of its `micro_batch_size * grad_accum`
streams and feeds them as `grad_accum` micro-batches, each with its own memory slot
(memory rows = streams; the memory never crosses ranks and adds no collective). Memory
rows are reset per the data reset policy (every 500 steps by default, optionally at
document starts, always at an epoch's first segment).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from ..eval import EvalResult
from ..eval.configured import describe, evaluate_split
from ..eval.gain import memory_gain, part_gains
from ..data.reset import ResetPolicy
from ..data.segments import forward_segment
from ..memory import graph_stats
from ..memory.compiled import CUDAGRAPH_MODES
from . import distributed as dist_utils
from . import faults
from .build import unwrap
from .config import ADAPTED, RunConfig
from .episodic import LocalAdapter, whole_memory
from .distributed import DistInfo
from .engine import guard_loss
from .export import export_hf
from .metrics import MetricsWriter
from .parse import to_dict
from .preemption import StopRequest, Stopped
from .run import RunContext, RunState
from .setup import setup


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


def train(ctx: RunContext, state: RunState) -> dict[str, Any]:
    """The loop. Nothing in a step waits for the device: losses, token counts and
    non-finite losses accumulate as device tensors (`_Window`) and are read once per
    logging window (and before an evaluation or a checkpoint), as nanoGPT reads its loss
    only at log steps. A non-finite loss is back-propagated as NaN (`guard_loss`), so the
    engine's own check skips that optimizer step, and the memory rows of its micro-batch
    start fresh at the next step."""
    cfg, info = ctx.cfg, ctx.info
    finished = state.step >= ctx.total_steps
    if finished and (done := _already_done(ctx)) is not None:
        return done
    writer = MetricsWriter(ctx.run_dir, enabled=info.is_main, total_steps=ctx.total_steps,
                           initial_step=state.step, tensorboard=cfg.log.tensorboard,
                           progress=cfg.log.progress and not finished,
                           resumed_at=state.step if ctx.resumed is not None else None,
                           wandb=({"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode,
                                   "config": to_dict(cfg)} if cfg.log.wandb else None))
    if finished:  # trained and checkpointed, then stopped before its summary: finish it, train nothing
        last_loss = _last_logged_loss(ctx.run_dir)
    else:
        window = _Window(ctx.device, track_first=cfg.optim.nan_policy == "stop")
        state.engine.train()
        stop = StopRequest.install()  # SIGTERM / SIGUSR1: finish the step, checkpoint it, stop (preemption.py)
        try:
            last_loss = _steps(ctx, state, writer, window, stop)
        finally:
            stop.uninstall()
        _stop_if_nonfinite(ctx, window)
    writer.end_progress()  # the final evaluation's and the export's lines start on lines of their own
    results = evaluate(ctx, state, writer, ctx.total_steps) if cfg.eval.at_end else []
    export_dir = None
    if cfg.checkpoint.export:
        export_dir = export_hf(ctx.cfg, state.engine, state.model, vocab_size=ctx.vocab_size,
                               is_main=ctx.info.is_main, log=ctx.log, step=ctx.total_steps, results=results)
    writer.close()
    gain = memory_gain(results)
    summary = {"steps": ctx.total_steps, "final_train_loss": last_loss,
               "eval": [r.to_dict() for r in results], "memory_gain": gain.to_dict() if gain else None,
               "memory_gain_parts": {part: g.to_dict() for part, g in part_gains(results).items()},
               "export": str(export_dir) if export_dir else None, "run_dir": str(ctx.run_dir)}
    if info.is_main:
        (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _steps(ctx: RunContext, state: RunState, writer: MetricsWriter, window: _Window, stop: StopRequest) -> float | None:
    """The optimiser steps from `state.step` to the last; the last logged training loss."""
    cfg, info = ctx.cfg, ctx.info
    batches = iter(state.streams)
    step_stats: list = []  # the memory statistics of the step's micro-batches
    last_loss: float | None = None
    span_length, recompute = cfg.optim.bptt_segments, cfg.optim.bptt_recompute
    replayed = cfg.model.compile in CUDAGRAPH_MODES  # the step's outputs live until its next replay
    for step in range(state.step, ctx.total_steps):
        span, batches = _span(ctx, state, batches, step)
        step_stats = []
        # A segment without targets (the sorting task's input) runs forward only, to write
        # the memory: no loss, no gradient, no optimizer step (it would be all zeros).
        update = state.streams.has_targets(span[0][0].step)  # (bptt_segments > 1 is refused for those)
        for j in range(ctx.accum):
            rows = slice(j * ctx.micro, (j + 1) * ctx.micro)
            losses = []
            for k, (batch, reset) in enumerate(span):
                micro = batch.rows(rows)
                targets = micro.targets if micro.labels is None else micro.labels  # a classifier's: (B,)
                fresh = reset[rows] | state.discard[j] if k == 0 else reset[rows]
                with torch.set_grad_enabled(update):
                    out = _forward(state.engine, micro, state.memories[j], fresh, targets if update else None,
                                   recompute)
                if out.memory_stats is not None:  # kept past later replays of a CUDA-graph step: a copy
                    step_stats.append(out.memory_stats.copy() if replayed else out.memory_stats)
                state.memories[j] = out.memory
                if not update:
                    state.discard[j] = torch.zeros_like(state.discard[j])
                    window.tokens += micro.attention_mask.sum()
                    continue
                if state.episodic is not None:  # MbPA++: the documents read are written to the episodic memory
                    state.episodic.observe(micro.input_ids, micro.attention_mask, micro.labels, micro.tasks)
                loss = out.loss
                if j == 0 and k == 0 and info.rank == 0 and faults.active("nan_loss", step + 1):
                    loss = loss * float("nan")
                scored = (targets != -100).sum()
                loss, bad = guard_loss(loss, scored)
                losses.append((loss, bad))
                window.add(loss.detach(), bad, scored, micro.attention_mask.sum(), step * ctx.accum + j)
            if update:  # one backward per micro-batch: the mean loss of its span
                loss, bad = losses[0] if span_length == 1 else (torch.stack([l for l, _ in losses]).mean(),
                                                                torch.stack([b for _, b in losses]).any())
                state.engine.backward(loss)
                state.discard[j] = bad
            state.memories[j].detach_()  # the span's end: no gradient reaches further back
        if update:
            window.last_step_applied = state.engine.step()
            dist_utils.average_running_statistics(state.engine.module)  # the PKM layers' query batch norms
            window.skipped_steps += not window.last_step_applied
            for _ in range(state.episodic.due(ctx.num_streams) if state.episodic is not None else 0):
                _replay(ctx, state)
        done = step + 1
        writer.advance()
        logged = done % cfg.log.every == 0 or done == ctx.total_steps
        if logged:
            last_loss = _log_window(ctx, state, writer, done, window, step_stats)
        periodic = bool(cfg.eval.every and done % cfg.eval.every == 0)
        if (periodic or done in ctx.task_ends) and done != ctx.total_steps:
            _stop_if_nonfinite(ctx, window)
            evaluate(ctx, state, writer, done, None if periodic else cfg.eval.after_each_task)
        saved = bool(cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == ctx.total_steps
        if saved:
            _stop_if_nonfinite(ctx, window)
            state.save(ctx, done)
        if faults.active("kill_after_step", done):
            faults.kill(f"after step {done}")
        if faults.active("sigterm_after_step", done) and info.is_main:
            faults.signal_self(f"after step {done}")
        if done != ctx.total_steps and stop.agreed():
            _stop_on_request(ctx, state, writer, done, window, step_stats, stop, saved=saved, logged=logged)
    return last_loss


def _replay(ctx: RunContext, state: RunState) -> None:
    """MbPA++'s sparse experience replay: one optimiser update on documents drawn from every rank's episodic
    memory, as `grad_accum` micro-batches (each read alone: no recurrent memory carried). A rank whose
    memory holds too few for a micro-batch takes part with a one-token row that has no label (a zero loss),
    so every rank reaches the same collectives."""
    for part in state.episodic.replay_batches(ctx.accum, ctx.device):
        if part is None:
            ids = torch.zeros((1, 1), dtype=torch.long, device=ctx.device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "labels": torch.full((1,), -100, dtype=torch.long, device=ctx.device)}
        else:
            inputs = part.model_inputs()
        out = state.engine(**inputs, memory=None, reset=None)
        state.engine.backward(guard_loss(out.loss, (inputs["labels"] != -100).sum())[0])
    state.engine.step()


def _forward(engine: Any, micro: Any, memory: Any, reset: torch.Tensor, labels: torch.Tensor | None,
             recompute: bool) -> Any:
    """One segment of a micro-batch; under `recompute` (memory replay back-propagation) inside
    non-reentrant activation checkpointing: only its inputs (the memory carried in) and outputs are
    kept, and the segment is recomputed in backward. The memory passed in is cloned inside, so
    the recompute reads it as it was (a forward updates its memory in place)."""
    if not (recompute and torch.is_grad_enabled()):
        return forward_segment(engine, micro, memory, reset, labels=labels)

    def segment(carried: Any) -> Any:
        return forward_segment(engine, micro, carried.clone() if carried is not None else None, reset, labels=labels)

    return torch.utils.checkpoint.checkpoint(segment, memory, use_reentrant=False)


def _span(ctx: RunContext, state: RunState, batches: Iterator[Any], step: int) -> tuple[list, Iterator[Any]]:
    """The step's `bptt_segments` consecutive segments of every stream, each with its reset mask,
    on the device; and the batch iterator to continue from (a new epoch's when one finished)."""
    policy, span = ctx.cfg.data.reset_policy, []
    for k in range(ctx.cfg.optim.bptt_segments):
        batch = next(batches, None)
        if batch is None:  # epoch finished: the streams move to the next one
            batches = iter(state.streams)
            batch = next(batches)
        batch = batch.to(ctx.device)
        span.append((batch, policy.reset_mask(batch, step) if k == 0 else _within_span(policy).reset_mask(batch)))
    return span, batches


def _within_span(policy: ResetPolicy) -> ResetPolicy:
    """The resets of a span's later segments: document and epoch starts, never the periodic one
    (which counts optimiser steps, and happens at a span's first segment)."""
    return dataclasses.replace(policy, every_n_steps=None)


STOP_WARN_S = 15.0  # a stop that takes longer is told that the launcher's grace is 30 s


def _stop_on_request(ctx: RunContext, state: RunState, writer: MetricsWriter, done: int, window: _Window,
                     stats: list, stop: StopRequest, *, saved: bool, logged: bool) -> None:
    """Every rank agreed to stop after step `done`: log, checkpoint (unless this step just did), raise `Stopped`."""
    if not logged:
        _log_window(ctx, state, writer, done, window, stats)
    _stop_if_nonfinite(ctx, window)
    if not saved:
        state.save(ctx, done)
    writer.close()
    stop.finished()
    took = stop.seconds()
    late = (f" It took {took:.0f} s from the signal: close to the 30 s that the deepspeed launcher and SLURM's "
            f"default KillWait allow before SIGKILL; ask for the signal earlier (docs/training.md)"
            if took > STOP_WARN_S else "")
    raise Stopped(f"stopped by {stop.name} after step {done} of {ctx.total_steps}; checkpoint "
                  f"{ctx.run_dir / 'checkpoints'} holds it: resume with --resume auto (checkpoint.resume=auto).{late}")


def _already_done(ctx: RunContext) -> dict[str, Any] | None:
    """Resumed at the last step: the run's summary if it has one (nothing to train, evaluate or
    export again: the records stand), else None: the run stopped between its final checkpoint and
    its summary (killed, or its final evaluation or export failed), and that end is done now."""
    path = ctx.run_dir / "summary.json"
    if dist_utils.broadcast_object(path.exists()):  # rank 0 decides: every rank takes the same path
        ctx.log(f"the run already reached step {ctx.total_steps} (its last); nothing to do. To train further, "
                f"raise optim.max_steps (or optim.epochs) and resume")
        return json.loads(path.read_text())
    ends = [name for name, on in (("evaluation", ctx.cfg.eval.at_end), ("export", ctx.cfg.checkpoint.export)) if on]
    ctx.log(f"the run already reached step {ctx.total_steps} (its last) but has no summary.json: it stopped before "
            f"the end of the run; doing that end now ({', '.join(ends + ['summary'])}), training nothing")
    return None


def _last_logged_loss(run_dir: Path) -> float | None:
    """The last training loss in the run's metrics (the summary of a run finished on a rerun)."""
    path = run_dir / "metrics.jsonl"
    loss = None
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "train" and isinstance(record.get("loss"), (int, float)):
            loss = float(record["loss"])
    return loss


def _stop_if_nonfinite(ctx: RunContext, window: _Window) -> None:
    """Under `optim.nan_policy=stop`, raise if any rank saw a non-finite loss (one host sync).

    Called before an evaluation or a checkpoint, at log steps and at the end, so no
    checkpoint is written after the first non-finite loss. The update of that step was
    already skipped by the engine (`guard_loss`)."""
    if ctx.cfg.optim.nan_policy != "stop":
        return
    first = dist_utils.all_min(window.first_bad)
    if first == _Window.NONE:
        return
    step, micro = divmod(first, ctx.accum)
    where = f"rank {ctx.info.rank}" if int(window.first_bad) == first else "another rank"
    raise NonFiniteLoss(
        f"non-finite loss at step {step + 1} (micro-batch {micro}, {where}); stopped by optim.nan_policy=stop. "
        f"The last good checkpoint is kept in {ctx.run_dir / 'checkpoints'}; lower optim.lr or use "
        f"nan_policy=skip"
    )


def _log_window(ctx: RunContext, state: RunState, writer: MetricsWriter, step: int, w: _Window,
                stats: list) -> float | None:
    """Log the window's means (one host read); the loss is None if every micro-batch was skipped."""
    _stop_if_nonfinite(ctx, w)
    loss_sum, scored, tokens, skipped, skipped_steps = dist_utils.all_sum_tensor(
        torch.stack([w.loss_sum, w.scored, w.tokens, w.skipped, w.loss_sum.new_tensor(w.skipped_steps)]))
    elapsed = max(time.time() - w.t0, 1e-9)
    loss = loss_sum / scored if scored else None
    values = {"loss": loss, "ppl": math.exp(min(loss, 50.0)) if scored else None,
              "tok/s": tokens / elapsed, "lr": state.engine.lr(), "skipped_micro_batches": skipped,
              "skipped_steps": skipped_steps,
              "epoch": (step - 1) * ctx.cfg.optim.bptt_segments // state.streams.steps_per_epoch}
    if state.episodic is not None:
        values.update(state.episodic.scalars())  # rank 0's
    norm = state.engine.grad_norm() if w.last_step_applied else None  # a skipped step has none
    if norm is not None:
        values["grad_norm"] = norm
    if ctx.device.type == "cuda":
        values["gpu_peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    # memory statistics of this step, averaged over every micro-batch slot of rank 0
    summaries = [s.summary() for s in stats]
    for key in summaries[0] if summaries else ():
        finite = [x[key] for x in summaries if x[key] == x[key]]
        values[key] = sum(finite) / len(finite) if finite else float("nan")
    graphs = [graph_stats(m.state) for m in state.memories if m is not None and hasattr(m, "state")]
    for key in graphs[0] if graphs else ():  # O(C^2) per row: only at logging steps
        values[f"memory/graph_{key}"] = float(torch.cat([g[key] for g in graphs]).mean())
    writer.log(step, values)
    w.clear()
    return loss


def evaluate(ctx: RunContext, state: RunState, writer: MetricsWriter, step: int,
             protocols: list[str] | None = None) -> list[EvalResult]:
    """Evaluate `eval.split` by `protocols` (default `eval.protocols`) at `step`, and log it."""
    cfg = ctx.cfg
    corpus = ctx.corpora.get(cfg.eval.split)
    if corpus is None:
        return []
    evaluation = cfg.eval if protocols is None else cfg.eval.model_copy(update={"protocols": list(protocols)})
    state.engine.eval()
    results = evaluate_split(
        state.model, corpus, data=cfg.data, evaluation=evaluation, rank=ctx.info.rank,
        world_size=ctx.info.world_size, device=ctx.device, out_dir=_eval_dir(ctx),
        label=(f"{cfg.model.preset}@step_{step:08d}" if cfg.data.corpus == "sorting"
               else f"{cfg.model.backbone}:{cfg.model.preset}@step_{step:08d}"),
        sorting_batch_size=ctx.num_streams,
        trace=functools.partial(_trace, ctx) if step == ctx.total_steps and cfg.data.corpus != "documents" else None,
        train_corpus=ctx.corpora.get("train"), adapter=_adapter(ctx, state, evaluation.protocols),
    )
    for result in results:
        line, values = describe(result)
        kind = ((f"eval_classification_{result.protocol['name']}") if result.macro_f1 is not None else
                ("eval_sorting_memoryless" if result.protocol.get("memoryless") else "eval_sorting")
                if result.accuracy is not None else f"eval_{result.protocol['name']}")
        writer.log(step, values, kind=kind)
        writer.message(f"eval step {step} {line}")
    gain = memory_gain(results)  # with `memoryless` beside `full`: what the memory is worth
    if gain is not None:
        writer.log(step, gain.scalars(), kind="eval_memory_gain")
        writer.message(f"eval step {step} {gain.describe()}")
    for part, gain in part_gains(results).items():  # `memoryless_<part>`: what one part of a composite is worth
        writer.log(step, gain.scalars(), kind=f"eval_memory_gain_{part}")
        writer.message(f"eval step {step} {gain.describe()}")
    state.engine.train()
    return results


def _adapter(ctx: RunContext, state: RunState, protocols: list[str]) -> LocalAdapter | None:
    """MbPA++'s local adaptation over every rank's episodic memory, for the `adapted` reading."""
    if state.episodic is None or ADAPTED not in protocols:
        return None
    return LocalAdapter(unwrap(state.model), state.episodic.keys, whole_memory(state.episodic.memory), ctx.cfg.episodic)


def _trace(ctx: RunContext, protocol: str):
    """A memory trace of the final evaluation (rank 0's streams), if `eval.trace`."""
    if not (ctx.cfg.eval.trace and ctx.info.is_main and ctx.memoria_config is not None):
        return None
    from ..eval.trace import MemoryTrace

    d = _eval_dir(ctx)
    return MemoryTrace(d / f"trace_{protocol}.jsonl", state_path=d / f"memory_{protocol}.safetensors",
                       memoria_config=ctx.memoria_config, graph_every=10)


def _eval_dir(ctx: RunContext) -> Path:
    path = ctx.run_dir / "eval"
    path.mkdir(exist_ok=True)
    return path


def run(cfg: RunConfig, info: DistInfo) -> dict[str, Any]:
    """Build, resume if asked, train, evaluate, checkpoint and export one run."""
    warnings.filterwarnings("ignore", message=".*torch.utils._pytree._register_pytree_node.*")
    ctx, state = setup(cfg, info)
    try:
        return train(ctx, state)
    finally:
        ctx.lock.release()
