"""One GPT-2 block run through its own (unmodified) submodules, with the memory inserted.

Why this shape (and not forward hooks or a copied block): the memory attention goes
*between* a block's self-attention residual and its MLP (the authors' order), which no
hook on an HF `GPT2Block` can reach without re-deriving its residual stream. So each block
is driven here through its submodules, in HF's own order and arithmetic:

    h = attn(ln_1(h)) + h        # HF's GPT2Attention (SDPA or eager; LoRA-wrapped c_attn/c_proj work);
                                 # or a kind's own in its place (`MemoryRead.block_attention`: `memorizing`)
    h = memory_attention(h, ...) # Memoria only: + WM residual, + M_rem residual
    h = h + mlp(ln_2(h))         # HF's GPT2MLP; or, in a block of `pkm_layers` (any kind, `model/pkm.py`):
                                 #   h = h + pkm(ln_2(h))               placement "replace" (no MLP), or
                                 #   h = h + mlp(ln_2(h)); h = h + pkm(h)   "after" (pkm's own layer norm)

Every parameter is still called through its own module, so ZeRO-3's per-module gather
hooks, peft's LoRA layers and HF's weight names are untouched. One exception: the engrams'
key/value projections of all blocks run as one matmul before the blocks
(`memory_attention.engram_key_values`; not where peft wraps one; ZeRO-3 gathers weights read
outside their module by itself). `MemoryBlock` is a
`GradientCheckpointingLayer`: `model.gradient_checkpointing_enable()` checkpoints it, and
since the memory step (remind before the blocks, memorize after) lies outside it, the
recompute in backward never touches the memory. What the engrams' reads attended with and the keys/values
that Transformer-XL caches, and a PKM layer's query batch statistics, are *returned* (never
stored as a side effect), so a recompute cannot double-count them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from .config import MemoriaGPT2Config
from .memory_attention import MemoryAttention, MemoryInputs, RemindedRead
from .pkm import ProductKeyMemory
from .recurrent.base import MemoryRead
from .extended_attention import ExtendedKeyValues
from .hf_compat import ATTENTION_CACHE, self_attention_with_queries


@dataclass
class BlockInputs:
    """What every block reads in one forward.

    Attributes:
        attention_mask: the self-attention mask (`extended_attention.self_attention_mask`), None for SDPA's causal path.
        memory: Memoria's per-forward inputs, or None.
        cache: HF decode cache of the current segment (generation), or None.
        collect_kv: return this segment's keys/values (Transformer-XL builds its next memory from them).
        collect_queries: return this segment's self-attention queries too (a kind's training loss uses them).
        side: a read whose `side_attention` adds to every block's self-attention output (the
            infinity-former's long-term memory), or None.
        own_attention: the read whose `block_attention` may replace a block's self-attention
            (`MemoryRead.replaces_attention`), or None.
        engram_slots: the engrams are key/value slots of every block's self-attention
            (Memoria's `memory_read="self_attention"`; their mask is the attention mask's first
            slots), not read by a memory cross-attention.
        token_mask: (B, L) bool, True at the segment's real tokens (a PKM layer's query batch
            norm takes its training statistics over them), or None (every token is real).
    """

    attention_mask: Tensor | None
    memory: MemoryInputs | None
    cache: Cache | None
    collect_kv: bool
    collect_queries: bool = False
    side: MemoryRead | None = None
    own_attention: MemoryRead | None = None
    engram_slots: bool = False
    token_mask: Tensor | None = None


class SlotBias(nn.Module):
    """A block's learned per-head bias on the engram slots' attention logits (`engram_bias`)."""

    def __init__(self, num_heads: int, start: float) -> None:
        super().__init__()
        self.start = float(start)
        self.bias = nn.Parameter(torch.full((num_heads,), self.start))

    @torch.no_grad()
    def init_memory_weights(self, memory_init: str) -> None:
        """The model's init (`_init_weights`): the configured start, under either `memory_init`."""
        self.bias.fill_(self.start)


