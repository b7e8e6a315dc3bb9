"""peft LoRA on a Memoria encoder's backbone; the memory modules and the classification head stay trainable.

The adapters go on the backbone's layers only (their attention's `query`, `key`, `value`, the two
`dense` output projections and the feed-forward's `intermediate.dense`), never on the memory modules
(the abstractor's `key` / `value` share names with BERT's, hence a pattern anchored at the backbone's
layers) nor on the head. peft freezes every non-adapter parameter; the memory modules and the
classification head (`classifier`, as peft's SEQ_CLS task keeps it) are made trainable again, not
wrapped in `modules_to_save`, so `PeftModel.save_pretrained` stores the adapters only: save training
state whole, export with `merge_and_unload()` + `save_pretrained` (as Memoria GPT-2's `lora.py`).
"""

from __future__ import annotations

from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model

from .modeling import MemoriaEncoderModel

# every linear layer of the backbone's transformer layers (BERT and RoBERTa name them alike)
BACKBONE_TARGETS = (r"(bert|roberta)\.encoder\.layer\.\d+\.(attention\.self\.(query|key|value)"
                    r"|attention\.output\.dense|intermediate\.dense|output\.dense)")


def apply_encoder_lora(model: MemoriaEncoderModel, r: int = 8, alpha: int = 16, dropout: float = 0.0,
                       target_modules: str | list[str] = BACKBONE_TARGETS, **lora_kwargs: Any) -> PeftModel:
    """Wrap the backbone's linear layers with LoRA; keep the memory modules and the head trainable.

    Args:
        model: a Memoria BERT or RoBERTa classifier.
        r / alpha / dropout: LoRA rank, scaling numerator and dropout.
        target_modules: peft's `target_modules` (a regex matched against whole module names, or names).
        **lora_kwargs: any other `peft.LoraConfig` field.

    Returns:
        The `PeftModel`; `model(...)` takes and returns what the Memoria encoder does.
    """
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none",
                        **lora_kwargs)
    peft_model = get_peft_model(model, config)
    for module in [*model.memory_modules(), model.classifier]:
        module.requires_grad_(True)
    return peft_model


__all__ = ["apply_encoder_lora", "BACKBONE_TARGETS"]
