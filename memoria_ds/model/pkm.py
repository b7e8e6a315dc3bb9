"""Product-Key Memory layer (Lample et al. 2019, "Large Memory Layers with Product Keys").

A large sparse parametric memory that a block reads in place of (or after) its MLP. Written
from the paper and a reading of facebookresearch/XLM's `xlm/model/memory/memory.py`
(`HashingMemoryProductFast`, CC BY-NC: not copied) in the configuration of its
`PKM-layer.ipynb`; docs/pkm.md gives each default's source
and where this layer departs from XLM.

For each token x (per head h):

    q      = BN(W x + b)                  the query network (batch norm optional; the paper's)
    q1, q2 = q[:K/2], q[K/2:]             the two halves of the head's query
    s1, s2 = q1 . C1_h, q2 . C2_h          scores against the head's two tables of n sub-keys
    top-k of s1, top-k of s2 -> k x k candidates (i, j), score s1[i] + s2[j], key index i n + j
    top-k of the candidates, w = softmax of their scores
    out    = sum over heads and kept candidates of w * V[index]     (`EmbeddingBag`, mode "sum")

The product keys make the top-k over all n^2 full keys [C1_h[i], C2_h[j]] exact at the cost
of 2 n + k^2 scores instead of n^2. The values V (n^2 slots) are shared by the heads.

Padding: in training, the query batch norm's mean and variance (and the running statistics
they update) are those of the real tokens only (`MaskedBatchNorm1d`), so padded positions
change nothing (XLM's layer normalises over every position, padding included: its issue 171).
In evaluation it normalises with the running statistics, per token.

Notation: N tokens (B * L flattened), D width (input and output), H heads, K key width per
head (`k_dim`), h = K / 2, n sub-keys per half (`n_keys`), S = n^2 value slots, k kept (`knn`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

from ..setting_rules import SettingError, check_fields, setting

PLACEMENTS = ("replace", "after")


@dataclass(frozen=True)
class PKMSettings:
    """The sizes of every PKM layer of a model (`MemoriaGPT2Config.pkm`; sources in docs/pkm.md).

    Attributes:
        n_keys: sub-keys per half, n; the memory has n^2 value slots (XLM and the paper: 512).
        heads: query heads, each with its own two sub-key tables, summed (4).
        knn: k, slots each head reads per token (32); at most `n_keys`.
        k_dim: K, the query width of a head, split in two halves (XLM's `mem_k_dim`: 256); even.
        query_batchnorm: batch norm on the queries (the paper's configuration: True).
        placement: `"replace"` (the block's MLP is removed and the PKM layer reads `ln_2(h)` in
            its place, as the paper does) or `"after"` (the MLP stays and the PKM layer adds a
            residual after it, reading the stream through a layer norm of its own).
        input_dropout / query_dropout / value_dropout: dropout on the layer's input, the
            queries and the output (XLM's `mem_*_dropout`: 0).
    """

    n_keys: int = setting(512, least=1)
    heads: int = setting(4, least=1)
    knn: int = setting(32, least=1)
    k_dim: int = setting(256, least=2)
    query_batchnorm: bool = True
    placement: Literal["replace", "after"] = "replace"
    input_dropout: float = setting(0.0, least=0, below=1)
    query_dropout: float = setting(0.0, least=0, below=1)
    value_dropout: float = setting(0.0, least=0, below=1)

    key: ClassVar[str] = "pkm"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.k_dim % 2:
            raise SettingError("k_dim", f"({self.k_dim}) must be even: each query is split in two halves")
        if self.knn > self.n_keys:
            raise SettingError("knn", f"({self.knn}) must be at most `n_keys` ({self.n_keys}): a head keeps the "
                               f"top-knn sub-keys of each half")

    @property
    def slots(self) -> int:
        """S = n_keys^2 value slots."""
        return self.n_keys * self.n_keys

    @classmethod
    def from_dict(cls, values: Any) -> PKMSettings:
        """Parse the config's `pkm` mapping (missing names take the defaults).

        Raises:
            SettingError: keyed `pkm.<name>` (an unknown name, a bad value).
        """
        known = sorted(f.name for f in fields(cls))
        if not isinstance(values, dict):
            raise SettingError(cls.key, f"({values!r}) must be a mapping of PKM settings; known: {known}")
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            more = f" (so are {unknown[1:]})" if len(unknown) > 1 else ""
            raise SettingError(f"{cls.key}.{unknown[0]}", f"is an unknown PKM setting{more}; known: {known}")
        try:
            return cls(**values)
        except SettingError as e:
            raise e.within(cls.key) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def untouched_parameters(self, width: int) -> int:
        """Parameters of one layer that a token does not compute with: its value table but the
        `heads * knn` rows it reads (the `6 * parameters` rule of training FLOPs would count the
        whole table for every token)."""
        return (self.slots - self.heads * self.knn) * width

    def selection_flops(self) -> float:
        """Training FLOPs per token of one layer outside its matrix products and value reads:
        each head's k x k candidate sums, forward and backward (about 3 per candidate)."""
        return 3.0 * self.heads * self.knn * self.knn

    def activation_bytes(self, width: int, element: int) -> float:
        """Activations one token keeps for the backward of one layer, `element` bytes a value:
        its input, the queries before and after the batch norm, both halves' scores over the
        sub-keys, each head's k x k candidates, and the k slots' weights (and int64 indices);
        the output. Rough, as `train/activation_memory.py`."""
        per_head = self.k_dim * 2 + 2 * self.n_keys + self.knn * self.knn + 2 * self.knn
        return element * (2 * width + self.heads * per_head) + 8 * self.heads * self.knn


class MaskedBatchNorm1d(nn.BatchNorm1d):
    """`nn.BatchNorm1d` over (N, F) whose training statistics are those of the valid rows only.

    In training, the mean and the (biased) variance that normalise every row are taken over
    the rows where `valid` is True, and returned (with the unbiased variance and the count) for
    `update_running` to move the running statistics towards (momentum, as `nn.BatchNorm1d`),
    unless fewer than two rows are valid (then they stay). The statistics are *returned*, not
    applied as a side effect, so that a block recomputed under activation checkpointing does not
    move them twice (the model applies them once, after its blocks). With every row valid a
    forward and its update are `nn.BatchNorm1d`'s training step. In evaluation every row is
    normalised by the running statistics. Statistics are computed in float32 (or x's dtype if
    wider). No host synchronisation: the count of valid rows stays a tensor.
    """

    def forward(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor | None]:  # type: ignore[override]
        """Normalise.

        Args:
            x: (N, F).
            valid: (N,) bool, or None (every row).

        Returns:
            (N, F) in x's dtype; in training the statistics (2 F + 1,) for `update_running`
            (the mean, the unbiased variance, the count of valid rows), else None.
        """
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps), None
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least float32
        xf = x.to(dtype)  # (N, F)
        w = (valid.reshape(-1, 1).to(dtype) if valid is not None
             else torch.ones(x.shape[0], 1, dtype=dtype, device=x.device))  # (N, 1)
        n = w.sum()  # () valid rows
        mean = (xf * w).sum(0) / n.clamp(min=1)  # (F,)
        var = ((xf - mean).square() * w).sum(0) / n.clamp(min=1)  # (F,) biased, as BatchNorm normalises
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(dtype) + self.bias.to(dtype)
        unbiased = var * n / (n - 1).clamp(min=1)
        stats = torch.cat([mean, unbiased, n[None]]).detach()  # (2 F + 1,)
        return y.to(x.dtype), stats

    @torch.no_grad()
    def update_running(self, stats: Tensor) -> None:
        """Move the running statistics towards a training forward's `stats` (unchanged if it had
        fewer than 2 valid rows)."""
        f = self.num_features
        mean, unbiased, n = stats[:f], stats[f:2 * f], stats[2 * f]
        rate = (n > 1).to(self.running_mean.dtype) * self.momentum  # 0: too few rows to estimate
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), rate)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), rate)
        self.num_batches_tracked.add_(1)


