"""MbPA++ in the training loop: writes, sparse replay and the checkpointed state (`episodic.*`).

`EpisodicTraining` is one rank's share of the episodic memory (`memoria_ds.episodic`) and what the
loop does with it:

    observe(micro)            after a micro-batch: its documents (labelled rows) written, keyed by the
                              frozen key encoder, each with probability `write_prob`
    due(documents)            after an optimiser step: the replays that step made due (the schedule
                              counts the documents read over all ranks: every rank agrees, no collective)
    replay_batches(parts)     one replay: `replay_size / ranks` documents of this rank's memory, split into
                              the `grad_accum` micro-batches of one optimiser update
    state_dict() / load()     the memory, the schedule, the draw generator: part of this rank's shard

The key encoder is the encoder of a second copy of the classifier, built as the run built its model
(same seed, same checkpoint): the pretrained backbone before any update, frozen, whole on every rank
(also under ZeRO-3), as the paper's separate key network. A resumed run builds it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..episodic import (EpisodicMemory, KeyEncoder, MemoryBatch, ReplaySchedule, adapt_and_predict, concat, sample,
                        write)
from .config import EpisodicSection

FORMAT = 1


@dataclass
class EpisodicTraining:
    """One rank's episodic memory and replay schedule.

    Attributes:
        keys: the frozen key encoder.
        memory: this rank's examples.
        schedule: documents read (over all ranks) and the replay rate.
        local_replay: documents this rank contributes to one replay.
        write_prob: the chance each document is written.
        generator: the draws of writes and replays (its state is checkpointed).
        replays: replay updates made so far.
    """

    keys: KeyEncoder
    memory: EpisodicMemory
    schedule: ReplaySchedule
    local_replay: int
    write_prob: float
    generator: torch.Generator
    replays: int = 0

    @classmethod
    def build(cls, settings: EpisodicSection, key_model: torch.nn.Module, *, pad_token_id: int, rank: int,
              world_size: int, seed: int, device: torch.device) -> EpisodicTraining:
        """The state of a fresh run.

        Raises:
            ValueError: a replay size that does not split over the ranks.
        """
        if settings.replay_size % world_size:
            raise ValueError(f"`episodic.replay_size` ({settings.replay_size}) must split evenly over the "
                             f"{world_size} ranks (each replays from its own memory)")
        keys = KeyEncoder(key_model).to(device)
        generator = torch.Generator(device="cpu").manual_seed(seed + 7919 * (rank + 1))
        return cls(keys=keys, memory=EpisodicMemory.empty(keys.key_dim, pad_token_id=pad_token_id, device=device),
                   schedule=ReplaySchedule(settings.replay_every, settings.replay_size),
                   local_replay=settings.replay_size // world_size, write_prob=float(settings.write_prob),
                   generator=generator)

    def observe(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                tasks: torch.Tensor | None = None) -> None:
        """Write the labelled rows of a micro-batch ((B, T) tokens and mask, (B,) labels, -100: a padding row;
        (B,) task ids when the documents have them, else task 0)."""
        rows = labels >= 0  # (B,)
        if not bool(rows.any()):
            return
        ids, mask = input_ids[rows], attention_mask[rows]
        self.memory = write(self.memory, self.keys(ids, mask), ids, mask, labels[rows],
                            tasks[rows] if tasks is not None else 0, write_prob=self.write_prob,
                            generator=self.generator)

    def due(self, documents: int) -> int:
        """Count `documents` more read over all ranks; the replays now due."""
        self.schedule, count = self.schedule.advance(documents)
        return count

    def replay_batches(self, parts: int, device: torch.device) -> list[MemoryBatch | None]:
        """One replay's documents of this rank in `parts` micro-batches; None for a part with nothing in it
        (a memory with fewer documents than a part: the rank still takes part in the update)."""
        batch = sample(self.memory, self.local_replay, generator=self.generator) if len(self.memory) else None
        self.replays += 1
        if batch is None:
            return [None] * parts
        bounds = [round(i * len(batch) / parts) for i in range(parts + 1)]
        out: list[MemoryBatch | None] = []
        for lo, hi in zip(bounds, bounds[1:]):
            if hi == lo:
                out.append(None)
                continue
            part = MemoryBatch(*(t[lo:hi].to(device) for t in (batch.input_ids, batch.attention_mask, batch.labels,
                                                                batch.task_ids, batch.indices)))
            out.append(part)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "memory": self.memory.state_dict(), "schedule": self.schedule.state_dict(),
                "generator": self.generator.get_state(), "replays": self.replays}

    def load(self, state: Any) -> None:
        """Restore a `state_dict` of a run with these settings.

        Raises:
            ValueError: not such a state, or one saved with other replay settings or keys of another width.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError("its shard holds no episodic memory of this format (was the run started without "
                             "`episodic.enabled`?)")
        memory = EpisodicMemory.from_state_dict(state["memory"], key_dim=self.keys.key_dim, device=self.memory.device)
        schedule = ReplaySchedule.from_state_dict(state["schedule"], expect=self.schedule)
        generator = state.get("generator")
        if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8:
            raise ValueError("its episodic draw generator state is not a byte tensor")
        replays = state.get("replays")
        if type(replays) is not int or replays < 0:
            raise ValueError(f"its episodic replay count is {replays!r}")
        self.generator.set_state(generator)
        self.memory, self.schedule, self.replays = memory, schedule, replays

    def scalars(self) -> dict[str, float]:
        """What the metrics log: this rank's memory size and the replays made."""
        return {"episodic/size": float(len(self.memory)), "episodic/replays": float(self.replays)}


