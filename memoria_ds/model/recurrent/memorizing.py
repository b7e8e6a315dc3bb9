"""`memorizing`: the Memorizing Transformer's kNN memory (Wu et al., 2022) for an unmodified GPT-2.

One block (the setting `layer` of `memory_settings`) gets a kNN-augmented self-attention
(`model/knn_attention.py`, the kind's `memory_net`, in place of that block's own through
`MemoryRead.block_attention`): its queries also attend to the top-k (key, value) pairs of a
per-stream memory of that layer's past segments, mixed with the local attention by a
learned per-head gate. After every segment the write appends the segment's (L2-normalised
key, value) pairs of that layer to the memory (detached: no gradient flows into the
memory), keeping the newest `size` (a FIFO, oldest out). A reset (a document
start) empties a row, as the paper clears the memory of each new document.

The paper pairs the memory with a Transformer-XL cache in every layer or uses none (it
reports both). Alone this kind is the "no XL cache" variant (preset `memorizing_no_cache`);
the `memorizing` preset composes it with `xl` (`xl+memorizing`), as google-research/meliad
runs it. GPT-2's absolute positions are in the stored keys (docs/field_memories.md).

Notation: B rows, H heads, M memory slots, L tokens of the segment, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ...rows import BatchRows, pad_to, rows_field
from ...setting_rules import SettingError, setting
from ..knn_attention import KNNAttention, KNNSlots
from .base import FORMAT, BlockWrites, KindSettings, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import BOOL, FLOAT32, SavedState, backbone_sizes, vector_lengths


@dataclass(frozen=True)
class MemorizingSettings(KindSettings):
    """The Memorizing Transformer's settings (`memory_settings`; sources in docs/field_memories.md).

    Attributes:
        layer: the block (0-based) with the kNN-augmented attention; None = round(0.75 n_layer) - 1
            (the paper's 9th of 12 layers).
        size: (key, value) pairs the kNN memory keeps per stream, oldest out (8192: the paper's
            smallest main memory).
        topk: neighbours each query retrieves (the paper: 32).
        gate_bias: the per-head gate's bias b_g at initialisation (g = sigmoid(b_g)); None: by the
            model's `memory_init` (`noop`: -4, g = 0.018, close to the backbone; `random`: 0).
            The `memorizing` preset sets 0, an even mix, as google-research/meliad starts it.
    """

    kind: ClassVar[str] = "memorizing"

    # checked by their rules (KindSettings)
    layer: int | None = setting(None, least=0, what="a block index", none="the block at three quarters of the depth")
    size: int = setting(8192, least=1)
    topk: int = setting(32, least=1)
    gate_bias: float | None = setting(None, least=-20, most=20, what="a gate bias",
                                      none="by `memory_init`: -4 under noop, 0 under random")

    def check_model(self, config: Any) -> None:
        """Raise SettingError if the settings do not fit the model (the config's validation calls it)."""
        self.resolved_layer(config.n_layer)

    def resolved_layer(self, n_layer: int) -> int:
        """The memory block of a model of `n_layer` blocks (SettingError if there is no such block)."""
        if self.layer is None:
            return max(0, round(0.75 * n_layer) - 1)
        if self.layer >= n_layer:
            raise SettingError("layer", f"({self.layer}) must be a block index in [0, {n_layer}) (the model has "
                               f"{n_layer} blocks), or None for the block at three quarters of the depth")
        return self.layer


@dataclass
class MemorizingMemory(BatchRows):
    """The kNN memory of one layer, per row: the newest M (key, value) pairs of its document.

    Attributes:
        keys: (B, H, M, hd) float32, L2-normalised keys (detached).
        values: (B, H, M, hd) float32 values.
        mask: (B, M) bool, True where a slot holds a token of the row's document (oldest
            first; a reset row has none).

    Memories of different M stack and exchange rows: the shorter are padded at the old end.
    """

    keys: Tensor = rows_field(pad=(2, "left"))
    values: Tensor = rows_field(pad=(2, "left"))
    mask: Tensor = rows_field(pad=(1, "left"))

    @classmethod
    def empty(cls, batch_size: int, num_heads: int, head_dim: int,
              device: torch.device | str | None = None, length: int = 0) -> MemorizingMemory:
        """A fresh memory of `length` (M) empty slots."""
        shape = (batch_size, num_heads, length, head_dim)
        return cls(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                   torch.zeros(batch_size, length, dtype=torch.bool, device=device))

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or the rows where the (B,) bool `mask` is True, in place (zeroed, as XL's).

        Forgetting all rows empties the memory (length 0). Forgetting some keeps the length where
        shapes must stay fixed (`static_shapes`: a compiled step, or an accelerator, where finding
        the slots no row holds would read the mask on the host every step). In eager CPU steps,
        where that read costs nothing, the oldest slots no row holds any more are dropped, so a
        batch whose rows all start new documents (the sorting task) searches only what it holds,
        not `size` masked slots (a run of memorizing on sorting: 514 s against 6,607 s). The
        reads are the same either way: a masked slot is never read (tested).
        """
        if mask is None:
            self.keys, self.values, self.mask = self.keys[:, :, :0], self.values[:, :, :0], self.mask[:, :0]
            return
        mask = mask.to(self.mask.device, torch.bool)
        self.mask.masked_fill_(mask[:, None], False)
        rows = mask[:, None, None, None]  # (B, 1, 1, 1) over (B, H, M, hd)
        self.keys.masked_fill_(rows, 0.0)
        self.values.masked_fill_(rows, 0.0)
        if not static_shapes(self.mask.device):
            held = self.mask.any(0).nonzero()  # slots some row still holds, the oldest first (CPU: no sync)
            start = int(held[0]) if len(held) else self.length
            if start:
                self.keys, self.values = self.keys[:, :, start:], self.values[:, :, start:]
                self.mask = self.mask[:, start:]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memorizing", "format": FORMAT, "keys": self.keys, "values": self.values, "mask": self.mask}

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, Any], config: Any = None, device: torch.device | str | None = None
    ) -> MemorizingMemory:
        check_format(state_dict, "memorizing")
        out = cls(state_dict["keys"], state_dict["values"], state_dict["mask"])
        if (out.keys.shape != out.values.shape or out.keys.dim() != 4 or out.keys.shape[0] != out.mask.shape[0]
                or out.keys.shape[2] != out.mask.shape[1]):
            raise ValueError(f"inconsistent memorizing memory: keys {tuple(out.keys.shape)}, "
                             f"values {tuple(out.values.shape)}, mask {tuple(out.mask.shape)}")
        return out.to(device) if device is not None else out


@dataclass
class MemorizingRead(BatchRows, MemoryRead):
    """The blocks' view of a `MemorizingMemory`: the memory layer's slots, read by that block's
    kNN-augmented attention in place of its own (nothing else is read).

    Attributes:
        keys / values: (B, H, M, hd) float32. mask: (B, M) bool.
        attention: the kind's `KNNAttention` (the model's `memory_net`). layer: its block.
    """

    keys: Tensor
    values: Tensor
    mask: Tensor
    attention: KNNAttention | None = rows_field(rows=False, default=None)
    layer: int = rows_field(rows=False, default=-1)
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None
    collects_kv: ClassVar[bool] = True
    replaces_attention: ClassVar[bool] = True

    def _map(self, fn) -> MemorizingRead:  # row operations keep the attention and its block
        out = BatchRows._map(self, fn)
        out.attention, out.layer = self.attention, self.layer
        return out

    def block_attention(self, layer: int, attn: Any, hidden: Tensor, attention_mask: Tensor | None,
                        kv: Any) -> Tensor | None:
        if layer != self.layer or self.attention is None:
            return None
        return self.attention(attn, hidden, KNNSlots(self.keys, self.values, self.mask), attention_mask, kv)


def static_shapes(device: torch.device) -> bool:
    """Whether the memory keeps fixed shapes in this step: when compiling (a graph is made for
    them) and on an accelerator (CUDA graphs; a data-dependent length would read the mask on the
    host); eager on CPU a reset may drop the slots no row holds (`MemorizingMemory.reset`)."""
    return torch.compiler.is_compiling() or torch.device(device).type != "cpu"


def fifo_append(memory: Tensor, current: Tensor, size: int, dim: int) -> Tensor:
    """The newest `size` entries of [memory, current] along `dim` (fewer while not full), a new
    contiguous tensor (a view of a longer one would change the strides a compiled step sees)."""
    M, L = memory.shape[dim], current.shape[dim]
    drop = max(0, M + L - size)  # the oldest entries that fall out
    if drop >= M:  # the segment alone fills the memory
        return current.narrow(dim, drop - M, L - (drop - M)).contiguous()
    return torch.cat([memory.narrow(dim, drop, M - drop), current], dim=dim)


class MemorizingKind(MemoryKind):
    """A kNN memory of `size` past (key, value) pairs at block `layer` (`MemorizingSettings`)."""

    name = "memorizing"
    places = frozenset({"own attention", "modules"})
    memory_class = MemorizingMemory
    settings_class = MemorizingSettings

    def __init__(self, config) -> None:
        super().__init__(config)
        self.layer = self.settings.resolved_layer(config.n_layer)  # checked when the model is built

    def build_module(self) -> KNNAttention:
        """The memory block's learned per-head gate and cosine scale (`memory_net`)."""
        return KNNAttention(self.config.n_head, self.settings.topk, self.settings.gate_bias)

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MemorizingMemory:
        """With the model's `segment_length` set, a memory of `size` empty slots, the length every write
        leaves once full (every step then sees the same shapes: a compiled step compiles once; the cost, a
        top-k over all `size` slots from the first segment on); else of none, growing to `size`."""
        cfg = self.config
        return MemorizingMemory.empty(batch_size, cfg.n_head, cfg.n_embd // cfg.n_head, device,
                                      self.settings.size if cfg.segment_length else 0)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        s = SavedState(state_dict, "memorizing", backbone_sizes(config))
        keys = s.tensor("keys", FLOAT32, "B H M hd")
        s.tensor("values", FLOAT32, "B H M hd")
        s.tensor("mask", BOOL, "B M")
        # stored L2-normalised (a forgotten slot holds zeros): a longer key is crafted
        s.require((vector_lengths(keys) <= 1.001).all(), "keys", "holds a key longer than 1 (keys are stored "
                  "L2-normalised)")
        if config is not None:
            size = cls.settings_class.from_dict(dict(config.memory_settings or {})).size
            s.at_most("mask", "M", size, "memorizing `size`")

    def prepare(self, memory: MemorizingMemory | None, batch_size: int, device: torch.device, dtype: torch.dtype,
                reset: Tensor | None) -> MemorizingMemory:
        """The base's, then a memory shorter than `size` (made without `segment_length`, or saved while
        filling) padded at its old end with empty slots when the model's `segment_length` is set and the
        step needs fixed shapes (`static_shapes`): the steps that fill it would each see another shape
        (a compiled step recompiling at each). Eager on CPU, a reset may have shortened it: kept so."""
        memory = super().prepare(memory, batch_size, device, dtype, reset)
        size = self.settings.size
        if self.config.segment_length and memory.length < size and static_shapes(device):
            memory.keys, memory.values = (pad_to(t, size, 2, "left") for t in (memory.keys, memory.values))
            memory.mask = pad_to(memory.mask, size, 1, "left")
        return memory

    def check(self, memory: MemorizingMemory) -> None:
        cfg = self.config
        want = (cfg.n_head, cfg.n_embd // cfg.n_head)
        if (memory.keys.shape[1], memory.keys.shape[3]) != want:
            raise ValueError(f"memorizing memory of {memory.keys.shape[1]} heads of width {memory.keys.shape[3]}; "
                             f"this model has {want[0]} of width {want[1]}")

    def read(self, memory: MemorizingMemory, dtype: torch.dtype, net: Any) -> tuple[MemorizingRead, None]:
        memory = held(memory)  # the write overwrites the memory in place; the backward needs what was read
        return MemorizingRead(memory.keys, memory.values, memory.mask, net, self.layer), None

    def frozen_read(self, memory: MemorizingMemory, dtype: torch.dtype, net: Any) -> MemorizingRead:
        return self.read(memory, dtype, net)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(self, memory: MemorizingMemory, read: MemorizingRead, pending: None, writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> None:
        layer, size = self.layer, self.settings.size
        keys = F.normalize(writes.keys[layer].detach().float(), dim=-1)  # (B, H, L, hd)
        values = writes.values[layer].detach().float()
        memory.store_(keys=fifo_append(memory.keys, keys, size, 2),  # (B, H, M, hd), in place once full
                      values=fifo_append(memory.values, values, size, 2),
                      mask=fifo_append(memory.mask, valid.to(torch.bool), size, 1))  # (B, M)
        return None


__all__ = ["MemorizingSettings", "MemorizingMemory", "MemorizingRead", "MemorizingKind", "fifo_append"]
