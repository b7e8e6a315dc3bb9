"""One HF BERT / RoBERTa layer above the memory layer, run through its own submodules, memory inserted.

The authors' `MemoriaBertLayer.forward` puts the memory attention between a layer's self-attention
sublayer and its feed-forward sublayer, which no hook on an HF `BertLayer` can reach. So each such
layer is driven here through its own (unmodified) submodules, in HF's order and arithmetic:

    a = layer.attention(h, mask)            # HF's BertAttention / RobertaAttention (LayerNorm(h + attn))
    a = memory_attention(a, [WM, M_rem])    # the two uses (memory_attention.py)
    h = layer.feed_forward_chunk(a)         # HF's intermediate + output (LayerNorm(a + ffn(a)))

Every weight is called through its own module, so ZeRO-3's gather hooks, peft's LoRA layers (which
replace `query`, `key`, `value`, `dense` in place) and HF's weight names keep working. The layers at
and below the memory layer are called whole (`layer(h, mask)`), as HF's encoder calls them.

`EncoderMemoryLayer` is a `GradientCheckpointingLayer`, so `model.gradient_checkpointing_enable()`
checkpoints it (and the backbone's own layers); the memory step (the abstractor's remind after the
memory layer, memorize after the last layer) lies outside every checkpointed layer, and what the
M_rem use attended with is returned, never stored, so a recompute cannot count it twice.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import apply_chunking_to_forward

from ..memory_attention import MemoryInputs, RemindedRead
from .memory_attention import EncoderMemoryAttention


class EncoderMemoryLayer(GradientCheckpointingLayer):
    """The memory attention of one layer above the memory layer, and the driving of that HF layer.

    Args:
        config: the Memoria encoder config.
        layer_idx: index of the backbone layer it wraps.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.memory_attention = EncoderMemoryAttention(
            dim=config.hidden_size,
            num_heads=config.num_attention_heads,
            residual=config.memory_residual,
            eps=config.layer_norm_eps,
            attn_dropout=config.attention_probs_dropout_prob,
            resid_dropout=config.hidden_dropout_prob,
        )

    def forward(self, hidden: Tensor, engrams: Tensor, key_values: Tensor | None = None, *, layer: nn.Module,
                attention_mask: Tensor | None, memory: MemoryInputs) -> tuple[Tensor, RemindedRead | None]:
        """Run `layer` with the memory read between its two sublayers.

        Tensors that may need gradients are positional (reentrant checkpointing only tracks those).

        Args:
            hidden: (B, L, D) the stream.
            engrams: (B, N + R, D) the working memory, then the reminded engrams.
            key_values: (2, B, H, N + R, hd) their keys and values for this layer's memory attention,
                projected for every layer at once (`memory_attention.engram_key_values`), or None.
            layer: the HF `BertLayer` / `RobertaLayer` at this index (not owned: its weights keep HF's names).
            attention_mask: the backbone's self-attention mask (`create_bidirectional_mask`), or None.
            memory: the per-forward memory inputs.

        Returns:
            The stream (B, L, D), and what this layer's M_rem use attended with (or None).
        """
        attended, _ = layer.attention(hidden, attention_mask)  # (B, L, D)
        attended, reminded = self.memory_attention(attended, engrams, memory, key_values)
        hidden = apply_chunking_to_forward(layer.feed_forward_chunk, layer.chunk_size_feed_forward,
                                           layer.seq_len_dim, attended)
        return hidden, reminded


__all__ = ["EncoderMemoryLayer"]
