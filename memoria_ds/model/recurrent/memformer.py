"""`memformer`: Memformer's slot memory (Wu et al. 2020) for an unmodified GPT-2.

Each stream carries k memory slots m^1..m^k (vectors of the model's width). Per segment:

    read   every block: a cross-attention from the block's input tokens to the slots
           (Q = LN(x) W_Q, K = M W_K, V = M W_V, per head; W_O after), added to the
           block's self-attention output (`side_attention`)
    write  after the blocks, from the final hidden states H (after ln_f), per slot i:
               a_i = softmax([q_i . k_i ; q_i . K_H] / (sqrt(hd) tau))   per head
               m'_i = a_i,self m_i + a_i,H V_H       (a slot attends to itself and the tokens,
                                                      never to another slot)
               m_i  = (m'_i + v_i) / ||m'_i + v_i||   biased memory normalisation (forgetting)
           with q_i, k_i = m_i W_Q', m_i W_K' and K_H, V_H = H W_K', H W_V'
    init   m_0^i = v_i / ||v_i||: the learned bias vectors, used for a fresh or reset row

A slot that attends only to itself moves along the unit sphere towards its initial value v_i
(the paper's forgetting: its terminal state is its initial state). The write keeps its graph:
within a span of `optim.bptt_segments` segments the loss of segment t + 1 reaches the write of
segment t (the slots are detached only by `detach_()`, at the end of the training loop's span).
With `memory_init="noop"` the read's output projections start at zero: the model starts as
exactly the backbone (and the memory still learns, from the projections' gradients).

Notation: B rows, Y layers, k slots, L tokens of the segment, D width, H heads, hd head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...rows import BatchRows, rows_field
from ...setting_rules import setting
from ..memory_attention import OutputProjection
from .base import FORMAT, BlockWrites, KindSettings, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import BOOL, FLOAT32, SavedState, vector_lengths


@dataclass(frozen=True)
class MemformerSettings(KindSettings):
    """Memformer's settings (sources in docs/field_memories.md).

    Attributes:
        num_slots: k, memory slots per stream (1024: the paper's language model).
        temperature: tau < 1 of the memory writer's slot attention (sharpens it; 0.5).
    """

    kind: ClassVar[str] = "memformer"
    # checked by their rules (KindSettings)
    num_slots: int = setting(1024, least=1)
    temperature: float = setting(0.5, above=0)


def heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, N, D) -> (B, H, N, hd)."""
    B, N, D = x.shape
    return x.view(B, N, num_heads, D // num_heads).transpose(1, 2)


class MemformerNet(nn.Module):
    """Memformer's weights: the per-block memory readers, the memory writer and the slot biases.

    Args:
        num_layers / dim / num_heads: the backbone's. settings: the kind's.
    """

    def __init__(self, num_layers: int, dim: int, num_heads: int, settings: MemformerSettings) -> None:
        super().__init__()
        self.num_heads, self.settings = num_heads, settings
        # v_bias, one per slot: the initial slots (normalised) and the forgetting bias. An
        # embedding, so that the model's own init (GPT-2's N(0, 0.02)) initialises it everywhere.
        self.slot_bias = nn.Embedding(settings.num_slots, dim)
        layers = lambda make: nn.ModuleList(make() for _ in range(num_layers))  # noqa: E731
        self.read_norm = layers(lambda: nn.LayerNorm(dim))
        self.read_query = layers(lambda: nn.Linear(dim, dim))
        self.read_key_value = layers(lambda: nn.Linear(dim, 2 * dim))
        self.read_out = layers(lambda: OutputProjection(dim, dim))
        self.write_query = nn.Linear(dim, dim)
        self.write_key = nn.Linear(dim, dim)
        self.write_value = nn.Linear(dim, dim)

    def slot_biases(self) -> Tensor:
        """(k, D) v, read through the embedding's forward (so ZeRO-3 gathers it)."""
        index = torch.arange(self.settings.num_slots, device=self.write_query.bias.device)
        return self.slot_bias(index)

    def initial_slots(self) -> Tensor:
        """(k, D) m_0 = v / ||v||."""
        return F.normalize(self.slot_biases(), dim=-1)

    def read(self, layer: int, hidden: Tensor, slots: Tensor) -> Tensor:
        """(B, L, D) cross-attention of block `layer`'s input tokens to the (B, k, D) slots."""
        H = self.num_heads
        x = self.read_norm[layer](hidden)
        q = heads(self.read_query[layer](x), H)  # (B, H, L, hd)
        k, v = (heads(t, H) for t in self.read_key_value[layer](slots.to(x.dtype)).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)  # every slot is the past: no mask
        return self.read_out[layer](out.transpose(1, 2).flatten(2))

    def write(self, slots: Tensor, hidden: Tensor, valid: Tensor) -> Tensor:
        """The next (B, k, D) slots from the slots and the segment's (B, L, D) final hidden states.

        Each slot attends over [itself; the valid tokens] with temperature tau; its own value
        is itself, the tokens' are projected; then biased memory normalisation.
        """
        H, tau = self.num_heads, self.settings.temperature
        slots = slots.to(hidden.dtype)
        B, k, D = slots.shape
        hd = D // H
        q = heads(self.write_query(slots), H)  # (B, H, k, hd)
        self_key = heads(self.write_key(slots), H)
        keys, values = heads(self.write_key(hidden), H), heads(self.write_value(hidden), H)  # (B, H, L, hd)
        scale = 1.0 / (hd**0.5 * tau)
        own = (q * self_key).sum(-1, keepdim=True) * scale  # (B, H, k, 1)
        tokens = (q @ keys.transpose(-1, -2)) * scale  # (B, H, k, L)
        tokens = tokens.masked_fill(~valid[:, None, None, :], float("-inf"))
        weights = torch.cat([own, tokens], dim=-1).softmax(dim=-1)
        mixed = weights[..., :1] * heads(slots, H) + weights[..., 1:] @ values  # (B, H, k, hd)
        new = mixed.transpose(1, 2).reshape(B, k, D) + self.slot_biases().to(mixed.dtype)
        return F.normalize(new, dim=-1)


@dataclass
class MemformerMemory(BatchRows):
    """The slots of every row.

    Attributes:
        slots: (B, k, D) float32, the memory (with its graph inside a training span).
        fresh: (B,) bool, rows at their initial slots (the net's, read at the next forward).
    """

    slots: Tensor = rows_field()
    fresh: Tensor = rows_field()

    @classmethod
    def empty(cls, batch_size: int, num_slots: int, dim: int,
              device: torch.device | str | None = None) -> MemformerMemory:
        return cls(torch.zeros(batch_size, num_slots, dim, device=device),
                   torch.ones(batch_size, dtype=torch.bool, device=device))

    def reset(self, mask: Tensor | None = None) -> None:
        """Make all rows, or those where the (B,) bool `mask` is True, fresh (slots zeroed): in place,
        except slots inside the graph of a training span (a new tensor then: the graph holds the old)."""
        if mask is None:
            mask = torch.ones_like(self.fresh)
        mask = mask.to(self.fresh.device, torch.bool)
        if self.slots.requires_grad:
            self.slots = self.slots.masked_fill(mask[:, None, None], 0.0)
        else:
            self.slots.masked_fill_(mask[:, None, None], 0.0)
        self.fresh.logical_or_(mask)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "memformer", "format": FORMAT, "slots": self.slots.detach(), "fresh": self.fresh}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> MemformerMemory:
        check_format(state_dict, "memformer")
        missing = [n for n in ("slots", "fresh") if n not in state_dict]
        if missing:
            raise ValueError(f"saved memformer memory lacks {missing}")
        slots, fresh = state_dict["slots"], state_dict["fresh"]
        if (not isinstance(slots, Tensor) or not isinstance(fresh, Tensor) or slots.dim() != 3
                or fresh.shape != slots.shape[:1] or fresh.dtype != torch.bool or not slots.is_floating_point()):
            raise ValueError(f"inconsistent memformer memory: slots {getattr(slots, 'shape', slots)!r}, "
                             f"fresh {getattr(fresh, 'shape', fresh)!r} (want (B, k, D) floats and (B,) bools)")
        out = cls(slots, fresh)
        return out.to(device) if device is not None else out


@dataclass
class MemformerRead(BatchRows, MemoryRead):
    """The blocks' view: the (B, k, D) slots this segment reads (initial slots for fresh rows)."""

    slots: Tensor
    net: MemformerNet | None = rows_field(rows=False, default=None)
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None
    has_side: ClassVar[bool] = True

    def _map(self, fn) -> MemformerRead:  # row operations keep the net
        out = BatchRows._map(self, fn)
        out.net = self.net
        return out

    def side_attention(self, layer: int, hidden: Tensor, queries: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return self.net.read(layer, hidden, self.slots).to(hidden.dtype), ()


class MemformerKind(MemoryKind):
    """k memory slots per stream, read by every block, written after the blocks (`MemformerSettings`)."""

    name = "memformer"
    places = frozenset({"side attention", "modules"})
    memory_class = MemformerMemory
    settings_class = MemformerSettings
    trains_across_segments = True

    def build_module(self) -> MemformerNet:
        cfg = self.config
        return MemformerNet(cfg.n_layer, cfg.n_embd, cfg.n_head, self.settings)

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MemformerMemory:
        return MemformerMemory.empty(batch_size, self.settings.num_slots, self.config.n_embd, device)

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        sizes = {}
        if config is not None:
            sizes = {"k": cls.settings_class.from_dict(dict(config.memory_settings or {})).num_slots,
                     "D": config.n_embd}
        s = SavedState(state_dict, "memformer", sizes)
        slots = s.tensor("slots", FLOAT32, "B k D")
        s.tensor("fresh", BOOL, "B")
        # every write normalises each slot to length 1 (in the model's dtype: 1.05 leaves bf16 room); a fresh row
        # holds zeros
        s.require((vector_lengths(slots) <= 1.05).all(), "slots", "holds a slot longer than 1 (the write "
                  "normalises every slot to unit length)")

    def check(self, memory: MemformerMemory) -> None:
        want = (self.settings.num_slots, self.config.n_embd)
        if tuple(memory.slots.shape[1:]) != want:
            raise ValueError(f"the memory holds {tuple(memory.slots.shape[1:])} slots (slots, width) but this model "
                             f"has {want}")

    def row_bytes(self, segment_length: int) -> dict[str, int]:
        return {"slots": self.settings.num_slots * self.config.n_embd * 4}

    def read(self, memory: MemformerMemory, dtype: torch.dtype, net: Any) -> tuple[MemformerRead, MemformerNet]:
        memory = held(memory)  # the write overwrites the memory in place; the backward needs what was read
        initial = net.initial_slots().float()  # (k, D), with its gradient into the slot biases
        slots = torch.where(memory.fresh[:, None, None], initial.to(memory.slots.device), memory.slots)
        return MemformerRead(slots, net), net

    def frozen_read(self, memory: MemformerMemory, dtype: torch.dtype, net: Any) -> MemformerRead:
        return self.read(memory, dtype, net)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(self, memory: MemformerMemory, read: MemformerRead, net: MemformerNet, writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> None:
        weight = net.write_query.weight
        # the new slots carry their graph (a later segment's loss trains this write): a new tensor, not
        # stored in place (`store_` replaces a value with a graph); scored without gradient, in place
        memory.store_(slots=net.write(read.slots.to(weight.dtype), hidden.to(weight.dtype), valid).float())
        memory.fresh.zero_()
        return None


__all__ = ["MemformerSettings", "MemformerNet", "MemformerMemory", "MemformerRead", "MemformerKind"]
