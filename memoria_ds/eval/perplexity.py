"""Perplexity / BPC of a memory model over a split, under a named protocol.

The loop: build this rank's streams for the protocol, feed them through the segment runner
(data/segments.py: segment t of every stream reads the memory returned for segment t - 1, with
the rows to reset), score the targets (with the
last target of each segment masked under `paper`), add NLL and token counts as float64
sums on the device, and all-reduce the sums once at the end. PPL = exp(total NLL / total
scored tokens): token-weighted over streams and ranks, never a mean of means.

Ranks: with `num_streams` a multiple of the world size each rank reads its own slice of
streams. A one-stream protocol (`paper`) on several ranks is read by every rank in
lockstep (so collective forwards, e.g. ZeRO-3 parameter gathers, stay matched) and only
rank 0's sums count.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from collections.abc import Callable
from typing import Any

import torch

from memoria_ds.data.batch import IGNORE_INDEX
from memoria_ds.data.streams import StreamLayout, TokenStreams
from memoria_ds.data.token_corpus import TokenCorpus
from memoria_ds.eval.knn_lm import Datastore, IndexedDatastore, KNNLMSettings, KNNScorer, capture_keys
from memoria_ds.eval.protocols import EvalProtocol, protocol_from_name
from memoria_ds.eval.result import EvalResult, write_results
from memoria_ds.eval.scoring import all_reduce_sums, dist_coordinates, evaluating, model_device, token_nll
from memoria_ds.data.segments import run_segments


def evaluate_lm(
    model: Any,
    corpus: TokenCorpus,
    protocol: EvalProtocol,
    *,
    model_name: str = "model",
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
    max_steps: int | None = None,
    progress: bool = True,
    output_path: str | None = None,
    on_step: Callable[[int, Any, Any], None] | None = None,
    memory_for: Callable[[list[int]], Any] | None = None,
    knn: KNNLMSettings | None = None,
    knn_store: Datastore | IndexedDatastore | None = None,
) -> EvalResult:
    """Evaluate a Contract-2 model on one split under `protocol`.

    Args:
        model: called as `model(input_ids=, shift_labels=None, memory=, reset=)`,
            returning `.logits` (B, L, V) and `.memory` (None allowed).
        corpus: the tokenized split (`TokenCorpus`).
        protocol: `paper_protocol()`, `full_protocol(...)`, or any `EvalProtocol`.
        model_name: recorded in the result.
        rank, world_size: default from `torch.distributed` (0 and 1 without it).
        device: where batches go; default the model's first parameter's device.
        max_steps: stop after this many segments per stream (a quick look; the result
            says so in `notes`).
        progress: a progress bar on rank 0.
        output_path: rank 0 writes the result there as JSON.
        on_step: called after every segment as `on_step(step, batch, output)` with this
            rank's `StreamBatch` and the model's whole output (e.g. `output.memory_stats`,
            `output.memory`); memoria_ds.eval.trace records the memory with it.
        memory_for: `memory_for(stream_ids)` -> the memory this rank's streams start from (one
            row per global stream id, e.g. `load_snapshot(path, model, stream_ids).memory`);
            None: an empty memory. The result's notes say so.
        knn: score with kNN-LM on top of the model (`memoria_ds.eval.knn_lm`): a datastore
            per stream of the text read so far, reset with the stream's memory; the result's
            `knn_lm` records the settings and the model's NLL without it on the same tokens.
        knn_store: a shared datastore (`knn_lm.build_datastore`, e.g. of the training text)
            every stream also searches (with `knn` only).

    Returns:
        The `EvalResult` (identical on every rank).

    Raises:
        ValueError: `num_streams` not a multiple of the world size (and not 1), or a
            token outside the model's vocabulary.
    """
    rank, world_size = dist_coordinates(rank, world_size)
    parts = tuple(getattr(getattr(model, "config", None), "memory_kinds", ()))  # `MemoriaGPT2Config.memory_kinds`
    if protocol.forget is not None and (len(parts) < 2 or protocol.forget not in parts):
        raise ValueError(f"protocol {protocol.name!r} forgets the part {protocol.forget!r} of a composite memory; "
                         f"this model's memory is {'+'.join(parts) or 'none'!r}")
    replicated = protocol.num_streams == 1 and world_size > 1
    if protocol.num_streams % world_size and not replicated:
        raise ValueError(
            f"{protocol.num_streams} streams cannot be split over {world_size} ranks; use a multiple of "
            f"{world_size} streams, or one stream (read by every rank, counted once)"
        )
    streams = TokenStreams(
        corpus, num_streams=protocol.num_streams, segment_length=protocol.segment_length,
        rank=0 if replicated else rank, world_size=1 if replicated else world_size, tail="pad",
    )
    device = torch.device(device) if device is not None else model_device(model)
    counts_here = 0.0 if replicated and rank != 0 else 1.0
    steps = streams.steps_per_epoch if max_steps is None else min(max_steps, streams.steps_per_epoch)

    memory = memory_for([int(s) for s in streams.stream_ids]) if memory_for is not None else None
    if memory is not None and memory.batch_size != len(streams.stream_ids):
        raise ValueError(f"a starting memory of {memory.batch_size} rows for {len(streams.stream_ids)} streams")
    if knn_store is not None and knn is None:
        raise ValueError("`knn_store` is a kNN-LM datastore: pass `knn` settings with it")
    scorer = KNNScorer(knn, knn_store) if knn is not None else None
    # nll, scored tokens, input tokens, the model's own nll (with kNN-LM)
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    start = time.perf_counter()
    label = f"eval {protocol.name}" if progress and rank == 0 else None
    keys = capture_keys(model, knn.key) if knn is not None else contextlib.nullcontext()
    with evaluating(model), keys as held:
        for seg in run_segments(model, streams, reset=protocol.reset, device=device, steps=steps, progress=label,
                                memory=memory, forget=protocol.forget):
            batch = seg.batch
            if on_step is not None:
                on_step(seg.step, batch, seg.output)
            targets = batch.targets
            if not protocol.score_segment_first:
                targets = targets.clone()
                targets[:, -1] = IGNORE_INDEX  # what HF's label shift never scores
            nll, mask = token_nll(seg.logits, targets)
            lm_nll = nll
            if scorer is not None:
                nll, lm_nll = scorer.segment_nll(held.keys, seg.logits, batch, seg.reset, targets)
            sums += torch.stack([nll.double().sum(), mask.sum().double(), batch.attention_mask.sum().double(),
                                 lm_nll.double().sum()])
    totals = all_reduce_sums(sums * counts_here).tolist()
    wall = time.perf_counter() - start
    notes = [] if steps == streams.steps_per_epoch else [f"stopped after {steps} of {streams.steps_per_epoch} steps"]
    if replicated:
        notes.append(f"one stream read by each of {world_size} ranks, counted once")
    if memory is not None:
        notes.append("started from a given memory (not an empty one)")
    knn_record = None
    if knn is not None:
        lm_mean = totals[3] / max(totals[1], 1.0)
        knn_record = {**knn.to_dict(), "datastore": "stream" if knn_store is None else "stream+shared",
                      "shared_entries": 0 if knn_store is None else knn_store.entries,
                      "lm_nll": lm_mean, "lm_ppl": math.exp(lm_mean) if lm_mean < 700 else math.inf}
    result = EvalResult.from_sums(
        nll_sum=totals[0], scored_tokens=int(round(totals[1])),
        character_level=corpus.metadata.get("unit") == "character",
        model=model_name, data=corpus.describe(), split=str(corpus.metadata.get("split", "")),
        protocol=protocol.to_dict(), world_size=world_size, steps=steps, input_tokens=int(round(totals[2])),
        wall_time_s=wall, tokens_per_s=totals[2] / wall if wall > 0 else 0.0, notes=notes, knn_lm=knn_record,
    )
    if output_path is not None and rank == 0:
        result.save(output_path)
    return result


def evaluate_protocols(
    model: Any,
    corpus: TokenCorpus,
    protocols: Sequence[EvalProtocol | str] = ("paper", "full"),
    *,
    segment_length: int = 150,
    output_path: str | None = None,
    **kwargs: Any,
) -> list[EvalResult]:
    """Evaluate under several protocols (by default `paper` and `full`, to stand beside the paper).

    Protocol names use `segment_length` (one stream, no resets for `full`); pass
    `EvalProtocol` objects for anything else. `kwargs` go to `evaluate_lm`.
    """
    resolved = [protocol_from_name(p, segment_length) if isinstance(p, str) else p for p in protocols]
    results = [evaluate_lm(model, corpus, p, **kwargs) for p in resolved]
    rank = kwargs.get("rank")
    if output_path is not None and (rank if rank is not None else dist_coordinates()[0]) == 0:
        write_results(results, output_path)
    return results


def expected_scored_tokens(corpus: TokenCorpus, protocol: EvalProtocol) -> int:
    """How many targets `protocol` scores on `corpus` (N - 1 for `full`; N - T for `paper`)."""
    n = corpus.num_tokens
    if protocol.score_segment_first:
        return n - 1
    starts = StreamLayout(n, protocol.num_streams, protocol.segment_length).starts
    # Each stream loses the target at the last position of each of its full segments, except
    # where that position is the very end of the data (no target to lose).
    seg = protocol.segment_length
    lost = 0
    for s in range(protocol.num_streams):
        length = int(starts[s + 1] - starts[s])
        full = length // seg
        lost += full - (1 if int(starts[s + 1]) == n and length % seg == 0 and full > 0 else 0)
    return n - 1 - lost
