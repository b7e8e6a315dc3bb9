"""The abstractor f_e: the previous segment's hidden states -> N_wm working-memory engrams.

Paper section 4.2 / Appendix F.1:  M_wm = FFN(softmax(Q (W_k h_{t-1})^T) W_v h_{t-1}).

Notation: B rows, P positions of the previous segment, N = N_wm engrams, D width.

Decision (SPEC section 2 leaves it open): the default `"transformer"` style reads the
paper's text literally, "FFN is a feed-forward network as same in Transformer": attention
scaled by 1/sqrt(D) and an FFN with the backbone's activation between its two linear
layers. The authors' code has neither (their two linear layers compose into one linear
map, which looks like an oversight); `"authors"` reproduces it for comparison.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN


class Abstractor(nn.Module):
    """N learned queries attend (one head) over h_{t-1}, then an FFN.

    Args:
        dim: D, the backbone's hidden size (engram width).
        num_queries: N_wm.
        ffn_dim: inner width of the FFN (the backbone's `n_inner`, i.e. 4 D for GPT-2).
        activation: the backbone's activation name (used by the `"transformer"` style).
        style: `"transformer"` or `"authors"` (see the module docstring).
    """

    def __init__(self, dim: int, num_queries: int, ffn_dim: int, activation: str, style: str = "transformer") -> None:
        super().__init__()
        self.num_queries = num_queries
        self.queries = nn.Parameter(torch.empty(num_queries, dim))
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.ffn_in = nn.Linear(dim, ffn_dim)
        self.act = ACT2FN[activation] if style == "transformer" else nn.Identity()
        self.ffn_out = nn.Linear(ffn_dim, dim)
        self.scale = dim**-0.5 if style == "transformer" else 1.0

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """Encode working memory.

        Args:
            hidden: (B, P, D) previous segment's last hidden states (after ln_f, detached).
            mask: (B, P) bool, True at real positions. A row with none (no previous
                segment) attends everywhere and gives finite engrams that the caller
                ignores (it gates them out), so shapes stay static.

        Returns:
            (B, N, D) working-memory engrams in the module's dtype.
        """
        k = self.key(hidden)  # (B, P, D)
        v = self.value(hidden)  # (B, P, D)
        scores = torch.matmul(self.queries, k.transpose(1, 2)) * self.scale  # (B, N, P)
        allowed = mask | ~mask.any(dim=1, keepdim=True)  # (B, P): empty rows attend everywhere
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        probs = scores.float().softmax(dim=-1).to(v.dtype)  # (B, N, P)
        pooled = torch.matmul(probs, v)  # (B, N, D)
        return self.ffn_out(self.act(self.ffn_in(pooled)))


__all__ = ["Abstractor"]
