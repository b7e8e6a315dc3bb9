"""Sorting-task accuracy (paper Table 4): teacher-forced argmax over the 20 target positions.

Each batch of examples is read segment by segment through the segment runner (data/segments.py),
memory carried between segments and every row reset at its example's first segment. Scored positions are those with a
target (the separator and the first 19 answer symbols, predicting the 20 answer symbols);
accuracy = correct / scored over all examples and ranks (exact sums, all-reduced).

`memoryless=True` reads the same examples with every row reset before every segment: the model
then sees only the last segment's symbols when it answers, and the difference from the
carried reading is what its memory does on the task (`memoria_ds.eval.gain`).
"""

from __future__ import annotations

import time
from typing import Any

import datasets
import torch

from memoria_ds.data.examples import ExampleStreams
from memoria_ds.data.reset import ResetPolicy
from memoria_ds.eval.protocols import EVERY_SEGMENT
from memoria_ds.eval.result import EvalResult
from memoria_ds.eval.scoring import all_reduce_sums, token_nll
from memoria_ds.eval.scoring import dist_coordinates, evaluating, model_device
from memoria_ds.data.segments import run_segments

_EVERY_EXAMPLE = ResetPolicy(at_document_start=True)


def evaluate_sorting(
    model: Any,
    dataset: datasets.Dataset,
    *,
    segment_length: int,
    batch_size: int = 32,
    model_name: str = "model",
    split: str = "test",
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    output_path: str | None = None,
    memoryless: bool = False,
) -> EvalResult:
    """Accuracy of a Contract-2 model on a sorting split.

    Args:
        model: as for `evaluate_lm`.
        dataset: rows of `generate_sorting` (or aligned `input_ids` / `targets`).
        segment_length: tokens per segment (256 / 512 / 1024 in the paper).
        batch_size: B_global examples per batch (a multiple of the world size); the last
            batch is padded with unscored rows, so every example counts once.
        model_name, split: recorded in the result.
        rank, world_size, device, progress, output_path: as for `evaluate_lm`.
        memoryless: reset every row before every segment (the model without its memory).

    Returns:
        `EvalResult` with `accuracy`, `correct`, and the NLL of the answer symbols.
    """
    rank, world_size = dist_coordinates(rank, world_size)
    streams = ExampleStreams(dataset, batch_size=batch_size, segment_length=segment_length,
                             rank=rank, world_size=world_size)
    device = torch.device(device) if device is not None else model_device(model)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # nll, scored, correct, input tokens
    start = time.perf_counter()
    label = "eval sorting" if progress and rank == 0 else None
    reset = EVERY_SEGMENT if memoryless else _EVERY_EXAMPLE
    with evaluating(model):
        for seg in run_segments(model, streams, reset=reset, device=device, progress=label):
            batch, logits = seg.batch, seg.logits
            nll, mask = token_nll(logits, batch.targets)
            correct = (logits.argmax(dim=-1) == batch.targets) & mask
            sums += torch.stack([nll.double().sum(), mask.sum().double(), correct.sum().double(),
                                 batch.attention_mask.sum().double()])
    totals = all_reduce_sums(sums).tolist()
    wall = time.perf_counter() - start
    result = EvalResult.from_sums(
        nll_sum=totals[0], scored_tokens=int(round(totals[1])), correct=int(round(totals[2])),
        model=model_name,
        data={"corpus": "sorting", "num_examples": len(dataset), "example_length": streams.example_length,
              "fingerprint": getattr(dataset, "_fingerprint", "")},
        split=split,
        protocol={"name": "sorting", "segment_length": segment_length, "num_streams": batch_size,
                  "segments_per_example": streams.segments_per_example,
                  "reset": reset.to_dict(), "memoryless": memoryless,
                  "scored": "the 20 answer positions, teacher-forced argmax"},
        world_size=world_size, steps=streams.steps_per_epoch, input_tokens=int(round(totals[3])),
        wall_time_s=wall, tokens_per_s=totals[3] / wall if wall > 0 else 0.0,
    )
    if output_path is not None and rank == 0:
        result.save(output_path)
    return result
