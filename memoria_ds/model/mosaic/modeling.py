"""The GPT-2-like Memory Mosaic language model (Zhang et al. 2024, Section 5, Figure 8).

    x = drop(wte(ids))                              # no position embedding
    for each block:
        x = x + contextual(ln_1(x))                 # N_c contextual memory units (units.py)
        x = x + persistent(ln_2(x))                 # N_p persistent memory units
    logits = lm_head(ln_f(x))                       # lm_head tied to wte

Contract 2 (docs/design.md) like every model of the toolkit: `forward(input_ids, labels,
shift_labels, memory, reset)` returns `loss`, `logits`, `memory` (the `none` kind's: a Memory
Mosaic carries nothing from one segment to the next) and `memory_stats` (None). Weight names
(`mosaic.*`, `lm_head.weight`) follow the reference's layout; `docs/memory_mosaics.md` maps
them onto the reference's.

Notation: B rows, L tokens, D width, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ..family_lm import FamilyLMHeadModel
from ..modeling import MemoriaCausalLMOutput
from .config import EXP_SCALING, KEY_SCALE_INIT, LEAK_INIT, VALUE_SCALE_INIT, MemoryMosaicConfig
from .units import ContextualMemory, KeyExtractor, OutProj, PersistentMemory, ValueExtractor


class MemoryMosaicBlock(GradientCheckpointingLayer):
    """Pre-norm block: contextual memory, then persistent memory, each with a residual."""

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=eps, bias=config.bias)
        self.context = ContextualMemory(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=eps, bias=config.bias)
        self.persistent = PersistentMemory(config)

    def forward(self, x: Tensor, key_padding: Tensor | None = None, eager: bool = False,
                carry: tuple[Any, Tensor] | None = None) -> Tensor | tuple[Tensor, tuple[Any, Tensor]]:
        """(B, L, D) -> (B, L, D); `eager`: attention spelled out instead of SDPA.

        With `carry` (a carried memory's `layer(i)`: the contextual memory's `ContextCarry` and the
        persistent key's kbar), also reads it and returns (output, the new carry and kbar).
        """
        if carry is None:
            x = x + self.context(self.ln_1(x), key_padding, eager)
            return x + self.persistent(self.ln_2(x), eager)[0]
        context, kbar = carry
        h, context = self.context.forward_carried(self.ln_1(x), context, key_padding, eager)
        x = x + h
        h, kbar = self.persistent(self.ln_2(x), eager, start=kbar)
        return x + h, (context, kbar)


class MemoryMosaicLMHeadModel(FamilyLMHeadModel):
    """A Memory Mosaic LM in the toolkit's model contract.

    Args:
        config: a `MemoryMosaicConfig`.
    """

    config_class = MemoryMosaicConfig
    config: MemoryMosaicConfig
    base_model_prefix = "mosaic"
    _tied_weights_keys = {"lm_head.weight": "mosaic.wte.weight"}
    _no_split_modules = ["MemoryMosaicBlock"]

    def __init__(self, config: MemoryMosaicConfig) -> None:
        super().__init__(config)
        self.mosaic = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList(MemoryMosaicBlock(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()
        self.memory_kind  # made now, outside any compiled forward

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The reference's init: linear and embedding weights N(0, 0.02), biases 0, layer
        norms 1/0; output projections N(0, 0.02 / sqrt(2 n_layer)); persistent keys/values
        N(0, 1/sqrt(hd)); leak rates 0.5..5 across heads, key scale e, value and output
        scales exp(-0.5), the value's mix weight U(0, 1)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scaled = isinstance(module, OutProj)  # residual output projections, as GPT-2
            init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer) if scaled else std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, KeyExtractor):
            init.copy_(module.leak, torch.linspace(*LEAK_INIT, module.heads) / EXP_SCALING)
            init.constant_(module.scale, KEY_SCALE_INIT / EXP_SCALING)
        elif isinstance(module, ValueExtractor):
            init.uniform_(module.mix, 0.0, 1.0)
            init.constant_(module.scale, VALUE_SCALE_INIT / EXP_SCALING)
        elif isinstance(module, PersistentMemory):
            hd = module.keys.shape[-1]
            init.normal_(module.keys, mean=0.0, std=hd**-0.5)
            init.normal_(module.values, mean=0.0, std=hd**-0.5)
            init.constant_(module.scale, VALUE_SCALE_INIT / EXP_SCALING)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        shift_labels: Tensor | None = None,
        memory: Any = None,
        reset: Tensor | None = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> MemoriaCausalLMOutput:
        """One segment for every row.

        Args:
            input_ids: (B, L) int64, L <= n_positions.
            labels: (B, L) HF convention: shifted inside the model, -100 ignored.
            shift_labels: (B, L) already aligned targets, -100 ignored (not with `labels`).
            memory / reset: Contract 2's. The paper's Memory Mosaic (`memory_type="none"`)
                carries nothing across segments: the memory only keeps the batch size
                (checked); with `memory_type="mosaic"` it carries the contextual memories
                (`recurrent/mosaic.py`), updated in place.
            attention_mask: (B, L), 1 at real tokens: padded positions are never read.
            logits_to_keep: as HF (generation).
            **kwargs: `num_items_in_batch` (loss normalisation, as HF's Trainer passes it).

        Returns:
            `MemoriaCausalLMOutput` (memory_stats None).

        Raises:
            ValueError: a segment longer than n_positions, both kinds of labels, unsupported inputs.
        """
        num_items_in_batch = self._check_segment(input_ids, labels, shift_labels, inputs_embeds, output_attentions,
                                                 output_hidden_states, kwargs)
        cfg = self.config
        B, L = input_ids.shape
        device = input_ids.device
        memory = self.memory_kind.prepare(memory, B, device, self.dtype, reset)
        key_padding = attention_mask[:, -L:].to(device=device, dtype=torch.bool) if attention_mask is not None else None

        eager = cfg._attn_implementation == "eager"  # SDPA otherwise (the reference's)
        kind = self.memory_kind
        read = kind.read(memory, self.dtype, None)[0] if kind.carries_state else None
        x = self.mosaic.drop(self.mosaic.wte(input_ids))  # (B, L, D)
        writes = []
        for i, block in enumerate(self.mosaic.h):
            if read is None:
                x = block(x, key_padding, eager)
            else:
                x, carried = block(x, key_padding, eager, read.layer(i))
                writes.append(carried)
        x = self.mosaic.ln_f(x)  # (B, L, D)
        if read is not None:
            valid = key_padding if key_padding is not None else torch.ones(B, L, dtype=torch.bool, device=device)
            kind.write(memory, read, None, writes, x, valid)
        return self._output(x, memory, labels, shift_labels, logits_to_keep, num_items_in_batch)

AutoConfig.register(MemoryMosaicConfig.model_type, MemoryMosaicConfig, exist_ok=True)
AutoModel.register(MemoryMosaicConfig, MemoryMosaicLMHeadModel, exist_ok=True)
AutoModelForCausalLM.register(MemoryMosaicConfig, MemoryMosaicLMHeadModel, exist_ok=True)

__all__ = ["MemoryMosaicLMHeadModel", "MemoryMosaicBlock"]
