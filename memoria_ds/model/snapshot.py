"""Memory snapshots: a stream's memory saved as an artifact, for the model that made it.

    memory = read(model, book_ids, segment_length=150)            # read a book once
    save_snapshot("book.memory.safetensors", model, memory, stream_ids=[0], description="Alice")
    ...
    snap = load_snapshot("book.memory.safetensors", model)          # later, another process
    out = model.generate(question_ids, memory=snap.memory, max_new_tokens=20)

A snapshot is safetensors + JSON (`memoria_ds.safe_io`: loading it runs no code) holding the
memory's rows, one per stream id, the memory settings, and a fingerprint of the model that
wrote it. The engrams are the model's own hidden states, so a snapshot only means something
to that model: loading it into another (other weights, other shape or memory settings) is
refused with a clear message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..safe_io import load_tree, save_tree
from .recurrent import RecurrentMemory, memory_from_state_dict

SNAPSHOT_KIND = "memoria_ds.memory_snapshot"
FORMAT = 1
_SAMPLES = 4096  # values per parameter that enter the fingerprint


class SnapshotMismatch(ValueError):
    """A snapshot that does not belong to the model it is loaded into."""


@dataclass
class Snapshot:
    memory: RecurrentMemory
    stream_ids: list[int]
    description: str
    model_fingerprint: str


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's configuration and weights (a strided sample of every
    parameter, rounded to bf16 so fp32 and bf16 copies of one model agree)."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("_name_or_path", "dtype", "torch_dtype", "transformers_version", "architectures",
                           "auto_map", "use_cache", "_attn_implementation_autoset")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES)
            sample = flat[::step][:_SAMPLES].to(torch.bfloat16).float().cpu()
            h.update(name.encode() + str(tuple(p.shape)).encode() + sample.numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def read(model: Any, input_ids: torch.Tensor, segment_length: int, memory: RecurrentMemory | None = None,
         attention_mask: torch.Tensor | None = None) -> RecurrentMemory:
    """Feed (B, T) tokens through the memory segment by segment; returns the memory after the last.

    The last, possibly shorter, segment is read too (everything in `input_ids` is memorized).
    """
    if memory is None:
        memory = model.empty_memory(input_ids.shape[0], input_ids.device)
    for start in range(0, input_ids.shape[1], segment_length):
        mask = attention_mask[:, start:start + segment_length] if attention_mask is not None else None
        memory = model(input_ids[:, start:start + segment_length], memory=memory, attention_mask=mask).memory
    return memory


def save_snapshot(path: str | Path, model: Any, memory: RecurrentMemory, stream_ids: list[int] | None = None,
                  description: str = "") -> Path:
    """Write `memory` (one row per stream id; default 0..B-1) for `model` to `path`."""
    state = memory.to("cpu").state_dict()
    rows = memory.batch_size
    ids = list(range(rows)) if stream_ids is None else [int(s) for s in stream_ids]
    if len(ids) != rows or len(set(ids)) != rows:
        raise ValueError(f"{len(ids)} stream ids {ids[:8]} for a memory of {rows} rows (one distinct id per row)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tree({"kind": SNAPSHOT_KIND, "format": FORMAT, "memory": state, "stream_ids": ids,
               "memory_type": model.config.memory_type, "memoria": getattr(model.config, "memoria", None),
               "model_fingerprint": model_fingerprint(model), "description": description}, path)
    return path


def _check_fields(path: str | Path, tree: dict[str, Any]) -> None:
    """The snapshot's own fields have the types `save_snapshot` writes (its memory is checked
    when it is rebuilt): a damaged or crafted file is a ValueError, not a crash further on."""
    ids = tree.get("stream_ids")
    wrong = [name for name, ok in (
        ("memory", isinstance(tree.get("memory"), dict)),
        ("stream_ids", isinstance(ids, list) and all(type(i) is int for i in ids) and len(set(ids)) == len(ids)),
        ("memory_type", isinstance(tree.get("memory_type"), str)),
        ("model_fingerprint", isinstance(tree.get("model_fingerprint"), str)),
        ("description", isinstance(tree.get("description", ""), str)),
    ) if not ok]
    if wrong:
        raise ValueError(f"{path} is damaged or crafted: its field(s) {', '.join(wrong)} are not what "
                         f"save_snapshot writes")


def load_snapshot(path: str | Path, model: Any, stream_ids: list[int] | None = None,
                  device: torch.device | str | None = None) -> Snapshot:
    """A snapshot for `model`, optionally only the rows of `stream_ids` (in that order).

    Raises:
        SnapshotMismatch: another model's snapshot (weights, shape or memory settings).
        ValueError: not a snapshot, a memory this model cannot run (damaged or crafted: another
            kind, a field of the wrong shape or dtype, a value out of range), or a stream id it
            does not hold.
    """
    tree = load_tree(path)
    if not isinstance(tree, dict) or tree.get("kind") != SNAPSHOT_KIND:
        raise ValueError(f"{path} is not a memory snapshot (save one with memoria_ds.model.save_snapshot)")
    if tree.get("format") != FORMAT:
        raise ValueError(f"{path}: snapshot format {tree.get('format')!r}; this version reads {FORMAT}")
    _check_fields(path, tree)
    mine = model_fingerprint(model)
    if tree["memory_type"] != model.config.memory_type or tree["model_fingerprint"] != mine:
        raise SnapshotMismatch(
            f"{path} holds the memory of another model (memory type {tree['memory_type']}, model {tree['model_fingerprint']}; "
            f"this one: {model.config.memory_type}, {mine}). Engrams are a model's own hidden states: read the text "
            f"again with this model (memoria_ds.model.read) to make its snapshot"
        )
    try:  # of the model's kind, every field fitting its shapes and settings, every value in range
        memory = memory_from_state_dict(tree["memory"], device=device, model_config=model.config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    ids = list(tree["stream_ids"])
    if memory.batch_size != len(ids):
        raise ValueError(f"{path} is damaged or crafted: {len(ids)} stream ids for a memory of {memory.batch_size} rows")
    if stream_ids is not None:
        missing = [s for s in stream_ids if s not in ids]
        if missing:
            raise ValueError(f"{path} has no rows for stream ids {missing[:8]} (it holds {ids[:8]}"
                             f"{'...' if len(ids) > 8 else ''})")
        memory = memory.take_rows([ids.index(s) for s in stream_ids])
        ids = list(stream_ids)
    return Snapshot(memory=memory, stream_ids=ids, description=tree.get("description", ""),
                    model_fingerprint=mine)
