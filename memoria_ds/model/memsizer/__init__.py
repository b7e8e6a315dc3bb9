"""MemSizer (Zhang & Cai 2022, "Linearizing Transformers with Key-Value Memory"): attention replaced
by a key-value memory of k slots per layer.

    from memoria_ds.model import build_model
    model = build_model(GPT2Config(n_layer=2, n_embd=64, n_head=4), preset="memsizer")

See docs/memsizer.md. Importing this package registers the model with the Auto classes.
"""

from .attention import MemSizerAttention, memory_after, memsizer_read, sinusoids
from .config import MEMSIZER_FIELDS, MEMSIZER_PRESETS, MemSizerConfig
from .modeling import MemSizerBlock, MemSizerLMHeadModel

__all__ = ["MemSizerConfig", "MemSizerLMHeadModel", "MemSizerBlock", "MemSizerAttention", "memsizer_read",
           "memory_after", "sinusoids", "MEMSIZER_PRESETS", "MEMSIZER_FIELDS"]
