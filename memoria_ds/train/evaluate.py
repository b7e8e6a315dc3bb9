"""The evaluate command: score a saved model on a corpus split, without training.

    python launch/evaluate.py runs/x                               # a run: its export, its data settings
    python launch/evaluate.py runs/x/export --config run.yaml eval.split=test eval.protocols=[full,paper]
    deepspeed --num_gpus 4 launch/evaluate.py runs/x eval.split=test     # split over ranks
    python launch/evaluate.py gpt2 data.corpus=wikitext103 eval.protocols=[paper]   # plain GPT-2 baseline

MODEL is a run directory (its `export/` is scored, its `config.yaml` gives the data and
evaluation settings), a `save_pretrained` directory (Memoria GPT-2, or any causal LM scored
segment by segment without memory), or a hub id. The same dotted overrides as training
apply (`data.*`, `eval.*`); `eval.trace=true` also records the memory of every segment and
saves the final memory for `launch/analyze.py`; `--memory SNAPSHOT` starts the streams from a
saved memory (`memoria_ds.model.save_snapshot`: one row per stream id) instead of an empty
one. Results go to `--out` (default
`<run_dir>/eval`, else `eval_results/`) as one JSON per protocol, `<split>_<protocol>.json`.
Mistakes stop before any model or data work, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .config import RunConfig
from .sources import check_sources
from .parse import ConfigError, load
from .saved_model import check_saved_model


def resolve_model(model: str) -> tuple[str, Path | None]:
    """(what to load, the run directory if MODEL is one); a local model is checked whole."""
    path = Path(model)
    if (path / "config.yaml").is_file():
        export = path / "export"
        if not (export / "config.json").is_file():
            raise ConfigError(f"{path} is a run directory without an export/ to evaluate; train it with "
                              f"checkpoint.export=true (or give a save_pretrained directory)")
        check_saved_model(export)
        return str(export), path
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is neither a run directory (config.yaml) nor a save_pretrained "
                              f"directory (config.json)")
        check_saved_model(path)
        return str(path), None
    if model.startswith((".", "/")) or model.count("/") > 1:
        raise ConfigError(f"{model} does not exist (give a run directory, a save_pretrained directory or a hub id)")
    return model, None


def parse(argv: list[str] | None) -> tuple[RunConfig, str, Path | None, Path, Path | None]:
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
    out = Path(a.out) if a.out else (run_dir / "eval" if run_dir is not None else Path("eval_results"))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the results")
    # the data (and, for a hub id, the model) must be reachable before anything is loaded
    scored = cfg.model.model_copy(update={"backbone": source, "from_scratch": False})
    check_sources(cfg.model_copy(update={"model": scored}))
    memory = Path(a.memory) if a.memory else None
    if memory is not None and not memory.is_file():
        raise ConfigError(f"--memory {memory}: no such snapshot file (write one with memoria_ds.model.save_snapshot)")
    if memory is not None and cfg.data.corpus == "sorting":
        raise ConfigError("--memory: the sorting task starts every example from an empty memory")
    return cfg, source, run_dir, out, memory


def load_model(source: str, device, precision: str):
    """The model to score: a Memoria GPT-2 as it is, any other causal LM without memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..eval import MemorylessLM
    from ..model import MemoriaGPT2LMHeadModel, MemoryMosaicConfig, MemoryMosaicLMHeadModel

    dtype = torch.bfloat16 if device.type == "cuda" and precision == "bf16" else torch.float32
    if getattr(AutoConfig.from_pretrained(source), "model_type", None) == MemoriaGPT2LMHeadModel.config_class.model_type:
        return MemoriaGPT2LMHeadModel.from_pretrained(source, dtype=dtype).to(device).eval()
    if isinstance(AutoConfig.from_pretrained(source), MemoryMosaicConfig):  # Contract 2 as it is
        return MemoryMosaicLMHeadModel.from_pretrained(source, dtype=dtype).to(device).eval()
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


def run(cfg: RunConfig, source: str, out: Path, info, memory: Path | None = None) -> list[Any]:
    import torch

    from ..eval.configured import describe, evaluate_split
    from ..eval.gain import memory_gain
    from .build import load_corpora

    knn = cfg.eval.knn_lm
    splits = (cfg.eval.split, "train") if knn.enabled and knn.train_datastore else (cfg.eval.split,)
    corpora = load_corpora(cfg.data, tuple(dict.fromkeys(splits)), info.rank)
    corpus = corpora[cfg.eval.split]
    model = load_model(source, info.device, cfg.optim.precision)
    if cfg.model.compile is not None:  # as training compiles it: in place, one graph per shape
        model.compile(mode=cfg.model.compile, dynamic=False)
        if info.is_main:
            print(f"model: compiled in place (torch.compile, mode={cfg.model.compile}); the first segment compiles",
                  flush=True)
    memoria = getattr(getattr(model, "config", None), "memoria_config", None)
    memory_for = _snapshot_rows(memory, model, source, info.device) if memory is not None else None
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)

    def trace(protocol: str):
        if not (cfg.eval.trace and info.is_main and memoria is not None):
            return None
        from ..eval.trace import MemoryTrace

        name = f"{cfg.eval.split}_{protocol}"
        return MemoryTrace(out / f"trace_{name}.jsonl", state_path=out / f"memory_{name}.safetensors",
                           memoria_config=memoria, graph_every=10)

    with torch.no_grad():
        results = evaluate_split(
            model, corpus, data=cfg.data, evaluation=cfg.eval, label=f"{source}@{cfg.eval.split}", rank=info.rank,
            world_size=info.world_size, device=info.device, out_dir=out,
            sorting_batch_size=cfg.optim.micro_batch_size * info.world_size, trace=trace, memory_for=memory_for,
            train_corpus=corpora.get("train"),
        )
    if info.is_main:
        for r in results:
            line, _ = describe(r)
            print(f"eval {cfg.eval.split} {line}", flush=True)
        gain = memory_gain(results)
        if gain is not None:
            print(gain.describe(), flush=True)
        print(f"results: {out} ({', '.join(sorted(p.name for p in out.glob(f'{cfg.eval.split}_*.json')))})",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, source, _, out, memory = parse(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from . import distributed as dist_utils
    from .build import DataPreparationFailed

    info = dist_utils.init_distributed(use_deepspeed=False)
    code = 0
    try:
        run(cfg, source, out, info, memory)
    except (ConfigError, OSError, ValueError, DataPreparationFailed) as e:
        print(f"error (rank {info.rank}): {e}", file=sys.stderr, flush=True)
        code = 2 if isinstance(e, ConfigError) else 1
    dist_utils.leave(code)

