"""What each rank puts in its checkpoint shard, and how shards are read back on any world size.

A rank's shard holds, for the token streams it owns (global stream ids, row order):
the recurrent memory of each micro-batch slot (Memoria engrams and previous hidden states,
Transformer-XL caches), the data streams' position, and its RNG states. Resuming on the
same world size gives every rank its own shard back; on another world size every rank
reads all shards (memory-mapped, so only the rows it needs are copied) and assembles the
rows of its new streams by stream id.

A shard is untrusted input (`check_shard`): every memory in it is checked by its kind
(`MemoryKind.check_state`), against the model of the checkpoint's own run configuration
when the manifest is at hand (`saved_model_config`).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from ...model import memory_from_state_dict
from ..build import run_model_config
from ..config import RunConfig
from ..parse import validate


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def seed_everything(seed: int) -> None:
    """Seed every RNG a run uses: Python's `random`, NumPy's global one and torch's (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def make_shard(stream_ids: list[int], memories: list[Any], streams_state: dict[str, Any], step: int,
               micro_batch_size: int, episodic: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's checkpoint shard (memories: one per micro-batch slot, None if never used; `episodic`:
    this rank's MbPA++ state, `EpisodicTraining.state_dict()`, when the run keeps one)."""
    shard = {
        "stream_ids": list(stream_ids),
        "micro_batch_size": micro_batch_size,
        "memory": [None if m is None else m.state_dict() for m in memories],
        "streams": streams_state,
        "rng": rng_state(),
        "step": step,
    }
    if episodic is not None:
        shard["episodic"] = episodic
    return shard


def check_shard(shard: Any, rank: int, model_config: Any = None) -> None:
    """Raise ValueError unless `shard` is what `make_shard` wrote for `rank` (and `save_checkpoint`
    stamped): every field of its type, one memory per micro-batch slot that loads (of a known kind,
    every field of its dtype and a consistent shape, values in range, `micro_batch_size` rows),
    RNG states that can be set. Damaged or crafted content never reaches the run.

    Args:
        model_config: the checkpoint's model (`saved_model_config`): each memory must also be of
            its kind and fit its shapes and capacities (`MemoryKind.check_state`).
    """
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"shard of rank {rank}: {what}")

    need(isinstance(shard, dict), "not a mapping")
    ids, micro = shard.get("stream_ids"), shard.get("micro_batch_size")
    need(isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1, f"micro_batch_size is {micro!r}")
    need(isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids) and len(set(ids)) == len(ids)
         and len(ids) % micro == 0, "stream_ids are not distinct stream numbers filling its micro-batches")
    need(shard.get("rank") == rank, f"it says it is rank {shard.get('rank')!r}'s")
    step = shard.get("step")
    need(type(step) is int and step >= 0, f"step is {step!r}")
    need(isinstance(shard.get("streams"), dict), "no data stream state")
    memories = shard.get("memory")
    need(isinstance(memories, list) and len(memories) == len(ids) // micro,
         f"{len(memories) if isinstance(memories, list) else 'no'} memories for {len(ids) // micro} micro-batch slots")
    for slot, sd in enumerate(memories):
        if sd is not None:
            try:
                rows = memory_from_state_dict(sd, model_config=model_config).batch_size
            except ValueError as e:
                raise ValueError(f"shard of rank {rank}, memory of slot {slot}: {e}") from None
            need(rows == micro, f"the memory of slot {slot} has {rows} rows, not {micro}")
    _check_rng(shard.get("rng"), rank)


def saved_model_config(manifest: dict[str, Any]) -> Any:
    """The config of the model a checkpoint's run built, from its manifest's run configuration
    (`meta.config`; the fingerprint check makes it the resuming run's model): what its shards'
    memories are checked against. No weights are read.

    Raises:
        ValueError: a manifest without a usable run configuration, or one whose model cannot be built.
    """
    meta = manifest.get("meta")
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError("its manifest holds no run configuration to check its memories against")
    # the sections the fingerprint covers, the model's and the data's (the others may have changed since), and
    # no evaluation: its defaults must not be checked against these data (a classifier's documents may have
    # no `validation` split, the default `eval.split`)
    sections = {k: config[k] for k in ("model", "data") if k in config} | {"eval": {"at_end": False, "every": 0}}
    try:
        return run_model_config(validate(RunConfig, sections))
    except (ValueError, OSError) as e:  # a ConfigError, or a backbone whose config cannot be read
        raise ValueError(f"the model of its run configuration cannot be built to check its memories against "
                         f"({type(e).__name__}: {e})") from None


def _check_rng(state: Any, rank: int) -> None:
    """The RNG states can be set (tried on fresh generators: nothing global changes)."""
    try:
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise ValueError(f"shard of rank {rank}: its RNG state cannot be restored ({type(e).__name__}: {e})") from None


def _row_index(shards: list[dict[str, Any]]) -> dict[int, tuple[int, int, int]]:
    """stream id -> (shard, slot, row within slot)."""
    index = {}
    for s, shard in enumerate(shards):
        mb = shard["micro_batch_size"]
        for pos, sid in enumerate(shard["stream_ids"]):
            index[int(sid)] = (s, pos // mb, pos % mb)
    return index


def restore_memories(
    shards: list[dict[str, Any]], stream_ids: list[int], micro_batch_size: int, device: torch.device, memoria_config,
    model_config: Any = None,
) -> list[Any]:
    """Memory objects for this rank's micro-batch slots, assembled from the saved shards by stream id.

    Args:
        shards: every saved rank's shard (or just this rank's, when the layout is unchanged).
        stream_ids: this rank's global stream ids, in row order.
        micro_batch_size: rows per slot now.
        memoria_config: the model's MemoriaConfig (checks engram states), or None.
        model_config: the running model's config: every memory must be of its kind and fit it.

    Returns:
        One memory per slot; None for a slot whose streams had no memory yet.

    Raises:
        ValueError: a stream of this rank is in no shard (the checkpoint has other streams).
    """
    index = _row_index(shards)
    missing = [sid for sid in stream_ids if sid not in index]
    if missing:
        raise ValueError(
            f"streams {missing[:8]} are in no shard of the checkpoint (it holds {len(index)} streams); "
            f"resume with the same number of streams (train_batch_size)"
        )
    cache: dict[tuple[int, int], Any] = {}

    def source(s: int, slot: int):
        if (s, slot) not in cache:
            sd = shards[s]["memory"][slot]
            cache[(s, slot)] = None if sd is None else memory_from_state_dict(sd, config=memoria_config, device="cpu",
                                                                              model_config=model_config)
        return cache[(s, slot)]

    out = []
    for lo in range(0, len(stream_ids), micro_batch_size):
        rows = []
        for sid in stream_ids[lo : lo + micro_batch_size]:
            s, slot, row = index[sid]
            mem = source(s, slot)
            rows.append(None if mem is None else mem.take_rows([row]))
        if any(r is None for r in rows):
            if not all(r is None for r in rows):
                warnings.warn("some streams of a micro-batch had no memory saved; the whole slot starts fresh")
            out.append(None)
            continue
        out.append(type(rows[0]).cat(rows).to(device) if len(rows) > 1 else rows[0].to(device))
    return out
