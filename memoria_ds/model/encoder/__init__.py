"""Memoria on encoders: BERT and RoBERTa classifying long documents segment by segment (paper section 4.3).

    from memoria_ds.model.encoder import build_encoder_model
    model = build_encoder_model("bert-base-uncased", num_labels=2)   # hub name, local dir, or a config
    memory = None
    for segment, mask, new_doc in document_segments:                  # (B, L) each, one document per row
        out = model(segment, attention_mask=mask, labels=y, memory=memory, reset=new_doc)
        memory = out.memory

See docs/encoders.md. Importing this package registers the model types with the Auto classes.
"""

from .build import build_encoder_model
from .config import ENCODER_MEMORIA, ENCODER_PRESETS, MemoriaBertConfig, MemoriaRobertaConfig, encoder_config
from .export import add_encoder_remote_code
from .lora import apply_encoder_lora
from .memory import EncoderMemory
from .modeling import (
    MemoriaBertForSequenceClassification,
    MemoriaRobertaForSequenceClassification,
    MemoriaSequenceClassifierOutput,
)

__all__ = [
    "build_encoder_model", "encoder_config", "ENCODER_MEMORIA", "ENCODER_PRESETS", "MemoriaBertConfig",
    "MemoriaRobertaConfig", "MemoriaBertForSequenceClassification", "MemoriaRobertaForSequenceClassification",
    "MemoriaSequenceClassifierOutput", "EncoderMemory", "add_encoder_remote_code", "apply_encoder_lora",
]
