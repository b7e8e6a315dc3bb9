"""The reference implementation's weights as ours (`nanoMosaics/mosaic_model.py`, facebookresearch/MemoryMosaics).

Their names map onto ours one to one; their per-head scalars are stored (1, H, 1, 1) and
ours (H,), their persistent memories (P, 1, H, S, hd) and ours (P, H, S, hd). The values are
the same parametrisation (no transformation), so a converted state dict computes the same
logits (tests/model/test_mosaic_reference.py).
"""

from __future__ import annotations

import re

from torch import Tensor

# (reference pattern, our name) in order; `\1` is the block index.
_RULES = [
    (r"^mosaic\.wte\.weight$", "mosaic.wte.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^mosaic\.ln_f\.(weight|bias)$", r"mosaic.ln_f.\1"),
    (r"^mosaic\.h\.(\d+)\.(ln_1|ln_2)\.(weight|bias)$", r"mosaic.h.\1.\2.\3"),
    (r"^mosaic\.h\.(\d+)\.attn\.k_featurizer\.W_k\.(weight|bias)$", r"mosaic.h.\1.context.key.proj.\2"),
    (r"^mosaic\.h\.(\d+)\.attn\.k_featurizer\.leaky_avg\.leaky_key_beta$", r"mosaic.h.\1.context.key.leak"),
    (r"^mosaic\.h\.(\d+)\.attn\.k_featurizer\.key_scale$", r"mosaic.h.\1.context.key.scale"),
    (r"^mosaic\.h\.(\d+)\.attn\.v_featurizer\.W_v\.(weight|bias)$", r"mosaic.h.\1.context.value.proj.\2"),
    (r"^mosaic\.h\.(\d+)\.attn\.v_featurizer\.coef$", r"mosaic.h.\1.context.value.mix"),
    (r"^mosaic\.h\.(\d+)\.attn\.v_featurizer\.val_scale$", r"mosaic.h.\1.context.value.scale"),
    (r"^mosaic\.h\.(\d+)\.attn\.c_proj\.(weight|bias)$", r"mosaic.h.\1.context.out_proj.\2"),
    (r"^mosaic\.h\.(\d+)\.mlp\.k_featurizer\.W_k\.(weight|bias)$", r"mosaic.h.\1.persistent.key.proj.\2"),
    (r"^mosaic\.h\.(\d+)\.mlp\.k_featurizer\.leaky_avg\.leaky_key_beta$", r"mosaic.h.\1.persistent.key.leak"),
    (r"^mosaic\.h\.(\d+)\.mlp\.k_featurizer\.key_scale$", r"mosaic.h.\1.persistent.key.scale"),
    (r"^mosaic\.h\.(\d+)\.mlp\.P_k$", r"mosaic.h.\1.persistent.keys"),
    (r"^mosaic\.h\.(\d+)\.mlp\.P_v$", r"mosaic.h.\1.persistent.values"),
    (r"^mosaic\.h\.(\d+)\.mlp\.out_scale$", r"mosaic.h.\1.persistent.scale"),
    (r"^mosaic\.h\.(\d+)\.mlp\.c_proj\.(weight|bias)$", r"mosaic.h.\1.persistent.out_proj.\2"),
]
# the reference's buffers (a causal mask, the leaky average's lag matrix): computed here, not stored
_BUFFERS = re.compile(r"(\.attn\.bias|\.leaky_avg\.coef)$")


def reference_name(name: str) -> str | None:
    """Our name for a reference parameter name (None for one of its buffers).

    Raises:
        KeyError: a name the reference does not have.
    """
    if _BUFFERS.search(name):
        return None
    for pattern, ours in _RULES:
        if re.match(pattern, name):
            return re.sub(pattern, ours, name)
    raise KeyError(f"{name!r} is not a parameter of the reference Memory Mosaic (nanoMosaics/mosaic_model.py)")


def from_reference(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A reference `MemoryMosaic` state dict as a `MemoryMosaicLMHeadModel` state dict.

    Per-head scalars (1, H, 1, 1) become (H,); persistent memories (P, 1, H, S, hd) become (P, H, S, hd).
    """
    out = {}
    for name, value in state_dict.items():
        ours = reference_name(name)
        if ours is None:
            continue
        if value.dim() == 4 and value.shape[0] == 1 and value.shape[2:] == (1, 1):
            value = value.reshape(-1)  # (1, H, 1, 1) -> (H,)
        elif value.dim() == 5:
            value = value.squeeze(1)  # (P, 1, H, S, hd) -> (P, H, S, hd)
        out[ours] = value
    return out


__all__ = ["from_reference", "reference_name"]
