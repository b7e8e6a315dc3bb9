"""peft LoRA on the GPT-2 backbone while the Memoria modules stay fully trainable.

GPT-2's `c_attn`, `c_proj` and `c_fc` are `transformers.pytorch_utils.Conv1D` layers,
whose weight is stored (in, out): peft needs `fan_in_fan_out=True` for them. peft freezes
every non-adapter parameter; the new memory modules (abstractor, memory attentions) are
then made trainable again. They are not wrapped in peft's `modules_to_save`, which keeps
a frozen copy of each module (a third of GPT-2 XL's size at full width); the trade-off is
that `PeftModel.save_pretrained` stores only the adapters, so save the whole training
state through DeepSpeed or export with `merge_and_unload()` + `save_pretrained`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model

from .modeling import MemoriaGPT2LMHeadModel

BACKBONE_TARGETS = ("c_attn", "c_proj", "c_fc")


def apply_lora(
    model: MemoriaGPT2LMHeadModel,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: Sequence[str] = BACKBONE_TARGETS,
    **lora_kwargs: Any,
) -> PeftModel:
    """Wrap the backbone's Conv1D projections with LoRA; keep the memory modules trainable.

    Args:
        model: a `MemoriaGPT2LMHeadModel`.
        r / alpha / dropout: LoRA rank, scaling numerator and dropout.
        target_modules: backbone module names to adapt (GPT-2's Conv1D layers by default).
        **lora_kwargs: any other `peft.LoraConfig` field.

    Returns:
        The `PeftModel`; `model(...)`, `generate()` and Contract 2 work through it.
    """
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        fan_in_fan_out=True,
        bias="none",
        **lora_kwargs,
    )
    peft_model = get_peft_model(model, config)
    for module in model.memory_modules():
        module.requires_grad_(True)
    return peft_model


__all__ = ["apply_lora", "BACKBONE_TARGETS"]
