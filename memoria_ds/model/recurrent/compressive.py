"""`compressive`: the Compressive Transformer (Rae et al. 2020) for an unmodified GPT-2.

Transformer-XL's memory (`xl.py`: each layer's self-attention also attends to the cached,
detached keys/values of the last M tokens) plus a compressed memory of C slots: the slots
that fall out of the memory are not dropped but compressed, c of them into one
(`compression.py`), and kept in a second FIFO. Each segment attends to
[compressed memory, memory, itself]. Per layer, after the blocks:

    full      = [memory, this segment]             (M + L slots, the oldest first)
    memory'   = the last M of full
    evicted   = the rest                           (padded at the old end to a multiple of c)
    cmemory'  = the last C of [cmemory, f_c(evicted)]

Training adds the attention-reconstruction loss (`compression.reconstruction_error`,
weighted by `reconstruction_weight`) to the LM loss; its queries are the segment's own
self-attention queries, detached, so it trains the compression network alone. The
compressed memory is stored detached, so the LM loss never reaches the compression (the
paper's stop-gradient). With `mean`/`max` pooling there is nothing to train and no loss.

Like `xl`, the memory holds keys/values (not the layer inputs the paper stores): the
same function of the stored tokens at fixed weights, without recomputing M + C keys per
layer per segment; so the compression compresses keys and values (docs/baselines.md).
Positions follow `xl_positions` (`"alternate"` in the preset: the cached previous segment
sits in the other bank). The first segment after a reset is exactly the backbone.

Notation: B rows, Y layers, H heads, M memory slots, C compressed slots, L segment tokens, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...rows import BatchRows, rows_field
from ...setting_rules import setting
from .base import FORMAT, BlockWrites, KindSettings, MemoryKind, check_format
from .read_copy import held
from .saved_state import BOOL, FLOATS, INT64, SavedState, backbone_sizes
from .compression import COMPRESSIONS, CompressionNet, pad_to_rate, reconstruction_error
from .xl import XLRead, roll_memory


@dataclass(frozen=True)
class CompressiveSettings(KindSettings):
    """The Compressive Transformer's settings (sources in docs/baselines.md).

    Attributes:
        memory_length: M, uncompressed slots per layer; None = half the segment (the
            config's `segment_length`, else this segment's length; the
            Memoria paper's baselines: memory = segment length, normal : compressed = 1 : 1).
        compressed_length: C, compressed slots per layer; None = M.
        compression_rate: c, evicted slots per compressed slot (4: Memoria paper, Appendix B).
        compression: `"conv"` (Rae et al.'s best, the authors' code), `"mean"` or `"max"`.
        reconstruction_weight: weight of the attention-reconstruction loss (1.0: the authors' configs).
    """

    kind: ClassVar[str] = "compressive"

    # checked by their rules (KindSettings)
    memory_length: int | None = setting(None, least=1, none="half the segment")
    compressed_length: int | None = setting(None, least=1, none="`memory_length`")
    compression_rate: int = setting(4, least=1)
    compression: str = setting("conv", choices=COMPRESSIONS)
    reconstruction_weight: float = setting(1.0, least=0)

    def lengths(self, segment_length: int) -> tuple[int, int]:
        """(M, C) for segments of `segment_length` tokens."""
        memory = self.memory_length if self.memory_length is not None else max(1, segment_length // 2)
        return memory, self.compressed_length if self.compressed_length is not None else memory


@dataclass
class CompressiveMemory(BatchRows):
    """The memory and the compressed memory: detached keys/values per layer.

    Attributes:
        keys / values: (B, Y, H, M, hd) the memory (the oldest slots first). mask: (B, M) bool.
        compressed_keys / compressed_values: (B, Y, H, C, hd). compressed_mask: (B, C) bool.
        segments: (B,) int64 segments written since the row's last reset (position banks).

    Memories of different M or C stack and exchange rows (padded at the old end).
    """

    keys: Tensor = rows_field(pad=(3, "left"))
    values: Tensor = rows_field(pad=(3, "left"))
    mask: Tensor = rows_field(pad=(1, "left"))
    compressed_keys: Tensor = rows_field(pad=(3, "left"))
    compressed_values: Tensor = rows_field(pad=(3, "left"))
    compressed_mask: Tensor = rows_field(pad=(1, "left"))
    segments: Tensor | None = None

    def __post_init__(self) -> None:
        if self.segments is None:
            self.segments = torch.zeros(self.mask.shape[0], dtype=torch.int64, device=self.mask.device)

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, num_heads: int, head_dim: int,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
              length: int = 0, compressed_length: int = 0) -> CompressiveMemory:
        """A memory of `length` (M) and `compressed_length` (C) slots per layer, all empty."""
        def zeros(slots: int) -> Tensor:  # (B, Y, H, slots, hd)
            return torch.zeros(batch_size, num_layers, num_heads, slots, head_dim, device=device, dtype=dtype)

        def none(slots: int) -> Tensor:  # (B, slots)
            return torch.zeros(batch_size, slots, dtype=torch.bool, device=device)

        return cls(zeros(length), zeros(length), none(length), zeros(compressed_length), zeros(compressed_length),
                   none(compressed_length))

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or those where the (B,) bool `mask` is True, in place (values zeroed, as `XLMemory`)."""
        tensors = (self.keys, self.values, self.compressed_keys, self.compressed_values)
        if mask is None:
            for t in (*tensors, self.mask, self.compressed_mask, self.segments):
                t.zero_()
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        self.compressed_mask.masked_fill_(mask[:, None], False)
        self.segments.masked_fill_(mask, 0)
        for t in tensors:
            t.masked_fill_(mask[:, None, None, None, None], 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "compressive", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask,
                "compressed_keys": self.compressed_keys, "compressed_values": self.compressed_values,
                "compressed_mask": self.compressed_mask, "segments": self.segments}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> CompressiveMemory:
        check_format(state_dict, "compressive")
        names = ("keys", "values", "mask", "compressed_keys", "compressed_values", "compressed_mask", "segments")
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise ValueError(f"saved compressive memory lacks {missing}")
        out = cls(*(state_dict[n] for n in names))
        B = out.mask.shape[0]
        if (out.keys.shape != out.values.shape or out.compressed_keys.shape != out.compressed_values.shape
                or out.keys.shape[:3] != out.compressed_keys.shape[:3] or out.keys.shape[0] != B
                or out.keys.shape[3] != out.mask.shape[1] or out.compressed_mask.shape != (B, out.compressed_keys.shape[3])
                or out.segments.shape != (B,)):
            raise ValueError(
                f"inconsistent compressive memory: keys {tuple(out.keys.shape)}, mask {tuple(out.mask.shape)}, "
                f"compressed keys {tuple(out.compressed_keys.shape)}, compressed mask {tuple(out.compressed_mask.shape)}"
            )
        return out.to(device) if device is not None else out


@dataclass
class CompressiveRead(XLRead):
    """The blocks' view: every layer's [compressed memory, memory] read as `xl`'s cache is
    (keys / values (B, Y, H, C + M, hd), slot_mask (B, C + M)), and each layer's queries
    collected for the reconstruction loss."""

    collects_queries: ClassVar[bool] = True


@dataclass
class Pending:
    """What a forward's write needs from its read: the compression network; the loss it leaves."""

    net: CompressionNet
    held: CompressiveMemory | None = None  # what the read read (`read_copy.held`): the write evicts from it
    loss: Tensor | None = None


def evict(memory: Tensor, memory_mask: Tensor, current: Tensor, current_mask: Tensor,
          length: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Split [memory, current] into the kept last `length` slots and the evicted older ones.

    Args:
        memory: (B, H, M, hd). memory_mask: (B, M). current: (B, H, L, hd). current_mask: (B, L).

    Returns:
        ((B, H, length, hd) kept, (B, length) mask) padded at the old end as empty when
        fewer; ((B, H, E, hd) evicted, (B, E) mask), E = max(0, M + L - length).
    """
    full = torch.cat([memory.to(current.dtype), current.detach()], dim=2)
    full_mask = torch.cat([memory_mask, current_mask], dim=1)
    cut = max(0, full.shape[2] - length)
    kept = roll_memory(None, None, full[:, :, cut:], full_mask[:, cut:], length)
    return kept, (full[:, :, :cut], full_mask[:, :cut])


class CompressiveKind(MemoryKind):
    """Memory of M slots plus compressed memory of C slots per layer (`CompressiveSettings`)."""

    name = "compressive"
    places = frozenset({"cached slots", "modules"})
    memory_class = CompressiveMemory
    settings_class = CompressiveSettings

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> CompressiveMemory:
        """With the model's `segment_length` set, a memory of the M and C slots every write leaves, all
        empty (every step then sees the same shapes: a compiled step compiles once); else of none."""
        cfg = self.config
        lengths = self.settings.lengths(cfg.segment_length) if cfg.segment_length else (0, 0)
        return CompressiveMemory.empty(batch_size, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, device, dtype,
                                       *lengths)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "compressive", backbone_sizes(config))
        keys = s.tensor("keys", FLOATS, "B Y H M hd")
        for name, dims in (("values", "B Y H M hd"), ("compressed_keys", "B Y H C hd"),
                           ("compressed_values", "B Y H C hd")):
            s.tensor(name, (keys.dtype,), dims)
        s.tensor("mask", BOOL, "B M")
        s.tensor("compressed_mask", BOOL, "B C")
        s.require((s.tensor("segments", INT64, "B") >= 0).all(), "segments", "holds a negative count")
        if config is not None:  # the longest segment gives the largest default lengths
            settings = cls.settings_class.from_dict(dict(config.memory_settings or {}))
            memory, compressed = settings.lengths(config.segment_length or config.positions_per_segment)
            s.at_most("mask", "M", memory, "compressive `memory_length`")
            s.at_most("compressed_mask", "C", compressed, "compressive `compressed_length`")

    def build_module(self) -> CompressionNet:
        s, cfg = self.settings, self.config
        return CompressionNet(cfg.n_layer, cfg.n_embd, s.compression_rate, s.compression)

    def read(self, memory: CompressiveMemory, dtype: torch.dtype, net: Any) -> tuple[CompressiveRead, Pending]:
        cfg = self.config
        memory = held(memory)  # the write overwrites the memory in place; the backward needs what was read
        offset = None
        if cfg.position_banks > 1:
            offset = (memory.segments % cfg.position_banks) * cfg.positions_per_segment
        keys = torch.cat([memory.compressed_keys, memory.keys], dim=3)
        values = torch.cat([memory.compressed_values, memory.values], dim=3)
        mask = torch.cat([memory.compressed_mask, memory.mask], dim=1)
        return CompressiveRead(keys, values, mask, offset), Pending(net, memory)

    def cached_slots(self, segment_length: int) -> int:
        return sum(self.settings.lengths(self.config.segment_length or segment_length))

    def frozen_read(self, memory: CompressiveMemory, dtype: torch.dtype, net: Any) -> CompressiveRead:
        return self.read(memory, dtype, net)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(self, memory: CompressiveMemory, read: CompressiveRead, pending: Pending, writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> None:
        settings, net, old = self.settings, pending.net, pending.held  # `old`: the memory as read (its reconstruction
        # loss is back-propagated after `memory` is overwritten)
        length, compressed_length = settings.lengths(self.config.segment_length or valid.shape[1])
        train = net.training and net.trainable and settings.reconstruction_weight > 0 and torch.is_grad_enabled()
        new = {name: [] for name in ("k", "v", "ck", "cv")}
        masks, errors = None, []
        for i, (k, v) in enumerate(zip(writes.keys, writes.values)):
            (kept_k, kept_mask), (old_k, old_mask) = evict(old.keys[:, i], old.mask, k, valid, length)
            (kept_v, _), (old_v, _) = evict(old.values[:, i], old.mask, v, valid, length)
            old_k, old_mask_padded = pad_to_rate(old_k, old_mask, net.rate)
            old_v, _ = pad_to_rate(old_v, old_mask, net.rate)
            with torch.set_grad_enabled(train):
                ck, cv, cmask = net(i, old_k, old_v, old_mask_padded)
            if train:
                errors.append(reconstruction_error(writes.queries[i], valid, (old_k, old_v, old_mask_padded),
                                                   (ck, cv, cmask)))
            ck_all, cmask_all = roll_memory(old.compressed_keys[:, i], old.compressed_mask, ck.to(k.dtype),
                                            cmask, compressed_length)
            cv_all, _ = roll_memory(old.compressed_values[:, i], old.compressed_mask, cv.to(k.dtype),
                                    cmask, compressed_length)
            new["k"].append(kept_k)
            new["v"].append(kept_v)
            new["ck"].append(ck_all)
            new["cv"].append(cv_all)
            masks = (kept_mask.contiguous(), cmask_all.contiguous())  # not views of a cat: the same strides every step
        memory.store_(keys=torch.stack(new["k"], dim=1), values=torch.stack(new["v"], dim=1),  # in place
                      compressed_keys=torch.stack(new["ck"], dim=1), compressed_values=torch.stack(new["cv"], dim=1),
                      mask=masks[0], compressed_mask=masks[1], segments=memory.segments + 1)
        if train:
            pending.loss = settings.reconstruction_weight * torch.stack(errors).mean()
        return None

    def auxiliary_loss(self, pending: Pending) -> Tensor | None:
        return pending.loss


__all__ = ["CompressiveSettings", "CompressiveMemory", "CompressiveRead", "CompressiveKind", "evict"]
