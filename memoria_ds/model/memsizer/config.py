"""MemSizerConfig: a GPT-2-shaped decoder whose attention is MemSizer's (Zhang & Cai 2022).

The config *is* a `MemoriaGPT2Config` (so a `GPT2Config`): the run's machinery (the memory
protocol, the launcher's checks, export) reads it as it reads every model's, and a
from-scratch GPT-2 shape (`n_embd`, `n_layer`, `n_head`, `vocab_size`) gives the MemSizer
of that shape. What the GPT-2 fields mean here:

    n_embd, n_layer, vocab_size   as in GPT-2
    n_head           the query's heads: each head's softmax over the slots, averaged (the reference's
                     `decoder_attention_heads`); keys and values have none
    n_positions      the longest segment (positions are sinusoids of the token's place in its
                     stream, computed, not a table)
    n_inner, activation_function   the MLP (GPT-2's: 4 * n_embd, gelu_new)
    embd_pdrop       dropout after the embedding (and positions)
    attn_pdrop       dropout on each head's slot distribution softmax(Phi x), before the heads' mean
    resid_pdrop      dropout on the attention's and the MLP's outputs (before the residual addition)
    layer_norm_epsilon, initializer_range   as in GPT-2 (1e-5, the reference's too; 0.02 for the MLP)

The other GPT-2 fields (scale_attn_*, ...) are not read.

Added fields (the reference's names and defaults, `src/memsizer_lm.py` of jcyk/memsizer):

    memsizer_slots   k, the key-value memory's slots per layer (32: the reference's WikiText-103
                     language model, `--causal-proj-dim 32`)
    q_init_scale     Phi's initialisation: Xavier uniform with gain q_init_scale ** -0.5 (32)
    kv_init_scale    the key and value projections' initialisation: gain kv_init_scale ** -0.5 (1)
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from ...setting_rules import SettingError
from ..config import MemoriaGPT2Config

# The presets `build_model` builds as a MemSizer (each also in `config.PRESETS`).
MEMSIZER_PRESETS = frozenset({"memsizer", "memsizer_carry"})
# Settings only a MemSizer reads.
MEMSIZER_FIELDS = frozenset({"memsizer_slots", "q_init_scale", "kv_init_scale"})
# fairseq numbers a stream's tokens from padding_idx + 1 = 2 (`utils.make_positions`, its dictionaries'
# pad index 1): the reference's first token has the sinusoid of position 2
POSITION_OFFSET = 2


@strict
class MemSizerConfig(MemoriaGPT2Config):
    """A MemSizer language model's settings (module docstring: what each field means).

    Args:
        memsizer_slots: k, slots of each layer's key-value memory.
        q_init_scale: Phi (the query projection) starts Xavier uniform with gain q_init_scale ** -0.5.
        kv_init_scale: the key and value projections start Xavier uniform with gain kv_init_scale ** -0.5.
    """

    model_type = "memsizer"

    memory_type: str = "none"
    memsizer_slots: int = 32
    q_init_scale: float = 32.0
    kv_init_scale: float = 1.0

    def validate_architecture(self) -> None:
        """Part of the `@strict` validation: the MemSizer's own settings (their types and ranges by their
        rules, `config.SETTING_RULES`), each mistake a `SettingError` naming the setting."""
        super().validate_architecture()
        if self.memory_type not in ("none", "memsizer"):
            raise SettingError("memory_type", f"of a MemSizer is 'none' (its memory read segment by segment, "
                               f"the reference's training) or 'memsizer' (its memory carried across segments), "
                               f"got {self.memory_type!r}")
        if self.n_embd < 4:
            raise SettingError("n_embd", f"({self.n_embd}) must be at least 4: the sinusoidal positions need "
                               f"two frequencies per half")
        if self.pkm_layers:
            raise SettingError("pkm_layers", f"({self.pkm_layers}): PKM layers are a Memoria GPT-2's option; a "
                               f"MemSizer takes none (leave `pkm_layers` unset)")

    @property
    def query_width(self) -> int:
        """Phi's outputs: n_head heads of memsizer_slots logits."""
        return self.n_head * self.memsizer_slots


__all__ = ["MemSizerConfig", "MEMSIZER_PRESETS", "MEMSIZER_FIELDS", "POSITION_OFFSET"]
