"""A tiny BERT pre-trained by masked language modelling: the CPU stand-in for a pretrained encoder.

MbPA++ fine-tunes a *pretrained* BERT and keys its memory with a frozen pretrained encoder. At CPU
scale no pretrained checkpoint is at hand (no hub here), and a tiny encoder from random weights is a
poor stand-in: learning tasks one after another from random weights, it learned the first and then
none (docs/episodic.md, "The CPU study"). A few hundred masked-language-modelling updates on the tasks'
*unlabelled* text (as BERT's own corpus covered its tasks' domains) give it what fine-tuning needs.

    path = pretrain_mlm(texts, tokenizer_dir, "enc", steps=600)
    # then: launch/classify.py model.backbone=enc model.preset=backbone ...

Hugging Face's `BertForMaskedLM` and `DataCollatorForLanguageModeling` (15% of the tokens; of them
80% [MASK], 10% a random token, 10% kept); AdamW, gradient clipping at 1, a constant rate. The saved
folder holds the model and the tokenizer: `from_pretrained` reads it as any BERT checkpoint (the
classifier's head is new, as on a hub BERT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
             "max_position_embeddings": 66}


def pretrain_mlm(texts: Sequence[str], tokenizer_dir: str | Path, out_dir: str | Path, *, steps: int = 600,
                 batch_size: int = 32, max_length: int = 64, lr: float = 1e-3, seed: int = 0,
                 settings: dict[str, Any] | None = None) -> dict[str, float]:
    """Pre-train a BERT of `settings` (default `TINY_BERT`) on `texts` and save it with the tokenizer.

    Returns:
        `first_loss` and `last_loss`: the masked-token loss of the first update and the mean of the last 50.

    Raises:
        ValueError: no texts, steps or batch below 1, a tokenizer without a mask token, too few positions.
    """
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    if not texts or steps < 1 or batch_size < 1:
        raise ValueError(f"need texts, steps >= 1 and batch_size >= 1 (got {len(texts)} texts, {steps}, {batch_size})")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tokenizer.mask_token is None:
        raise ValueError(f"the tokenizer at {tokenizer_dir} has no mask token: masked language modelling needs one")
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **{**TINY_BERT, **(settings or {})})
    if config.max_position_embeddings < max_length:
        raise ValueError(f"max_length {max_length} exceeds the model's {config.max_position_embeddings} positions")
    model = BertForMaskedLM(config).train()
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    draws = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        rows = torch.randint(len(encoded), (batch_size,), generator=draws).tolist()
        loss = model(**collate([{"input_ids": encoded[i]} for i in rows])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    tail = losses[-50:]
    return {"first_loss": losses[0], "last_loss": sum(tail) / len(tail)}


__all__ = ["TINY_BERT", "pretrain_mlm"]
