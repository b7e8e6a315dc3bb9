"""The infinity-former's continuous signal (Martins et al. 2022), as pure functions.

A memory of L vectors x_1..x_L (one channel at a time) becomes a continuous signal
x(t) = B^T psi(t) on t in [0, 1], psi being N Gaussian radial basis functions
(centres on a grid over [0, 1], widths 0.005 and 0.01), by ridge regression onto the
basis: B = X G with G = F^T (F F^T + lambda I)^-1, F_jk = psi_j(t_k), lambda = 0.5. The
positions t_k are L points of [0, 1] together with points outside it (the "padding" of
the authors' code, which keeps the fit flat at the ends), whose rows of G are cut off.

Continuous attention: a query gives a Gaussian density N(t; mu, sigma^2) over [0, 1] and
reads E[psi(t)] = r, r_j = N(mu; mu_j, sigma^2 + sigma_j^2) in closed form (the integral of
a product of two Gaussians); the context is V^T r with V = B W_V.

The unbounded memory: at the next segment the old signal is sampled at S positions
(evenly, or, with sticky memories, where the last attention densities put their mass,
128 bins), and those S samples, placed on [0, tau], together with the L new vectors on
(tau, 1], are regressed again (G_inf). Everything here follows the authors' code
(`long_term_attention.py`, itself from the original infinite-former code); differences
are in docs/baselines.md.

Notation: N basis functions, L memory vectors, S samples, D channels, K bins.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

BASIS_SIGMAS = (0.005, 0.01)
RIDGE_PENALTY = 0.5
STICKY_BINS = 128


def basis(num_basis: int) -> tuple[Tensor, Tensor]:
    """(N,) centres and (N,) widths: every centre of linspace(0, 1, N / 2) with each width.

    N is rounded up to a multiple of the number of widths (the authors' rule).
    """
    n = num_basis + (-num_basis % len(BASIS_SIGMAS))
    mu, sigma = torch.meshgrid(torch.linspace(0, 1, n // len(BASIS_SIGMAS), dtype=torch.float64),
                               torch.tensor(BASIS_SIGMAS, dtype=torch.float64), indexing="ij")
    return mu.flatten(), sigma.flatten()


def resolved_basis_count(num_basis: int) -> int:
    return num_basis + (-num_basis % len(BASIS_SIGMAS))


def evaluate(t: Tensor, mu: Tensor, sigma: Tensor) -> Tensor:
    """psi(t): (..., 1) or (...,) positions -> (..., N) values of the Gaussian basis functions."""
    if t.dim() == 0 or t.shape[-1] != 1:
        t = t[..., None]
    z = (t - mu) / sigma
    return torch.exp(-0.5 * z**2) / (math.sqrt(2 * math.pi) * sigma)


def padded_positions(length: int) -> Tensor:
    """The L regression points spread over [0, 1] plus the padding outside it (2L or 2L - 1 points)."""
    if length % 2:
        shift = 1 / length
        return torch.linspace(-0.5 + shift, 1.5 - shift, 2 * length - 1, dtype=torch.float64)
    shift = 1 / (2 * length)
    return torch.linspace(-0.5 + shift, 1.5 - shift, 2 * length, dtype=torch.float64)


def infinity_positions(length: int, samples: int, tau: float) -> Tensor:
    """Positions of [S old samples on (0, tau], L new vectors on (tau, 1]] plus the padding outside [0, 1]."""
    inside = torch.cat([torch.linspace(0.0, tau, samples + 1, dtype=torch.float64)[1:],
                        torch.linspace(tau, 1.0, length + 1, dtype=torch.float64)[1:]])
    total = length + samples
    shift = 1 / (2 * length + samples)  # the authors' spacing of the padding
    pad = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * total, dtype=torch.float64)
    return torch.cat([pad[pad < 0], inside, pad[pad > 1]])


def regression_matrix(length: int, positions: Tensor, num_basis: int) -> Tensor:
    """G (length, N): B = X G fits the basis to `length` vectors (the padding's rows cut off)."""
    mu, sigma = basis(num_basis)
    F = evaluate(positions, mu, sigma).T  # (N, P)
    G = F.T @ torch.linalg.inv(F @ F.T + RIDGE_PENALTY * torch.eye(F.shape[0], dtype=F.dtype))  # (P, N)
    cut = (length - 1) // 2 if length % 2 else length // 2
    return G[cut:G.shape[0] - cut]


@functools.lru_cache(maxsize=64)
def _matrices(length: int, samples: int, num_basis: int, tau: float) -> tuple[Tensor, Tensor]:
    """float64 (G (L, N), G_inf (S + L, N)), cached by shape."""
    g = regression_matrix(length, padded_positions(length), num_basis)
    g_inf = regression_matrix(length + samples, infinity_positions(length, samples, tau), num_basis)
    if g.shape[0] != length or g_inf.shape[0] != length + samples:
        raise ValueError(f"the basis fit of {length} vectors and {samples} samples does not cut evenly")
    return g, g_inf


@functools.lru_cache(maxsize=64)
def _matrices_on(length: int, samples: int, num_basis: int, tau: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tuple(m.to(device=device, dtype=dtype) for m in _matrices(length, samples, num_basis, tau))


# constants of their arguments: a compiled forward holds the result as a constant on the device, instead
# of tracing the fit (float64 on the host, a `pad < 0` selection of data-dependent size) into every step
@torch.compiler.assume_constant_result
def matrices(length: int, samples: int, num_basis: int, tau: float, device: torch.device,
             dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(G (L, N), G_inf (S + L, N)) on `device` in `dtype` (cached: never modify them)."""
    return _matrices_on(length, samples, num_basis, float(tau), torch.device(device), dtype)


@functools.lru_cache(maxsize=64)
def _basis_on(num_basis: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return tuple(b.to(device=device, dtype=dtype) for b in basis(num_basis))


@torch.compiler.assume_constant_result
def basis_on(num_basis: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`basis(num_basis)` on `device` in `dtype` (cached: never modify them; a constant to a compiled forward)."""
    return _basis_on(num_basis, torch.device(device), dtype)


@functools.lru_cache(maxsize=64)
def _even_samples_on(samples: int, num_basis: int, tau: float, device: torch.device) -> Tensor:
    mu, sigma = basis(num_basis)
    old = torch.linspace(0.0, tau, samples + 1, dtype=torch.float64)[1:]
    return evaluate(old / tau, mu, sigma).to(device=device, dtype=torch.float32)


@torch.compiler.assume_constant_result
def even_samples(samples: int, num_basis: int, tau: float, device: torch.device) -> Tensor:
    """(S, N) psi at S even positions of the old signal (t / tau for t in (0, tau]): no sticky memories
    (cached: never modify it; a constant to a compiled forward)."""
    return _even_samples_on(samples, num_basis, float(tau), torch.device(device))


def fit(x: Tensor, g: Tensor) -> Tensor:
    """(B, P, D) vectors -> (B, N, D) coefficients B of the basis (ridge regression, G (P, N))."""
    return torch.einsum("bpd,pn->bnd", x, g)


def gaussian_expectation(mu: Tensor, variance: Tensor, num_basis: int) -> Tensor:
    """E_{N(mu, variance)}[psi(t)]: (...) -> (..., N), N(mu; mu_j, variance + sigma_j^2)."""
    centres, widths = basis_on(num_basis, mu.device, mu.dtype)
    s = torch.sqrt(widths**2 + variance[..., None])
    z = (mu[..., None] - centres) / s
    return torch.exp(-0.5 * z**2) / (math.sqrt(2 * math.pi) * s)


def bin_mass(mu: Tensor, sigma: Tensor, weights: Tensor) -> Tensor:
    """Sticky memories: how much of the attention densities falls in each of the 128 bins of [0, 1].

    Args:
        mu / sigma: (B, Q) the densities' means and standard deviations. weights: (B, Q),
            1 for a density that counts (a real query), else 0.

    Returns:
        (B, K) the mass per bin, normalised per row (uniform for a row with none).
    """
    edges = torch.linspace(0, 1, STICKY_BINS + 1, device=mu.device, dtype=mu.dtype)
    edges[0], edges[-1] = -1e-6, 1 + 1e-6  # the authors' edges
    cdf = torch.distributions.Normal(mu[..., None], sigma[..., None]).cdf(edges)  # (B, Q, K + 1)
    mass = ((cdf[..., 1:] - cdf[..., :-1]) * weights[..., None]).sum(dim=1)  # (B, K)
    total = mass.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(mass, 1.0 / STICKY_BINS)
    return torch.where(total > 0, mass / total.clamp(min=1e-30), uniform)


def sticky_positions(mass: Tensor, samples: int, generator: torch.Generator | None = None) -> Tensor:
    """(B, K) bin masses -> (B, S) sorted positions: the left edges of S bins drawn by mass (the authors' code)."""
    index = torch.multinomial(mass, samples, replacement=True, generator=generator)  # (B, S)
    edges = torch.linspace(0, 1, STICKY_BINS + 1, device=mass.device, dtype=mass.dtype)
    return edges[index].sort(dim=-1).values


def kl_to_prior(mu: Tensor, variance: Tensor, mu_0: float, sigma_0: float) -> Tensor:
    """The regulariser per density: KL(N(mu, var) || N(mu_0, sigma_0^2)); without the mean's
    term when mu_0 > 0 (the authors' code, as the original's)."""
    v0 = sigma_0**2
    kl = 0.5 * (variance / v0 - torch.log(variance / v0) - 1)
    if mu_0 > 0:
        return kl
    return kl + 0.5 * (mu - mu_0) ** 2 / v0


__all__ = ["BASIS_SIGMAS", "RIDGE_PENALTY", "STICKY_BINS", "basis", "basis_on", "bin_mass", "evaluate", "even_samples",
           "fit", "gaussian_expectation", "infinity_positions", "kl_to_prior", "matrices", "padded_positions",
           "regression_matrix", "resolved_basis_count", "sticky_positions"]
