"""Small real models whose probabilities are known, for the evaluation tests (Contract 2 calls)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from memoria_ds.data import SEPARATOR, sorting_target


class UnigramLM(nn.Module):
    """Every position predicts the same fixed distribution `probs`."""

    def __init__(self, probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = nn.Parameter(torch.log(probs), requires_grad=False)

    def forward(self, input_ids, labels=None, shift_labels=None, memory=None, reset=None):
        b, length = input_ids.shape
        return SimpleNamespace(logits=self.log_probs.expand(b, length, -1), memory=None)


class BigramLM(nn.Module):
    """Position i predicts `table[input_ids[i]]`: catches any misalignment of targets."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.log_table = nn.Parameter(torch.log(table), requires_grad=False)

    def forward(self, input_ids, labels=None, shift_labels=None, memory=None, reset=None):
        return SimpleNamespace(logits=self.log_table[input_ids], memory=None)


class CountingMemoryLM(nn.Module):
    """Memory = segments seen by each row since its last reset (k).

    Every position of a row predicts softmax(k * w): the probabilities change only if the
    memory returned for one segment is passed back with the next, and return to k = 0
    exactly where the row is reset.
    """

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)
        self.calls: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def log_probs(self, k: int) -> torch.Tensor:
        return torch.log_softmax(k * self.w, dim=-1)

    def forward(self, input_ids, labels=None, shift_labels=None, memory=None, reset=None):
        b, length = input_ids.shape
        k = torch.zeros(b, dtype=torch.long) if memory is None else memory.clone()
        if reset is not None:
            k[reset] = 0
        self.calls.append((None if memory is None else memory.clone(), reset.clone()))
        logits = torch.log_softmax(k[:, None].float() * self.w[None, :], dim=-1)  # (B, V)
        return SimpleNamespace(logits=logits[:, None, :].expand(b, length, -1), memory=k + 1)


class SortingOracle(nn.Module):
    """Solves the sorting task exactly, but only by remembering every earlier segment.

    Memory per row: symbol counts and first positions seen so far, and the index of the
    answer being produced. With `forget=True` it drops the memory at every segment, so
    it only knows the current segment's symbols.
    """

    def __init__(self, forget: bool = False) -> None:
        super().__init__()
        self.forget = forget
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, input_ids, labels=None, shift_labels=None, memory=None, reset=None):
        b, length = input_ids.shape
        if memory is None or self.forget:
            memory = [None] * b
        memory = [None if (reset is not None and bool(reset[r])) else m for r, m in enumerate(memory)]
        logits = torch.full((b, length, SEPARATOR + 1), -10.0)
        out = []
        for r in range(b):
            seen, answer = (list(memory[r][0]), memory[r][1]) if memory[r] is not None else ([], -1)
            for i, tok in enumerate(input_ids[r].tolist()):
                if answer < 0 and tok != SEPARATOR:
                    seen.append(tok)
                    continue
                answer = answer + 1 if answer >= 0 else 0  # SEP predicts answer 0, then 1, 2, ...
                order = sorting_target(np.array(seen, dtype=np.int64)) if seen else np.arange(20)
                if answer < 20:
                    logits[r, i, int(order[answer])] = 10.0
            out.append((seen, answer))
        return SimpleNamespace(logits=logits, memory=out)
