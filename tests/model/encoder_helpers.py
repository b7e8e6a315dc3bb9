"""Helpers shared by the Memoria encoder tests (imported by name): tiny BERT / RoBERTa backbones built
locally (never downloaded), small Memoria settings, segments of documents."""

from __future__ import annotations

import torch
from transformers import BertConfig, RobertaConfig

from memoria_ds.model.encoder import build_encoder_model

# Small enough that STM fills and LTM is reminded within a handful of segments.
SMALL_ENCODER_MEMORIA = dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=6, initial_lifespan=3.0,
                             alpha=2.0, search_depth=2)
VOCAB = 50
PAD = {"bert": 0, "roberta": 1}  # the backbones' pad_token_id


def tiny_backbone(family: str, **overrides) -> BertConfig | RobertaConfig:
    """A 4-layer, 32-wide BERT or RoBERTa config, dropout off."""
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    sizes.update(overrides)
    return BertConfig(**sizes) if family == "bert" else RobertaConfig(**sizes)


def tiny_encoder(family: str = "bert", preset: str | None = None, **settings):
    """A tiny Memoria encoder (3 labels, memory read by layers 2 and 3) in eval mode."""
    memoria = {**SMALL_ENCODER_MEMORIA, **settings.pop("memoria", {})}
    settings.setdefault("memory_layer_index", 1)
    settings.setdefault("num_labels", 3)
    return build_encoder_model(tiny_backbone(family), preset, memoria=memoria, **settings).eval()


def document_segments(family: str = "bert", batch: int = 2, length: int = 8, count: int = 5,
                      seed: int = 0) -> list[torch.Tensor]:
    """`count` segments of `batch` documents: a list of (batch, length) int64, no pad token inside."""
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(PAD[family] + 2, VOCAB, (batch, length * count), generator=gen).split(length, dim=1))


@torch.no_grad()
def randomize(model, std: float = 0.2, seed: int = 0) -> None:
    """Every weight drawn afresh (biases and layer norms away from 0 and 1 too), so that each one shows in
    the logits; the abstractor's queries N(0, 1), so that a step's engrams differ clearly."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("LayerNorm.weight") or name.endswith(".ln.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name == "abstractor.queries":
            p.copy_(noise)
        else:
            p.copy_(std * noise)
