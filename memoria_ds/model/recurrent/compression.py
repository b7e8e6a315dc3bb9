"""The Compressive Transformer's compression (Rae et al. 2020): its functions, its network
and its attention-reconstruction loss, as pure functions of explicit tensors.

The memory here holds keys/values (as `xl` does), so the compression acts on each layer's
evicted keys and on its evicted values, as two signals of D = H * hd channels over time:

    conv   the paper's best: a 1D convolution of kernel = stride = c (D -> D channels),
           written as one linear map of each group of c consecutive slots
    mean   mean pooling of each group (over the slots that hold a token)
    max    max pooling of each group (over the slots that hold a token)

A group of c slots becomes one compressed slot, which holds a token when any of its slots
does. The evicted slots are padded at the old end with empty slots to a multiple of c
(as the authors' code pads). An empty compressed slot holds zeros.

The reconstruction loss (the paper's Algorithm 1, `L^attn`) asks the compressed slots to
give the current queries the attention output the evicted slots gave them:

    || attn(q, K_old, V_old) - attn(q, f_k(K_old), f_v(V_old)) ||^2

with q, K_old and V_old detached, so that only the compression network learns from it
(and, since the compressed memory is stored detached, the LM loss never reaches it: the
paper's stop-gradient). The mean over elements, then over layers, times a weight: the
authors' code (`F.mse_loss`, summed over layers / number of layers, weight 1.0).

Notation: B rows, H heads, E evicted slots, c compression rate, hd head width, Q queries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

COMPRESSIONS = ("conv", "mean", "max")


def pad_to_rate(slots: Tensor, mask: Tensor, rate: int) -> tuple[Tensor, Tensor]:
    """(B, H, E, hd) slots and (B, E) mask padded at the old end with empty slots to a multiple of `rate`."""
    missing = -slots.shape[2] % rate
    if not missing:
        return slots, mask
    B, H, _, hd = slots.shape
    slots = torch.cat([slots.new_zeros(B, H, missing, hd), slots], dim=2)
    mask = torch.cat([mask.new_zeros(B, missing), mask], dim=1)
    return slots, mask


def group_mask(mask: Tensor, rate: int) -> Tensor:
    """(B, E) slot mask -> (B, E / rate): a compressed slot holds a token when any of its group does."""
    return mask.view(mask.shape[0], mask.shape[1] // rate, rate).any(dim=2)


def pool(slots: Tensor, mask: Tensor, rate: int, how: str) -> Tensor:
    """Mean or max of each group of `rate` slots over the slots that hold a token (zeros for none).

    Args:
        slots: (B, H, E, hd) with E a multiple of `rate`. mask: (B, E) bool.

    Returns:
        (B, H, E / rate, hd).
    """
    B, H, E, hd = slots.shape
    grouped = slots.view(B, H, E // rate, rate, hd)
    m = mask.view(B, 1, E // rate, rate, 1)
    if how == "mean":
        count = m.sum(dim=3).clamp(min=1)
        return (grouped * m).sum(dim=3) / count
    if how == "max":
        low = torch.finfo(slots.dtype).min
        out = grouped.masked_fill(~m, low).amax(dim=3)
        return out.masked_fill(~m.any(dim=3), 0.0)
    raise ValueError(f"unknown pooling {how!r}; expected 'mean' or 'max'")


class GroupLinear(nn.Module):
    """Conv1d(D, D, kernel=c, stride=c) over time, as one linear map of each group's c * D values.

    `weight` (D, c * D) reads a group as [slot 0 channels, slot 1 channels, ...]; torch's
    Conv1d weight (D, D, c) is `weight.view(D, c, D).transpose(1, 2)` (tested).
    """

    def __init__(self, dim: int, rate: int) -> None:
        super().__init__()
        self.rate = rate
        self.linear = nn.Linear(rate * dim, dim)

    def forward(self, slots: Tensor) -> Tensor:
        """(B, H, E, hd) -> (B, H, E / c, hd) over the D = H * hd channels."""
        B, H, E, hd = slots.shape
        x = slots.transpose(1, 2).reshape(B, E // self.rate, self.rate * H * hd)  # (B, E/c, c * D)
        y = self.linear(x.to(self.linear.weight.dtype))  # (B, E/c, D)
        return y.view(B, E // self.rate, H, hd).transpose(1, 2)


class CompressionNet(nn.Module):
    """Each layer's compression of its evicted keys and values (`conv` only has weights).

    Args:
        num_layers / dim: the backbone's. rate: c. how: one of `COMPRESSIONS`.
    """

    def __init__(self, num_layers: int, dim: int, rate: int, how: str) -> None:
        super().__init__()
        if how not in COMPRESSIONS:
            raise ValueError(f"unknown compression {how!r}; expected one of {COMPRESSIONS}")
        self.rate, self.how = rate, how
        if how == "conv":
            self.keys = nn.ModuleList(GroupLinear(dim, rate) for _ in range(num_layers))
            self.values = nn.ModuleList(GroupLinear(dim, rate) for _ in range(num_layers))

    @property
    def trainable(self) -> bool:
        return self.how == "conv"

    def forward(self, layer: int, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Compress one layer's evicted slots.

        Args:
            keys / values: (B, H, E, hd), E a multiple of the rate. mask: (B, E) bool.

        Returns:
            compressed keys and values (B, H, E / c, hd), zero at empty compressed slots,
            and their (B, E / c) mask.
        """
        cmask = group_mask(mask, self.rate)
        if self.how == "conv":
            keep = mask[:, None, :, None]
            ck = self.keys[layer](keys * keep)  # empty slots enter as zeros (the authors' padding)
            cv = self.values[layer](values * keep)
        else:
            ck, cv = pool(keys, mask, self.rate, self.how), pool(values, mask, self.rate, self.how)
        full = cmask[:, None, :, None]
        return ck * full, cv * full, cmask


