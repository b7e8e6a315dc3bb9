"""Data: corpora through `datasets`, tokenisation, the sorting task, checkpointable streams.

Contract 3 (docs/design.md, docs/data.md): `B_global` contiguous streams, step t feeds
segment t of every stream, each rank owns a fixed slice of the streams, every batch
carries `input_ids`, aligned `targets` (-100 where none), per-row `doc_start` flags and
global `stream_ids`; `state_dict()` resumes exactly, on any world size.
"""

from memoria_ds.data.batch import IGNORE_INDEX, StreamBatch
from memoria_ds.data.chars import CharVocabulary
from memoria_ds.data.corpora import (
    CORPORA,
    bundled,
    bundled_chapters,
    load_corpus,
    load_dataset_dict,
    local_documents,
    pg19,
    split_wikitext_articles,
    wikitext103,
)
from memoria_ds.data.documents import DocumentStreams, document_segments
from memoria_ds.data.enwik8 import ENWIK8_SYMBOLS, enwik8, enwik8_vocabulary, read_enwik8_file, split_enwik8_bytes
from memoria_ds.data.examples import ExampleStreams
from memoria_ds.data.prepare import prepare_corpus
from memoria_ds.data.reset import ResetPolicy
from memoria_ds.data.sorting import (
    SEPARATOR,
    VOCAB_SIZE,
    generate_sorting,
    generate_sorting_example,
    input_length_for,
    sorting_dataset,
    sorting_sequence,
    sorting_target,
)
from memoria_ds.data.streams import StreamLayout, TokenStreams
from memoria_ds.data.token_corpus import TokenCorpus
from memoria_ds.data.tokenize import (
    gpt2_tokenizer_offline,
    load_tokenizer,
    token_metadata,
    tokenize_documents,
    tokenizer_fingerprint,
)

__all__ = [
    "CORPORA", "ENWIK8_SYMBOLS", "IGNORE_INDEX", "SEPARATOR", "VOCAB_SIZE",
    "CharVocabulary", "DocumentStreams", "ExampleStreams", "ResetPolicy", "StreamBatch", "StreamLayout", "TokenCorpus", "TokenStreams",
    "bundled", "bundled_chapters", "document_segments", "enwik8", "enwik8_vocabulary", "generate_sorting", "generate_sorting_example",
    "gpt2_tokenizer_offline", "input_length_for", "load_corpus", "load_dataset_dict", "load_tokenizer",
    "local_documents", "pg19", "prepare_corpus", "read_enwik8_file", "sorting_dataset", "sorting_sequence",
    "sorting_target", "split_enwik8_bytes", "split_wikitext_articles", "token_metadata", "tokenize_documents",
    "tokenizer_fingerprint", "wikitext103",
]
