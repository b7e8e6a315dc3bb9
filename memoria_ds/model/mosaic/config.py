"""MemoryMosaicConfig: the GPT-2-like Memory Mosaic of Zhang et al. (2024), Section 5, Figure 8.

The config *is* a `MemoriaGPT2Config` (so a `GPT2Config`): the run's machinery (the memory
protocol, the launcher's checks, export) reads it as it reads every model's, and a
from-scratch GPT-2 shape (`n_embd`, `n_layer`, `n_head`, `vocab_size`) gives the Memory
Mosaic of that shape. What the GPT-2 fields mean here:

    n_embd, n_head, n_layer, vocab_size   as in GPT-2 (N_c = N_p = n_head memory units per block)
    n_positions      the longest segment (there is no position embedding: the Memory Mosaic has none)
    n_inner          sizes the persistent memories by default (`pmem_size`, below)
    embd_pdrop       dropout after the token embedding
    attn_pdrop       dropout on the contextual and persistent memories' attention scores
    resid_pdrop      dropout on each memory layer's output (before the residual addition)
    layer_norm_epsilon, initializer_range   as in GPT-2 (1e-5, 0.02: the reference's values)

The other GPT-2 fields (activation_function, scale_attn_*, ...) are not read.

Added fields (names and defaults of the reference `nanoMosaics/mosaic_model.py`):

    pmem_size    key/value slots of each persistent memory unit; None = n_inner - n_embd / 2
                 (3.5 * n_embd, 2688 at n_embd = 768, the paper's value): a block then has the
                 weight count of the GPT-2 block of the same shape (5 d^2 + 2 d pmem_size =
                 4 d^2 + 2 d n_inner, biases and norms aside)
    pmem_count   persistent memories per unit, averaged (1)
    bias         biases in the linear layers and layer norms (True, as GPT-2 and the reference)
    mosaic_memory_length   with `memory_type="mosaic"` (preset `memory_mosaic_carry`): the
                 contextual memory's pairs carried to the next segment (None: one segment's);
                 `memory_type="none"` (preset `memory_mosaic`, the paper's) carries nothing
"""

from __future__ import annotations

import math
from typing import Any

from huggingface_hub.dataclasses import strict

from ...setting_rules import SettingError
from ..config import MemoriaGPT2Config

# The presets `build_model` builds as a Memory Mosaic (each also in `config.PRESETS`).
MOSAIC_PRESETS = frozenset({"memory_mosaic", "memory_mosaic_carry"})
# Settings only a Memory Mosaic reads.
MOSAIC_FIELDS = frozenset({"pmem_size", "pmem_count", "bias", "mosaic_memory_length"})

# The reference's parametrisation of its per-head scalars: a stored p means exp(EXP_SCALING * p)
# (or EXP_SCALING * |p| for the leak rate), so AdamW moves them EXP_SCALING times faster.
EXP_SCALING = 10.0
# The key scale's upper bound, log(2**16 - 1): scaled keys fit in fp16 (the reference's).
KEY_SCALE_MAX = math.log(2**16 - 1)
# Initial values (the reference's): leak rates from 0.5 to 5 across heads, key scale e,
# value and output scales exp(-0.5).
LEAK_INIT = (0.5, 5.0)
KEY_SCALE_INIT = 1.0
VALUE_SCALE_INIT = -0.5
# Added to a norm before dividing by it (the reference's): a zero vector stays zero.
NORM_EPS = 1e-10


@strict
class MemoryMosaicConfig(MemoriaGPT2Config):
    """A Memory Mosaic language model's settings (module docstring: what each field means).

    Args:
        pmem_size: slots of each persistent memory unit; None = `n_inner - n_embd // 2`.
        pmem_count: persistent memories per unit (their outputs are averaged).
        bias: biases in linear layers and layer norms.
        mosaic_memory_length: pairs carried across segments by the `mosaic` memory kind (None: one segment's).
    """

    model_type = "memory_mosaic"

    memory_type: str = "none"
    pmem_size: int | None = None
    pmem_count: int = 1
    bias: bool = True
    mosaic_memory_length: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.pmem_size is None:
            inner = self.n_inner if self.n_inner is not None else 4 * self.n_embd
            self.pmem_size = inner - self.n_embd // 2
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Part of the `@strict` validation: the mosaic's own settings (their types and ranges by their
        rules, `config.SETTING_RULES`), each mistake a `SettingError` naming the setting."""
        super().validate_architecture()
        if self.n_embd % self.n_head:
            raise SettingError("n_head", f"({self.n_head}) must divide `n_embd` ({self.n_embd})")
        if self.memory_type not in ("none", "mosaic"):
            raise SettingError("memory_type", f"of a Memory Mosaic is 'none' (each segment alone, the paper's) or "
                               f"'mosaic' (its contextual memory carried), got {self.memory_type!r}")
        if self.pkm_layers:
            raise SettingError("pkm_layers", f"({self.pkm_layers}): PKM layers replace or follow a GPT-2 block's MLP; "
                               f"a Memory Mosaic's blocks have a persistent memory in its place and take none "
                               f"(leave `pkm_layers` unset)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


__all__ = ["MemoryMosaicConfig", "MOSAIC_PRESETS", "MOSAIC_FIELDS", "EXP_SCALING", "KEY_SCALE_MAX"]
