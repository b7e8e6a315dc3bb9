"""Quality against price: one panel per recipe, every variant a point with its seed range."""

from __future__ import annotations

import math
from pathlib import Path

from .table import PLAIN, Table


def draw(tables: list[Table], path: Path) -> list[str]:
    """Write the figure; return the variants left out of it (no price or no plain model to pair).

    x: compute ops of one forward + backward against the plain model's (what a host-bound GPU
    step pays); y: quality above the plain model of the same seed (up is better), with the
    half-range over seeds as the bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(tables)) or 1
    rows = math.ceil(len(tables) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.8 * rows), squeeze=False)
    left_out = []
    for ax, t in zip(axes.flat, tables):
        for r in t.rows:
            h, x = r.headline, r.price.get("compute_ops")
            if h is None or x is None:
                left_out.append(f"{t.comparison.name}: {r.label or r.variant}")
                continue
            colour = "black" if r.variant == PLAIN else None
            bar = h[1] if len(r.seeds) > 1 else None
            ax.errorbar(x, h[0], yerr=bar, fmt="o" if len(r.seeds) > 1 else "s", capsize=3, color=colour,
                        mfc="none" if len(r.seeds) == 1 else None)
            ax.annotate((r.label or r.variant).replace("`", ""), (x, h[0]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xlabel("compute ops per step / the plain model's (CPU count)")
        ax.set_ylabel("accuracy above the plain model (points)" if t.metric == "accuracy"
                      else "held-out perplexity below the plain model (%)")
        ax.set_title(t.comparison.title or t.comparison.name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tables):]:
        ax.set_visible(False)
    fig.text(0.01, 0.005, "up is better; bars: half the range over seeds; hollow squares: one seed", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return left_out
