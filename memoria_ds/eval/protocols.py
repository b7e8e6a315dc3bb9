"""Evaluation protocols: how a split is read and which tokens are scored.

A split is read as `num_streams` contiguous streams (memoria_ds.data.streams) in
`segment_length`-token segments, memory carried from segment to segment of each stream and
reset per `reset`. Two named protocols:

- `paper`: the authors' evaluation. One stream, no resets, and the last target of every
  segment masked: exactly what HF's internal label shift scores with `labels=input_ids`
  (149 of 150 tokens; each segment's first token is never scored). Over N tokens in T
  segments it scores N - T tokens.
- `full`: every target scored, including each segment's first token (predicted from the
  previous segment through the memory); any number of streams; reset policy stated. Over
  N tokens it scores N - 1 tokens (only the split's very first token has no context),
  whatever the number of streams.

`custom` allows any combination, recorded as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memoria_ds.data.reset import ResetPolicy

ProtocolName = Literal["paper", "full", "custom"]


@dataclass(frozen=True)
class EvalProtocol:
    """How a split is read and scored (recorded in every result).

    Args:
        name: "paper", "full" or "custom".
        segment_length: L (150 for WikiText-103 / PG-19 in the paper, 512 for enwik8).
        num_streams: B_global streams (a multiple of the world size, or 1).
        reset: when memory rows are reset.
        score_segment_first: score each segment's first token (its target sits at the
            previous segment's last position). False masks the last target of every
            segment, as HF's label shift does.

    Raises:
        ValueError: a `paper` or `full` protocol that is not what its name promises.
    """

    name: ProtocolName = "full"
    segment_length: int = 150
    num_streams: int = 1
    reset: ResetPolicy = field(default_factory=ResetPolicy)
    score_segment_first: bool = True

    def __post_init__(self) -> None:
        if self.name not in ("paper", "full", "custom"):
            raise ValueError(f"protocol name must be 'paper', 'full' or 'custom', got {self.name!r}")
        if self.segment_length < 2:
            raise ValueError(f"`segment_length` must be >= 2, got {self.segment_length}")
        if self.num_streams < 1:
            raise ValueError(f"`num_streams` must be >= 1, got {self.num_streams}")
        if self.name == "paper" and (
            self.num_streams != 1 or self.reset != ResetPolicy() or self.score_segment_first
        ):
            raise ValueError(
                "the `paper` protocol is one stream, no resets, segment-first tokens not scored; "
                "use name='custom' for other combinations"
            )
        if self.name == "full" and not self.score_segment_first:
            raise ValueError("the `full` protocol scores every token; use name='custom' to skip segment-first tokens")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "segment_length": self.segment_length,
            "num_streams": self.num_streams,
            "reset": self.reset.to_dict(),
            "score_segment_first": self.score_segment_first,
            "scored_per_full_segment": self.segment_length if self.score_segment_first else self.segment_length - 1,
        }


def paper_protocol(segment_length: int = 150) -> EvalProtocol:
    """The authors' protocol: one stream, no resets, 149 of 150 tokens scored per segment."""
    return EvalProtocol("paper", segment_length, 1, ResetPolicy(), score_segment_first=False)


def full_protocol(
    segment_length: int = 150, num_streams: int = 1, reset: ResetPolicy | str = "never"
) -> EvalProtocol:
    """Every token scored; any number of streams; the reset policy stated."""
    policy = ResetPolicy.parse(reset) if isinstance(reset, str) else reset
    return EvalProtocol("full", segment_length, num_streams, policy, score_segment_first=True)


def protocol_from_name(name: str, segment_length: int = 150, num_streams: int = 1,
                       reset: ResetPolicy | str = "never") -> EvalProtocol:
    """`paper` or `full` by name (the CLI's spelling); `num_streams` / `reset` apply to `full`."""
    if name == "paper":
        return paper_protocol(segment_length)
    if name == "full":
        return full_protocol(segment_length, num_streams, reset)
    raise ValueError(f"unknown protocol {name!r}; use 'paper' or 'full' (or build an EvalProtocol)")