class MemoryBlock(GradientCheckpointingLayer):
    """The per-block wrapper. It owns the memory attention (if this block has one), the engram
    slots' bias (`engram_bias`) and the PKM layer (a block of `pkm_layers`).

    Args:
        config: the model config.
        layer_idx: index of the wrapped block.
        with_memory_attention: whether this block gets a memory cross-attention.
    """

    def __init__(self, config: MemoriaGPT2Config, layer_idx: int, with_memory_attention: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.memory_attention = (
            MemoryAttention(
                dim=config.n_embd,
                num_heads=config.resolved_memory_heads,
                inner_dim=config.resolved_memory_inner_dim,
                mode=config.memory_attention_mode,
                eps=config.layer_norm_epsilon,
                attn_dropout=config.attn_pdrop,
                resid_dropout=config.resid_pdrop,
            )
            if with_memory_attention
            else None
        )
        # `engram_bias` (memory_read="self_attention"): a learned per-head bias on the engram slots' logits
        self.engram_bias = (SlotBias(config.n_head, config.engram_bias)
                            if "memoria" in config.memory_kinds and config.engram_bias is not None else None)
        pkm = config.pkm_settings if layer_idx in (config.pkm_layers or ()) else None
        self.pkm = ProductKeyMemory(config.n_embd, pkm, eps=config.layer_norm_epsilon) if pkm is not None else None
        self.pkm_replaces_mlp = pkm is not None and pkm.placement == "replace"

    def forward(
        self,
        hidden: Tensor,
        engrams: Tensor | None,
        engram_kv: Tensor | None,
        memory_keys: Tensor | None,
        memory_values: Tensor | None,
        *,
        block: GPT2Block,
        inputs: BlockInputs,
    ) -> tuple[Tensor | None, ...]:
        """Run `block` with the memory.

        Tensors that may need gradients are positional (reentrant checkpointing only
        tracks those).

        Args:
            hidden: (B, L, D) residual stream.
            engrams: (B, N + R, D) working memory then reminded engrams (Memoria), or None.
            engram_kv: (2, B, H', N + R, hd') their keys and values for this block's memory attention,
                projected for every block at once (`memory_attention.engram_key_values`), or None.
            memory_keys / memory_values: (B, H, M, hd) Transformer-XL memory of this block, or None.
            block: the HF `GPT2Block` at this index (not owned: its weights keep HF's names).
            inputs: the per-forward inputs.

        Returns:
            hidden (B, L, D); the PKM layer's query batch statistics (training; the model applies
            them once, `ProductKeyMemory.update_running`, so a recompute does not) or None;
            what this block's read of the reminded engrams attended with
            (`RemindedRead`: their contribution is computed for all blocks at once) or None;
            this segment's keys and values (B, H, L, hd) if
            `inputs.collect_kv`, else None.
        """
        attention_mask = inputs.attention_mask
        engram_keys = None
        if inputs.engram_slots and engrams is not None:  # projected as this block projects its tokens
            engram_keys, engram_values = engram_key_values(block, engrams)  # (B, H, N + R, hd)
            if memory_keys is not None:  # a cache beside them (`xl+memoria`): the engram slots first
                memory_keys = torch.cat([engram_keys, memory_keys.to(engram_keys.dtype)], dim=2)
                memory_values = torch.cat([engram_values, memory_values.to(engram_values.dtype)], dim=2)
            else:
                memory_keys, memory_values = engram_keys, engram_values
            if self.engram_bias is not None and attention_mask is not None:
                attention_mask = biased_slot_mask(attention_mask, self.engram_bias.bias, engram_keys.shape[2],
                                                  hidden.dtype)
        kv = None
        if inputs.collect_kv or memory_keys is not None or inputs.cache is not None:
            kv = ExtendedKeyValues(memory_keys, memory_values, inputs.cache)
        residual = hidden
        engram_weights = engram_keys is not None and inputs.memory is not None
        # GPT2Attention keeps its queries: where they are needed, its steps run here (no hook: a graph break)
        wants_queries = inputs.collect_queries or inputs.side is not None or engram_weights
        normed, attn_output, heads = block.ln_1(hidden), None, None  # heads: (B, H, L, hd) queries
        if inputs.own_attention is not None:  # a kind's attention in place of this block's (`memorizing`)
            kv = kv if kv is not None else ExtendedKeyValues(None, None, None)
            attn_output = inputs.own_attention.block_attention(self.layer_idx, block.attn, normed,
                                                               inputs.attention_mask, kv)
        if attn_output is None and wants_queries:
            attn_output, heads = self_attention_with_queries(block.attn, normed, attention_mask, kv)
        elif attn_output is None:
            attn_output, _ = block.attn(normed, attention_mask=attention_mask, **{ATTENTION_CACHE: kv})
        side: tuple[Tensor, ...] = ()
        if inputs.side is not None:
            extra, side = inputs.side.side_attention(self.layer_idx, residual, heads)
            attn_output = attn_output + extra
        hidden = attn_output + residual
        reminded = None
        if engram_weights and heads is not None:
            reminded = reminded_read(block, heads, engram_keys, inputs.memory)
        if self.memory_attention is not None:
            hidden, reminded = self.memory_attention(hidden, engrams, inputs.memory, engram_kv)
        residual, pkm_stats = hidden, None
        if self.pkm_replaces_mlp:  # the paper's: the memory in place of the feed-forward network
            read, pkm_stats = self.pkm(block.ln_2(hidden), inputs.token_mask)
            hidden = residual + read
        else:
            hidden = residual + block.mlp(block.ln_2(hidden))
            if self.pkm is not None:  # after the MLP, read through its own layer norm
                read, pkm_stats = self.pkm(hidden, inputs.token_mask)
                hidden = hidden + read
        query = heads.detach() if heads is not None and inputs.collect_queries else None
        if inputs.collect_kv and kv is not None and kv.current is not None:
            return hidden, pkm_stats, reminded, kv.current[0].detach(), kv.current[1].detach(), query, *side
        return hidden, pkm_stats, reminded, None, None, query, *side


def engram_key_values(block: GPT2Block, engrams: Tensor) -> tuple[Tensor, Tensor]:
    """(B, H, E, hd) keys and values of the engrams as `block`'s self-attention makes its tokens'
    (its `ln_1` and `c_attn`, LoRA included): they join the tokens' keys in one softmax."""
    attn = block.attn
    _, keys, values = attn.c_attn(block.ln_1(engrams)).split(attn.split_size, dim=-1)  # (B, E, D) each
    B, E, _ = keys.shape
    return tuple(t.view(B, E, -1, attn.head_dim).transpose(1, 2) for t in (keys, values))  # type: ignore[return-value]


def biased_slot_mask(mask: Tensor, bias: Tensor, slots: int, dtype: torch.dtype) -> Tensor:
    """The self-attention mask with a per-head bias on the first `slots` keys (the engram slots).

    Args:
        mask: (B or 1, 1, Q, K) bool (True = attend; SDPA) or additive float (eager), over
            [engram slots, decode cache, segment] (`extended_attention.self_attention_mask`).
        bias: (H,) the block's learned `engram_bias`.

    Returns:
        (B or 1, H, Q, K) additive float mask in `dtype`: the bias on allowed slot keys, 0 on
        allowed others, dtype's minimum where `mask` forbids (gradients reach `bias`).
    """
    H, K = bias.shape[0], mask.shape[-1]
    per_key = torch.cat([bias.to(dtype)[:, None].expand(H, slots),
                         torch.zeros(H, K - slots, dtype=dtype, device=bias.device)], dim=1)  # (H, K)
    add = per_key[None, :, None, :]  # (1, H, 1, K)
    if mask.dtype == torch.bool:
        return torch.where(mask, add, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device))
    return (mask + add).clamp(min=torch.finfo(dtype).min)


def reminded_read(block: GPT2Block, queries: Tensor, keys: Tensor, mem: MemoryInputs) -> RemindedRead | None:
    """What the segment's queries (B, H, L, hd) read of the reminded engrams among `keys` (B, H, N + R,
    hd), for their contribution over the reminded engrams alone, as the paper's memory attention gives
    it (`memory_attention.contribution`, fp32, no gradient). None when no engram is reminded."""
    R = mem.reminded_mask.shape[1]
    if not R:
        return None
    attn = block.attn
    scale = attn.head_dim**-0.5 if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        scale /= attn.layer_idx + 1
    N = keys.shape[2] - R
    return RemindedRead(queries=queries.detach().float(), keys=keys[:, :, N:].detach().float(), scale=scale)


__all__ = ["MemoryBlock", "BlockInputs", "SlotBias", "biased_slot_mask", "engram_key_values", "reminded_read"]