class LocalAdapter:
    """MbPA++'s inference for the `adapted` reading: each labelled document's K nearest documents of the
    whole episodic memory (every rank's, gathered once), L gradient steps from the trained weights on them
    with the pull back to those weights, then the prediction (`memoria_ds.episodic.adapt_and_predict`; the
    model itself is never written).

    Args:
        model: the trained classifier (its full weights on this rank: ZeRO-3's partitions cannot be adapted).
        keys: the frozen key encoder.
        memory: the whole memory.
        settings: the run's `episodic` section.
    """

    def __init__(self, model: torch.nn.Module, keys: KeyEncoder, memory: EpisodicMemory,
                 settings: EpisodicSection) -> None:
        if len(memory) == 0:
            raise ValueError("the episodic memory is empty: nothing to adapt to")
        self.model, self.keys, self.memory = model, keys, memory
        self.settings = {"neighbours": settings.neighbours, "steps": settings.adapt_steps,
                         "lr": float(settings.adapt_lr), "l2": float(settings.adapt_l2), "optimizer": "sgd",
                         "memory_size": len(memory)}

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(n, L) tokens and mask -> (n, K) logits, each row from its own adapted weights."""
        s = self.settings
        with torch.enable_grad():
            return adapt_and_predict(self.model, self.memory, self.keys(input_ids, attention_mask),
                                     {"input_ids": input_ids, "attention_mask": attention_mask}, k=s["neighbours"],
                                     steps=s["steps"], lr=s["lr"], l2=s["l2"])


def whole_memory(local: EpisodicMemory) -> EpisodicMemory:
    """Every rank's memory joined, in rank order, on every rank (one gather of their state dicts)."""
    from .distributed import gather_objects

    states = gather_objects({k: v.cpu() if torch.is_tensor(v) else v for k, v in local.state_dict().items()})
    return concat([EpisodicMemory.from_state_dict(sd, key_dim=local.key_dim, device=local.device) for sd in states])


def adapter_from_run(run_cfg: Any, run_dir: Path, model: torch.nn.Module, vocab_size: int | None,
                     settings: EpisodicSection, device: torch.device) -> tuple[LocalAdapter, int]:
    """MbPA++'s local adaptation for the evaluate command: every rank's episodic memory from the run's newest
    checkpoint (in rank order, as the run's own evaluation gathers it) and the key network rebuilt as the run
    built it (its config and seed: the classifier before any update), checked against the keys stored.

    Args:
        run_cfg: the run's own configuration (config.yaml); `settings`: the `episodic` section to adapt with.
        model: the trained classifier being scored.

    Returns:
        The adapter and the checkpoint's step.

    Raises:
        ValueError: no complete checkpoint, shards without an episodic memory, keys the rebuilt key network
            does not give.
    """
    from .build import build_run_model
    from .checkpoints import find_latest, load_shard
    from .checkpoints.shards import seed_everything

    checkpoint, skipped = find_latest(Path(run_dir) / "checkpoints")
    if checkpoint is None:
        raise ValueError(f"{run_dir} has no complete checkpoint holding the episodic memory"
                         + (f" ({skipped[0]})" if skipped else ""))
    parts = []
    for rank in range(checkpoint.world_size):
        state = load_shard(checkpoint, rank).get("episodic")
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{checkpoint.path}: rank {rank}'s shard holds no episodic memory (was the run started "
                             f"without `episodic.enabled`?)")
        parts.append(EpisodicMemory.from_state_dict(state["memory"], device=device))
    memory = concat(parts)
    id2label = model.config.id2label
    seed_everything(run_cfg.seed)  # the run's initial weights: its key network
    keys = KeyEncoder(build_run_model(run_cfg, vocab_size, [id2label[i] for i in range(len(id2label))])).to(device)
    probe = min(len(memory), 8)
    again = keys(memory.input_ids[:probe], memory.attention_mask()[:probe]) if probe else None
    if probe and not torch.allclose(again, memory.keys[:probe], atol=1e-4, rtol=1e-4):
        raise ValueError(f"the key network rebuilt from {run_dir}/config.yaml does not give the keys its memory "
                         f"holds (was the backbone changed since the run?)")
    return LocalAdapter(model, keys, memory, settings), checkpoint.step


def replays_in_run(settings: EpisodicSection, documents_per_step: int, steps: int) -> int:
    """Replay updates a run of `steps` steps of `documents_per_step` documents makes (the schedule's length)."""
    return documents_per_step * steps // settings.replay_every if settings.replay_every else 0


__all__ = ["EpisodicTraining", "LocalAdapter", "adapter_from_run", "replays_in_run", "whole_memory"]
