"""Three moons (Memory Mosaics, Zhang et al. 2024, Section 3): predictive disentanglement, at CPU scale.

Each observation x_t holds three complex numbers exp(i theta_k), the angular positions of three
moons with periods p_1, p_2, p_3. A single-layer network of contextual memory units predicts
x_{t+1} (Figure 3): keys k_t = W_phi x_t, values v_t = W_psi x_{t+1} (peeking one step ahead),
a memory read by kernel smoothing with beta = 50 over the pairs stored so far (t < T), and an
output z_T = W_z y_T. W_phi, W_psi, W_z are 3x3 complex matrices (54 real weights) split over
either one memory unit of C^3 or three units of C^1. The paper's claims, shown here:

- one unit predicts well only after lcm(p_1, p_2, p_3) observations (a full set of moon
  configurations); three units after max(p_1, p_2, p_3): each unit comes to track one moon
  (Figures 4 and 5: generation error over the next 25 steps vs context length);
- the three-unit network's matrices are disentangled: each unit reads and predicts one moon
  (Figure 6: the moduli of the complex coefficients; the "attribution" panels below, one row
  per unit, one column per moon).

The data and training follow the reference code (`ThreeMoons/` of facebookresearch/MemoryMosaics,
written for Apple's MLX): the 9 period triples of {0.5, 1, ..., 3.5} with the smallest lcm, the
largest of them held out for validation; sequences of 800 observations that hold 3 periods of
the slowest system; 500 AdamW steps of 64 sequences, learning rate linear from 1e-2 to 5e-6,
the squared error clipped at 0.5 (here 16 sequences a step by default, to fit a CPU).
Errors are measured as the paper says (the next 25 true
positions against 25 auto-regressive predictions, each prediction's pair stored before the
next is made), averaged over `--eval-batch` sequences of the held-out (or a training) system.

    python benchmarks/three_moons.py --out three_moons            # paper sizes but batch 16: minutes on 1 CPU core
    python benchmarks/three_moons.py --iters 60 --block 400 --out /tmp/moons_quick

Writes `<out>/three_moons.png` and `<out>/three_moons.json` (curves, the disentanglement score:
for each unit of W_phi the share of its modulus on its strongest moon, and whether the
strongest moons of the three units are three different moons).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from functools import reduce
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

BASE_PERIODS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)
PHASE = 0.3
BETA = 50.0  # the memory's fixed kernel sharpness (paper: beta = 50)
TRAIN_SHOWN = 5  # the training system the reference plots (lcm 5 > its slowest period 2.5)


# ---------------------------------------------------------------------------------------------- data
def lcm_tenths(periods) -> float:
    """lcm of half-integer periods, computed on tenths (the reference's lcm_float with precision 1)."""
    return reduce(math.lcm, (int(round(p * 10)) for p in periods)) / 10


def period_sets() -> tuple[list[tuple[float, ...]], tuple[float, ...]]:
    """(training triples, the held-out triple): the 35 // 4 + 1 triples with the smallest lcm, the largest held out."""
    triples = list(itertools.combinations(BASE_PERIODS, 3))
    order = np.argsort(np.array([lcm_tenths(t) for t in triples]))  # the reference's call: the same order among ties
    chosen = [triples[i] for i in order[: len(triples) // 4 + 1]]
    return chosen[:-1], chosen[-1]


class Moons:
    """Sequences of `block + 1` observations (x and its next-step target) of one triple of periods.

    Time runs in steps of 1 / scale, scale = block / max_lcm / min_periods: every training and
    held-out system completes `min_periods` full periods within a block (3 for the paper).
    """

    def __init__(self, block: int, min_periods: int = 3, total: int = 10_000) -> None:
        self.train, self.val = period_sets()
        self.block = block
        self.scale = block / max(lcm_tenths(p) for p in self.train + [self.val]) / min_periods
        self.total = total

    def in_steps(self, periods) -> tuple[float, list[float]]:
        """(lcm, each period) in observation steps."""
        return lcm_tenths(periods) * self.scale, [p * self.scale for p in periods]

    def batch(self, triples, n: int, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        """x, y (n, block, 6): (sin, cos) of each moon, y one step ahead; each row a random triple and start."""
        rows = []
        for _ in range(n):
            periods = triples[rng.integers(len(triples))]
            start = rng.integers(0, self.total - 2 * self.block - 1)
            t = np.arange(start, start + self.block + 1) / self.scale
            angles = np.stack([2 * np.pi / p * t + PHASE for p in periods])  # (3, block + 1)
            rows.append(np.stack([np.sin(angles), np.cos(angles)], 1).reshape(6, -1).T)  # (block + 1, 6)
        data = torch.tensor(np.array(rows), dtype=torch.float32)
        return data[:, :-1], data[:, 1:]


# --------------------------------------------------------------------------------------------- model
class ComplexLinear(nn.Module):
    """A complex matrix (out x in) acting on (re, im) pairs: 2 * out * in real weights."""

    def __init__(self, dim: int, generator: torch.Generator) -> None:
        super().__init__()
        bound = (2 * dim) ** -0.5
        self.re = nn.Parameter((torch.rand(dim, dim, generator=generator) * 2 - 1) * bound)
        self.im = nn.Parameter((torch.rand(dim, dim, generator=generator) * 2 - 1) * bound)

    def matrix(self) -> Tensor:
        """(2 out, 2 in) real: [[re, -im], [im, re]] per coefficient, rows and columns interleaved (re, im)."""
        top = torch.stack([self.re, -self.im], -1)  # (out, in, 2)
        bottom = torch.stack([self.im, self.re], -1)
        return torch.stack([top, bottom], 1).flatten(2).flatten(0, 1)  # (2 out, 2 in)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix().T

    def moduli(self) -> Tensor:
        """(out, in) |coefficient|."""
        return torch.sqrt(self.re**2 + self.im**2)


class MoonMemory(nn.Module):
    """One layer of `heads` contextual memory units over C^3 (Figure 3): 54 real weights whatever `heads`."""

    def __init__(self, heads: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.w_phi, self.w_psi, self.w_z = (ComplexLinear(3, g) for _ in range(3))

    def split(self, x: Tensor) -> Tensor:
        """(B, L, 6) -> (B, H, L, 6 / H)."""
        B, L, _ = x.shape
        return x.view(B, L, self.heads, -1).transpose(1, 2)

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """k_t = W_phi x_t, v_t = W_psi x_{t+1} (the last one not known yet: 0), each (B, H, L, hd)."""
        return self.split(self.w_phi(x)), self.split(F.pad(self.w_psi(x[:, 1:]), (0, 0, 0, 1)))

    def forward(self, x: Tensor) -> Tensor:
        """Teacher-forced predictions z_T of x_{T+1} for every T (0 at T = 0): (B, L, 6)."""
        B, L, _ = x.shape
        k, v = self.keys_values(x)
        past = torch.ones(L, L, dtype=torch.bool).tril(-1)[1:]  # (L-1, L): query T >= 1 reads keys t < T
        y = F.scaled_dot_product_attention(k[:, :, 1:], k, v, attn_mask=past, scale=BETA)  # (B, H, L-1, hd)
        y = F.pad(y, (0, 0, 1, 0))  # T = 0 reads nothing
        return self.w_z(y.transpose(1, 2).reshape(B, L, 6))

    @torch.no_grad()
    def attention(self, x: Tensor) -> Tensor:
        """(B, H, L, L) the memory's read weights (row 0 empty), for plots."""
        k, _ = self.keys_values(x)
        L = x.shape[1]
        att = (BETA * k @ k.transpose(-1, -2)).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(-1), float("-inf"))
        return F.pad(torch.softmax(att[:, :, 1:], -1), (0, 0, 1, 0))

    @torch.no_grad()
    def rollout(self, x: Tensor, context: int, steps: int) -> Tensor:
        """(B, steps, 6): predictions of x_context .. x_{context+steps-1} from x_0 .. x_{context-1},
        each fed back as the next observation; the pair it completes (k_{T-1}, W_psi x_T) is
        stored before the next prediction (the memory's own semantics)."""
        k = self.split(self.w_phi(x[:, :context]))  # (B, H, T, hd)
        v = self.split(self.w_psi(x[:, 1:context]))  # (B, H, T-1, hd): pairs t < T - 1
        out = []
        for _ in range(steps):
            q = k[:, :, -1:]  # the newest key
            if v.shape[2] == 0:
                y = torch.zeros_like(q)
            else:
                y = torch.softmax(BETA * q @ k[:, :, :-1].transpose(-1, -2), -1) @ v  # (B, H, 1, hd)
            z = self.w_z(y.transpose(1, 2).reshape(x.shape[0], 1, 6))  # (B, 1, 6)
            out.append(z)
            k = torch.cat([k, self.split(self.w_phi(z))], 2)
            v = torch.cat([v, self.split(self.w_psi(z))], 2)
        return torch.cat(out, 1)


def clipped_loss(pred: Tensor, target: Tensor) -> Tensor:
    """The reference's: the squared error, each coordinate's error clipped to [-0.5, 0.5]."""
    return (pred - target).clamp(-0.5, 0.5).square().mean()


def train(model: MoonMemory, moons: Moons, iters: int, batch: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - (1 - 5e-6 / 1e-2) * min(i, iters) / iters)
    losses = []
    for _ in range(iters):
        x, y = moons.batch(moons.train, batch, rng)
        loss = clipped_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))  # a CPU toy: one sync per step costs nothing here
    return losses


def generation_error(model: MoonMemory, x: Tensor, contexts: list[int], steps: int) -> list[float]:
    """Mean |x_{T..T+steps-1} - rollout| for each context length T (x holds the true sequence)."""
    return [float((model.rollout(x, T, steps) - x[:, T : T + steps]).abs().mean()) for T in contexts]


def disentanglement(model: MoonMemory) -> dict:
    """Per unit of W_phi (a row group), the share of its modulus on its strongest moon."""
    m = model.w_phi.moduli()  # (out, in): out complex dims grouped by unit
    per_unit = m.view(model.heads, -1, 3).sum(1)  # (H, moons)
    share = (per_unit.max(1).values / per_unit.sum(1)).tolist()
    strongest = per_unit.argmax(1).tolist()
    return {"heads": model.heads, "share_on_strongest_moon": share, "strongest_moon": strongest,
            "distinct_moons": len(set(strongest)) == model.heads}


def plot(path: Path, results: dict) -> None:
    """Learning curves; generation error vs context length (held-out and a training system);
    the moduli of W_phi, W_psi, W_z of each network (rows: output complex dims, unit by unit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 8.5), layout="constrained")
    grid = fig.add_gridspec(2, 6)
    ax = fig.add_subplot(grid[0, 0:2])
    for name, r in results["models"].items():
        ax.plot(r["train_loss"], label=f"{name} ({r['parameters']} weights)")
    ax.set(yscale="log", xlabel="training step", ylabel="clipped squared error", title="learning curves")
    ax.legend()
    for col, split in ((2, "validation"), (4, "train")):
        ax = fig.add_subplot(grid[0, col : col + 2])
        for name, r in results["models"].items():
            ax.plot(results["contexts"], r[f"error_{split}"], label=name)
        lcm, periods = results["periods"][f"{split}_in_steps"]
        for p in periods:
            ax.axvline(p, color="grey", lw=0.8)
        ax.axvline(lcm, color="red", lw=1)
        triple = results["periods"][f"{split}_triple"]
        ax.set(xlabel="context length (observations)", ylabel=f"mean |error|, next {results['steps']} generated",
               title=f"{split} system {triple} (grey: periods, red: lcm)", ylim=(-0.02, None))
        ax.legend()
    for i, (name, mats) in enumerate(results["weights"].items()):
        for j, key in enumerate(("w_phi", "w_psi", "w_z")):
            ax = fig.add_subplot(grid[1, 3 * i + j])
            ax.imshow(np.array(mats[key]), cmap="viridis", vmin=0)
            heads = results["models"][name]["disentanglement"]["heads"]
            ax.set_title(f"{name}: |{key}|", fontsize=9)
            ax.set_xticks(range(3), ["moon 1", "moon 2", "moon 3"], fontsize=7)
            ax.set_yticks(range(3), [f"unit {r * heads // 3 + 1}" for r in range(3)] if heads == 3 else
                          ["dim 1", "dim 2", "dim 3"], fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=500, help="training steps (paper: 500)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (paper: 64; 16 fits a CPU)")
    p.add_argument("--block", type=int, default=800, help="observations per sequence (paper: 800)")
    p.add_argument("--steps", type=int, default=25, help="generated steps scored per context length (paper: 25)")
    p.add_argument("--eval-batch", type=int, default=64, help="sequences the errors average over (paper: 512)")
    p.add_argument("--stride", type=int, default=4, help="score every stride-th context length")
    p.add_argument("--seed", type=int, default=100, help="the reference's seed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("three_moons"))
    a = p.parse_args(argv)
    for name in ("iters", "batch", "steps", "eval_batch", "stride", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    if a.block < 4 * a.steps:
        p.error(f"--block {a.block}: must be at least 4 x --steps ({4 * a.steps})")
    torch.set_num_threads(a.threads)
    moons = Moons(a.block)
    contexts = list(range(2, a.block - a.steps + 1, a.stride))
    rng = np.random.default_rng(a.seed + 1)
    x_val, _ = moons.batch([moons.val], a.eval_batch, rng)
    shown = moons.train[TRAIN_SHOWN]
    x_train, _ = moons.batch([shown], a.eval_batch, rng)
    results = {"contexts": contexts, "steps": a.steps, "models": {}, "weights": {},
               "periods": {"train": [list(t) for t in moons.train], "validation_triple": list(moons.val),
                           "validation_in_steps": moons.in_steps(moons.val), "train_triple": list(shown),
                           "train_in_steps": moons.in_steps(shown)},
               "settings": vars(a) | {"out": str(a.out)}}
    for heads in (1, 3):
        name = f"{heads} head{'s' if heads > 1 else ''}"
        torch.manual_seed(a.seed)
        model = MoonMemory(heads, a.seed)
        start = time.perf_counter()
        losses = train(model, moons, a.iters, a.batch, a.seed)
        seconds = time.perf_counter() - start
        model.eval()
        r = {"train_loss": losses, "train_seconds": seconds,
             "error_validation": generation_error(model, x_val, contexts, a.steps),
             "error_train": generation_error(model, x_train, contexts, a.steps),
             "disentanglement": disentanglement(model), "parameters": sum(q.numel() for q in model.parameters())}
        results["models"][name] = r
        results["weights"][name] = {k: getattr(model, k).moduli().tolist() for k in ("w_phi", "w_psi", "w_z")}
        print(f"{name}: {a.iters} steps in {seconds:.0f} s, final loss {losses[-1]:.5f}, "
              f"W_phi share on strongest moon {[round(s, 2) for s in r['disentanglement']['share_on_strongest_moon']]}")
    a.out.mkdir(parents=True, exist_ok=True)
    plot(a.out / "three_moons.png", results)
    (a.out / "three_moons.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out / 'three_moons.png'} and {a.out / 'three_moons.json'}")
    return results


if __name__ == "__main__":
    main()
