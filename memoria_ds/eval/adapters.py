"""MemorylessLM: a plain HF causal LM seen through Contract 2 (each segment read alone).

Lets the evaluation score an unmodified `transformers` model (the GPT-2 baseline of paper
Table 5) with the same loop and protocols as a memory model: the memory is always None
and `reset` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput


@dataclass
class MemorylessOutput(ModelOutput):
    """`logits` (B, L, V); `memory` is always None."""

    logits: torch.Tensor | None = None
    memory: Any = None
    loss: torch.Tensor | None = None


class MemorylessLM(nn.Module):
    """Wrap a causal LM whose forward takes `input_ids` and returns `.logits`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        memory: Any = None,
        reset: torch.Tensor | None = None,
    ) -> MemorylessOutput:
        """Logits of one segment; `labels` / `shift_labels` give the HF loss when passed."""
        kwargs = {}
        if labels is not None:
            kwargs["labels"] = labels
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        out = self.model(input_ids=input_ids, **kwargs)
        return MemorylessOutput(logits=out.logits, memory=None, loss=getattr(out, "loss", None))
