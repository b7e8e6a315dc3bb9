"""Setting a run up, in the order that stops a mistake before expensive work.

    ctx, state = setup(cfg, info)

1. the checkpoint to resume from and its compatibility (one it cannot use is a `ConfigError`,
   exit 2, on every rank); the DeepSpeed config, checked by DeepSpeed's own classes (no
   data or model work yet);
2. the data: corpora and this rank's streams (`TokenStreams` for text, `ExampleStreams`
   for the sorting task);
3. the model (straight into ZeRO-3 partitions under stage 3; compiled in place if
   `model.compile` says so) and its engine;
4. the resume (`RunState.load`), then the run directory's resolved config written (and a
   previous run's records set aside if this one starts afresh there).

The run directory is locked before step 1 (one run per directory): two runs started a moment
apart cannot both decide to start fresh there, or both resume the same checkpoint.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from ..data import VOCAB_SIZE, DocumentStreams, ExampleStreams, StreamLayout, TokenStreams
from ..eval.protocols import protocol_from_name
from ..model.composition import memory_kinds
from ..model.config import idle_settings, resolve_preset
from ..model.recurrent import KINDS
from . import distributed as dist_utils
from .build import build_run_model, check_pretrained_settings, load_corpora, resolve_precision, unwrap
from .checkpoints import (CheckpointError, CheckpointInfo, check_compatible, choose_checkpoint, seed_everything,
                          set_aside_newer, set_aside_records)
from .config import ADAPTED, RunConfig
from .distributed import DistInfo
from .ds_config import read_ds_config, resolve_ds_config
from .engine import (DeepSpeedEngine, TorchEngine, TrainEngine, capped_memory_delay, check_ds_config,
                     memory_settings_idle, zero3_construction)
from .health import weights_magnitude
from .parse import ConfigError, dump
from .preflight import check_datastore, check_run
from .episodic import EpisodicTraining, replays_in_run
from .run import RunContext, RunState, rank0_print
from .run_lock import RunDirInUse, RunLock


def _ds_config(cfg: RunConfig, info: DistInfo, precision: str, resumed: CheckpointInfo | None) -> dict[str, Any]:
    ds = resolve_ds_config(read_ds_config(cfg.deepspeed), cfg.optim, world_size=info.world_size,
                           precision=precision, device_type=info.device.type)
    check_ds_config(ds)
    if cfg.model.compile is not None and ds["zero_optimization"]["stage"] == 3:
        raise ConfigError("`model.compile` is not supported under ZeRO-3 (its parameter gathers run as module "
                          "hooks inside the forward); use ZeRO-1/2 (ds_configs/zero2.json) or leave model.compile unset")
    if ADAPTED in [*cfg.eval.protocols, *cfg.eval.after_each_task] and ds["zero_optimization"]["stage"] == 3:
        raise ConfigError("`eval.protocols` `adapted` adapts the whole weights per document, which ZeRO-3 holds in "
                          "partitions: use ZeRO-1/2 (ds_configs/zero2.json), or leave `adapted` out")
    if resumed is not None and resumed.world_size != info.world_size:
        ds["checkpoint"] = dict(ds.get("checkpoint", {}), load_universal=True)
    return ds


def _streams(cfg: RunConfig, info: DistInfo, corpus: Any, num_streams: int) -> TokenStreams | ExampleStreams:
    """This rank's training streams: labelled documents for classification, fixed-length examples
    for the sorting task, else text."""
    if cfg.data.corpus == "documents":
        try:
            return DocumentStreams(corpus.dataset, batch_size=num_streams, segment_length=cfg.data.segment_length,
                                   max_segments=cfg.data.max_segments, rank=info.rank, world_size=info.world_size,
                                   shuffle=not cfg.data.in_order, seed=cfg.seed, drop_last=True, pad_id=corpus.pad_id,
                                   cls_id=corpus.cls_id, sep_id=corpus.sep_id)
        except ValueError as e:
            raise ConfigError(f"the training documents cannot make this run's batches ({e}); the settings: "
                              f"data.segment_length, optim.micro_batch_size x optim.grad_accum x ranks = "
                              f"{num_streams} rows") from None
    if cfg.data.corpus == "sorting":
        return ExampleStreams(corpus, batch_size=num_streams, segment_length=cfg.data.segment_length,
                              rank=info.rank, world_size=info.world_size, shuffle=True, seed=cfg.seed,
                              drop_last=True)
    try:
        return TokenStreams(corpus, num_streams=num_streams, segment_length=cfg.data.segment_length, rank=info.rank,
                            world_size=info.world_size, tail=cfg.data.tail,
                            shuffle_documents=cfg.data.shuffle_documents, seed=cfg.seed)
    except ValueError as e:  # too little text for the streams: bad input, said in the config's terms
        raise ConfigError(f"the training split is too small for this run ({e}); the settings: data.tail, "
                          f"data.segment_length, optim.micro_batch_size x optim.grad_accum x ranks = "
                          f"{num_streams} streams") from None


def _task_ends(cfg: RunConfig, streams: Any, total_steps: int) -> list[int]:
    """The steps that end a task, for `eval.after_each_task` (before any model is built)."""
    if not cfg.eval.after_each_task:
        return []
    try:
        return streams.task_end_steps(cfg.optim.bptt_segments, total_steps)
    except ValueError:
        raise ConfigError("`eval.after_each_task` needs each training document's task: give the documents a `task` "
                          "column (an int; memoria_ds/data/lifelong_tasks.py writes one)") from None


def _check_eval_split(cfg: RunConfig, info: DistInfo, corpus: Any) -> None:
    """The evaluated split can hold the streams of its protocols (else the run would fail after
    training): the same protocols and stream layout the evaluation builds."""
    for name in cfg.eval.protocols:
        protocol = protocol_from_name(name, cfg.data.segment_length, cfg.eval.num_streams or info.world_size)
        try:
            StreamLayout(corpus.num_tokens, protocol.num_streams, protocol.segment_length, tail="pad")
        except ValueError:
            raise ConfigError(f"eval.split {cfg.eval.split!r} has {corpus.num_tokens} tokens, too few for the "
                              f"evaluation's {protocol.num_streams} stream(s): give that split more text, or turn "
                              f"evaluation off (eval.at_end=false, eval.every=0)") from None


def _engine(cfg: RunConfig, info: DistInfo, model, ds_config: dict | None, precision: str,
            update_steps: int) -> TrainEngine:
    if cfg.engine == "torch":
        return TorchEngine(model, info.device, cfg.optim, update_steps, precision)
    model.to(info.device)
    return DeepSpeedEngine(model, ds_config, cfg.optim, update_steps)


def _lock_run_dir(cfg: RunConfig, info: DistInfo) -> RunLock:
    """Rank 0 takes the run directory's lock (collectively: every rank stops if another run holds
    it) before the run reads what the directory holds: the choice of checkpoint, or of a fresh
    start, is made on what is there while no other run can change it."""
    lock = RunLock(cfg.run_dir)
    in_use = None
    if info.is_main:
        try:
            lock.acquire()
        except RunDirInUse as e:
            in_use = str(e)
    in_use = dist_utils.broadcast_object(in_use)
    if in_use is not None:
        raise ConfigError(in_use)
    return lock


def _write_run_dir(ctx: RunContext, state: RunState, ds_config: dict | None) -> None:
    """Rank 0, under the lock: set aside what a new timeline replaces, write the resolved configuration."""
    if ctx.info.is_main:
        if ctx.resumed is not None:
            set_aside_newer(ctx.resumed, ctx.run_dir, ctx.log)
        else:
            set_aside_records(ctx.run_dir, ctx.log)
        dump(ctx.cfg, ctx.run_dir / "config.yaml")
        if isinstance(state.engine, DeepSpeedEngine):
            (ctx.run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=1))
    dist_utils.barrier()


def _resume_point(cfg: RunConfig, info: DistInfo, log) -> CheckpointInfo | None:
    """The checkpoint to resume from, checked against this run before any data or model work.

    A checkpoint this run cannot use (corrupt, partial, another model or data layout, other
    optimizer groups, a world-size change without DeepSpeed) or a fresh start over a run
    directory with checkpoints is bad input, so it is a `ConfigError` (exit 2) on every rank:
    rank 0 decides and tells the others, none waits at the broadcast."""
    choice: tuple[CheckpointInfo | None, str | None] = (None, None)
    if info.is_main:
        try:
            choice = (choose_checkpoint(cfg, log), None)
        except CheckpointError as e:
            choice = (None, str(e))
    resumed, refused = dist_utils.broadcast_object(choice)
    if refused is None and resumed is not None:
        try:
            check_compatible(resumed, cfg, info.world_size)
            if resumed.world_size != info.world_size and cfg.engine != "deepspeed":
                raise CheckpointError(f"checkpoint {resumed.path} was saved by {resumed.world_size} ranks and this "
                                      f"run has {info.world_size}: a world-size change needs engine=deepspeed")
        except CheckpointError as e:
            refused = str(e)
    if refused is not None:
        raise ConfigError(refused)
    return resumed


def setup(cfg: RunConfig, info: DistInfo) -> tuple[RunContext, RunState]:
    """Build (and resume) one run, holding its directory's lock from the start; see the module
    docstring for the order. A run refused on the way releases the lock and leaves the directory
    as it found it."""
    if cfg.engine == "torch" and info.world_size != 1:
        raise ValueError("engine `torch` runs on one process; use engine `deepspeed` for several ranks")
    lock = _lock_run_dir(cfg, info)
    try:
        return _build(cfg, info, lock)
    except BaseException:
        lock.abandon()
        raise


def _build(cfg: RunConfig, info: DistInfo, lock: RunLock) -> tuple[RunContext, RunState]:
    log = functools.partial(rank0_print, info)
    precision = resolve_precision(cfg.optim.precision, info.device)
    classify = cfg.model.task == "classification"
    if not classify:  # (an encoder's settings were checked whole by RunConfig)
        check_pretrained_settings(cfg.model)  # before any data work
        check_run(cfg, info, precision)  # the settings against the model's shape, the kNN-LM index, a bptt span
    resumed = _resume_point(cfg, info, log)
    # DeepSpeed config mistakes (batch arithmetic, fp16 on CPU) stop the run before any data work
    ds_config = _ds_config(cfg, info, precision, resumed) if cfg.engine == "deepspeed" else None

    splits = ("train",) + ((cfg.eval.split,) if (cfg.eval.at_end or cfg.eval.every) else ())
    corpora = load_corpora(cfg.data, splits, info.rank)
    if cfg.data.corpus not in ("sorting", "documents"):
        check_datastore(cfg, corpora["train"].num_tokens)
    num_streams = cfg.optim.micro_batch_size * cfg.optim.grad_accum * info.world_size
    streams = _streams(cfg, info, corpora["train"], num_streams)
    if len(splits) > 1 and cfg.data.corpus not in ("sorting", "documents"):
        _check_eval_split(cfg, info, corpora[cfg.eval.split])
    if classify and streams.truncated:
        log(f"note: {streams.truncated} of {corpora['train'].num_documents} training documents are longer than "
            f"data.max_segments={cfg.data.max_segments} segments of {cfg.data.segment_length}: their first "
            f"{cfg.data.max_segments} segments are read")
    vocab_size = VOCAB_SIZE if cfg.data.corpus == "sorting" else corpora["train"].metadata.get("vocab_size")
    total_steps = cfg.optim.max_steps or cfg.optim.epochs * streams.steps_per_epoch // cfg.optim.bptt_segments
    if total_steps < 1:
        raise ConfigError(f"optim.epochs={cfg.optim.epochs} of {streams.steps_per_epoch} segments per stream make no "
                          f"step of optim.bptt_segments={cfg.optim.bptt_segments}: lower bptt_segments or set "
                          f"optim.max_steps")
    # optimizer updates (the learning-rate schedule's length): steps whose segment holds targets
    update_steps = streams.count_target_steps(total_steps)
    task_ends = _task_ends(cfg, streams, total_steps)
    if resumed is not None and resumed.step > total_steps:
        raise ConfigError(f"checkpoint {resumed.path} is at step {resumed.step}, past this run's last step "
                          f"{total_steps} (optim.max_steps / optim.epochs): to train further set optim.max_steps "
                          f"above {resumed.step}; to go back, --resume an earlier checkpoint")

    seed_everything(cfg.seed)  # the same initial weights on every rank
    with zero3_construction(ds_config):  # under ZeRO-3: built straight into partitions
        model = build_run_model(cfg, vocab_size, corpora["train"].label_names if classify else None)
    memory_type = ("memoria" if classify else
                   resolve_preset(cfg.model.preset, **cfg.model.settings).get("memory_type", "memoria"))
    idle = [] if classify else idle_settings(memory_type, cfg.model.settings)
    if idle:
        log(f"note: model.settings {', '.join(idle)} configure another kind of memory; model.preset="
            f"{cfg.model.preset} (memory_type {memory_type}) does not read them: they change nothing in this run")
    across = [k for k in memory_kinds(memory_type) if k in KINDS and KINDS[k].trains_across_segments]
    if across and cfg.optim.bptt_segments == 1:
        log(f"note: model.preset={cfg.model.preset} (memory_type {memory_type}) trains its memory write from later "
            f"segments' losses, but optim.bptt_segments=1 back-propagates one segment at a time: its write gets no "
            f"gradient in this run; set optim.bptt_segments to 2 or more")
    if memory_settings_idle(model, cfg.optim.memory_lr_scale, cfg.optim.memory_delay_steps):
        log(f"note: optim.memory_lr_scale / optim.memory_delay_steps act on the modules Memoria adds; "
            f"model.preset={cfg.model.preset} has none to train, so they change nothing in this run")
    elif (delay := capped_memory_delay(cfg.optim.memory_delay_steps, update_steps)) != cfg.optim.memory_delay_steps:
        log(f"note: optim.memory_delay_steps ({cfg.optim.memory_delay_steps}) capped at {delay}, at most half of "
            f"this run's {update_steps} optimizer updates: the memory modules learn from update {delay + 1} on")
    episodic = None
    if cfg.episodic.enabled:  # MbPA++: its key network is the classifier's encoder as built, before any update
        seed_everything(cfg.seed)  # the same initial weights as the model's (a from-scratch backbone too)
        key_model = build_run_model(cfg, vocab_size, corpora["train"].label_names)  # whole, also under ZeRO-3
        try:
            episodic = EpisodicTraining.build(cfg.episodic, key_model, pad_token_id=corpora["train"].pad_id,
                                              rank=info.rank, world_size=info.world_size, seed=cfg.seed,
                                              device=info.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        del key_model
        update_steps += replays_in_run(cfg.episodic, num_streams, total_steps)  # each replay is one more update
    if cfg.model.compile is not None:  # in place: the same module, parameter names and state_dict
        model.compile(mode=cfg.model.compile, dynamic=False)
    engine = _engine(cfg, info, model, ds_config, precision, update_steps)
    config = unwrap(engine.module).config
    ctx = RunContext(cfg=cfg, info=info, lock=lock, precision=precision, corpora=corpora,
                     vocab_size=vocab_size, total_steps=total_steps, update_steps=update_steps,
                     memoria_config=(getattr(config, "memoria_config", None) if classify  # (none: Longformer, BigBird)
                                     else config.memoria_config if "memoria" in memory_kinds(config.memory_type)
                                     else None),
                     resumed=resumed, task_ends=frozenset(task_ends))
    state = RunState.fresh(engine, streams, cfg.optim.grad_accum, info.device, episodic)
    seed_everything(cfg.seed + 1000 * (info.rank + 1))  # dropout streams differ per rank
    if resumed is not None:
        try:
            state.load(ctx, resumed)
        except CheckpointError as e:  # read before the run directory is taken: nothing was written
            raise ConfigError(str(e)) from None
    # the divergence check's baseline is the run's first one, kept across resumes
    start = (resumed.manifest.get("meta", {}) if resumed is not None else {}).get("weights_at_start")
    ctx.weights_at_start = float(start) if start is not None else weights_magnitude(state.model, info.device)
    _write_run_dir(ctx, state, ds_config)
    return ctx, state
