"""prepare_corpus: documents -> tokens -> one `TokenCorpus` per split, in one call."""

from __future__ import annotations

from typing import Any

import datasets

from memoria_ds.data.corpora import load_corpus
from memoria_ds.data.enwik8 import enwik8_vocabulary
from memoria_ds.data.token_corpus import TokenCorpus
from memoria_ds.data.tokenize import load_tokenizer, token_metadata, tokenize_documents


def prepare_corpus(
    corpus: str | datasets.DatasetDict,
    tokenizer: Any = None,
    *,
    name: str | None = None,
    splits: tuple[str, ...] | None = None,
    append_eos: bool | None = None,
    num_proc: int | None = None,
    **loader_kwargs: Any,
) -> dict[str, TokenCorpus]:
    """Load (by name) or take a `DatasetDict`, tokenize it, and flatten each split.

    Args:
        corpus: a corpus name for `load_corpus` (`wikitext103`, `pg19`, `enwik8`,
            `bundled`), or a `DatasetDict` of documents with a `text` column.
        tokenizer: a tokenizer object, a name for `load_tokenizer`, or None: GPT-2, or for
            `enwik8` its character vocabulary (with the loader's `newlines` choice).
        name: recorded in the corpus metadata (default: the corpus name).
        splits: the splits to keep (default: all).
        append_eos: see `tokenize_documents`.
        num_proc: tokenisation processes.
        **loader_kwargs: passed to the corpus loader (e.g. `path=...`).

    Returns:
        `{split: TokenCorpus}`, each with metadata `corpus`, `split` and the tokenizer facts.
    """
    if isinstance(corpus, str):
        name = name or corpus
        if tokenizer is None and corpus == "enwik8":
            tokenizer = enwik8_vocabulary(loader_kwargs.get("newlines", "drop"))
        docs = load_corpus(corpus, **loader_kwargs)
    else:
        docs = corpus
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer or "gpt2")
    if splits is not None:
        missing = set(splits) - set(docs)
        if missing:
            raise ValueError(f"splits {sorted(missing)} are not in the corpus (it has {sorted(docs)})")
        docs = datasets.DatasetDict({k: docs[k] for k in splits})
    tokens = tokenize_documents(docs, tokenizer, append_eos=append_eos, num_proc=num_proc)
    meta = token_metadata(tokenizer, append_eos=append_eos)
    return {
        split: TokenCorpus.from_dataset(ds, metadata={"corpus": name or "custom", "split": split, **meta})
        for split, ds in tokens.items()
    }
