"""The evaluate command: score a saved model on a corpus split, without training.

    python launch/evaluate.py runs/x                               # a run: its export, its data settings
    python launch/evaluate.py runs/x/export --config run.yaml eval.split=test eval.protocols=[full,paper]
    deepspeed --num_gpus 4 launch/evaluate.py runs/x eval.split=test     # split over ranks
    python launch/evaluate.py gpt2 data.corpus=wikitext103 eval.protocols=[paper]   # plain GPT-2 baseline

MODEL is a run directory (its `export/` is scored, or without one its newest checkpoint,
consolidated in memory; its `config.yaml` gives the data and evaluation settings), a
`save_pretrained` directory (Memoria GPT-2, or any causal LM scored segment by segment without
memory), or a hub id. The same dotted overrides as training
apply (`data.*`, `eval.*`); `eval.trace=true` also records the memory of every segment and
saves the final memory for `launch/analyze.py`; `--memory SNAPSHOT` starts the streams from a
saved memory (`memoria_ds.model.save_snapshot`: one row per stream id) instead of an empty
one. Results go to `--out` (default
`<run_dir>/eval`, else `eval_results/`) as one JSON per protocol, `<split>_<protocol>.json`; a
run scored with other settings than its `config.yaml` (kNN-LM, another segment length, more
streams, a starting memory, ...) gets `<split>_<protocol>.<what>-<hash>.json` instead, so the
run's own results are never overwritten. The closing `results:` line names the files written.
Mistakes stop before any model or data work, with exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from .config import RunConfig
from .sources import check_sources
from .parse import ConfigError, load, to_dict
from .saved_model import check_saved_model


# Where runs and results go: a name under them is a path, never a hub id
LOCAL_ROOTS = ("runs", "eval_results")


def looks_like_a_path(model: str) -> bool:
    """A name that can only mean a local path (`./x`, `~/x`, `a/b/c`, `runs/x`, `x/` or `d/x` with
    `d` an existing folder), not a hub id (`gpt2`, `owner/name`)."""
    first = model.split("/", 1)[0]
    return (model.startswith((".", "/", "~")) or model.endswith("/") or model.count("/") > 1
            or ("/" in model and (first in LOCAL_ROOTS or Path(first).is_dir())))


def resolve_model(model: str) -> tuple[str, Path | None]:
    """(what to load, the run directory if MODEL is one); a local model is checked whole.

    A run directory without an export gives its newest complete checkpoint folder (checked
    against its manifest, contents hashed), which `load_model` builds in memory.
    """
    from .checkpoints import find_latest

    path = Path(model).expanduser()
    if (path / "config.yaml").is_file():
        export = path / "export"
        if (export / "config.json").is_file():
            check_saved_model(export)
            return str(export), path
        checkpoint, skipped = find_latest(path / "checkpoints")
        if checkpoint is None:
            why = f" ({len(skipped)} unusable; the newest: {skipped[0]})" if skipped else ""
            raise ConfigError(f"{path} is a run directory with neither an export/ nor a complete checkpoint to "
                              f"evaluate{why}; train it first (or give a save_pretrained directory)")
        return str(checkpoint.path), path
    if (path / "manifest.json").is_file():  # a checkpoint folder given itself
        from .checkpoints import CheckpointError, validate

        try:
            validate(path)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        return str(path), None
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is neither a run directory (config.yaml) nor a save_pretrained "
                              f"directory (config.json)")
        check_saved_model(path)
        return str(path), None
    if looks_like_a_path(model):
        raise ConfigError(f"{model} does not exist (give a run directory, a save_pretrained directory or a hub id)")
    return model, None


def is_checkpoint(source: str) -> bool:
    """`source` is a checkpoint folder (`resolve_model` gives one for a run without an export)."""
    return (Path(source) / "manifest.json").is_file()


def checkpoint_config(source: str) -> RunConfig:
    """The run configuration a checkpoint's manifest holds (the model it builds)."""
    from .checkpoint_model import checkpoint_config as read_config
    from .checkpoints import CheckpointError

    try:
        return read_config(Path(source), verify=False)[1]
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def parse(argv: list[str] | None) -> tuple[RunConfig, str, Path | None, Path, Path | None, RunConfig | None]:
    """(configuration, what to load, run directory, results folder, starting memory, the run's own
    configuration: the baseline whose results keep the plain names; None outside a run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run directory, a save_pretrained directory or a hub id")
    p.add_argument("--config", help="a run configuration (YAML/JSON) for the data and eval settings "
                                    "(default: the run's config.yaml, else the defaults)")
    p.add_argument("--out", help="where the results go (default: <run_dir>/eval, else eval_results/)")
    p.add_argument("--memory", help="a memory snapshot (memoria_ds.model.save_snapshot) the streams start from, "
                                    "one row per stream id; default: an empty memory")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.split=test data.segment_length=150")
    a = p.parse_intermixed_args(argv)
    source, run_dir = resolve_model(a.model)
    config = a.config or (str(run_dir / "config.yaml") if run_dir is not None else None)
    cfg = load(RunConfig, config, list(a.overrides))
    if (cfg.model.task == "classification" and run_dir is None and config is None and not is_checkpoint(source)
            and not any(o.startswith("data.tokenizer=") for o in a.overrides)):
        cfg.data.tokenizer = source  # a saved classifier reads its own tokenizer's ids (not the default backbone's)
    out = Path(a.out) if a.out else (run_dir / "eval" if run_dir is not None else Path("eval_results"))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the results")
    # the data (and, for a hub id, the model) must be reachable before anything is loaded
    if is_checkpoint(source):  # built from its own configuration: a pretrained backbone must be reachable
        built = checkpoint_config(source)
        check_sources(cfg.model_copy(update={"model": built.model, "lora": built.lora}))
    else:
        scored = cfg.model.model_copy(update={"backbone": source, "from_scratch": False})
        check_sources(cfg.model_copy(update={"model": scored}))
    memory = Path(a.memory) if a.memory else None
    if memory is not None and not memory.is_file():
        raise ConfigError(f"--memory {memory}: no such snapshot file (write one with memoria_ds.model.save_snapshot)")
    if memory is not None and cfg.data.corpus == "sorting":
        raise ConfigError("--memory: the sorting task starts every example from an empty memory")
    baseline = load(RunConfig, str(run_dir / "config.yaml"), []) if run_dir is not None else None
    if "adapted" in cfg.eval.protocols and (baseline is None or not baseline.episodic.enabled):
        raise ConfigError("`adapted` (MbPA++'s local adaptation) reads the episodic memory in a run's checkpoint: "
                          "give the directory of a run trained with `episodic.enabled=true`")
    if "adapted" in cfg.eval.protocols:
        from .checkpoints import find_latest

        if find_latest(run_dir / "checkpoints")[0] is None:
            raise ConfigError(f"`adapted` reads the episodic memory in {run_dir}/checkpoints, which holds no complete "
                              f"checkpoint; train the run (or resume it) first")
    return cfg, source, run_dir, out, memory, baseline


def load_model(source: str, device, precision: str, *, verified: bool = False):
    """The model to score: a Memoria GPT-2 as it is, any other causal LM without memory; a
    checkpoint folder built in memory (`checkpoint_model`; `verified`: its files were hashed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..eval import MemorylessLM
    from ..model import MemoriaGPT2LMHeadModel
    from ..model.encoder.config import EncoderMemoryFields
    from ..model.encoder.modeling import MODEL_FOR_CONFIG
    from ..model.encoder.plain import PLAIN_CLASSIFIERS
    from ..model.families import family_of_config

    dtype = torch.bfloat16 if device.type == "cuda" and precision == "bf16" else torch.float32
    if is_checkpoint(source):
        from .checkpoint_model import checkpoint_model

        return checkpoint_model(Path(source), verify=not verified).to(device=device, dtype=dtype).eval()
    if getattr(AutoConfig.from_pretrained(source), "model_type", None) == MemoriaGPT2LMHeadModel.config_class.model_type:
        return MemoriaGPT2LMHeadModel.from_pretrained(source, dtype=dtype).to(device).eval()
    saved = AutoConfig.from_pretrained(source)
    if isinstance(saved, EncoderMemoryFields):  # a Memoria BERT / RoBERTa classifier
        return MODEL_FOR_CONFIG[type(saved)].from_pretrained(source, dtype=dtype).to(device).eval()
    classifier = any(a.endswith("ForSequenceClassification") for a in saved.architectures or [])
    if saved.model_type in PLAIN_CLASSIFIERS and (saved.model_type != "gpt2" or classifier):
        # a Longformer / BigBird / GPT-2 classifier (no memory); a GPT-2 language model is scored as one below
        return PLAIN_CLASSIFIERS[saved.model_type].from_pretrained(source, dtype=dtype).to(device).eval()
    family = family_of_config(saved)  # a Memory Mosaic, a MemSizer: Contract 2 as it is
    if family is not None:
        return family.model_class.from_pretrained(source, dtype=dtype).to(device).eval()
    return MemorylessLM(AutoModelForCausalLM.from_pretrained(source, dtype=dtype)).to(device).eval()


def _snapshot_rows(path: Path, model, source: str, device):
    """stream ids -> the snapshot's rows for them, for `model` (another model's snapshot: ConfigError)."""
    from ..model.snapshot import load_snapshot

    if not hasattr(model, "memory_kind"):
        raise ConfigError(f"--memory: {source} has no memory to start from (it is scored without memory)")
    try:
        load_snapshot(path, model)  # refuses another model's snapshot before any data is read
    except ValueError as e:  # another model's (SnapshotMismatch), or not a snapshot at all
        raise ConfigError(f"--memory: {e}") from None

    def rows(stream_ids: list[int]):
        return load_snapshot(path, model, stream_ids=stream_ids, device=device).memory

    return rows


# Settings that change nothing evaluate scores (split and protocol are in the file names)
UNSCORED = frozenset({"data.num_proc", "eval.every", "eval.split", "eval.protocols", "eval.at_end", "eval.trace",
                      "eval.after_each_task"})


def scoring_settings(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The settings behind evaluate's numbers, flat (`data.segment_length`, `eval.knn_lm.k`, ...),
    `eval.num_streams` as used (0: one stream per rank)."""
    def flat(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in values.items():
            out.update(flat(f"{prefix}.{key}", value) if key == "knn_lm" else {f"{prefix}.{key}": value})
        return out

    found = {**flat("data", to_dict(cfg.data)), **flat("eval", to_dict(cfg.eval)),
             **flat("episodic", to_dict(cfg.episodic)),
             "optim.precision": cfg.optim.precision, "eval.num_streams": cfg.eval.num_streams or world_size}
    return {k: v for k, v in found.items() if k not in UNSCORED}


def results_suffix(cfg: RunConfig, baseline: RunConfig | None, world_size: int,
                   memory: Path | None) -> tuple[str, dict[str, Any]]:
    """The name suffix of results scored with other settings than the run's (`baseline`, scored in
    one process from an empty memory), and those settings: `("", {})` for the run's own, else
    `(".<what>-<hash>", {setting: value})`, the hash over the settings that differ (the same
    settings again give the same names)."""
    if baseline is None:
        return "", {}
    mine, theirs = scoring_settings(cfg, world_size), scoring_settings(baseline, 1)
    changed = {k: mine.get(k) for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)}
    if not (cfg.eval.knn_lm.enabled or baseline.eval.knn_lm.enabled):  # kNN-LM's settings matter only when on
        changed = {k: v for k, v in changed.items() if not k.startswith("eval.knn_lm.")}
    if memory is not None:
        changed["--memory"] = str(memory.resolve())
    if not changed:
        return "", {}
    words = "+".join(dict.fromkeys("knn_lm" if k.startswith("eval.knn_lm.") else k.rsplit(".", 1)[-1].lstrip("-")
                                   for k in changed))
    digest = hashlib.sha256(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f".{words if len(words) <= 40 else 'settings'}-{digest}", changed


def run(cfg: RunConfig, source: str, out: Path, info, memory: Path | None = None,
        baseline: RunConfig | None = None, run_dir: Path | None = None) -> list[Any]:
    """Score `source` as `cfg` says and write the results into `out` (rank 0).

    Args:
        baseline: the run's own configuration; results with other scoring settings get their own
            names (`results_suffix`). None: not a run, every result keeps the plain name.
        run_dir: the run's directory (`adapted` reads its checkpoint's episodic memory).
    """
    import torch

    from ..eval.configured import describe, evaluate_split, result_file, result_key
    from ..eval.gain import memory_gain, part_gains
    from .build import load_corpora

    knn = cfg.eval.knn_lm
    splits = (cfg.eval.split, "train") if knn.enabled and knn.train_datastore else (cfg.eval.split,)
    corpora = load_corpora(cfg.data, tuple(dict.fromkeys(splits)), info.rank)
    corpus = corpora[cfg.eval.split]
    if info.is_main and is_checkpoint(source):
        print(f"model: no export in the run; scoring its newest checkpoint, {source}, its weights consolidated in "
              f"memory (nothing written but the results)", flush=True)
    model = load_model(source, info.device, cfg.optim.precision, verified=True)  # resolve_model hashed it
    if cfg.data.corpus == "documents":  # the labels as the model's classes number them, not as this split would
        id2label = model.config.id2label
        classes = [id2label[i] for i in range(len(id2label))]
        if classes != corpus.label_names:
            corpus = load_corpora(cfg.data, (cfg.eval.split,), info.rank, label_names=classes)[cfg.eval.split]
    if cfg.model.compile is not None:  # as training compiles it: in place, one graph per shape
        model.compile(mode=cfg.model.compile, dynamic=False)
        if info.is_main:
            print(f"model: compiled in place (torch.compile, mode={cfg.model.compile}); the first segment compiles",
                  flush=True)
    memoria = getattr(getattr(model, "config", None), "memoria_config", None)
    memory_for = _snapshot_rows(memory, model, source, info.device) if memory is not None else None
    suffix, changed = results_suffix(cfg, baseline, info.world_size, memory)
    earlier = set()
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        earlier = {p.name for p in out.iterdir()}
        if changed:
            shown = ", ".join(f"{k}={_short(v)}" for k, v in changed.items())
            print(f"settings: {shown} differ from the run's; results named {cfg.eval.split}_<protocol>{suffix}.json "
                  f"(the run's own are kept)", flush=True)
    traces: list[Path] = []

    def trace(protocol: str):
        if not (cfg.eval.trace and info.is_main and memoria is not None):
            return None
        from ..eval.trace import MemoryTrace

        name = f"{cfg.eval.split}_{protocol}{suffix}"
        traces.extend([out / f"trace_{name}.jsonl", out / f"memory_{name}.safetensors"])
        return MemoryTrace(traces[-2], state_path=traces[-1], memoria_config=memoria, graph_every=10)

    adapter = None
    if "adapted" in cfg.eval.protocols:  # (parse checked that this is a run trained with an episodic memory)
        from .episodic import adapter_from_run

        try:
            adapter, step = adapter_from_run(baseline, run_dir, model, corpus.metadata.get("vocab_size"),
                                             cfg.episodic, info.device)
        except ValueError as e:  # a damaged memory, keys another backbone gives: the run's input, exit 2
            raise ConfigError(str(e)) from None
        if info.is_main:
            print(f"adapted: the episodic memory of {run_dir}/checkpoints step {step}, {len(adapter.memory)} "
                  f"documents of every rank", flush=True)
    with torch.no_grad():
        results = evaluate_split(
            model, corpus, data=cfg.data, evaluation=cfg.eval, label=f"{source}@{cfg.eval.split}", rank=info.rank,
            world_size=info.world_size, device=info.device, out_dir=out,
            sorting_batch_size=cfg.optim.micro_batch_size * info.world_size, trace=trace, memory_for=memory_for,
            train_corpus=corpora.get("train"), suffix=suffix, adapter=adapter,
        )
    if info.is_main:
        for r in results:
            line, _ = describe(r)
            print(f"eval {cfg.eval.split} {line}", flush=True)
        gain = memory_gain(results)
        if gain is not None:
            print(gain.describe(), flush=True)
        for part_gain in part_gains(results).values():
            print(part_gain.describe(), flush=True)
        written = sorted(result_file(out, cfg.eval.split, result_key(r), suffix).name for r in results)
        written += [p.name for p in traces if p.is_file()]
        replaced = [name for name in written if name in earlier]
        print(f"results: {out} ({', '.join(written)})"
              + (f"; replaced the earlier {', '.join(replaced)}" if replaced else ""), flush=True)
    return results


def _short(value: Any, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, source, run_dir, out, memory, baseline = parse(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from . import distributed as dist_utils
    from .build import DataPreparationFailed

    info = dist_utils.init_distributed(use_deepspeed=False)
    code = 0
    try:
        run(cfg, source, out, info, memory, baseline, run_dir)
    except (ConfigError, OSError, ValueError, DataPreparationFailed) as e:
        print(f"error (rank {info.rank}): {e}", file=sys.stderr, flush=True)
        code = 2 if isinstance(e, ConfigError) else 1
    dist_utils.leave(code)

