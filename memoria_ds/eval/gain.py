"""What the memory is worth: the same model scored with its memory (`full`) and without (`memoryless`).

Both protocols read the same streams and score the same tokens; `memoryless` resets the memory
before every segment. The gain is the difference of their mean NLLs, in nats per scored
token: positive when the memory helps, 0 for a model without memory (`transformer`), and
negative when the model scores better with its memory taken away. It is a paired measure
(one model, the same tokens), so it says what the memory contributes to *this* model, not
how the model compares with one trained without a memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .result import EvalResult


@dataclass(frozen=True)
class MemoryGain:
    """`memoryless` minus `full` on one split.

    Attributes:
        split: the split both were scored on.
        nats_per_token: NLL without the memory minus NLL with it (> 0: the memory helps).
        ppl_with, ppl_without: the two perplexities.
        scored_tokens: the tokens both scored.
    """

    split: str
    nats_per_token: float
    ppl_with: float
    ppl_without: float
    scored_tokens: int

    @property
    def ppl_change(self) -> float:
        """Relative perplexity with the memory against without it (-0.02: 2% lower with it)."""
        return math.expm1(-self.nats_per_token)

    def describe(self) -> str:
        return (f"memory gain {self.split}: {self.nats_per_token:+.4f} nats/token (ppl {self.ppl_with:.3f} with the "
                f"memory, {self.ppl_without:.3f} with it reset before every segment: {100 * self.ppl_change:+.1f}%)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl_change": self.ppl_change}


def _name(result: EvalResult | dict) -> str | None:
    protocol = result["protocol"] if isinstance(result, dict) else result.protocol
    return protocol.get("name") if isinstance(protocol, dict) else None


def memory_gain(results: Sequence[EvalResult | dict]) -> MemoryGain | None:
    """The gain from one evaluation's results (`EvalResult`s or their dicts), or None unless it
    has both a `full` and a `memoryless` result.

    Raises:
        ValueError: the two did not score the same tokens (different splits, stream counts or
            segment lengths), so their difference would not be the memory's.
    """
    by_name = {_name(r): r if isinstance(r, dict) else r.to_dict() for r in results}
    full, bare = by_name.get("full"), by_name.get("memoryless")
    if full is None or bare is None:
        return None
    same = ("segment_length", "num_streams")
    if (full["split"] != bare["split"] or full["scored_tokens"] != bare["scored_tokens"]
            or any(full["protocol"][k] != bare["protocol"][k] for k in same)):
        raise ValueError(f"`full` and `memoryless` scored different tokens ({full['scored_tokens']} on "
                         f"{full['split']!r} against {bare['scored_tokens']} on {bare['split']!r}); their "
                         f"difference is not the memory's")
    return MemoryGain(split=full["split"], nats_per_token=bare["nll"] - full["nll"], ppl_with=full["ppl"],
                      ppl_without=bare["ppl"], scored_tokens=full["scored_tokens"])
