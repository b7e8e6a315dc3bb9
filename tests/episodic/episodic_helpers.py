"""Shared builders for the MbPA++ tests: tiny classifiers from configs, random token batches."""

from __future__ import annotations

import torch
from transformers import BertConfig

VOCAB = 50


def tiny_bert_config(**overrides) -> BertConfig:
    """A 1-layer, 16-wide BERT with 3 labels; dropout left at BERT's 0.1 unless overridden."""
    settings = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=64, num_labels=3)
    settings.update(overrides)
    return BertConfig(**settings)


def random_batch(n: int, width: int, generator: torch.Generator, min_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, width) token ids (1..VOCAB-1) and right-padded masks of random lengths in min_len..width."""
    ids = torch.randint(1, VOCAB, (n, width), generator=generator)
    lengths = torch.randint(min_len, width + 1, (n,), generator=generator)
    mask = (torch.arange(width) < lengths[:, None]).long()
    return ids, mask
