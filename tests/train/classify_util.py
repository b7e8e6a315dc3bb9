"""A tiny labelled-documents task for the classification runs' tests: JSONL splits and a real
WordPiece tokenizer (BertTokenizerFast from a vocabulary written here), no hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [f"w{i}" for i in range(60)]
CUES = ["alpha", "beta", "gamma"]  # the label's word: in the document's first segment only


def make_tokenizer(folder: Path) -> Path:
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CUES, *WORDS]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)})
    assert len(tokenizer) == len(words)
    tokenizer.save_pretrained(str(folder))
    return folder


def make_documents(folder: Path, counts: dict[str, int], seed: int = 0, length: tuple[int, int] = (10, 40)) -> dict:
    """`{split: [path]}`: documents of `length` words whose label (a name) is told by one cue word near
    their start; the rest is filler."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n in counts.items():
        path = folder / f"{split}.jsonl"
        with path.open("w") as f:
            for _ in range(n):
                label = rng.randrange(len(CUES))
                words = [rng.choice(WORDS) for _ in range(rng.randint(*length))]
                words.insert(rng.randrange(3), CUES[label])
                f.write(json.dumps({"text": " ".join(words), "label": CUES[label]}) + "\n")
        files[split] = [str(path)]
    return files


def classify_args(tmp: Path, counts: dict[str, int] | None = None) -> list[str]:
    """Write the task above under `tmp` (documents, tokenizer) and give the settings of a tiny
    from-scratch Memoria BERT run on it."""
    make_documents(tmp / "docs", counts or {"train": 16, "validation": 8})
    make_tokenizer(tmp / "tokenizer")
    return run_args(tmp, counts)


def run_args(tmp: Path, counts: dict[str, int] | None = None) -> list[str]:
    """The settings of `classify_args` for files it already wrote under `tmp`."""
    files = {split: [str(tmp / "docs" / f"{split}.jsonl")] for split in (counts or {"train": 16, "validation": 8})}
    tok = tmp / "tokenizer"
    split_files = "{" + ", ".join(f"{k}: [{v[0]}]" for k, v in files.items()) + "}"
    return [
        "model.task=classification", "model.backbone=bert", "model.from_scratch=true", "model.preset=memoria",
        "model.settings={num_hidden_layers: 2, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64, "
        "max_position_embeddings: 32, hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0, "
        "memory_layer_index: 0, memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, stm_capacity: 16, "
        "search_depth: 2}}",
        "data.corpus=documents", f"data.files={split_files}", f"data.tokenizer={tok}", "data.segment_length=12",
        "data.max_segments=4", "optim.micro_batch_size=2", "optim.grad_accum=1", "optim.lr=1e-3",
        "optim.precision=fp32", "log.every=1", "log.tensorboard=false", "log.progress=false",
        "eval.protocols=[full, memoryless]", "checkpoint.export=false",
    ]
