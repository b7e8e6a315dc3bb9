"""One split evaluated as a run configuration asks: the protocols of `eval`, the sorting task, or a
classifier's labelled documents.

Shared by the training loop (evaluation during and after training) and `launch/evaluate.py`
(a saved model on its own), so both score the same way and write the same result files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from memoria_ds.data.streams import TokenStreams

from .knn_lm import Datastore, IndexedDatastore, KNNLMSettings, build_datastore, index_datastore
from .perplexity import evaluate_lm
from .protocols import protocol_from_name
from .result import EvalResult
from .classification import evaluate_classification
from .sorting import evaluate_sorting


def evaluate_split(
    model: Any,
    corpus: Any,
    *,
    data: Any,
    evaluation: Any,
    label: str,
    rank: int,
    world_size: int,
    device: torch.device,
    out_dir: Path | None,
    sorting_batch_size: int,
    trace: Callable[[str], Any] | None = None,
    memory_for: Callable[[list[int]], Any] | None = None,
    train_corpus: Any = None,
    suffix: str = "",
    adapter: Any = None,
) -> list[EvalResult]:
    """Evaluate `model` on one tokenized split (or sorting dataset).

    Args:
        data: the run's `data` section (corpus, segment_length).
        evaluation: the run's `eval` section (split, protocols, num_streams, reset, max_steps; on the
            sorting task `memoryless` among the protocols adds the reading without memory).
        adapter: a classifier's local adaptation, for the `adapted` reading (`episodic.*`).
        label: the model's name in the results (e.g. `gpt2:memoria@step100`); result files are
            `<out_dir>/<file stem>_<protocol><suffix>.json` with the stem taken from after the last `@`
            (`result_file`).
        out_dir: where rank 0 writes one JSON per protocol (None: nowhere).
        sorting_batch_size: examples per batch on the sorting task (a multiple of the world size).
        trace: `trace(protocol)` -> a per-segment callback (`MemoryTrace`) or None; each
            callback returned is closed after its protocol.
        memory_for: the memory each protocol's streams start from (`evaluate_lm`); None: empty.
        train_corpus: the tokenized training split, for `eval.knn_lm.train_datastore`.
        suffix: added to every result file's name (launch/evaluate.py: settings other than the run's).

    Returns:
        One result per protocol (or the sorting result). Every rank calls this.
    """
    stem = label.rsplit("@", 1)[-1]

    def output(name: str) -> str | None:
        return str(result_file(out_dir, stem, name, suffix)) if out_dir is not None and rank == 0 else None

    if data.corpus == "documents":  # a classifier: `full` and `memoryless` readings of its documents
        if memory_for is not None:
            raise ValueError("a classifier starts every document from an empty memory: no starting memory")
        return [evaluate_classification(
            model, corpus, segment_length=data.segment_length, max_segments=data.max_segments,
            batch_size=sorting_batch_size, model_name=label, split=evaluation.split, rank=rank,
            world_size=world_size, device=device, output_path=output(f"classification_{name}"),
            memoryless=name == "memoryless", aggregate=getattr(evaluation, "aggregate", "last"),
            adapter=_adapter(adapter, name),
        ) for name in evaluation.protocols]
    if data.corpus == "sorting":
        if memory_for is not None:
            raise ValueError("the sorting task starts every example from an empty memory: no starting memory")
        # `memoryless` among the protocols: also read with the memory reset before every segment
        readings = (False, True) if "memoryless" in evaluation.protocols else (False,)
        return [evaluate_sorting(
            model, corpus, segment_length=data.segment_length, batch_size=sorting_batch_size, model_name=label,
            split=evaluation.split, rank=rank, world_size=world_size, device=device, progress=False,
            output_path=output("sorting_memoryless" if bare else "sorting"), memoryless=bare,
        ) for bare in readings]
    results = []
    streams = evaluation.num_streams or world_size
    section = getattr(evaluation, "knn_lm", None)
    knn = section.settings() if section is not None and section.enabled else None
    store = None
    if knn is not None and section.train_datastore:
        if train_corpus is None:
            raise ValueError("`eval.knn_lm.train_datastore` needs the training split, and none was given")
        store = train_datastore(model, train_corpus, knn, segment_length=data.segment_length,
                                streams=section.train_streams, reset=evaluation.reset,
                                max_entries=section.train_max_entries, device=device)
    for name in evaluation.protocols:
        protocol = protocol_from_name(name, data.segment_length, streams, evaluation.reset)
        callback = trace(name) if trace is not None else None
        try:
            results.append(evaluate_lm(
                model, corpus, protocol, model_name=label, rank=rank, world_size=world_size, device=device,
                max_steps=evaluation.max_steps, progress=False, on_step=callback, output_path=output(name),
                memory_for=memory_for, knn=knn, knn_store=store,
            ))
        finally:
            if callback is not None:
                callback.close()
    return results


def result_file(out_dir: Path, stem: str, key: str, suffix: str = "") -> Path:
    """Where `evaluate_split` writes the result `key` (`result_key`): `<stem>_<key><suffix>.json`."""
    return out_dir / f"{stem}_{key}{suffix}.json"


def result_key(result: EvalResult) -> str:
    """The result's name among its split's files: the protocol, or `sorting` / `sorting_memoryless`."""
    if result.macro_f1 is not None:
        return f"classification_{result.protocol['name']}"
    if result.accuracy is not None:
        return "sorting_memoryless" if result.protocol.get("memoryless") else "sorting"
    return result.protocol["name"]


def train_datastore(model: Any, corpus: Any, settings: KNNLMSettings, *, segment_length: int, streams: int,
                    reset: Any, max_entries: int | None, device: torch.device) -> Datastore | IndexedDatastore:
    """kNN-LM's shared datastore of the training split, read by `model` with its memory as the
    evaluation reads (`streams` streams, the evaluation's reset policy), the same on every rank:
    each rank reads every stream, so ZeRO-3's collectives stay in step and no exchange is needed.
    Under `settings.index` other than `exact`, its FAISS index (seeded: the same on every rank)."""
    reader = TokenStreams(corpus, num_streams=streams, segment_length=segment_length, rank=0, world_size=1,
                          tail="pad")
    policy = protocol_from_name("full", segment_length, streams, reset).reset
    store = build_datastore(model, reader, settings, reset=policy, device=device, max_entries=max_entries)
    return store if settings.index == "exact" else index_datastore(store, settings.index, settings.nprobe,
                                                                          settings.index_distances)


def _adapter(adapter: Any, protocol: str) -> Any:
    """The local adaptation of the `adapted` reading (None for the others)."""
    if protocol != "adapted":
        return None
    if adapter is None:
        raise ValueError("the `adapted` reading needs the run's episodic memory (episodic.enabled): it is scored by "
                         "the training run's own evaluation")
    return adapter


def describe(result: EvalResult) -> tuple[str, dict[str, float]]:
    """(a one-line summary, the scalars to log) of one result."""
    name = result.protocol["name"] if isinstance(result.protocol, dict) else str(result.protocol)
    if result.macro_f1 is not None:
        return (f"[classification, {name}]: accuracy {result.accuracy:.4f}, macro-F1 {result.macro_f1:.4f} over "
                f"{result.scored_tokens} documents", {"accuracy": result.accuracy, "macro_f1": result.macro_f1,
                                                       "nll": result.nll})
    if result.accuracy is not None:
        kind = "sorting, memoryless" if result.protocol.get("memoryless") else "sorting"
        return (f"[{kind}]: accuracy {result.accuracy:.4f} over {result.scored_tokens} targets",
                {"accuracy": result.accuracy, "nll": result.nll})
    values = {"ppl": result.ppl, "nll": result.nll, "scored_tokens": result.scored_tokens}
    if result.bpc is not None:
        values["bpc"] = result.bpc
    knn = ""
    if result.knn_lm is not None:  # the model alone on the same tokens, beside its kNN-LM score
        values.update(lm_ppl=result.knn_lm["lm_ppl"], lm_nll=result.knn_lm["lm_nll"])
        knn = f" with kNN-LM (model alone {result.knn_lm['lm_ppl']:.3f})"
    return f"[{name}]: ppl {result.ppl:.3f}{knn} over {result.scored_tokens} tokens", values