def masked_attention(queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Content attention of every query over the slots that hold a token (no causal mask).

    Args:
        queries: (B, H, Q, hd). keys / values: (B, H, S, hd). mask: (B, S) bool, at least
            one True per row used.

    Returns:
        (B, H, Q, hd).
    """
    scores = queries @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])  # (B, H, Q, S)
    scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ values


def reconstruction_error(
    queries: Tensor, query_mask: Tensor, old: tuple[Tensor, Tensor, Tensor], new: tuple[Tensor, Tensor, Tensor]
) -> Tensor:
    """One layer's mean squared difference of the attention outputs over old and compressed slots.

    Only rows with an evicted token and queries at real positions count (0 if none).

    Args:
        queries: (B, H, Q, hd). query_mask: (B, Q) bool.
        old: evicted (keys, values, mask); new: compressed (keys, values, mask).
    """
    rows = old[2].any(dim=1) & new[2].any(dim=1)  # (B,)
    use = (query_mask & rows[:, None])[:, None, :, None]  # (B, 1, Q, 1)
    dtype = torch.float32
    target = masked_attention(queries.to(dtype), old[0].to(dtype), old[1].to(dtype), old[2] | ~rows[:, None])
    got = masked_attention(queries.to(dtype), new[0].to(dtype), new[1].to(dtype), new[2] | ~rows[:, None])
    # where, not a product: a left-out row's difference never reaches the sum (nor, as NaN, its gradient)
    diff = torch.where(use, (target - got).square(), 0.0)
    count = use.sum() * queries.shape[1] * queries.shape[3]
    return diff.sum() / count.clamp(min=1)  # 0 when nothing counts (no host sync to test for it)


__all__ = ["COMPRESSIONS", "CompressionNet", "GroupLinear", "group_mask", "masked_attention", "pad_to_rate", "pool",
           "reconstruction_error"]
