"""`infinity`: the infinity-former (Martins et al. 2022) for an unmodified GPT-2, as the
authors of Memoria ran it (`infinity_gpt2`, from the original infinite-former code).

Each block gets a long-term memory attention beside its self-attention, whose output is
added to the self-attention's (`side_attention`, inside the block). Its memory, per layer:

    X        the previous segment's block inputs (detached)
    B_past   the basis coefficients of the continuous signal of everything before (detached)

At a segment, per layer (`continuous.py` for the maths):

    K   = X * sigmoid(conv3(X))                     the "cnn" mask (after a dropout of X)
    B   = fit(K, G)                                 the second segment after a reset
    B   = fit([psi(t_s) B_past ; K], G_inf)         later: S samples of the old signal on [0, tau]
    mu  = sigmoid(w_mu . s), var = softplus(w_sigma . s),  s = q (B W_K)^T / sqrt(hd)
    out = W_out (V^T E_{N(mu, var)}[psi]),  V = B W_V    per head, q the self-attention's query

and B is stored (detached) as the next B_past. With sticky memories, the S positions t_s
are drawn where the last step's attention densities put their mass (128 bins). Training
adds kl_weight x the mean KL of the densities to N(mu_0, sigma_0^2) to the loss.

The first segment after a reset has no memory and is exactly the backbone; with
`memory_init="noop"` the output projection starts at zero, so the model does too.

Notation: B rows, Y layers, P previous-segment tokens, N basis functions, S samples,
H heads, hd head width, L tokens of the segment, D width, K bins.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...rows import BatchRows, rows_field
from ...setting_rules import setting
from ..memory_attention import OutputProjection
from . import continuous
from .base import FORMAT, BlockWrites, KindSettings, MemoryKind, MemoryRead, check_format
from .read_copy import held
from .saved_state import BOOL, FLOAT32, SavedState

MASKS = ("cnn", "none")


@dataclass(frozen=True)
class InfinitySettings(KindSettings):
    """The infinity-former's settings (the authors' `infinity-gpt2*.json`; sources in docs/baselines.md).

    Attributes:
        num_basis: N; None = the segment length (the config's `segment_length`).
        num_samples: S, samples of the old signal per update; None = N.
        tau: the part of [0, 1] the old signal is compressed into (0.5).
        sticky: sticky memories (sample where the attention went) instead of even samples.
        mask: `"cnn"` (a kernel-3 convolution gates the memory) or `"none"`.
        mask_dropout: dropout of the memory vectors before the mask (training).
        kl_weight: weight of the KL regulariser (1e-6); 0 = none.
        mu_0 / sigma_0: the regulariser's Gaussian (-1.0 / 0.05: with mu_0 <= 0 the mean is regularised too).
    """

    kind: ClassVar[str] = "infinity"

    # checked by their rules (KindSettings)
    num_basis: int | None = setting(None, least=2, none="the segment length")
    num_samples: int | None = setting(None, least=2, none="`num_basis`")
    tau: float = setting(0.5, above=0, below=1)
    sticky: bool = True
    mask: str = setting("cnn", choices=MASKS)
    mask_dropout: float = setting(0.1, least=0, below=1)
    kl_weight: float = setting(1e-6, least=0)
    mu_0: float = -1.0
    sigma_0: float = setting(0.05, above=0)

    def sizes(self, segment_length: int | None) -> tuple[int, int]:
        """(N, S), N rounded up to even (two widths per centre)."""
        n = self.num_basis if self.num_basis is not None else segment_length
        if n is None:
            raise ValueError("the infinity-former needs `memory_settings.num_basis`, or the model's `segment_length` "
                             "(the default: one basis function per token of a segment)")
        n = continuous.resolved_basis_count(n)
        return n, self.num_samples if self.num_samples is not None else n


class InfinityNet(nn.Module):
    """Every layer's long-term attention weights.

    Args:
        num_layers / dim / num_heads: the backbone's. num_basis: N. num_samples: S. settings: the kind's.
    """

    def __init__(self, num_layers: int, dim: int, num_heads: int, num_basis: int, num_samples: int,
                 settings: InfinitySettings) -> None:
        super().__init__()
        self.num_heads, self.num_basis, self.num_samples = num_heads, num_basis, num_samples
        self.settings = settings
        linear = lambda: nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(num_layers))  # noqa: E731
        self.key, self.value = linear(), linear()
        self.out = nn.ModuleList(OutputProjection(dim, dim, bias=False) for _ in range(num_layers))
        self.mu = nn.ModuleList(nn.Linear(num_basis, 1, bias=False) for _ in range(num_layers))
        self.sigma = nn.ModuleList(nn.Linear(num_basis, 1, bias=False) for _ in range(num_layers))
        self.mask = None
        if settings.mask == "cnn":
            self.mask = nn.ModuleList(nn.Conv1d(dim, dim, 3, padding=1) for _ in range(num_layers))
        self.mask_dropout = nn.Dropout(settings.mask_dropout)

    def memory_keys(self, layer: int, x: Tensor, present: Tensor) -> Tensor:
        """(B, P, D) previous-segment vectors -> the masked signal to fit (zero at absent positions)."""
        x = self.mask_dropout(x)
        if self.mask is not None:
            x = x * torch.sigmoid(self.mask[layer](x.transpose(1, 2))).transpose(1, 2)
        return x * present[..., None]

    def attend(self, layer: int, coefficients: Tensor, queries: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Continuous attention of (B, H, L, hd) queries over the signal with (B, N, D) coefficients.

        Returns:
            (B, L, D) output, and the densities' (B, H, L) means and variances.
        """
        B, H, L, hd = queries.shape
        N = coefficients.shape[1]
        keys = self.key[layer](coefficients).view(B, N, H, hd).transpose(1, 2)  # (B, H, N, hd)
        values = self.value[layer](coefficients).view(B, N, H, hd).transpose(1, 2)
        scores = queries @ keys.transpose(-1, -2) / hd**0.5  # (B, H, L, N)
        mu = torch.sigmoid(self.mu[layer](scores)).squeeze(-1)  # (B, H, L)
        variance = F.softplus(self.sigma[layer](scores)).squeeze(-1).clamp(min=1e-4)
        r = continuous.gaussian_expectation(mu, variance, N)  # (B, H, L, N)
        context = (r @ values).transpose(1, 2).reshape(B, L, H * hd)
        return self.out[layer](context), mu, variance


@dataclass
class InfinityMemory(BatchRows):
    """The infinity-former's state, per row and layer.

    Attributes:
        hidden: (B, Y, P, D) float32, the previous segment's block inputs (detached).
        hidden_mask: (B, P) bool, its real positions; a row with none has no memory.
        coefficients: (B, Y, N, D) float32, B_past (detached). has_coefficients: (B,) bool.
        mass: (B, Y, K) float32, where the last attention densities went (sticky memories).
    """

    hidden: Tensor = rows_field(pad=(2, "right"))
    hidden_mask: Tensor = rows_field(pad=(1, "right"))
    coefficients: Tensor = rows_field()
    has_coefficients: Tensor = rows_field()
    mass: Tensor = rows_field()

    @classmethod
    def empty(cls, batch_size: int, num_layers: int, dim: int, num_basis: int,
              device: torch.device | str | None = None, length: int = 0) -> InfinityMemory:
        """A fresh memory: `length` (P) absent previous-segment positions."""
        return cls(
            hidden=torch.zeros(batch_size, num_layers, length, dim, device=device),
            hidden_mask=torch.zeros(batch_size, length, dtype=torch.bool, device=device),
            coefficients=torch.zeros(batch_size, num_layers, num_basis, dim, device=device),
            has_coefficients=torch.zeros(batch_size, dtype=torch.bool, device=device),
            mass=torch.full((batch_size, num_layers, continuous.STICKY_BINS), 1.0 / continuous.STICKY_BINS,
                            device=device),
        )

    @property
    def has_previous(self) -> Tensor:
        return self.hidden_mask.any(dim=1)

    def reset(self, mask: Tensor | None = None) -> None:
        """Forget all rows, or those where the (B,) bool `mask` is True, in place (values zeroed)."""
        if mask is None:
            mask = torch.ones(self.hidden_mask.shape[0], dtype=torch.bool, device=self.hidden_mask.device)
        mask = mask.to(self.hidden_mask.device, torch.bool)
        self.hidden.masked_fill_(mask[:, None, None, None], 0.0)
        self.hidden_mask.masked_fill_(mask[:, None], False)
        self.coefficients.masked_fill_(mask[:, None, None, None], 0.0)
        self.has_coefficients.masked_fill_(mask, False)
        self.mass.masked_fill_(mask[:, None, None], 1.0 / continuous.STICKY_BINS)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "infinity", "format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], config: Any = None,
                        device: torch.device | str | None = None) -> InfinityMemory:
        check_format(state_dict, "infinity")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise ValueError(f"saved infinity memory lacks {missing}")
        out = cls(**{n: state_dict[n] for n in names})
        B, Y = out.hidden.shape[:2]
        if (out.hidden_mask.shape != (B, out.hidden.shape[2]) or out.coefficients.shape[:2] != (B, Y)
                or out.has_coefficients.shape != (B,) or out.mass.shape != (B, Y, continuous.STICKY_BINS)
                or out.coefficients.shape[3] != out.hidden.shape[3]):
            raise ValueError(f"inconsistent infinity memory: hidden {tuple(out.hidden.shape)}, hidden_mask "
                             f"{tuple(out.hidden_mask.shape)}, coefficients {tuple(out.coefficients.shape)}, "
                             f"mass {tuple(out.mass.shape)}")
        return out.to(device) if device is not None else out


