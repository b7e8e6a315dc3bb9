"""A classifier's accuracy and macro-F1 on labelled documents, read segment by segment.

Each document is read as `DocumentStreams` cuts it (its first `max_segments` segments), its row's
memory carried from one segment to the next and reset at the document's first; the prediction is
the argmax at the document's last segment (the authors' evaluation of Memoria BERT / RoBERTa,
`eval_classification.py`). The counts (a confusion matrix, the label NLL) are exact sums over ranks.

`memoryless=True` reads the same documents with every row reset before every segment: the last
segment alone decides, and the difference from the carried reading is what the memory does.

`aggregate="mean"` predicts instead from the mean of a document's segments' logits (every
segment read, each as the memory left it): with a model without a memory (preset `backbone`),
the segment-mean baseline, which sees the whole document but carries nothing between segments.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from memoria_ds.data.documents import DocumentStreams
from memoria_ds.data.reset import ResetPolicy
from memoria_ds.data.segments import run_segments
from memoria_ds.eval.protocols import EVERY_SEGMENT
from memoria_ds.eval.result import EvalResult
from memoria_ds.eval.scoring import all_reduce_sums, dist_coordinates, evaluating, model_device

_EVERY_DOCUMENT = ResetPolicy(at_document_start=True)
AGGREGATES = ("last", "mean")


def macro_f1(confusion: torch.Tensor) -> float:
    """F1 averaged over the classes present in the labels or the predictions.

    Args:
        confusion: (K, K) counts, row = true class, column = predicted class.
    """
    c = confusion.double()
    tp, true, predicted = c.diagonal(), c.sum(1), c.sum(0)
    present = (true + predicted) > 0
    f1 = 2 * tp / (true + predicted).clamp(min=1)  # 2 TP / (2 TP + FP + FN)
    return float(f1[present].mean()) if bool(present.any()) else 0.0


def evaluate_classification(
    model: Any,
    documents: Any,
    *,
    segment_length: int,
    max_segments: int,
    batch_size: int,
    model_name: str = "model",
    split: str = "test",
    rank: int | None = None,
    world_size: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    output_path: str | None = None,
    memoryless: bool = False,
    aggregate: str = "last",
    adapter: Any = None,
) -> EvalResult:
    """Accuracy and macro-F1 of a classifier in Contract 2 (`model(input_ids, attention_mask, labels,
    memory, reset)`, logits (B, K)) on one split of `LabelledDocuments`.

    Args:
        documents: `memoria_ds.data.labelled.LabelledDocuments` of the split.
        segment_length / max_segments: how documents are cut (as the run trained).
        batch_size: B_global documents per batch (a multiple of the world size); the last batch is
            padded with unscored rows, so every document counts once.
        memoryless: reset every row before every segment.
        aggregate: `last` (the argmax at each document's last segment) or `mean` (the argmax of the
            mean of its segments' logits; its label NLL from the softmax of that mean).
        adapter: MbPA++'s local adaptation (`memoria_ds.train.episodic.LocalAdapter`): called with a
            segment's (n, L) tokens and mask of the labelled rows, gives their (n, K) logits, each row
            predicted by the weights adapted to its neighbours (the `adapted` reading; one segment per
            document). Its `settings` are recorded in the protocol.

    Returns:
        `EvalResult`: `accuracy`, `macro_f1`, `correct`, the NLL of the labels; `scored_tokens`
        counts documents.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate {aggregate!r}: use one of {AGGREGATES}")
    rank, world_size = dist_coordinates(rank, world_size)
    streams = DocumentStreams(documents.dataset, batch_size=batch_size, segment_length=segment_length,
                              max_segments=max_segments, rank=rank, world_size=world_size, pad_id=documents.pad_id,
                              cls_id=documents.cls_id, sep_id=documents.sep_id)
    device = torch.device(device) if device is not None else model_device(model)
    k = documents.num_labels
    confusion = torch.zeros(k * k, dtype=torch.float64, device=device)
    tasks = int(max(documents.dataset["task"])) + 1 if "task" in documents.dataset.column_names else 0
    per_task = torch.zeros(max(tasks, 1) * 2, dtype=torch.float64, device=device)  # (task, [correct, documents])
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # label nll, input tokens
    start = time.perf_counter()
    reset = EVERY_SEGMENT if memoryless else _EVERY_DOCUMENT
    label = f"eval {split}" if progress and rank == 0 else None
    summed = count = None  # `mean`: each row's sum of its document's segment logits so far, and their number
    with evaluating(model):
        for seg in run_segments(model, streams, reset=reset, device=device, progress=label):
            batch = seg.batch
            logits = (seg.output["logits"] if isinstance(seg.output, dict) else seg.output.logits).float()  # (B, K)
            if adapter is not None:  # the labelled rows predicted by their own adapted weights
                rows = batch.labels >= 0  # (B,)
                if bool(rows.any()):
                    logits = logits.clone()
                    logits[rows] = adapter(batch.input_ids[rows], batch.attention_mask[rows]).float()
            if aggregate == "mean":
                if summed is None:
                    summed, count = torch.zeros_like(logits), torch.zeros(len(logits), dtype=torch.long, device=device)
                inside = (batch.labels >= 0).to(device)  # (B,) the row's document reaches this segment
                new_doc = batch.doc_start.to(device)  # (B,) a new document: its sums start again
                summed = torch.where(new_doc[:, None], 0.0, summed) + logits * inside[:, None]
                count = torch.where(new_doc, 0, count) + inside.long()
                logits = summed / count.clamp(min=1)[:, None]
            scored = batch.last & (batch.labels >= 0)  # (B,) the rows whose document ends here
            labels = batch.labels.clamp(min=0)
            nll = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            cell = labels * k + logits.argmax(-1)  # (B,) the confusion cell of each row; only scored rows count
            confusion.index_add_(0, cell, scored.double())  # no boolean indexing: no host sync per segment
            if tasks:  # a lifelong run's reading of each task (the forgetting curve)
                right = (logits.argmax(-1) == labels) & scored  # (B,)
                slot = batch.tasks.to(device).clamp(min=0) * 2  # (B,)
                per_task.index_add_(0, slot, right.double())
                per_task.index_add_(0, slot + 1, scored.double())
            sums += torch.stack([(nll * scored).double().sum(), batch.attention_mask.sum().double()])
    confusion, sums, per_task = all_reduce_sums(confusion), all_reduce_sums(sums), all_reduce_sums(per_task)
    matrix = confusion.view(k, k)
    wall = time.perf_counter() - start
    result = EvalResult.from_sums(
        nll_sum=float(sums[0]), scored_tokens=int(round(float(matrix.sum()))),
        correct=int(round(float(matrix.diagonal().sum()))), model=model_name,
        data={"corpus": "documents", "num_documents": documents.num_documents, "num_labels": k,
              "label_names": list(documents.label_names), "truncated": streams.truncated,
              "fingerprint": getattr(documents.dataset, "_fingerprint", ""), **documents.metadata},
        split=split,
        protocol={"name": "adapted" if adapter is not None else "memoryless" if memoryless else "full",
                  **({"local_adaptation": dict(adapter.settings)} if adapter is not None else {}),
                  "segment_length": segment_length,
                  "num_streams": batch_size, "max_segments": max_segments, "reset": reset.to_dict(),
                  "memoryless": memoryless, "aggregate": aggregate,
                  "scored": {"last": "argmax at each document's last segment",
                             "mean": "argmax of the mean of each document's segment logits"}[aggregate],
                  "confusion": matrix.long().tolist(),
                  **({"per_task": [{"task": t, "correct": int(per_task[2 * t]), "documents": int(per_task[2 * t + 1]),
                                    "accuracy": float(per_task[2 * t] / per_task[2 * t + 1])
                                    if per_task[2 * t + 1] else None} for t in range(tasks)]} if tasks else {})},
        world_size=world_size, steps=streams.steps_per_epoch, input_tokens=int(round(float(sums[1]))),
        wall_time_s=wall, tokens_per_s=float(sums[1]) / wall if wall > 0 else 0.0,
        macro_f1=macro_f1(matrix),
    )
    if output_path is not None and rank == 0:
        result.save(output_path)
    return result


__all__ = ["AGGREGATES", "evaluate_classification", "macro_f1"]
