"""What the memory is worth: the same model scored with its memory (`full`) and without (`memoryless`).

Both protocols read the same streams and score the same tokens; `memoryless` resets the memory
before every segment. The gain is the difference of their mean NLLs, in nats per scored
token: positive when the memory helps, 0 for a model without memory (`transformer`), and
negative when the model scores better with its memory taken away. It is a paired measure
(one model, the same tokens), so it says what the memory contributes to *this* model, not
how the model compares with one trained without a memory.

On the sorting task the pair is the sorting evaluation with the memory carried through each
example and the same with it reset before every segment (`evaluate_sorting(memoryless=True)`):
the gain is then in nats per answer symbol, with both accuracies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .protocols import FORGET
from .result import EvalResult


@dataclass(frozen=True)
class MemoryGain:
    """`memoryless` minus `full` on one split.

    Attributes:
        split: the split both were scored on.
        nats_per_token: NLL without the memory minus NLL with it (> 0: the memory helps).
        ppl_with, ppl_without: the two perplexities.
        scored_tokens: the tokens both scored.
        accuracy_with, accuracy_without: the two sorting accuracies (None for language modelling).
        part: the part of a composite memory reset in the reading without (`memoryless_<part>`), or
            None (the whole memory).
        unit: what an accuracy counts: `answer symbol` (sorting) or `document` (a classifier).
    """

    split: str
    nats_per_token: float
    ppl_with: float
    ppl_without: float
    scored_tokens: int
    accuracy_with: float | None = None
    accuracy_without: float | None = None
    part: str | None = None
    unit: str = "answer symbol"

    @property
    def ppl_change(self) -> float:
        """Relative perplexity with the memory against without it (-0.02: 2% lower with it)."""
        return math.expm1(-self.nats_per_token)

    def describe(self) -> str:
        if self.accuracy_with is not None:
            return (f"memory gain {self.split}: {self.nats_per_token:+.4f} nats/{self.unit} (accuracy "
                    f"{self.accuracy_with:.4f} with the memory, {self.accuracy_without:.4f} with it reset before every "
                    f"segment)")
        what, it = ("memory gain", "it") if self.part is None else (f"gain of the memory's {self.part}", self.part)
        return (f"{what} {self.split}: {self.nats_per_token:+.4f} nats/token (ppl {self.ppl_with:.3f} with the "
                f"memory, {self.ppl_without:.3f} with {it} reset before every segment: {100 * self.ppl_change:+.1f}%)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_change": self.ppl_change}

    def scalars(self) -> dict[str, float]:
        """What the training log records (`eval_memory_gain`)."""
        if self.accuracy_with is not None:
            return {"nats_per_token": self.nats_per_token, "accuracy_without": self.accuracy_without,
                    "accuracy_points": 100 * (self.accuracy_with - self.accuracy_without)}
        return {"nats_per_token": self.nats_per_token, "ppl_without": self.ppl_without}


def _role(protocol: dict) -> str | None:
    """`with` (memory carried), `without` (reset before every segment) or None (another protocol)."""
    if protocol.get("name") == "sorting":
        return "without" if protocol.get("memoryless") else "with"
    return {"full": "with", "memoryless": "without"}.get(protocol.get("name"))


def part_gains(results: Sequence[EvalResult | dict]) -> dict[str, MemoryGain]:
    """What each part of a composite memory is worth: `memoryless_<part>` (that part reset before every
    segment, the others carried) minus `full`, by part, for the parts the results scored."""
    dicts = [r if isinstance(r, dict) else r.to_dict() for r in results]
    full = next((r for r in dicts if r["protocol"].get("name") == "full"), None)
    out = {}
    for r in dicts:
        name = r["protocol"].get("name", "")
        if full is not None and name.startswith(FORGET):
            part = name[len(FORGET):]
            out[part] = dataclasses.replace(_gain(full, r), part=part)
    return out


def memory_gain(results: Sequence[EvalResult | dict]) -> MemoryGain | None:
    """The gain from one evaluation's results (`EvalResult`s or their dicts), or None unless it
    has both a `full` and a `memoryless` result (or a sorting result and its memoryless one).

    Raises:
        ValueError: the two did not score the same tokens (different splits, stream counts or
            segment lengths), so their difference would not be the memory's.
    """
    dicts = [r if isinstance(r, dict) else r.to_dict() for r in results]
    by_role = {_role(r["protocol"]): r for r in dicts}
    full, bare = by_role.get("with"), by_role.get("without")
    if full is None or bare is None:
        return None
    return _gain(full, bare)


def _gain(full: dict, bare: dict) -> MemoryGain:
    """`bare` (without the memory, or a part of it) against `full`, checked to score the same tokens."""
    same = ("segment_length", "num_streams")
    if (full["split"] != bare["split"] or full["scored_tokens"] != bare["scored_tokens"]
            or any(full["protocol"][k] != bare["protocol"][k] for k in same)):
        raise ValueError(f"the evaluations with and without the memory scored different tokens "
                         f"({full['scored_tokens']} on {full['split']!r} against {bare['scored_tokens']} on "
                         f"{bare['split']!r}); their difference is not the memory's")
    return MemoryGain(split=full["split"], nats_per_token=bare["nll"] - full["nll"], ppl_with=full["ppl"],
                      ppl_without=bare["ppl"], scored_tokens=full["scored_tokens"],
                      accuracy_with=full.get("accuracy"), accuracy_without=bare.get("accuracy"),
                      unit="document" if full.get("macro_f1") is not None else "answer symbol")
