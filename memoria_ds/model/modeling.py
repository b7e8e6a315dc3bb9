"""Memoria GPT-2 (and the `transformer` / `xl` baseline presets) around an unmodified HF GPT-2.

Contract 2 (docs/design.md):

    out = model(input_ids, labels=None, shift_labels=None, memory=None, reset=None)
    out.loss, out.logits, out.memory, out.memory_stats

One forward of the `memoria` type is one memory step, for all rows at once:

    1. reset the rows in `reset`; rows with no previous segment have no working memory
    2. WM = abstractor(h_{t-1})                  (differentiable; h_{t-1} is detached)
    3. retrieval = remind(state, WM)            (engine; writes WM, no gradient)
    4. blocks: self-attention -> memory attention (WM, then M_rem) -> MLP
    5. memorize(state, retrieval, mean contribution over blocks)   (engine)
    6. h_t = ln_f output, detached, kept as fp32 for the next step

Steps 2-3 and 5-6 run outside the (checkpointable) blocks, exactly once per forward. The
memory is updated in place and returned as `out.memory`.

Notation: B rows, L tokens in the segment, D width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
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

from ..memory import MemoryStats, memorize, remind
from .abstractor import Abstractor
from .config import MemoriaGPT2Config
from .generation import MemoriaContext, MemoryGenerationMixin
from .layer import BlockInputs, MemoryBlock
from .memory_attention import MemoryInputs, OutputProjection
from .state import MemoriaMemory, NoMemory, RecurrentMemory, XLMemory
from .xl import roll_memory, self_attention_mask


@dataclass
class MemoriaCausalLMOutput(ModelOutput):
    """Output of `MemoriaGPT2LMHeadModel.forward`.

    Attributes:
        loss: mean next-token cross-entropy over non-ignored targets (if labels were given).
        logits: (B, L, V) (or the last `logits_to_keep` positions).
        memory: the recurrent memory after this segment (the object passed in, updated in
            place; a new one if None was passed). None during decoding in `generate()`.
        memory_stats: the engine's `MemoryStats` of this step (`memoria` only); rows that
            had no previous segment report an empty memory.
        past_key_values: the decode cache (generation only).
    """

    loss: Tensor | None = None
    logits: Tensor | None = None
    memory: RecurrentMemory | None = None
    memory_stats: MemoryStats | None = None
    past_key_values: Cache | None = None


class MemoriaGPT2LMHeadModel(GPT2PreTrainedModel, MemoryGenerationMixin):
    """GPT-2 LM with a memory: `none` (plain), `xl` (Transformer-XL) or `memoria`.

    Weight names of the backbone are HF's (`transformer.*`, `lm_head.weight`), so any GPT-2
    checkpoint loads by `from_pretrained` (see `build_model`); the new modules are
    `abstractor.*` and `memory_blocks.{i}.memory_attention.*`.

    Args:
        config: a `MemoriaGPT2Config`.
    """

    config_class = MemoriaGPT2Config
    config: MemoriaGPT2Config
    base_model_prefix = "transformer"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # the memory modules are expected to be missing when a plain GPT-2 checkpoint is loaded
    _keys_to_ignore_on_load_missing = [r"memory_blocks\.", r"abstractor\."]
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
        if config.memory_type == "memoria":
            self.abstractor = Abstractor(
                dim=config.n_embd,
                num_queries=config.memoria_config.num_wm,
                ffn_dim=config.n_inner if config.n_inner is not None else 4 * config.n_embd,
                activation=config.activation_function,
                style=config.abstractor_style,
            )
        self.post_init()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's init for everything; memory modules per `config.memory_init`.

        `noop`: the memory attention's output projection starts at zero, so its output is
        exactly 0 and the model is exactly the backbone (the projection still receives a
        gradient, and the rest of the memory learns once it moves). `random`: the paper's
        random init (GPT-2's scheme: N(0, 0.02), residual output projections scaled by
        1/sqrt(2 n_layer)). Abstractor queries are N(0, 1), so that at step 0 each query
        attends to a different mixture of positions and the first engrams differ.
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
            init.zeros_(module.bias)

    def memory_modules(self) -> list[nn.Module]:
        """The modules Memoria adds (abstractor and memory attentions); all trainable."""
        mods: list[nn.Module] = [b.memory_attention for b in self.memory_blocks if b.memory_attention is not None]
        return ([self.abstractor] if self.abstractor is not None else []) + mods

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    # ------------------------------------------------------------------ memory objects
    def empty_memory(self, batch_size: int, device: torch.device | str | None = None) -> RecurrentMemory:
        """A fresh memory of this model's type for `batch_size` rows."""
        cfg = self.config
        device = device if device is not None else self.transformer.wte.weight.device
        if cfg.memory_type == "memoria":
            return MemoriaMemory.empty(cfg.memoria_config, batch_size, cfg.n_embd, device=device)
        if cfg.memory_type == "xl":
            return XLMemory.empty(
                batch_size, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, 0, device=device, dtype=self.dtype
            )
        return NoMemory.empty(batch_size)

    def _prepare_memory(
        self, memory: RecurrentMemory | None, batch_size: int, device: torch.device, reset: Tensor | None
    ):
        expected = {"memoria": MemoriaMemory, "xl": XLMemory, "none": NoMemory}[self.config.memory_type]
        if memory is None:
            return self.empty_memory(batch_size, device)
        if not isinstance(memory, expected):
            raise TypeError(
                f"a `{self.config.memory_type}` model takes a {expected.__name__}, got {type(memory).__name__}"
            )
        if memory.batch_size != batch_size:
            raise ValueError(
                f"memory holds {memory.batch_size} rows but the batch has {batch_size}; use take_rows/put_rows"
            )
        if not isinstance(memory, NoMemory) and memory.device != device:
            raise ValueError(
                f"memory is on {memory.device} but the inputs are on {device}; call memory.to({str(device)!r})"
            )
        if isinstance(memory, MemoriaMemory):
            memory.state.check(self.config.memoria_config)
        if reset is not None:
            if reset.shape != (batch_size,):
                raise ValueError(f"`reset` must be a ({batch_size},) bool mask, got shape {tuple(reset.shape)}")
            memory.reset(reset)
        return memory

    def _read_memory(self, memory: MemoriaMemory, dtype: torch.dtype) -> tuple[MemoriaContext, Any]:
        """Steps 2-3: working memory (with gradient) and the engine's retrieval (in place)."""
        active = memory.has_previous  # (B,)
        wm = self.abstractor(memory.prev_hidden.to(dtype), memory.prev_mask)  # (B, N, D)
        retrieval = remind(memory.state, wm, self.config.memoria_config)
        mask = retrieval.reminded_mask & active[:, None]  # (B, R)
        ctx = MemoriaContext(wm, active, retrieval.reminded.to(dtype), mask, mask.any(dim=1))
        return ctx, retrieval

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
        memory_context: MemoriaContext | XLMemory | None = None,
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
            past_key_values / memory_context / use_cache / logits_to_keep: used by
                `generate()`: decode within the current segment against a frozen memory
                read (`memory_context`), no memory step.
            inputs_embeds / output_attentions / output_hidden_states: not supported
                (accepted as None/False so that peft and `generate()` can pass them).
            **kwargs: `num_items_in_batch` (loss normalisation, as HF's Trainer passes it).

        Returns:
            `MemoriaCausalLMOutput`.

        Raises:
            ValueError: inconsistent inputs (memory of another batch size or device, a
                segment longer than GPT-2's positions, both kinds of labels, ...).
        """
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
        cfg = self.config
        decoding = memory_context is not None
        if past_key_values is not None and not decoding and cfg.memory_type != "none":
            raise ValueError("`past_key_values` is for decoding inside generate(); segments pass `memory` instead")
        if use_cache and past_key_values is None and (decoding or cfg.memory_type == "none"):
            past_key_values = DynamicCache(config=cfg)
        B, L = input_ids.shape
        device = input_ids.device
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if past + L > cfg.positions_per_segment:
            banks = " (half of n_positions: `xl_positions='alternate'`)" if cfg.position_banks > 1 else ""
            raise ValueError(
                f"{past + L} positions in this segment exceed the {cfg.positions_per_segment} a segment may use"
                f"{banks}; GPT-2's n_positions={cfg.n_positions}. Use shorter segments"
            )

        xl: XLMemory | None = None
        if cfg.memory_type == "xl":
            xl = memory_context if decoding else self._prepare_memory(memory, B, device, reset)
        positions = torch.arange(past, past + L, device=device)[None]  # (1, L)
        if xl is not None and cfg.position_banks > 1:  # this segment's bank: the other one than the cached segment's
            positions = positions + (xl.segments % cfg.position_banks)[:, None] * cfg.positions_per_segment  # (B, L)
        hidden = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))  # (B, L, D)
        dtype = hidden.dtype
        key_padding = attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None else None
        query_mask = key_padding[:, -L:] if key_padding is not None else None  # (B, L)

        ctx: MemoriaContext | None = None
        retrieval = None
        if cfg.memory_type == "memoria":
            if decoding:
                ctx = memory_context
            else:
                memory = self._prepare_memory(memory, B, device, reset)
                ctx, retrieval = self._read_memory(memory, dtype)
        elif cfg.memory_type == "xl":
            memory = None if decoding else xl
        elif not decoding:
            memory = self._prepare_memory(memory, B, device, reset)

        mem_inputs = None
        if ctx is not None:
            mem_inputs = MemoryInputs(
                ctx.wm_active,
                ctx.reminded_mask,
                ctx.reminded_active,
                query_mask,
                use_sdpa=cfg._attn_implementation == "sdpa",
            )
        inputs = BlockInputs(
            attention_mask=self_attention_mask(
                B, L, past, xl.mask if xl is not None else None, key_padding, cfg._attn_implementation, dtype, device
            ),
            memory=mem_inputs,
            cache=past_key_values,
            collect_kv=cfg.memory_type == "xl" and not decoding,
        )
        engrams = None  # (B, N + R, D): WM (with the abstractor's gradient), then the reminded constants
        if ctx is not None:
            engrams = torch.cat([ctx.wm, ctx.reminded], dim=1) if ctx.reminded.shape[1] else ctx.wm
        weights, new_keys, new_values = [], [], []
        for i, (block, layer) in enumerate(zip(self.transformer.h, self.memory_blocks)):
            mem_k = xl.keys[:, i] if xl is not None and xl.length else None  # (B, H, M, hd)
            mem_v = xl.values[:, i] if xl is not None and xl.length else None
            hidden, w, k, v = layer(hidden, engrams, mem_k, mem_v, block=block, inputs=inputs)
            if w is not None:
                weights.append(w)
            if k is not None:
                new_keys.append(k)
                new_values.append(v)
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
            if cfg.memory_type == "memoria":
                stats = self._write_memoria(memory, ctx, retrieval, weights, hidden, valid)
            elif cfg.memory_type == "xl":
                self._write_xl(xl, new_keys, new_values, valid)
        return MemoriaCausalLMOutput(
            loss=loss,
            logits=logits,
            memory=None if decoding else memory,
            memory_stats=stats,
            past_key_values=past_key_values if decoding or use_cache else None,
        )

    # ------------------------------------------------------------------ memory writes
    def _write_memoria(
        self,
        memory: MemoriaMemory,
        ctx: MemoriaContext,
        retrieval,
        weights: list[Tensor],
        hidden: Tensor,
        valid: Tensor,
    ) -> MemoryStats:
        """Steps 5-6: memorize with the mean contribution over blocks; keep h_t."""
        mcfg = self.config.memoria_config
        if weights:
            contribution = torch.stack(weights).mean(dim=0)  # (B, R)
        else:
            contribution = torch.zeros(retrieval.reminded_slots.shape, device=hidden.device)
        stats = memorize(memory.state, retrieval, contribution, mcfg)
        # rows without a previous segment wrote a placeholder WM: return them to fresh
        memory.state.reset(~ctx.wm_active)
        memory.prev_hidden = hidden.detach().to(torch.float32, copy=True)  # a copy: never aliases the graph
        memory.prev_mask = valid.clone()
        return _gate_stats(stats, ctx.wm_active, memory.state.capacity)

    def _write_xl(self, xl: XLMemory, keys: list[Tensor], values: list[Tensor], valid: Tensor) -> None:
        length = self.config.xl_memory_length or valid.shape[1]
        old_k = [xl.keys[:, i] if xl.length else None for i in range(len(keys))]
        old_v = [xl.values[:, i] if xl.length else None for i in range(len(keys))]
        rolled_k = [roll_memory(m, xl.mask, k, valid, length) for m, k in zip(old_k, keys)]
        rolled_v = [roll_memory(m, xl.mask, v, valid, length)[0] for m, v in zip(old_v, values)]
        xl.keys = torch.stack([k for k, _ in rolled_k], dim=1)  # (B, Y, H, M, hd)
        xl.values = torch.stack(rolled_v, dim=1)
        xl.mask = rolled_k[0][1]
        xl.segments = xl.segments + 1


def _gate_stats(stats: MemoryStats, active: Tensor, capacity: int) -> MemoryStats:
    """Rows that had no previous segment took no memory step: report an empty memory."""
    empty = torch.zeros_like(stats.engrams)
    empty[:, 0] = capacity
    nan = torch.full_like(stats.reminded_ltm_age, float("nan"))
    return dataclasses.replace(
        stats,
        engrams=torch.where(active[:, None], stats.engrams, empty),
        evicted=torch.where(active, stats.evicted, 0),
        reminded_stm=torch.where(active, stats.reminded_stm, 0),
        reminded_ltm=torch.where(active, stats.reminded_ltm, 0),
        found_ltm=torch.where(active, stats.found_ltm, 0),
        reminded_ltm_age=torch.where(active, stats.reminded_ltm_age, nan),
        lifespan_mean=torch.where(active, stats.lifespan_mean, nan),
        lifespan_max=torch.where(active, stats.lifespan_max, 0.0),
    )


AutoConfig.register(MemoriaGPT2Config.model_type, MemoriaGPT2Config, exist_ok=True)
AutoModel.register(MemoriaGPT2Config, MemoriaGPT2LMHeadModel, exist_ok=True)
AutoModelForCausalLM.register(MemoriaGPT2Config, MemoriaGPT2LMHeadModel, exist_ok=True)

__all__ = ["MemoriaGPT2LMHeadModel", "MemoriaCausalLMOutput"]
