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
- `memoryless`: `full` with the memory reset before every segment: the same model, the
  same streams and the same scored tokens, without anything carried between segments.
  Beside `full` it measures what the memory is worth (`memoria_ds.eval.gain`); for a model
  without memory the two are equal.
- `memoryless_<part>` (`memoryless_xl`): `full` with one part of a composite memory
  (`model.preset=xl+memoria`) reset before every segment, the others carried: beside `full`,
  what that part is worth in this model.

`custom` allows any combination, recorded as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memoria_ds.data.reset import ResetPolicy

ProtocolName = Literal["paper", "full", "memoryless", "custom"]  # or "memoryless_<part>" (`forget_protocol`)
FORGET = "memoryless_"  # the prefix of a protocol that forgets one part of a composite memory


EVERY_SEGMENT = ResetPolicy(every_n_steps=1)  # `memoryless`: nothing carried between segments


@dataclass(frozen=True)
class EvalProtocol:
    """How a split is read and scored (recorded in every result).

    Args:
        name: "paper", "full", "memoryless" or "custom".
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

    @property
    def forget(self) -> str | None:
        """The part of a composite memory reset before every segment (`memoryless_<part>`), or None."""
        return self.name[len(FORGET):] if self.name.startswith(FORGET) else None

    def __post_init__(self) -> None:
        if self.name not in ("paper", "full", "memoryless", "custom") and not (
                self.name.startswith(FORGET) and self.name[len(FORGET):].isidentifier()):
            raise ValueError(f"protocol name must be 'paper', 'full', 'memoryless', 'memoryless_<part>' or 'custom', "
                             f"got {self.name!r}")
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
        if (self.name in ("full", "memoryless") or self.forget) and not self.score_segment_first:
            raise ValueError(f"the `{self.name}` protocol scores every token; use name='custom' to skip "
                             "segment-first tokens")
        if self.name == "memoryless" and self.reset != EVERY_SEGMENT:
            raise ValueError("the `memoryless` protocol resets the memory before every segment (`every:1`); "
                             "use name='custom' for another policy")

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


def memoryless_protocol(segment_length: int = 150, num_streams: int = 1) -> EvalProtocol:
    """`full` with the memory reset before every segment: the model scored without its memory."""
    return EvalProtocol("memoryless", segment_length, num_streams, EVERY_SEGMENT, score_segment_first=True)


def forget_protocol(part: str, segment_length: int = 150, num_streams: int = 1,
                    reset: ResetPolicy | str = "never") -> EvalProtocol:
    """`full` (with its reset policy) with the composite memory's `part` reset before every segment."""
    policy = ResetPolicy.parse(reset) if isinstance(reset, str) else reset
    return EvalProtocol(f"{FORGET}{part}", segment_length, num_streams, policy, score_segment_first=True)


PROTOCOL_NAMES = ("full", "paper", "memoryless")  # what a run configuration may name (and `memoryless_<part>`)


def protocol_from_name(name: str, segment_length: int = 150, num_streams: int = 1,
                       reset: ResetPolicy | str = "never") -> EvalProtocol:
    """A protocol by name (the CLI's spelling); `num_streams` applies to `full` and `memoryless`,
    `reset` to `full` (the `paper` protocol is one stream; `memoryless` resets every segment)."""
    if name == "paper":
        return paper_protocol(segment_length)
    if name == "full":
        return full_protocol(segment_length, num_streams, reset)
    if name == "memoryless":
        return memoryless_protocol(segment_length, num_streams)
    if name.startswith(FORGET):
        return forget_protocol(name[len(FORGET):], segment_length, num_streams, reset)
    raise ValueError(f"unknown protocol {name!r}; use one of {', '.join(PROTOCOL_NAMES)}, `memoryless_<part>` of a "
                     f"composite memory (or build an EvalProtocol)")
