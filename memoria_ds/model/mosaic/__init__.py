"""Memory Mosaics (Zhang, Nolte, Sadhukhan, Chen, Bottou, 2024): networks of associative memories.

    from memoria_ds.model import build_model
    model = build_model(GPT2Config(n_layer=2, n_embd=64, n_head=4), preset="memory_mosaic")

See docs/memory_mosaics.md. Importing this package registers the model with the Auto classes.
"""

from .config import MOSAIC_FIELDS, MOSAIC_PRESETS, MemoryMosaicConfig
from .modeling import MemoryMosaicBlock, MemoryMosaicLMHeadModel
from .units import ContextualMemory, PersistentMemory, leaky_average, peek_ahead

__all__ = ["MemoryMosaicConfig", "MemoryMosaicLMHeadModel", "MemoryMosaicBlock", "ContextualMemory",
           "PersistentMemory", "leaky_average", "peek_ahead", "MOSAIC_PRESETS", "MOSAIC_FIELDS"]
