"""CharVocabulary: a byte-level ("character") vocabulary for character-level corpora.

enwik8 is modelled as bytes: its "characters" are the bytes of the UTF-8 file, not Unicode
code points. Text is carried through `datasets` as a `str` decoded with latin-1, which maps
byte b to code point b one-to-one, so one character of the string is one byte of the file
and nothing is lost or merged. `CharVocabulary` maps those bytes to dense ids 0..V-1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CharVocabulary:
    """Dense ids for a set of byte values.

    Args:
        symbols: the byte values (0-255) of the vocabulary; id i stands for byte
            `symbols[i]`.
        name: recorded in results and fingerprints.

    Raises:
        ValueError: a symbol outside 0-255, or a repeated one.
    """

    symbols: tuple[int, ...]
    name: str = "bytes"
    _lut: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        symbols = tuple(int(s) for s in self.symbols)
        if any(not 0 <= s <= 255 for s in symbols):
            raise ValueError("CharVocabulary symbols must be byte values 0-255")
        if len(set(symbols)) != len(symbols):
            raise ValueError("CharVocabulary symbols must be distinct")
        object.__setattr__(self, "symbols", symbols)
        lut = np.full(256, -1, dtype=np.int16)
        lut[list(symbols)] = np.arange(len(symbols), dtype=np.int16)
        object.__setattr__(self, "_lut", lut)

    @classmethod
    def all_bytes(cls) -> "CharVocabulary":
        """All 256 byte values (id == byte)."""
        return cls(tuple(range(256)), name="bytes")

    @classmethod
    def from_data(cls, data: bytes | str, name: str = "bytes") -> "CharVocabulary":
        """The byte values that occur in `data`, in ascending order."""
        return cls(tuple(np.flatnonzero(np.bincount(_as_bytes(data), minlength=256)).tolist()), name=name)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def eos_token_id(self) -> None:
        """Character vocabularies have no end-of-document token."""
        return None

    def encode(self, text: bytes | str) -> np.ndarray:
        """Ids of the bytes of `text` (a `str` is read as latin-1: one character per byte).

        Returns:
            (n,) uint8 ids (uint16 for vocabularies over 256 ids, which cannot occur).

        Raises:
            ValueError: a byte outside the vocabulary (the message lists them).
        """
        ids = self._lut[_as_bytes(text)]
        if ids.size and ids.min() < 0:
            missing = sorted(set(np.asarray(_as_bytes(text))[ids < 0].tolist()))
            raise ValueError(
                f"bytes {missing[:10]} are not in the {self.name!r} vocabulary of {self.vocab_size} symbols; "
                "build the vocabulary with CharVocabulary.from_data on the training split"
            )
        return ids.astype(np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """The bytes of `ids`."""
        return bytes(np.asarray(self.symbols, dtype=np.uint8)[np.asarray(ids, dtype=np.int64)].tolist())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "symbols": list(self.symbols)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CharVocabulary":
        return cls(tuple(data["symbols"]), name=data.get("name", "bytes"))

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict()).encode()).hexdigest()[:16]


def _as_bytes(data: bytes | str) -> np.ndarray:
    if isinstance(data, str):
        try:
            data = data.encode("latin-1")
        except UnicodeEncodeError as err:
            raise ValueError(
                "character-level text must hold bytes decoded as latin-1 (code points 0-255); "
                "decode the raw file with `.decode('latin-1')`"
            ) from err
    return np.frombuffer(data, dtype=np.uint8)
