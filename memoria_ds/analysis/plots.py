"""The memory plots as PNG files (matplotlib, no display needed), each with its data as CSV beside it.

    reminded_ltm_age  paper Figure 5: mean age of the reminded LTM engrams over steps
    ltm_creation      paper Figure 6: creation time of the surviving LTM engrams (primacy / recency)
    edge_weight_age   paper Figure 8: edge weight against the creation-step difference of two engrams
    edge_weight_zoom  paper Figure 9: mean edge weight per age difference, differences up to 300
    memory_kinds      engrams per kind (and evictions) over steps
    lifespans         remaining lifespan of the live engrams, per kind

Every function takes plain arrays and a path `X.png`, writes `X.png` and `X.csv`, and
returns the PNG's path. Figures are drawn on `matplotlib.figure.Figure` (no pyplot state).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure


def _save(fig: Figure, path: str | os.PathLike, header: Sequence[str], rows) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, wrap=True)


def reminded_ltm_age(steps: Sequence[float], ages: Sequence[float], path: str | os.PathLike, *,
                     xlabel: str = "step", title: str = "Mean age of reminded LTM engrams") -> Path:
    """Figure 5. `ages` may hold NaN (no LTM engram reminded at that step): shown as gaps."""
    steps, ages = np.asarray(steps, float), np.asarray(ages, float)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ok = np.isfinite(ages)
    if ok.any():
        ax.plot(steps, ages, lw=0.8, color="tab:blue", marker="." if ok.sum() < 60 else None)
        fit = np.polyfit(steps[ok], ages[ok], 1) if ok.sum() > 1 else None
        if fit is not None:
            ax.plot(steps[ok], np.polyval(fit, steps[ok]), "--", color="tab:red", lw=1, label=f"trend {fit[0]:+.3g}/step")
            ax.legend(loc="upper left")
    else:
        _note(ax, "no LTM engram was reminded in this trace")
    ax.set(xlabel=xlabel, ylabel="age (steps since creation)", title=title)
    return _save(fig, path, ["step", "reminded_ltm_age"], zip(steps.tolist(), ages.tolist()))


def _kde(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Gaussian kernel density (Scott's bandwidth) of `x` on `grid`."""
    bw = 1.06 * x.std() * len(x) ** (-1 / 5) if len(x) > 1 and x.std() > 0 else 1.0
    z = (grid[:, None] - x[None, :]) / bw
    return np.exp(-0.5 * z**2).sum(axis=1) / (len(x) * bw * math.sqrt(2 * math.pi))


