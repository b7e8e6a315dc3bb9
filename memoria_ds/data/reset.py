"""ResetPolicy: which memory rows start fresh before a segment.

Memory is reset per row (SPEC section 1, "Reset"). Two independent triggers, combinable:

- `at_document_start`: reset a row whose `doc_start` flag is set (a new document has
  begun since the row's previous segment started; see `StreamBatch.doc_start`);
- `every_n_steps`: reset every row when `step % every_n_steps == 0` (the paper resets all
  memory every 500 training steps, 1500 for enwik8).

Independently of the policy, every row is reset at the first segment of an epoch: the
streams jump back to their beginnings, and memory of a stream's end must not flow into its
start. "never" therefore means "never within a pass over the data".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from memoria_ds.data.batch import StreamBatch


@dataclass(frozen=True)
class ResetPolicy:
    """When memory rows are reset.

    Args:
        at_document_start: reset rows whose `doc_start` flag is set.
        every_n_steps: reset all rows when `step % every_n_steps == 0`; None: never.

    Raises:
        ValueError: `every_n_steps` below 1.
    """

    at_document_start: bool = False
    every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps is not None:
            if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int):
                raise ValueError(f"`every_n_steps` must be an integer or None, got {self.every_n_steps!r}")
            if self.every_n_steps < 1:
                raise ValueError(
                    f"`every_n_steps` must be >= 1 (or None for no periodic reset), got {self.every_n_steps}"
                )

    @classmethod
    def parse(cls, spec: str) -> "ResetPolicy":
        """From a string: `never`, `document_start`, `every:500`, `document_start+every:500`."""
        at_doc, every = False, None
        for part in spec.strip().split("+"):
            part = part.strip()
            if part == "never":
                continue
            if part == "document_start":
                at_doc = True
            elif part.startswith("every:") and part[6:].isdigit():
                every = int(part[6:])
                if every < 1:
                    raise ValueError(f"{part!r} in {spec!r}: the period is a number of steps, at least 1 "
                                     f"(for no periodic reset, write `never`)")
            else:
                raise ValueError(
                    f"unknown reset policy part {part!r} in {spec!r}; use `never`, `document_start`, "
                    "`every:N`, or `document_start+every:N`"
                )
        return cls(at_document_start=at_doc, every_n_steps=every)

    def describe(self) -> str:
        """The policy as the string `parse` reads (recorded in results)."""
        parts = (["document_start"] if self.at_document_start else []) + (
            [f"every:{self.every_n_steps}"] if self.every_n_steps else []
        )
        return "+".join(parts) or "never"

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.describe(), "at_document_start": self.at_document_start,
                "every_n_steps": self.every_n_steps, "at_epoch_start": True}

    def reset_mask(self, batch: "StreamBatch", step: int | None = None) -> torch.Tensor:
        """Rows to reset before feeding `batch` to the model.

        Args:
            batch: the batch about to be fed.
            step: the counter for `every_n_steps`; default `batch.global_step` (a
                training loop that counts optimiser steps may pass its own).

        Returns:
            (B,) bool on the device of `batch.doc_start`.
        """
        step = batch.global_step if step is None else step
        mask = torch.zeros_like(batch.doc_start, dtype=torch.bool)
        if batch.step == 0 or (self.every_n_steps is not None and step % self.every_n_steps == 0):
            return ~mask
        if self.at_document_start:
            mask = mask | batch.doc_start.bool()
        return mask
