"""EvalResult: one evaluation, JSON-able, with everything needed to compare it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

LN2 = math.log(2.0)


def _versions() -> dict[str, str]:
    import torch

    import memoria_ds

    out = {"memoria_ds": memoria_ds.__version__, "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # the evaluation itself does not need transformers
        pass
    return out


@dataclass
class EvalResult:
    """The outcome of one evaluation.

    Attributes:
        model: the model's name or path, as given.
        data: the corpus description (name, split, tokenizer, unit, token and document
            counts, fingerprint).
        split: the split evaluated.
        protocol: the protocol as recorded (`EvalProtocol.to_dict()`, or the sorting
            task's reading).
        world_size: data-parallel ranks that took part.
        steps: segments read per stream.
        scored_tokens: targets scored over all ranks (the denominator).
        input_tokens: real (non-padding) tokens fed to the model over all ranks.
        nll_sum: summed negative log-likelihood of the scored targets, nats.
        nll: `nll_sum / scored_tokens`, nats per scored token.
        ppl: `exp(nll)`.
        bits_per_token: `nll / ln 2`.
        bpc: bits per character, `nll_sum / (ln 2 * scored characters)`, set when the
            corpus's tokens are characters (enwik8: bytes), else None.
        accuracy: sorting accuracy (`correct / scored_tokens`), or a classifier's over its
            documents (`scored_tokens` then counts documents), else None.
        correct: correct argmax predictions (sorting, classification), else None.
        macro_f1: a classifier's F1 averaged over the classes that occur in the labels or the
            predictions (scikit-learn's `f1_score(average="macro")`), else None.
        wall_time_s: seconds from the first batch to the reduced totals.
        tokens_per_s: `input_tokens / wall_time_s`.
        notes: anything that qualifies the numbers (e.g. a step limit).
        knn_lm: with kNN-LM (`memoria_ds.eval.knn_lm`): its settings, its datastore and the
            same model's NLL / PPL on the same tokens without it (`lm_nll`, `lm_ppl`); else None.
    """

    model: str
    data: dict[str, Any]
    split: str
    protocol: dict[str, Any]
    world_size: int
    steps: int
    scored_tokens: int
    input_tokens: int
    nll_sum: float
    nll: float
    ppl: float
    bits_per_token: float
    bpc: float | None = None
    accuracy: float | None = None
    correct: int | None = None
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    knn_lm: dict[str, Any] | None = None
    macro_f1: float | None = None
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    versions: dict[str, str] = field(default_factory=_versions)

    @classmethod
    def from_sums(cls, *, nll_sum: float, scored_tokens: int, character_level: bool = False,
                  correct: int | None = None, **fields: Any) -> "EvalResult":
        """Derive the means from exact totals (the only way results are built)."""
        if scored_tokens <= 0:
            raise ValueError("no token was scored; the split is too short for this protocol")
        nll = nll_sum / scored_tokens
        return cls(
            nll_sum=nll_sum, scored_tokens=scored_tokens, nll=nll,
            ppl=math.exp(nll) if nll < 700 else math.inf, bits_per_token=nll / LN2,
            bpc=nll / LN2 if character_level else None,
            correct=correct, accuracy=None if correct is None else correct / scored_tokens,
            **fields,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalResult":
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        """Write this result as JSON (parent directories are created)."""
        write_results([self], path)

    def summary(self) -> str:
        """One line for logs."""
        metric = (f"acc {self.accuracy:.4f}" + (f" macro-F1 {self.macro_f1:.4f}" if self.macro_f1 is not None else "")
                  if self.accuracy is not None
                  else f"bpc {self.bpc:.4f}" if self.bpc is not None else f"ppl {self.ppl:.3f}")
        return (f"{self.model} | {self.data.get('corpus', '?')}/{self.split} | {self.protocol.get('name')} "
                f"L={self.protocol.get('segment_length')} B={self.protocol.get('num_streams')} | {metric} | "
                f"{self.scored_tokens} scored tokens | {self.tokens_per_s:.0f} tok/s")


def write_results(results: Sequence[EvalResult], path: str | os.PathLike) -> None:
    """Write results as a JSON list (one object when there is one result)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = results[0].to_dict() if len(results) == 1 else [r.to_dict() for r in results]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_results(path: str | os.PathLike) -> list[EvalResult]:
    """Results written by `write_results` / `EvalResult.save`."""
    with open(path) as f:
        payload = json.load(f)
    return [EvalResult.from_dict(d) for d in (payload if isinstance(payload, list) else [payload])]