@dataclass
class InfinityRead(BatchRows, MemoryRead):
    """The blocks' view: the memory, the samples of the old signal, and the weights to attend with.

    Attributes:
        hidden / hidden_mask / coefficients / has_coefficients: the memory's.
        samples: (B, Y, S, N) psi at the S positions the old signal is sampled at.
        net: the model's `InfinityNet` (not a row field).
    """

    hidden: Tensor
    hidden_mask: Tensor
    coefficients: Tensor
    has_coefficients: Tensor
    samples: Tensor
    net: InfinityNet | None = rows_field(rows=False, default=None)
    engrams: ClassVar[None] = None
    slot_mask: ClassVar[None] = None
    has_side: ClassVar[bool] = True

    def _map(self, fn) -> InfinityRead:  # row operations keep the net
        out = BatchRows._map(self, fn)
        out.net = self.net
        return out

    def side_attention(self, layer: int, hidden: Tensor, queries: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The long-term attention of block `layer` (see the module docstring).

        Returns:
            the (B, L, D) output (zero for rows without a memory), and for the write: the
            block input (detached), then, if the memory has positions (P > 0), the new
            coefficients (detached), the densities' means and standard deviations (detached)
            and the per-row mean KL to the prior (with its gradient). Computed for every row,
            with a memory or not (no host sync to find out which); a row without one adds 0
            and its write keeps its state.
        """
        inputs = hidden.detach()
        present = self.hidden_mask
        if not present.shape[1]:  # a shape, not a value: no memory was ever written to this one
            return hidden.new_zeros(()), (inputs,)
        net = self.net
        dtype = net.key[layer].weight.dtype
        P = present.shape[1]
        keys = net.memory_keys(layer, self.hidden[:, layer].to(dtype), present)  # (B, P, D)
        g, g_inf = continuous.matrices(P, net.num_samples, net.num_basis, net.settings.tau, keys.device, dtype)
        plain = continuous.fit(keys, g)
        old = self.samples[:, layer].to(dtype) @ self.coefficients[:, layer].to(dtype)  # (B, S, D)
        grown = continuous.fit(torch.cat([old, keys], dim=1), g_inf)
        coefficients = torch.where(self.has_coefficients[:, None, None], grown, plain)  # (B, N, D)
        out, mu, variance = net.attend(layer, coefficients, queries.to(dtype))
        rows = present.any(dim=1)  # (B,)
        out = torch.where(rows[:, None, None], out, 0.0)  # a row without a memory adds exactly 0
        s = net.settings
        kl = continuous.kl_to_prior(mu.float(), variance.float(), s.mu_0, s.sigma_0).flatten(1).mean(dim=1)  # (B,)
        return out.to(hidden.dtype), (inputs, coefficients.detach(), mu.detach(), variance.sqrt().detach(), kl)


@dataclass
class Pending:
    """The write's share of a forward: the net (train mode or not); the KL it leaves."""

    net: InfinityNet
    loss: Tensor | None = None


class InfinityKind(MemoryKind):
    """The infinity-former's continuous long-term memory (`InfinitySettings`)."""

    name = "infinity"
    places = frozenset({"side attention", "modules"})
    memory_class = InfinityMemory
    settings_class = InfinitySettings

    def _sizes(self) -> tuple[int, int]:
        return self.settings.sizes(self.config.segment_length)

    def build_module(self) -> InfinityNet:
        cfg = self.config
        n, s = self._sizes()
        return InfinityNet(cfg.n_layer, cfg.n_embd, cfg.n_head, n, s, self.settings)

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> InfinityMemory:
        """With the model's `segment_length` set, a memory of one segment's positions, all absent (every
        step then sees the same shapes: a compiled step compiles once); else of none."""
        cfg = self.config
        return InfinityMemory.empty(batch_size, cfg.n_layer, cfg.n_embd, self._sizes()[0], device,
                                    cfg.segment_length or 0)

    def row_bytes(self, segment_length: int) -> dict[str, int]:
        cfg, n = self.config, self._sizes()[0]
        return {"hidden": cfg.n_layer * segment_length * cfg.n_embd * 4, "coefficients": cfg.n_layer * n * cfg.n_embd * 4,
                "mass": cfg.n_layer * continuous.STICKY_BINS * 4}

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: Any = None) -> None:
        sizes = {"K": continuous.STICKY_BINS}
        if config is not None:
            settings = cls.settings_class.from_dict(dict(config.memory_settings or {}))
            sizes.update(Y=config.n_layer, D=config.n_embd, N=settings.sizes(config.segment_length)[0])
        s = SavedState(state_dict, "infinity", sizes)
        s.tensor("hidden", FLOAT32, "B Y P D")
        s.tensor("hidden_mask", BOOL, "B P")
        s.tensor("coefficients", FLOAT32, "B Y N D")
        s.tensor("has_coefficients", BOOL, "B")
        mass = s.tensor("mass", FLOAT32, "B Y K")
        # a distribution over the bins per row and layer: the sticky memories draw samples from it
        s.require((mass >= 0).all(), "mass", "holds negative masses")
        s.require(((mass.double().sum(dim=-1) - 1).abs() <= 1e-3).all(), "mass",
                  "does not sum to 1 over the bins of a row and layer")
        if config is not None:
            s.at_most("hidden_mask", "P", config.n_positions, "`n_positions`, the longest segment")

    def check(self, memory: InfinityMemory) -> None:
        cfg, n = self.config, self._sizes()[0]
        if memory.coefficients.shape[1:] != (cfg.n_layer, n, cfg.n_embd):
            raise ValueError(f"the memory holds {tuple(memory.coefficients.shape[1:])} coefficients (layers, basis, "
                             f"width) but this model has ({cfg.n_layer}, {n}, {cfg.n_embd})")

    def read(self, memory: InfinityMemory, dtype: torch.dtype, net: Any) -> tuple[InfinityRead, Pending]:
        memory = held(memory)  # the write overwrites the memory in place; the backward needs what was read
        B, Y = memory.coefficients.shape[:2]
        n, s = net.num_basis, net.num_samples
        mu, sigma = continuous.basis_on(n, memory.mass.device, torch.float32)  # (N,) each
        if net.settings.sticky:
            positions = continuous.sticky_positions(memory.mass.reshape(B * Y, -1), s).view(B, Y, s)
            samples = continuous.evaluate(positions, mu, sigma)  # (B, Y, S, N)
        else:
            samples = continuous.even_samples(s, n, net.settings.tau, memory.mass.device).expand(B, Y, s, n)
        read = InfinityRead(memory.hidden, memory.hidden_mask, memory.coefficients, memory.has_coefficients, samples,
                            net)
        return read, Pending(net)

    def frozen_read(self, memory: InfinityMemory, dtype: torch.dtype, net: Any) -> InfinityRead:
        return self.read(memory, dtype, net)[0]  # the read holds copies (`read_copy.held`): a later write leaves it

    def write(self, memory: InfinityMemory, read: InfinityRead, pending: Pending, writes: BlockWrites,
              hidden: Tensor, valid: Tensor) -> None:
        side = writes.side
        rows = read.hidden_mask.any(dim=1)  # rows whose memory was read this step (as read: the KL loss's mask)
        # every field in place (`BatchRows.store_`): the memory keeps its addresses
        memory.store_(hidden=torch.stack([s[0] for s in side], dim=1).float() * valid[:, None, :, None])
        if len(side[0]) > 1:
            new = torch.stack([s[1] for s in side], dim=1).float()  # (B, Y, N, D)
            memory.store_(coefficients=torch.where(rows[:, None, None, None], new, memory.coefficients),
                          has_coefficients=memory.has_coefficients | rows)
            H = side[0][2].shape[1]
            weights = valid[:, None, :].expand(-1, H, -1).flatten(1).float()  # (B, H * L)
            mass = torch.stack([continuous.bin_mass(s[2].flatten(1).float(), s[3].flatten(1).float(), weights)
                                for s in side], dim=1)  # (B, Y, K)
            memory.store_(mass=torch.where(rows[:, None, None], mass, memory.mass))
            s = pending.net.settings
            if pending.net.training and s.kl_weight > 0 and torch.is_grad_enabled():
                kl = torch.stack([t[4] for t in side], dim=1).mean(dim=1)  # (B,) mean over layers
                pending.loss = s.kl_weight * torch.where(rows, kl, 0.0).sum() / rows.sum().clamp(min=1)
        memory.store_(hidden_mask=valid)
        return None

    def auxiliary_loss(self, pending: Pending) -> Tensor | None:
        return pending.loss


__all__ = ["InfinitySettings", "InfinityNet", "InfinityMemory", "InfinityRead", "InfinityKind"]
