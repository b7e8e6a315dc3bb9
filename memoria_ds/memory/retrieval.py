"""What one step reminded: the record `remind` returns and `memorize` consumes."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class Retrieval:
    """What one step reminded, handed to the model and then to `memorize`.

    Attributes:
        wm_slots: (B, N) slots holding this step's working memory.
        stm_slots: (B, K_stm) top STM engrams by score, -1 padded. They are the LTM
            search cues; they are reminded to the model only if `use_stm`.
        ltm_slots: (B, K_ltm) LTM engrams reminded, -1 padded ((B, 0) if `use_ltm` is off).
        num_found: (B,) LTM engrams found by the search (all LTM for `exhaustive`).
        evicted: (B,) LTM engrams evicted to make room for this working memory.
        reminded_slots: (B, R) slots of `M_rem` (STM part, then LTM part), -1 padded.
        reminded: (B, R, D) float32 vectors of `M_rem`, zeros where padded.
        reminded_mask: (B, R) True where `reminded_slots` holds a real engram.
    """

    wm_slots: Tensor
    stm_slots: Tensor
    ltm_slots: Tensor
    num_found: Tensor
    evicted: Tensor
    reminded_slots: Tensor
    reminded: Tensor
    reminded_mask: Tensor