class ProductKeyMemory(nn.Module):
    """One PKM layer: (..., D) -> (..., D), per token. Its forward returns the query batch norm's
    statistics with the output; `update_running(stats)` applies them (the model does, once per
    forward, outside its checkpointable blocks).

    Parameters (`keys` and `values` as XLM names them; `tests/model/test_pkm_reference.py` maps
    the rest): `query` (Linear D -> H K), `query_norm`
    (`MaskedBatchNorm1d` over H K features, or None), `keys` (H, 2, n, h) sub-keys, `values`
    (`EmbeddingBag` of S slots of width D, mode "sum"), `input_norm` (a LayerNorm, only when
    the layer is placed after a block's MLP: the pre-layer-norm a GPT-2 sub-layer reads through).

    Args:
        dim: D, the residual stream's width.
        settings: the sizes.
        eps: the input layer norm's epsilon (with `placement="after"`).
    """

    def __init__(self, dim: int, settings: PKMSettings, eps: float = 1e-5) -> None:
        super().__init__()
        s = settings
        self.dim, self.heads, self.k_dim, self.n_keys, self.knn = dim, s.heads, s.k_dim, s.n_keys, s.knn
        self.input_dropout, self.query_dropout, self.value_dropout = s.input_dropout, s.query_dropout, s.value_dropout
        self.input_norm = nn.LayerNorm(dim, eps=eps) if s.placement == "after" else None
        self.query = nn.Linear(dim, s.heads * s.k_dim, bias=True)
        self.query_norm = MaskedBatchNorm1d(s.heads * s.k_dim) if s.query_batchnorm else None
        self.keys = nn.Parameter(torch.empty(s.heads, 2, s.n_keys, s.k_dim // 2))
        self.values = nn.EmbeddingBag(s.slots, dim, mode="sum")
        self.init_memory_weights("random")

    @torch.no_grad()
    def init_memory_weights(self, memory_init: str) -> None:
        """XLM's initialisation (the model's `_init_weights` calls it after GPT-2's, so it wins):

        - query: `nn.Linear`'s default, U(-1/sqrt(D), 1/sqrt(D)) for weight and bias;
        - query batch norm: weight 1, bias 0, running mean 0 and variance 1;
        - sub-keys: U(-1/sqrt(h), 1/sqrt(h)) per key (XLM's `get_uniform_keys`, drawn from torch's
          generator instead of numpy's per-table seeds);
        - values: N(0, D^-1/2); zero for a layer placed after the MLP under `memory_init="noop"`
          (XLM's `mem_value_zero_init`): it then adds exactly nothing at the start, so the model
          starts as its backbone, as the toolkit's no-op init promises (a layer that replaces
          the MLP cannot: its values are always drawn);
        - input layer norm (placement "after"): weight 1, bias 0.
        """
        bound = 1 / math.sqrt(self.dim)
        init.uniform_(self.query.weight, -bound, bound)
        init.uniform_(self.query.bias, -bound, bound)
        if self.query_norm is not None:
            init.ones_(self.query_norm.weight)
            init.zeros_(self.query_norm.bias)
            init.zeros_(self.query_norm.running_mean)
            init.ones_(self.query_norm.running_var)
            init.zeros_(self.query_norm.num_batches_tracked)
        half = self.k_dim // 2
        init.uniform_(self.keys, -1 / math.sqrt(half), 1 / math.sqrt(half))
        if memory_init == "noop" and self.input_norm is not None:  # placed after the MLP
            init.zeros_(self.values.weight)
        else:
            init.normal_(self.values.weight, mean=0.0, std=self.dim**-0.5)
        if self.input_norm is not None:
            init.ones_(self.input_norm.weight)
            init.zeros_(self.input_norm.bias)

    def lookup(self, query: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k slots of every head by product keys.

        Args:
            query: (N, H, K) queries.

        Returns:
            scores (N, H, k) of the kept slots (best first), and their indices (N, H, k) int64 in [0, S).
        """
        N, H, K = query.shape
        n, k = self.n_keys, self.knn
        halves = query.view(N, H, 2, K // 2)  # (N, H, 2, h): q1, q2
        sub = torch.einsum("nhsd,hsjd->nhsj", halves, self.keys)  # (N, H, 2, n): each half against its sub-keys
        best, idx = sub.topk(k, dim=-1)  # (N, H, 2, k)
        pair_scores = best[:, :, 0, :, None] + best[:, :, 1, None, :]  # (N, H, k, k): s1[i] + s2[j]
        pair_index = idx[:, :, 0, :, None] * n + idx[:, :, 1, None, :]  # (N, H, k, k): i n + j
        scores, pick = pair_scores.reshape(N, H, k * k).topk(k, dim=-1)  # (N, H, k)
        return scores, pair_index.reshape(N, H, k * k).gather(-1, pick)  # (N, H, k) twice

    def forward(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Read the memory for every token.

        Args:
            x: (..., D) the stream (already layer-normed by the block when replacing its MLP).
            valid: (...) bool, True at real tokens (the query batch norm's training statistics
                skip the others), or None (every token is real).

        Returns:
            (..., D) in x's dtype, and (in training, with the query batch norm) the batch
            statistics for `update_running`, else None.
        """
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (N, D)
        if self.input_norm is not None:
            x = self.input_norm(x)
        x = F.dropout(x, p=self.input_dropout, training=self.training)
        query, stats = self.query(x), None  # (N, H K)
        if self.query_norm is not None:
            query, stats = self.query_norm(query, valid.reshape(-1) if valid is not None else None)
        query = F.dropout(query, p=self.query_dropout, training=self.training)
        N = query.shape[0]
        scores, indices = self.lookup(query.view(N, self.heads, self.k_dim))  # (N, H, k) twice
        weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # (N, H, k)
        out = self.values(indices.reshape(N, -1),  # (N, H k): the heads' slots in one bag, summed
                          per_sample_weights=weights.reshape(N, -1).to(self.values.weight.dtype))  # (N, D)
        out = F.dropout(out.to(x.dtype), p=self.value_dropout, training=self.training)
        return out.view(shape), stats

    def update_running(self, stats: Tensor | None) -> None:
        """Apply a training forward's batch statistics to the query batch norm's running ones (once per forward)."""
        if stats is not None and self.query_norm is not None:
            self.query_norm.update_running(stats)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, k_dim={self.k_dim}, n_keys={self.n_keys}, knn={self.knn}"


__all__ = ["PKMSettings", "ProductKeyMemory", "MaskedBatchNorm1d", "PLACEMENTS"]
