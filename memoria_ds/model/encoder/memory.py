"""What a Memoria encoder carries from one segment of a document to the next: the engine's state.

With a masked language model the working memory comes from the current segment itself (paper
section 4.3), so, unlike Memoria GPT-2 (`recurrent/memoria.py`, which keeps the previous segment's
hidden states for its abstractor), the encoder carries nothing but the memory engine's fp32
`MemoryState` (engrams, kinds, lifespans, co-retrieval counts), one row per document stream.

Rows move, stack, reset and save as every memory of the toolkit does (`BatchRows`), so a training
loop streams one document per row, resets a row when its document ends, and checkpoints and
re-shards the rows across data-parallel ranks with the same calls it uses for GPT-2's memories.

Notation: B rows, C engram slots, D width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...memory import MemoriaConfig, MemoryState
from ...memory.compiled import static_addresses
from ...rows import BatchRows, rows_field

KIND = "memoria_encoder"  # the `kind` tag of a saved encoder memory
FORMAT = 1


@dataclass
class EncoderMemory(BatchRows):
    """The recurrent state of a Memoria encoder.

    Attributes:
        state: the memory engine's `MemoryState`: (B, C, D) fp32 engrams and their bookkeeping.
    """

    state: MemoryState = rows_field()

    @classmethod
    def empty(cls, config: MemoriaConfig, batch_size: int, dim: int,
              device: torch.device | str | None = None) -> EncoderMemory:
        """A fresh memory for `batch_size` rows of `dim`-wide engrams."""
        memory = cls(MemoryState.empty(config, batch_size, dim, device=device))
        static_addresses(memory.state)  # updated in place every step (a captured step replays over it)
        return memory

    def reset(self, mask: Tensor | None = None) -> None:
        """Make all rows, or the rows where the (B,) bool `mask` is True, fresh, in place."""
        self.state.reset(mask)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and a kind/format tag; round-trips bit-exactly through `from_state_dict`."""
        return {"kind": KIND, "format": FORMAT, "state": self.state.state_dict()}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: MemoriaConfig | None = None,
                        device: torch.device | str | None = None) -> EncoderMemory:
        """Rebuild a saved memory (a copy: the memory is written in place), checked against `config` if given.

        Raises:
            ValueError: not an encoder memory of this format, or a state the engine cannot hold.
        """
        if not isinstance(state_dict, dict) or state_dict.get("kind") != KIND:
            got = state_dict.get("kind") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"saved memory is of kind {got!r}, expected {KIND!r}")
        if state_dict.get("format") != FORMAT:
            raise ValueError(f"memory format {state_dict.get('format')!r} is not supported "
                             f"(this version reads {FORMAT})")
        state = MemoryState.from_state_dict(state_dict.get("state"), config=config, device=device)
        memory = cls(state).clone()
        static_addresses(memory.state)
        return memory


__all__ = ["EncoderMemory", "KIND"]
