"""One table per recipe: every variant against the plain model of the same seed, and its price.

Per variant (mean and half the range over seeds, as the lab notebook reports them):
- quality: held-out perplexity per text (books) or answer accuracy (sorting);
- against `transformer` of the same seed (same data, same starting backbone): the perplexity's
  change in %, or the accuracy's in points, as mean (min..max) over the paired seeds;
- the memory gain: what the trained model gets from its memory (books: the NLL with the memory
  reset before every segment minus with it carried, nats/token; sorting: the accuracy's points
  over the same model with its memory reset);
- the price, from `benchmarks/model_step.py` records: one forward + backward's CPU time and
  compute ops (aten ops without views, what a host-bound GPU launches) against the plain
  model's, and the GPU step's time where a GPU run recorded it; and the run's own CPU time
  where this command ran it.

The headline (the figure's y): the perplexity change averaged over the held-out texts, sign
flipped so that up is better, or the accuracy points; its bar is the seed range's half,
averaged over the texts likewise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from .recipes import METRICS, MixedRecipes, describe, price_key
from .store import Comparison

PLAIN = "transformer"
CPU_SETTING = "cpu-small"  # model_step.py --shape small --batch 4 --segment 150 --threads 1 (docs/benchmarks.md)


@dataclass
class Spread:
    mean: float
    lo: float
    hi: float
    n: int

    @property
    def half(self) -> float:
        return (self.hi - self.lo) / 2

    @classmethod
    def of(cls, xs: list[float]) -> "Spread":
        return cls(statistics.fmean(xs), min(xs), max(xs), len(xs))


@dataclass
class Row:
    """One variant of a comparison."""

    variant: str
    label: str
    seeds: list[int]
    quality: dict[str, tuple[float, float]]  # text (or "accuracy") -> (mean, half-range)
    vs_plain: dict[str, Spread] = field(default_factory=dict)  # text -> paired change
    gain: tuple[float, float] | None = None  # (mean, half-range)
    gain_seeds: int = 0  # how many seeds the gain is over (a run may predate the reading without memory)
    price: dict[str, float] = field(default_factory=dict)  # cpu_step, compute_ops, ops, gpu_step, run_cpu_min
    dates: list[str] = field(default_factory=list)

    @property
    def headline(self) -> tuple[float, float] | None:
        """(quality above the plain model, up is better; its half-range), averaged over the texts."""
        if not self.vs_plain:
            return None
        sign = -1.0 if "accuracy" not in self.vs_plain else 1.0
        return (sign * statistics.fmean(s.mean for s in self.vs_plain.values()),
                statistics.fmean(s.half for s in self.vs_plain.values()))


@dataclass
class Table:
    comparison: Comparison
    metric: str
    texts: list[str]
    rows: list[Row]
    notes: list[str]


def build(c: Comparison, prices: list[dict[str, Any]], cpu_setting: str = CPU_SETTING) -> Table:
    """The table of one comparison: rows in order, the plain model first, then best first.

    Raises:
        ValueError: a variant given per seed and as a summary both, or a record without its measure.
    """
    metric = METRICS.get(c.recipe.get("task"), "ppl")
    by_variant: dict[str, list[dict]] = {}
    for r in c.records:
        by_variant.setdefault(r["variant"], []).append(r)
    plain = {r["seed"]: r for r in by_variant.get(PLAIN, []) if "seed" in r}
    _check_updates(c, plain)
    texts = _texts(c.records, metric)
    rows, notes = [], []
    for variant, records in by_variant.items():
        summaries = [r for r in records if "summary" in r]
        if summaries and len(records) > 1:
            raise ValueError(f"{variant}: given per seed and as a summary ({records[0]['_where']}); give one")
        row = _from_summary(variant, summaries[0], texts) if summaries else _from_seeds(variant, records, plain,
                                                                                         texts, metric)
        row.price.update(_price(variant, prices, cpu_setting))
        run_cpu = [r["cpu_s"] for r in records if r.get("cpu_s")]
        if run_cpu and len(run_cpu) == len(records):
            row.price["run_cpu_min"] = statistics.fmean(run_cpu) / 60
        rows.append(row)
    if PLAIN not in by_variant:
        notes.append(f"no `{PLAIN}` run of this recipe: nothing to pair the variants with")
    rows.sort(key=lambda r: (r.variant != PLAIN, -(r.headline or (float("-inf"), 0))[0]))
    return Table(c, metric, texts, rows, notes)


def _check_updates(c: Comparison, plain: dict[int, dict]) -> None:
    """A variant trained with another number of updates than the plain model (a run option such
    as `run.bptt_example` where the answer spans several segments) is another schedule.

    Raises:
        MixedRecipes: naming the variant, both counts and the file.
    """
    counts = {r["updates"] for r in plain.values() if "updates" in r}
    for r in c.records:
        if "updates" in r and counts and r["updates"] not in counts:
            raise MixedRecipes(f"{r['_where']}: {r['variant']} made {r['updates']} updates, the plain model "
                               f"{sorted(counts)[0]}: another update schedule, not comparable in one table; drop its "
                               f"run options (e.g. run.bptt_example) or compare it where the answer is in one segment")


def _texts(records: list[dict], metric: str) -> list[str]:
    if metric == "accuracy":
        return ["accuracy"]
    out: list[str] = []
    for r in records:
        for text in (r.get("ppl") or r.get("summary", {}).get("quality") or {}):
            if text not in out:
                out.append(text)
    return out


def _quality(r: dict, metric: str) -> dict[str, float]:
    if metric == "accuracy":
        return {"accuracy": 100 * r["accuracy"]}
    return dict(r["ppl"])


def _from_seeds(variant: str, records: list[dict], plain: dict[int, dict], texts: list[str], metric: str) -> Row:
    records = sorted(records, key=lambda r: r["seed"])
    for r in records:
        if (metric == "accuracy" and "accuracy" not in r) or (metric == "ppl" and "ppl" not in r):
            raise ValueError(f"{r['_where']}: {variant} seed {r['seed']} has no {metric}")
    qualities = [_quality(r, metric) for r in records]
    quality = {t: (Spread.of([q[t] for q in qualities]).mean, Spread.of([q[t] for q in qualities]).half)
               for t in texts if all(t in q for q in qualities)}
    row = Row(variant, records[0].get("label", ""), [r["seed"] for r in records], quality,
              dates=sorted({r["date"] for r in records if r.get("date")}))
    paired = [(r, q, _quality(plain[r["seed"]], metric)) for r, q in zip(records, qualities) if r["seed"] in plain]
    if paired and variant != PLAIN:
        for t in texts:
            if metric == "accuracy":
                changes = [q[t] - p[t] for _, q, p in paired]
            else:
                changes = [100 * (q[t] / p[t] - 1) for _, q, p in paired if t in q and t in p]
            if changes:
                row.vs_plain[t] = Spread.of(changes)
    elif variant == PLAIN:
        row.vs_plain = {t: Spread(0.0, 0.0, 0.0, len(records)) for t in texts}
    gains = [g for g in (_gain(r, metric) for r in records) if g is not None]
    if gains:
        s = Spread.of(gains)
        row.gain, row.gain_seeds = (s.mean, s.half), len(gains)
    return row


def _gain(r: dict, metric: str) -> float | None:
    if metric == "accuracy":
        if "accuracy_memoryless" not in r:
            return None
        return 100 * (r["accuracy"] - r["accuracy_memoryless"])
    return r.get("memory_gain")


def _from_summary(variant: str, r: dict, texts: list[str]) -> Row:
    s = r["summary"]
    quality = {t: tuple(v) for t, v in s["quality"].items()}
    row = Row(variant, r.get("label", ""), list(r["seeds"]), quality, dates=[r["date"]] if r.get("date") else [])
    n = len(r["seeds"])
    row.vs_plain = {t: Spread(v[0], v[1], v[2], n) for t, v in s.get("vs_plain", {}).items()}
    if variant == PLAIN:
        row.vs_plain = {t: Spread(0.0, 0.0, 0.0, n) for t in texts}
    if "memory_gain" in s:
        row.gain, row.gain_seeds = tuple(s["memory_gain"]), n
    return row


def _price(variant: str, prices: list[dict], cpu_setting: str) -> dict[str, float]:
    key, out = price_key(variant), {}
    for p in prices:
        if p["variant"] != key:
            continue
        if p["setting"] == cpu_setting:
            for field_ in ("step_ratio", "compute_ops_ratio", "ops_ratio"):
                if p.get(field_) is not None:
                    out[{"step_ratio": "cpu_step", "compute_ops_ratio": "compute_ops", "ops_ratio": "ops"}[field_]] = p[field_]
        elif p["setting"].startswith("gpu") and p.get("step_ratio") is not None:
            out["gpu_step"] = p["step_ratio"]
    return out


# ------------------------------------------------------------------------------ markdown

def markdown(t: Table, style: str = "full") -> str:
    """The table as markdown: `full` (every text's perplexity and change) or `compact` (the headline)."""
    c, lines = t.comparison, []
    has_run_cpu = any("run_cpu_min" in r.price for r in t.rows)
    has_gpu = any("gpu_step" in r.price for r in t.rows)
    if style == "compact":
        head = ["variant", "seeds", "vs plain, same seed" + (" (accuracy points" if t.metric == "accuracy"
                                                             else " (perplexity %, mean over the texts")
                + " ± half the seed range)",
                "memory gain" + (" (points)" if t.metric == "accuracy" else " (nats/token)")]
    elif t.metric == "accuracy":
        head = ["variant", "seeds", "accuracy %", "vs plain, same seed (points, min..max)", "memory gain (points)"]
    else:
        head = ["variant", "seeds", *(f"{x}: ppl, vs plain % (min..max)" for x in t.texts),
                "memory gain (nats/token)"]
    head += ["CPU step ×", "compute ops ×"] + (["GPU step ×"] if has_gpu else []) + (["run CPU min"] if has_run_cpu else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in t.rows:
        name = r.label or f"`{r.variant}`"
        cells = [name, _seeds(r)]
        if style == "compact":
            h = r.headline
            if h is None:
                cells.append("")
            elif r.variant == PLAIN:
                cells.append("0")
            else:
                shown = -h[0] if t.metric != "accuracy" else h[0]
                cells.append(f"{shown:+.1f} ± {h[1]:.1f}" if len(r.seeds) > 1 else f"{shown:+.1f}")
        elif t.metric == "accuracy":
            q = r.quality.get("accuracy")
            cells.append(_mean_half(q, ".1f", len(r.seeds)) if q else "")
            cells.append(_change(r, "accuracy", ".1f"))
        else:
            for x in t.texts:
                q = r.quality.get(x)
                change = _change(r, x, ".1f")
                cells.append(f"{q[0]:.1f}" + (f", {change}" if change and r.variant != PLAIN else "") if q else "")
        cells.append(_gain_cell(r, t.metric))
        cells += [_ratio(r.price.get("cpu_step")), _ratio(r.price.get("compute_ops"))]
        if has_gpu:
            cells.append(_ratio(r.price.get("gpu_step")))
        if has_run_cpu:
            cells.append(f"{r.price['run_cpu_min']:.1f}" if "run_cpu_min" in r.price else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seeds(r: Row) -> str:
    return ", ".join(str(s) for s in r.seeds)


def _mean_half(q: tuple[float, float], fmt: str, n: int) -> str:
    return f"{q[0]:{fmt}} ± {q[1]:{fmt}}" if n > 1 else f"{q[0]:{fmt}}"


def _change(r: Row, text: str, fmt: str) -> str:
    s = r.vs_plain.get(text)
    if s is None:
        return ""
    if r.variant == PLAIN:
        return "0"
    paired = f" ({s.n} seed{'s' if s.n > 1 else ''} paired)" if s.n < len(r.seeds) else ""
    if s.n == 1:
        return f"{s.mean:+{fmt}}{paired}"
    return f"{s.mean:+{fmt}} ({s.lo:+{fmt}}..{s.hi:+{fmt}}){paired}"


def _gain_cell(r: Row, metric: str) -> str:
    if r.variant == PLAIN or r.gain == (0.0, 0.0):
        return "0"
    if r.gain is None:
        return ""
    fmt = ".1f" if metric == "accuracy" else ".3f"
    text = f"{r.gain[0]:+{fmt}} ± {r.gain[1]:{fmt}}" if r.gain_seeds > 1 else f"{r.gain[0]:+{fmt}}"
    return text + (f" ({r.gain_seeds} seed{'s' if r.gain_seeds > 1 else ''})" if r.gain_seeds < len(r.seeds) else "")


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def measured(t: Table) -> str:
    """`Measured FIRST to LAST.` over the rows' dates (a date may be a span, `2026-11-26/27`)."""
    days = []
    for d in (d for r in t.rows for d in r.dates):
        days.append(d[:10])
        if "/" in d:
            days.append(d[:8] + d.split("/")[-1])
    if not days:
        return ""
    first, last = min(days), max(days)
    return f"Measured {first}" + (f" to {last}" if last != first else "") + "."


def heading(t: Table) -> str:
    """The line above a table: the recipe, stated once."""
    return describe(t.comparison.recipe) + "."


def footnotes(t: Table) -> str:
    """Labels spelled out, and what is missing."""
    out = [f"{r.label} = `{r.variant}`" for r in t.rows if r.label]
    lines = [("; ".join(out) + ".") if out else ""]
    lines += [n + "." for n in t.notes]
    return "\n".join(x for x in lines if x)