def ltm_creation(percent: np.ndarray, path: str | os.PathLike, *, bins: int = 20, source: str = "") -> Path:
    """Figure 6: histogram of creation times (percent of the steps) of surviving LTM engrams, with a KDE."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    counts, edges = np.histogram(percent, bins=bins, range=(0, 100))
    if len(percent):
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="tab:blue", alpha=0.6, edgecolor="white")
        grid = np.linspace(0, 100, 200)
        ax.plot(grid, _kde(percent, grid) * len(percent) * (100 / bins), color="tab:red", lw=1.2, label="KDE")
        ax.legend()
    else:
        _note(ax, "no engram in long-term memory")
    ax.set(xlabel="creation time (% of the steps)", ylabel="surviving LTM engrams",
           title=f"Creation time of surviving LTM engrams ({len(percent)})" + (f"\n{source}" if source else ""))
    return _save(fig, path, ["bin_start_percent", "bin_end_percent", "engrams"],
                 zip(edges[:-1].tolist(), edges[1:].tolist(), counts.tolist()))


def edge_weight_age(age: np.ndarray, weight: np.ndarray, path: str | os.PathLike, *, source: str = "") -> Path:
    """Figure 8: 2-D histogram of (age difference, weight) over linked pairs, mean over all pairs on top."""
    from .memory_data import mean_by_age

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    linked = weight > 0
    ages, mean_all, n_all = mean_by_age(age, weight)
    linked_ages, linked_mean, _ = mean_by_age(age[linked], weight[linked])
    linked_by_age = dict(zip(linked_ages.tolist(), linked_mean.tolist()))
    if linked.any():
        hb = ax.hist2d(age[linked], weight[linked], bins=(min(60, int(age.max()) + 1), 40), cmap="viridis",
                       norm=LogNorm())
        fig.colorbar(hb[3], ax=ax, label="linked pairs")
        ax.plot(ages, mean_all, color="tab:red", lw=1.2, label="mean over all pairs (0 if unlinked)")
        ax.legend(loc="upper right")
    else:
        _note(ax, "no two live engrams were ever reminded together")
    ax.set(xlabel="age difference (creation steps)", ylabel="edge weight Count[i,j] / Count[i,i]",
           title="Edge weight against age difference" + (f"\n{source}" if source else ""))
    rows = [(a, m, n, linked_by_age.get(a, 0.0)) for a, m, n in zip(ages.tolist(), mean_all.tolist(), n_all.tolist())]
    return _save(fig, path, ["age_difference", "mean_weight_all_pairs", "pairs", "mean_weight_linked_pairs"], rows)


def edge_weight_zoom(age: np.ndarray, weight: np.ndarray, path: str | os.PathLike, *, max_age: int = 300,
                     source: str = "") -> Path:
    """Figure 9: mean edge weight (all pairs) per age difference, differences up to `max_age`."""
    from .memory_data import mean_by_age

    ages, mean, n = mean_by_age(age, weight)
    keep = ages <= max_age
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    if keep.any():
        ax.scatter(ages[keep], mean[keep], s=8, color="tab:blue")
    else:
        _note(ax, "no pair of live engrams")
    right = min(max_age, int(ages[keep].max())) if keep.any() else max_age  # the axis ends where the data ends
    ax.set(xlabel="age difference (creation steps)", ylabel="mean edge weight", xlim=(-2, right + 2),
           title=f"Mean edge weight, age differences <= {max_age}" + (f"\n{source}" if source else ""))
    return _save(fig, path, ["age_difference", "mean_weight", "pairs"],
                 zip(ages[keep].tolist(), mean[keep].tolist(), n[keep].tolist()))


def memory_kinds(records: Sequence[dict], path: str | os.PathLike, *, xlabel: str = "step",
                 title: str = "Engrams per kind") -> Path:
    """Engrams per kind (mean over rows) and evictions over steps, from trace or metrics records.

    The statistics are taken after each step's memorize, when the step's working memory has
    already become STM, so `wm` is 0 by construction: it is kept in the CSV, and drawn only if
    it is ever non-zero (a zero line hides under the axis)."""
    keys = ["memory/wm", "memory/stm", "memory/ltm", "memory/evicted"]
    rows = [r for r in records if "memory/ltm" in r]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    steps = [r["step"] for r in rows]
    for k in keys:
        if k == "memory/wm" and not any(r.get(k) for r in rows):
            continue
        if rows and k in rows[0]:
            ax.plot(steps, [r.get(k, math.nan) for r in rows], label=k.split("/")[1], lw=1)
    if rows:
        ax.legend()
    else:
        _note(ax, "no memory statistics (not a Memoria model?)")
    ax.set(xlabel=xlabel, ylabel="engrams per row", title=title)
    return _save(fig, path, ["step", *keys], ([r["step"], *[r.get(k, "") for k in keys]] for r in rows))


def lifespans(by_kind: dict[str, np.ndarray], path: str | os.PathLike, *, source: str = "") -> Path:
    """Histogram of the remaining lifespans of live engrams, per kind."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    values = [v for v in by_kind.values() if len(v)]
    top = max((float(v.max()) for v in values), default=1.0)
    bins = np.linspace(0, max(top, 1.0), 40)
    for name, v in by_kind.items():
        if len(v):
            ax.hist(v, bins=bins, alpha=0.55, label=f"{name} ({len(v)})")
    if values:
        ax.legend()
        ax.set_yscale("log")
    else:
        _note(ax, "the memory is empty")
    ax.set(xlabel="remaining lifespan", ylabel="engrams",
           title="Lifespans of live engrams" + (f"\n{source}" if source else ""))
    return _save(fig, path, ["kind", "lifespan"], ((k, float(x)) for k, v in by_kind.items() for x in v.tolist()))


__all__ = ["edge_weight_age", "edge_weight_zoom", "lifespans", "ltm_creation", "memory_kinds", "reminded_ltm_age"]
