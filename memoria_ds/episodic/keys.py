"""KeyEncoder: the frozen key network of MbPA++.

MbPA++ keys each stored example by a pretrained encoder's representation of its input, the
last hidden state of the first token ([CLS] for BERT, <s> for RoBERTa), and freezes that
encoder so keys written early in the stream stay comparable with queries made at the end. A causal
model (GPT-2) sees the whole input only at its last token: its key is the last real token's state
(de Masson d'Autume et al. 2019; the survey (shared/papers), on the same setup in
Meta-MbPA: a separate pretrained BERT_BASE key network, frozen "to prevent from drifting while
training on a non-stationary data distribution"). The key network
is a separate copy: it must never share a parameter with the classifier being trained, or
every optimiser step would move the keys.

Shapes: B examples, T tokens, D hidden size (= key width).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


CAUSAL_TYPES = frozenset({"gpt2"})  # model types whose last token, not the first, has read the input


class KeyEncoder(nn.Module):
    """A frozen deep copy of a Hugging Face encoder that maps inputs to fp32 keys.

    Args:
        encoder: a `transformers` encoder (`BertModel`, `RobertaModel`, ...) or a model with one
            as its `base_model` (e.g. `BertForSequenceClassification` before fine-tuning, or
            `AutoModel.from_pretrained("bert-base-uncased")` as in the paper). It is copied, so
            later changes to it do not reach the keys.

    The copy is in eval mode (no dropout: a key must be a function of the input alone) and
    stays there whatever `.train()` is called with; its parameters do not require grad. The
    copy must be made from real tensors: a ZeRO-3 partitioned or meta-device model would be
    copied as placeholders.

    pooling: `first` (the first token: [CLS], <s>) or `last` (the last token the attention mask keeps;
        inputs right-padded); default `last` for a causal model (`CAUSAL_TYPES`), else `first`.
    """

    def __init__(self, encoder: nn.Module, pooling: str | None = None) -> None:
        super().__init__()
        base = getattr(encoder, "base_model", encoder)
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        self.pooling = pooling or ("last" if model_type in CAUSAL_TYPES else "first")
        if self.pooling not in ("first", "last"):
            raise ValueError(f"`pooling` must be `first` or `last`, got {pooling!r}")
        self.encoder = copy.deepcopy(base)
        self.encoder.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> KeyEncoder:
        """Stays in eval mode: the key network is frozen (the argument is ignored)."""
        return super().train(False)

    @property
    def key_dim(self) -> int:
        return self.encoder.config.hidden_size

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T) token ids and attention mask -> (B, D) float32 keys, no autograd graph."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        if self.pooling == "first":
            return hidden[:, 0].float()  # (B, D)
        last = (attention_mask.sum(1) - 1).clamp(min=0)  # (B,) the last real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()  # (B, D)


__all__ = ["CAUSAL_TYPES", "KeyEncoder"]
