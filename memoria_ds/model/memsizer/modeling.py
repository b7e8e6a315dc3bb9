"""A GPT-2-shaped decoder whose attention is MemSizer's (Zhang & Cai 2022).

    x = drop(sqrt(D) wte(ids) + sinusoids(positions))  # positions: the token's place in its stream
    for each block:
        x = x + memsizer(ln_1(x))                    # a key-value memory of k slots (attention.py)
        x = x + mlp(ln_2(x))                         # GPT-2's MLP (its modules, names and arithmetic)
    logits = lm_head(ln_f(x))                        # lm_head tied to wte

The embedding, the positions and the pre-norm blocks are the reference's language model
(jcyk/memsizer: fairseq's transformer decoder with `--decoder-normalize-before`, its attention
replaced); the MLP, the final layer norm and the tied head are GPT-2's. Contract 2
(docs/design.md) like every model of the toolkit: `forward(input_ids, labels, shift_labels,
memory, reset)` returns `loss`, `logits`, `memory` and `memory_stats` (None). With
`memory_type="none"` (preset `memsizer`) every segment is read from an empty memory, as the
reference trains; with `memory_type="memsizer"` (preset `memsizer_carry`) each layer's memory
S and the stream's length t carry to the next segment (`recurrent/memsizer.py`), so a stream
read segment by segment gives the logits of the stream read at once.

Notation: B rows, L tokens, D width, K slots, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D

from ..family_lm import FamilyLMHeadModel
from ..modeling import MemoriaCausalLMOutput
from .attention import MemSizerAttention, SlotProjection, sinusoids
from .config import POSITION_OFFSET, MemSizerConfig


class ResidualProjection(Conv1D):
    """The MLP's output projection (its own class: initialised at 0.02 / sqrt(2 n_layer), as GPT-2's)."""


class MLP(nn.Module):
    """GPT-2's MLP (`GPT2MLP`'s modules and arithmetic: c_fc, activation, c_proj, dropout), its output
    projection of its own class (HF initialises a model outside transformers module by module)."""

    def __init__(self, config: MemSizerConfig) -> None:
        super().__init__()
        inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.c_fc = Conv1D(inner, config.n_embd)
        self.c_proj = ResidualProjection(config.n_embd, inner)
        self.act = ACT2FN[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class MemSizerBlock(GradientCheckpointingLayer):
    """Pre-norm block: MemSizer's attention, then GPT-2's MLP, each with a residual."""

    def __init__(self, config: MemSizerConfig) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=eps)
        self.attn = MemSizerAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, scale: Tensor, keep: Tensor | None = None,
                start: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(B, L, D) -> (B, L, D), and the layer's memory after the segment when `start` (B, K, D) is given
        (`MemSizerAttention.forward`: `scale`, `keep`, `start`)."""
        h, memory = self.attn(self.ln_1(x), scale, keep, start)
        x = x + h
        return x + self.mlp(self.ln_2(x)), memory


class MemSizerLMHeadModel(FamilyLMHeadModel):
    """A MemSizer LM in the toolkit's model contract.

    Args:
        config: a `MemSizerConfig`.
    """

    config_class = MemSizerConfig
    config: MemSizerConfig
    base_model_prefix = "memsizer"
    _tied_weights_keys = {"lm_head.weight": "memsizer.wte.weight"}
    _no_split_modules = ["MemSizerBlock"]

    def __init__(self, config: MemSizerConfig) -> None:
        super().__init__(config)
        self.memsizer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList(MemSizerBlock(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()
        self.memory_kind  # made now, outside any compiled forward

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The reference's init for the embedding and the attention: the embedding (and an untied head)
        N(0, D^-1/2) (fairseq's, with the sqrt(D) scale of the input); Phi, W_k, W_v Xavier uniform, each
        with its own fan, gains q_init_scale^-1/2 and kv_init_scale^-1/2, biases 0. GPT-2's for the rest:
        the MLP N(0, 0.02) (its output projection N(0, 0.02 / sqrt(2 n_layer))), biases 0, layer norms 1/0."""
        cfg = self.config  # HF calls this on the modules that hold parameters themselves (the leaves)
        if isinstance(module, (nn.Embedding, nn.Linear)):
            init.normal_(module.weight, mean=0.0, std=cfg.n_embd**-0.5)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, SlotProjection):
            parts = []  # (out, in) each, as nn.Linear's, the reference's fans
            for rows, scale in ((cfg.query_width, cfg.q_init_scale), (cfg.memsizer_slots, cfg.kv_init_scale),
                                (cfg.n_embd, cfg.kv_init_scale)):
                part = torch.empty(rows, cfg.n_embd, dtype=module.weight.dtype, device=module.weight.device)
                parts.append(torch.nn.init.xavier_uniform_(part, gain=scale**-0.5))
            init.copy_(module.weight, torch.cat(parts).T)  # (D, H*K + K + D): Conv1D's (in, out)
            init.zeros_(module.bias)
        elif isinstance(module, Conv1D):
            residual = isinstance(module, ResidualProjection)
            std = cfg.initializer_range / math.sqrt(2 * cfg.n_layer) if residual else cfg.initializer_range
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)

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
            memory / reset: Contract 2's. With `memory_type="none"` nothing crosses segments
                (the memory only keeps the batch size, checked); with `memory_type="memsizer"`
                each layer's memory and the stream's length carry (`recurrent/memsizer.py`),
                updated in place.
            attention_mask: (B, L), 1 at real tokens: padded positions are neither read, stored
                nor counted in t.
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
        kind = self.memory_kind
        memory = kind.prepare(memory, B, device, self.dtype, reset)
        read = kind.read(memory, self.dtype, None)[0] if kind.carries_state else None

        valid = attention_mask[:, -L:].to(device=device, dtype=torch.bool) if attention_mask is not None else None
        # t_i: the tokens read up to i, i itself and earlier segments' included (padding is not counted)
        seen = valid.cumsum(1) if valid is not None else torch.arange(1, L + 1, device=device).expand(B, L)  # (B, L)
        if read is not None:
            seen = seen + read.tokens[:, None]
        scale = seen.clamp(min=1).double().rsqrt().to(self.dtype)[..., None]  # (B, L, 1): 1 / sqrt(t_i)
        keep = valid[..., None].to(self.dtype) if valid is not None else None  # (B, L, 1)
        positions = sinusoids(seen - 1 + POSITION_OFFSET, cfg.n_embd).to(self.dtype)  # (B, L, D)
        x = self.memsizer.drop(self.memsizer.wte(input_ids) * math.sqrt(cfg.n_embd) + positions)  # (B, L, D)
        writes = []
        for i, block in enumerate(self.memsizer.h):
            x, after = block(x, scale, keep, read.layer(i) if read is not None else None)
            writes.append(after)
        x = self.memsizer.ln_f(x)  # (B, L, D)
        if read is not None:
            kind.write(memory, read, None, writes, x,
                       valid if valid is not None else torch.ones(B, L, dtype=torch.bool, device=device))
        return self._output(x, memory, labels, shift_labels, logits_to_keep, num_items_in_batch)

AutoConfig.register(MemSizerConfig.model_type, MemSizerConfig, exist_ok=True)
AutoModel.register(MemSizerConfig, MemSizerLMHeadModel, exist_ok=True)
AutoModelForCausalLM.register(MemSizerConfig, MemSizerLMHeadModel, exist_ok=True)

__all__ = ["MemSizerLMHeadModel", "MemSizerBlock", "MLP", "ResidualProjection"]
