"""enwik8: the first 10^8 bytes of an English Wikipedia XML dump, modelled as bytes.

Split: the standard 90M / 5M / 5M bytes (train = all but the last 10M bytes, validation =
the next 5M, test = the last 5M), as in Transformer-XL and the authors' code; the cut is
made on raw bytes, before anything else.

Vocabulary. enwik8 holds 205 distinct byte values. The paper's 204 symbols are those
minus the newline (byte 10): Transformer-XL's preprocessing (and the authors', which
copies it) writes each byte as a number and a newline as a line break that its
whitespace tokenizer then discards, so newlines are silently dropped from the data. We
offer both:

- `newlines="drop"` (default, paper-comparable): newline bytes are removed after the
  split; vocabulary `ENWIK8_SYMBOLS`, 204 symbols. BPC is then per non-newline byte,
  exactly the quantity the paper (1.16) and Transformer-XL report.
- `newlines="keep"`: every byte of the file stays; 205 symbols (`ENWIK8_SYMBOLS` + 10).

BPC = (sum of NLL in nats over scored bytes) / (ln 2 * number of scored bytes).

Each split is one document (one row; `text` is the split's bytes decoded as latin-1, one
character per byte, see chars.py).
"""

from __future__ import annotations

import os
import warnings
import zipfile
from typing import Literal

import datasets
import numpy as np

from memoria_ds.data.chars import CharVocabulary

Newlines = Literal["drop", "keep"]
ENWIK8_BYTES = 100_000_000
ENWIK8_TEST_BYTES = 5_000_000

# Every byte value that occurs in enwik8 except the newline: 9 (tab), printable ASCII
# 32-126, and the UTF-8 lead/continuation bytes that occur. 204 values.
ENWIK8_SYMBOLS: tuple[int, ...] = tuple(
    [9] + list(range(32, 127)) + list(range(128, 192)) + list(range(194, 221)) + [222]
    + list(range(224, 238)) + [239, 240]
)
assert len(ENWIK8_SYMBOLS) == 204



ENWIK8_HUB = "LTCB/enwik8"  # the hub dataset whose `enwik8-raw` config holds the whole file

def enwik8_vocabulary(newlines: Newlines = "drop") -> CharVocabulary:
    """The 204-symbol (newlines dropped) or 205-symbol (kept) enwik8 vocabulary."""
    if newlines == "drop":
        return CharVocabulary(ENWIK8_SYMBOLS, name="enwik8-204")
    if newlines == "keep":
        return CharVocabulary(tuple(sorted(ENWIK8_SYMBOLS + (10,))), name="enwik8-205")
    raise ValueError(f"`newlines` must be 'drop' or 'keep', got {newlines!r}")


def split_enwik8_bytes(data: bytes, num_test_bytes: int = ENWIK8_TEST_BYTES) -> dict[str, bytes]:
    """The standard train / validation / test cut of the raw bytes."""
    if len(data) <= 2 * num_test_bytes:
        raise ValueError(f"{len(data)} bytes cannot hold two held-out splits of {num_test_bytes} bytes")
    return {
        "train": data[: -2 * num_test_bytes],
        "validation": data[-2 * num_test_bytes : -num_test_bytes],
        "test": data[-num_test_bytes:],
    }


def read_enwik8_file(path: str | os.PathLike) -> bytes:
    """The raw bytes of `enwik8` or of `enwik8.zip` (the file Matt Mahoney distributes)."""
    path = os.fspath(path)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/")]
            if len(names) != 1:
                raise ValueError(f"{path} holds {names}; expected the single file `enwik8`")
            return zf.read(names[0])
    with open(path, "rb") as f:
        return f.read()


def enwik8(
    path: str | os.PathLike | None = None,
    *,
    newlines: Newlines = "drop",
    hub_name: str = ENWIK8_HUB,
    revision: str | None = "refs/convert/parquet",
    num_test_bytes: int = ENWIK8_TEST_BYTES,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """enwik8 as a `DatasetDict` (train / validation / test), one byte-string document each.

    Args:
        path: a local `enwik8` or `enwik8.zip`; None loads `hub_name` from the hub.
        newlines: "drop" (paper, 204 symbols) or "keep" (205 symbols).
        hub_name: hub dataset whose `enwik8-raw` config holds the whole file as one text.
        revision: hub revision; the hub copy is script-based, which `datasets` >= 4 cannot
            run, so its parquet conversion is read by default.
        num_test_bytes: size of each held-out split (5M as standard; smaller for tests).
        cache_dir: `datasets` cache directory for the hub download.

    Returns:
        Column `text`: the split's bytes decoded as latin-1. Encode with
        `enwik8_vocabulary(newlines)`.
    """
    vocab = enwik8_vocabulary(newlines)  # validates `newlines` first
    if path is not None:
        data = read_enwik8_file(path)
    else:
        try:
            raw = datasets.load_dataset(hub_name, "enwik8-raw", revision=revision, split="train", cache_dir=cache_dir)
        except OSError as err:
            raise OSError(
                f"could not load {hub_name!r} from the hub ({err}). Without network, download enwik8.zip "
                "(mattmahoney.net/dc/enwik8.zip) elsewhere and pass enwik8(path='enwik8.zip')"
            ) from err
        data = raw[0]["text"].encode("utf-8")
    if len(data) != ENWIK8_BYTES and num_test_bytes == ENWIK8_TEST_BYTES:
        warnings.warn(
            f"enwik8 should hold {ENWIK8_BYTES} bytes, this copy holds {len(data)}; the splits will not be "
            "the standard ones. Use the original enwik8.zip with enwik8(path=...)",
            stacklevel=2,
        )
    splits = split_enwik8_bytes(data, num_test_bytes)
    if newlines == "drop":
        splits = {k: v.replace(b"\n", b"") for k, v in splits.items()}
    present = np.flatnonzero(np.bincount(np.frombuffer(b"".join(splits.values()), np.uint8), minlength=256))
    unknown = sorted(set(present.tolist()) - set(vocab.symbols))
    if unknown:
        raise ValueError(
            f"this enwik8 copy holds bytes {unknown[:10]} outside the {vocab.name} vocabulary; "
            "it is not the standard enwik8 (use the original enwik8.zip)"
        )
    return datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": [v.decode("latin-1")]}) for k, v in splits.items()}
    )
