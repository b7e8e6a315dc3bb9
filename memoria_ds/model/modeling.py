"""Memoria GPT-2 (and the `transformer` / `xl` baseline presets) around an unmodified HF GPT-2.

Contract 2 (docs/design.md):

    out = model(input_ids, labels=None, shift_labels=None, memory=None, reset=None)
    out.loss, out.logits, out.memory, out.memory_stats

One forward is one memory step for all rows at once, the same for every kind of memory
(the protocol in `recurrent/base.py`; one file per kind in `recurrent/`):

    prepare (fresh / reset rows) -> read -> embed -> blocks -> (PKM running statistics) -> ln_f -> write -> loss

The read and the write run outside the (checkpointable) blocks, exactly once per forward.
The memory is updated in place and returned as `out.memory`.

Notation: B rows, L tokens in the segment, D width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GPT2Model
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.gpt2.modeling_gpt2 import GPT2PreTrainedModel
from transformers.utils import ModelOutput

from ..memory import MemoryStats
from .abstractor import Abstractor
from .config import MemoriaGPT2Config
from .extended_attention import self_attention_mask
from .generation import MemoryGenerationMixin
from .hf_compat import OUTPUT_CACHE
from .layer import BlockInputs, MemoryBlock
from .memory_attention import OutputProjection, engram_key_values
from .recurrent import BlockWrites, MemoryKind, MemoryRead, RecurrentMemory, at_fixed_addresses, memory_kind


@dataclass
class _MemoriaOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    memory: RecurrentMemory | None = None
    memory_stats: MemoryStats | None = None


if OUTPUT_CACHE == "cache":  # transformers >= 5.24

    @dataclass
    class MemoriaCausalLMOutput(_MemoriaOutput):
        cache: Cache | None = None

else:

    @dataclass
    class MemoriaCausalLMOutput(_MemoriaOutput):
        past_key_values: Cache | None = None


MemoriaCausalLMOutput.__doc__ = """Output of `MemoriaGPT2LMHeadModel.forward`.

    Attributes:
        loss: mean next-token cross-entropy over non-ignored targets (if labels were given).
        logits: (B, L, V) (or the last `logits_to_keep` positions).
        memory: the recurrent memory after this segment (the object passed in, updated in
            place; a new one if None was passed). None during decoding in `generate()`.
        memory_stats: the engine's `MemoryStats` of this step (`memoria` only); rows that
            had no previous segment report an empty memory.
        cache (transformers >= 5.24) / past_key_values (5.23): the decode cache (generation only).
    """


class MemoriaGPT2LMHeadModel(GPT2PreTrainedModel, MemoryGenerationMixin):
    """GPT-2 LM with a memory: `none` (plain), `xl` (Transformer-XL) or `memoria`.

    Weight names of the backbone are HF's (`transformer.*`, `lm_head.weight`), so any GPT-2
    checkpoint loads by `from_pretrained` (see `build_model`); the new modules are
    `abstractor.*`, `memory_blocks.{i}.memory_attention.*`, a kind's `memory_net.*` and the
    PKM layers `memory_blocks.{i}.pkm.*` (`config.pkm_layers`). A PKM layer that replaces a
    block's MLP removes it: `transformer.h.{i}.mlp` is None, and its weights in a GPT-2
    checkpoint are ignored on loading.

    Args:
        config: a `MemoriaGPT2Config`.
    """

    config_class = MemoriaGPT2Config
    config: MemoriaGPT2Config
    base_model_prefix = "transformer"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # the memory modules are expected to be missing when a plain GPT-2 checkpoint is loaded
    _keys_to_ignore_on_load_missing = [r"memory_blocks\.", r"abstractor\.", r"memory_net\."]
    _no_split_modules = ["GPT2Block", "MemoryBlock"]
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    def __init__(self, config: MemoriaGPT2Config) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        with_memory = set(config.resolved_memory_layers)
        self.memory_blocks = nn.ModuleList(MemoryBlock(config, i, i in with_memory) for i in range(config.n_layer))
        self.abstractor = None
        if "memoria" in config.memory_kinds:
            self.abstractor = Abstractor(
                dim=config.n_embd,
                num_queries=config.memoria_config.num_wm,
                ffn_dim=config.n_inner if config.n_inner is not None else 4 * config.n_embd,
                activation=config.activation_function,
                style=config.abstractor_style,
            )
        self.memory_net = memory_kind(config).build_module()  # a kind's own weights (e.g. compression), or None
        for i in config.pkm_replaced_mlps:  # the PKM layer reads ln_2 in its place (layer.py)
            self.transformer.h[i].mlp = None
        self.post_init()
        if config.pkm_replaced_mlps:  # a GPT-2 checkpoint's weights of the removed MLPs: expected, not loaded
            self._keys_to_ignore_on_load_unexpected.update(rf"(^|\.)h\.{i}\.mlp\." for i in config.pkm_replaced_mlps)
        self.memory_kind  # made now, outside any compiled forward (its settings parse is not traceable)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's init for everything; memory modules per `config.memory_init`.

        `noop`: the memory attention's output projection starts at zero, so its output is
        exactly 0 and the model is exactly the backbone (the projection still receives a
        gradient, and the rest of the memory learns once it moves). `random`: the paper's
        random init (GPT-2's scheme: N(0, 0.02), residual output projections scaled by
        1/sqrt(2 n_layer)). Abstractor queries are N(0, 1), so that at step 0 each query
        attends to a different mixture of positions and the first engrams differ. A kind's
        module with an `init_memory_weights(memory_init)` method initialises itself (after
        GPT-2's init of its submodules), as a PKM layer does (XLM's init: `pkm.ProductKeyMemory`;
        under `noop` one placed after the MLP starts with zero values, so it adds nothing).
        """
        super()._init_weights(module)
        if isinstance(module, Abstractor):
            init.normal_(module.queries, mean=0.0, std=1.0)
        elif isinstance(module, OutputProjection):
            if self.config.memory_init == "noop":
                init.zeros_(module.weight)
            else:
                std = self.config.initializer_range / math.sqrt(2 * self.config.n_layer)
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif callable(getattr(module, "init_memory_weights", None)):  # a kind's module with an init of its own
            module.init_memory_weights(self.config.memory_init)

    def memory_modules(self) -> list[nn.Module]:
        """The modules the memory adds (abstractor, memory attentions, the kind's `memory_net`, PKM
        layers); all trainable."""
        mods: list[nn.Module] = [b.memory_attention for b in self.memory_blocks if b.memory_attention is not None]
        mods += [b.engram_bias for b in self.memory_blocks if b.engram_bias is not None]
        mods += self.pkm_modules()
        own = [m for m in (self.abstractor, self.memory_net) if m is not None]
        return own + mods

    def pkm_modules(self) -> list[nn.Module]:
        """The PKM layers (`config.pkm_layers`), in block order."""
        return [b.pkm for b in self.memory_blocks if b.pkm is not None]

    def pkm_value_parameters(self) -> list[nn.Parameter]:
        """The PKM layers' value tables: the optimiser gives them a group of their own (`optim.pkm_value_lr`)."""
        return [m.values.weight for m in self.pkm_modules()]

    @property
    def kind_module(self) -> nn.Module | None:
        """The module the memory kind reads with: Memoria's abstractor, the kind's `memory_net`, or None."""
        return self.memory_net if self.memory_net is not None else self.abstractor

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    # ------------------------------------------------------------------ memory
    @property
    def memory_kind(self) -> MemoryKind:
        """The kind of memory this model runs (`recurrent.KINDS[config.memory_type]`)."""
        kind = self.__dict__.get("_memory_kind")
        if kind is None or kind.config is not self.config or kind.name != self.config.memory_type:  # (a composite's
            # name is its memory_type)
            kind = self.__dict__["_memory_kind"] = memory_kind(self.config)
        return kind

    def empty_memory(self, batch_size: int, device: torch.device | str | None = None) -> RecurrentMemory:
        """A fresh memory of this model's type for `batch_size` rows."""
        device = device if device is not None else self.transformer.wte.weight.device
        return at_fixed_addresses(self.memory_kind.empty(batch_size, device, self.dtype))

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        shift_labels: Tensor | None = None,
        memory: RecurrentMemory | None = None,
        reset: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        memory_context: MemoryRead | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        inputs_embeds: Tensor | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> MemoriaCausalLMOutput:
        """One segment for every row (one memory step), or one decoding call.

        Args:
            input_ids: (B, L) int64 tokens of this segment.
            labels: (B, L) HF convention: shifted inside the model, -100 ignored.
            shift_labels: (B, L) already aligned targets (label i is the target of
                position i), -100 ignored. At most one of `labels` / `shift_labels`.
            memory: the memory returned by the previous call; None = fresh for all rows.
                Updated in place.
            reset: (B,) bool, rows that start fresh before this segment.
            attention_mask: (B, L) (or (B, P + L) when decoding) 1 at real tokens; padded
                positions are neither attended to nor stored.
            past_key_values (`cache` from transformers 5.24) / memory_context / use_cache / logits_to_keep: used by
                `generate()`: decode within the current segment against a frozen memory
                read (`memory_context`, from `memory_context()`), no memory step.
            inputs_embeds / output_attentions / output_hidden_states: not supported
                (accepted as None/False so that peft and `generate()` can pass them).
            **kwargs: `num_items_in_batch` (loss normalisation, as HF's Trainer passes it).

        Returns:
            `MemoriaCausalLMOutput`.

        Raises:
            ValueError: inconsistent inputs (memory of another batch size or device, a
                segment longer than GPT-2's positions, both kinds of labels, ...).
        """
        past_key_values = past_key_values if past_key_values is not None else cache
        num_items_in_batch = self._check_call(labels, shift_labels, inputs_embeds, output_attentions,
                                              output_hidden_states, past_key_values, memory_context, kwargs)
        cfg, kind = self.config, self.memory_kind
        decoding = memory_context is not None
        if use_cache and past_key_values is None and (decoding or not kind.carries_state):
            past_key_values = DynamicCache(config=cfg)
        B, L = input_ids.shape
        device, dtype = input_ids.device, self.transformer.wte.weight.dtype
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        self._check_positions(past + L)

        if decoding:
            read, pending, memory = memory_context, None, None
        else:
            memory = kind.prepare(memory, B, device, dtype, reset)
            read, pending = kind.read(memory, dtype, self.kind_module)
        positions = read.positions(torch.arange(past, past + L, device=device)[None])  # (1 or B, L)
        hidden = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))  # (B, L, D)
        key_padding = attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None else None
        query_mask = key_padding[:, -L:] if key_padding is not None else None  # (B, L)
        inputs = BlockInputs(
            attention_mask=self_attention_mask(
                B, L, past, read.slot_mask, key_padding, cfg._attn_implementation, hidden.dtype, device
            ),
            memory=read.memory_inputs(query_mask, use_sdpa=cfg._attn_implementation == "sdpa"),
            cache=past_key_values,
            collect_kv=read.collects_kv and not decoding,
            collect_queries=read.collects_queries and not decoding,
            side=read if read.has_side else None,
            own_attention=read if read.replaces_attention else None,
            engram_slots=read.engram_slots,
            token_mask=query_mask,
        )
        writes, pkm_stats = BlockWrites(memory=inputs.memory), []
        engram_kv = self._engram_key_values(read.engrams)
        for i, (block, layer) in enumerate(zip(self.transformer.h, self.memory_blocks)):
            hidden, stats, *written = layer(hidden, read.engrams, engram_kv[i], *read.layer_kv(i), block=block,
                                            inputs=inputs)
            writes.add(*written)
            pkm_stats.append(stats)
        for layer, stats in zip(self.memory_blocks, pkm_stats):  # once, outside the checkpointable blocks
            if layer.pkm is not None:
                layer.pkm.update_running(stats)
        hidden = self.transformer.ln_f(hidden)  # (B, L, D)

        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))  # (B, L, V)
        loss = None
        if labels is not None or shift_labels is not None:
            if logits.shape[1] != L:
                raise ValueError("a loss needs the logits of every position (logits_to_keep=0)")
            loss = ForCausalLMLoss(
                logits, labels, cfg.vocab_size, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels
            )
        stats = None
        if not decoding:
            valid = query_mask if query_mask is not None else torch.ones(B, L, dtype=torch.bool, device=device)
            stats = kind.write(memory, read, pending, writes, hidden, valid)
            extra = kind.auxiliary_loss(pending)
            if extra is not None and loss is not None:
                loss = loss + extra
        return MemoriaCausalLMOutput(
            loss=loss,
            logits=logits,
            memory=memory,
            memory_stats=stats,
            **{OUTPUT_CACHE: past_key_values if decoding or use_cache else None},
        )

    def _engram_key_values(self, engrams: Tensor | None) -> list[Tensor | None]:
        """Per block, the engrams' keys and values for its memory attention, every block's in one
        projection (`memory_attention.engram_key_values`), or None: the block projects them itself."""
        out: list[Tensor | None] = [None] * len(self.memory_blocks)
        with_attention = [i for i, b in enumerate(self.memory_blocks) if b.memory_attention is not None]
        if engrams is None or not with_attention:
            return out
        fused = engram_key_values([self.memory_blocks[i].memory_attention for i in with_attention], engrams)
        for i, kv in zip(with_attention, fused or ()):
            out[i] = kv
        return out

    def _check_call(self, labels, shift_labels, inputs_embeds, output_attentions, output_hidden_states,
                    past_key_values, memory_context, kwargs: dict[str, Any]) -> Any:
        """Refuse what `forward` does not support; returns `num_items_in_batch` (HF's Trainer)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("cache_position", None)
        if kwargs:
            raise TypeError(f"unexpected argument(s) {sorted(kwargs)}")
        if inputs_embeds is not None or output_attentions or output_hidden_states:
            raise ValueError(
                "pass `input_ids`; inputs_embeds / output_attentions / output_hidden_states are not supported"
            )
        if labels is not None and shift_labels is not None:
            raise ValueError("pass `labels` (shifted inside) or `shift_labels` (already aligned), not both")
        if past_key_values is not None and memory_context is None and self.memory_kind.carries_state:
            raise ValueError("`past_key_values` is for decoding inside generate(); segments pass `memory` instead")
        return num_items_in_batch

    def _check_positions(self, used: int) -> None:
        cfg = self.config
        if used > cfg.positions_per_segment:
            banks = " (half of n_positions: `xl_positions='alternate'`)" if cfg.position_banks > 1 else ""
            raise ValueError(
                f"{used} positions in this segment exceed the {cfg.positions_per_segment} a segment may use"
                f"{banks}; GPT-2's n_positions={cfg.n_positions}. Use shorter segments"
            )


AutoConfig.register(MemoriaGPT2Config.model_type, MemoriaGPT2Config, exist_ok=True)
AutoModel.register(MemoriaGPT2Config, MemoriaGPT2LMHeadModel, exist_ok=True)
AutoModelForCausalLM.register(MemoriaGPT2Config, MemoriaGPT2LMHeadModel, exist_ok=True)

__all__ = ["MemoriaGPT2LMHeadModel", "MemoriaCausalLMOutput"]
