"""A guard on host-side cost: the aten operations each memory kind dispatches per training step, and the
Memoria engine's per step, counted and compared with the committed figures (benchmarks/op_counts.json).

    python benchmarks/op_counts.py                  # count, compare; exit 1 naming each count that rose
    python benchmarks/op_counts.py --write          # count and record (after a change that moves a count)
    python benchmarks/op_counts.py --write --groups gpt2 --variants memorizing   # record those variants only
    python benchmarks/op_counts.py --groups ci      # only the CI shape (seconds; tests/launch/test_op_counts.py)
    python benchmarks/op_counts.py --markdown       # the recorded figures as docs/benchmarks.md's table

On a GPU a memory kind costs what its host side costs: each dispatched operation is at least one kernel
launch, and the engine's eager step once got 1.8x slower between two versions without any CPU timing
noticing. A count does not depend on timing, threads or load, so it can fail CI where a timed test cannot.

Groups (`--groups`, comma separated; default all):
    ci       every preset of `memoria_ds.model.config.PRESETS` and the `memory_read="self_attention"`
             variants, 2 layers x 64 wide, 4 heads, vocabulary 512, batch 2, segment 16 (what CI checks)
    gpt2     the same variants at the `gpt2` shape of docs/benchmarks.md: 12 x 768, 12 heads, GPT-2's
             50,257-token vocabulary, batch 2, segment 64 (minutes on a CPU: recorded for the docs)
    engine   the Memoria engine alone, one `remind` + `memorize`: `paper` (N_wm = K_stm = K_ltm = 50,
             C_stm = 400, depth 10, B = 4, D = 768, as benchmarks/memory_step.py), `small`, and
             `paper_gpu_path`: `paper` on meta tensors, where the engine takes the paths it takes
             on a GPU (fewer operations; on a CPU it tunes for the cache), counted without one

A model step is the third forward + backward of a model with random weights, its memory warm (a
Memoria memory after 40 engine steps on random engrams, a Memorizing Transformer's full to its cap,
as benchmarks/model_step.py does; the others after the two steps before), with row 0 reset before it
(`reset=[True, False]`, as the training loop passes a reset mask every step). An engine step is the
41st. `ops` counts every aten operation (a TorchDispatchMode); `compute` leaves out the views
(`view`, `transpose`, `expand`, `detach`, ...: host-side metadata, no kernel launched).

The check fails when a count rose by more than 2% or 5 operations, whichever is larger; a count that
fell, a variant not yet recorded or a torch version other than the recorded one is reported, and
`--write` records the new figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import GPT2Config

from memoria_ds.memory import MemoriaConfig, MemoryState, memorize, remind
from memoria_ds.model import PRESETS, build_model

from model_step import OpCounter, prefill  # noqa: E402  (benchmarks/: the `--ops` counter and its rules)
from recipe import parse_variant  # noqa: E402  (`preset+key=value` variant names)

FIGURES = Path(__file__).with_name("op_counts.json")
COMMAND = "python benchmarks/op_counts.py --write"
MARGIN_FRACTION, MARGIN_OPS = 0.02, 5

SHAPES = {
    "ci": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=2, segment=16),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, batch=2, segment=64),
}
VARIANTS = [
    *PRESETS,
    "memoria+memory_read='self_attention'",
    "xl+memoria", "xl+memoria_gated",  # composites (the `memorizing` preset is one)
]
ENGINE_SIZES = {
    "paper": dict(batch=4, dim=768, num_wm=50, num_stm_reminded=50, num_ltm_reminded=50, stm_capacity=400,
                  search_depth=10),
    "small": dict(batch=2, dim=32, num_wm=4, num_stm_reminded=4, num_ltm_reminded=4, stm_capacity=16,
                  search_depth=3),
}
# `paper` as a GPU dispatches it: on meta tensors the engine takes its non-CPU form (the digest in one
# product, one scoring matmul, int64 edge keys from one mixed-dtype add; `state.CACHE_TUNED_DEVICES`)
ENGINE_SIZES["paper_gpu_path"] = dict(ENGINE_SIZES["paper"], device="meta")
GROUPS = ("ci", "gpt2", "engine")
WARM_ENGINE_STEPS = 40


def count_model_step(variant: str, shape: str) -> dict:
    """`{"ops", "compute", "by_op"}` of one training step of `variant` at `shape` (see the module docstring)."""
    s = SHAPES[shape]
    preset, settings, _ = parse_variant(variant)
    torch.manual_seed(0)
    V = s["vocab_size"]
    backbone = GPT2Config(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=V - 1,
                          eos_token_id=V - 1, **{k: s[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")})
    settings.setdefault("segment_length", s["segment"])  # the infinity-former's basis: one function per token
    model = build_model(backbone, preset, memory_init="random", attn_implementation="sdpa", **settings).train()
    B, L = s["batch"], s["segment"]
    memory = model.empty_memory(B, "cpu")
    prefill(model, memory, WARM_ENGINE_STEPS)
    tokens = torch.randint(0, V, (B, 3 * L), generator=torch.Generator().manual_seed(0))
    keep = torch.zeros(B, dtype=torch.bool)
    reset = keep.clone()
    reset[0] = True
    for t in range(3):
        x = tokens[:, t * L : (t + 1) * L]
        counter = OpCounter() if t == 2 else None
        with counter if counter is not None else nullcontext():
            out = model(x, labels=x, memory=memory, reset=reset if counter is not None else keep)
            out.loss.backward()
        memory = out.memory.detach_()  # one segment per step, as training's optim.bptt_segments=1
        model.zero_grad(set_to_none=True)
    return counter.result()


def count_engine_step(size: str) -> dict:
    """`{"ops", "compute", "by_op"}` of one Memoria engine step (`remind` + `memorize`), memory warm."""
    s = dict(ENGINE_SIZES[size])
    batch, dim, device = s.pop("batch"), s.pop("dim"), torch.device(s.pop("device", "cpu"))
    cfg = MemoriaConfig(**s)
    state = MemoryState.empty(cfg, batch, dim, device=device)
    gen = torch.Generator().manual_seed(0)
    for t in range(WARM_ENGINE_STEPS + 1):
        wm = torch.randn(batch, cfg.num_wm, dim, generator=gen).to(device)
        slots = cfg.num_stm_reminded + cfg.num_ltm_reminded  # M_rem: padded to K_stm + K_ltm
        weights = torch.softmax(torch.randn(batch, slots, generator=gen), dim=-1).to(device)  # stands in for attention
        counter = OpCounter() if t == WARM_ENGINE_STEPS else None
        with counter if counter is not None else nullcontext():
            retrieval = remind(state, wm, cfg)
            memorize(state, retrieval, weights, cfg)
    return counter.result()


def count(groups: list[str], variants: list[str] | None = None, progress: bool = False) -> dict:
    """The counts of `groups`: `{group: {name: {"ops", "compute", "by_op"}}}`."""
    out: dict[str, dict] = {}
    for group in groups:
        names = list(ENGINE_SIZES) if group == "engine" else (variants or VARIANTS)
        out[group] = {}
        for name in names:
            if progress:
                print(f"counting {group} {name}", file=sys.stderr, flush=True)
            out[group][name] = count_engine_step(name) if group == "engine" else count_model_step(name, group)
    return out


def allowed_rise(recorded: int) -> int:
    """How many operations a count may rise above its recorded figure: 2% or 5, whichever is larger."""
    return max(MARGIN_OPS, math.ceil(MARGIN_FRACTION * recorded))


def compare(recorded: dict, counted: dict) -> tuple[list[str], list[str]]:
    """(rises beyond the margin, notes) of `counted` against the `recorded` figures' `"counts"`.

    A rise names its group, variant and count, with the operations that rose most; a variant counted
    but never recorded is a failure too (record it with `--write`), so every kind stays guarded.
    """
    rises, notes = [], []
    for group, names in counted.items():
        for name, now in names.items():
            was = recorded.get(group, {}).get(name)
            if was is None:
                rises.append(f"{group} {name}: not in {FIGURES.name}; record it: {COMMAND}")
                continue
            for key in ("ops", "compute"):
                before, after = was[key], now[key]
                if after - before > allowed_rise(before):
                    rises.append(f"{group} {name}: {key} rose {before} -> {after} (+{after - before}, "
                                 f"{100 * (after - before) / before:+.1f}%; margin {allowed_rise(before)})"
                                 + _risen_ops(was.get("by_op", {}), now["by_op"]))
                elif after < before:
                    notes.append(f"{group} {name}: {key} fell {before} -> {after}")
    return rises, notes


def _risen_ops(before: dict, after: dict) -> str:
    change = Counter(after)
    change.subtract(before)
    top = [(op, n) for op, n in change.most_common() if n > 0][:6]
    return "; most risen: " + ", ".join(f"{op} +{n}" for op, n in top) if top else ""


def table(counted: dict, recorded: dict) -> str:
    """Counts per group, the ratio to the plain `transformer` of the same shape, the recorded figure."""
    lines = []
    for group, names in counted.items():
        base = names.get("transformer")
        what = ("one Memoria engine step (remind + memorize)" if group == "engine" else
                "one training step (forward + backward), " + ", ".join(f"{k}={v}" for k, v in SHAPES[group].items()))
        w = max(map(len, names)) + 2
        lines += ["", f"{group}: {what}", f"{'variant' if base else 'size':<{w}}{'ops':>7}{'ratio':>7}{'compute':>9}"
                  f"{'ratio':>7}{'recorded':>11}"]
        for name, c in names.items():
            ratio = f"{c['ops'] / base['ops']:>7.3f}" if base else f"{'':>7}"
            cratio = f"{c['compute'] / base['compute']:>7.3f}" if base else f"{'':>7}"
            was = recorded.get(group, {}).get(name)
            rec = f"{was['ops']}/{was['compute']}" if was else "-"
            lines.append(f"{name:<{w}}{c['ops']:>7}{ratio}{c['compute']:>9}{cratio}{rec:>11}")
    return "\n".join(lines)


def markdown(counts: dict) -> str:
    """The recorded figures as docs/benchmarks.md's table: every kind at `gpt2` and `ci`, then the engine."""
    model = [g for g in ("gpt2", "ci") if g in counts]
    head = "| kind |" + "".join(f" ops, `{g}` | ratio | compute | ratio |" for g in model)
    lines = [head, "|---|" + "---|" * 4 * len(model)]
    for name in counts[model[0]] if model else []:
        preset, *pairs = re.split(r"\+(?=[\w.]+=)", name)  # `xl+memoria` a composite; `+key=value` settings
        label = " + ".join(f"`{part}`" for part in (preset, *pairs))
        cells = ""
        for g in model:
            c, base = counts[g].get(name), counts[g]["transformer"]
            cells += (f" {c['ops']:,} | {c['ops'] / base['ops']:.3f} | {c['compute']:,} | "
                      f"{c['compute'] / base['compute']:.3f} |") if c else " | | | |"
        lines.append(f"| {label} |{cells}")
    if "engine" in counts:
        lines += ["", "| engine step | ops | compute |", "|---|---|---|"]
        lines += [f"| `{n}` | {c['ops']:,} | {c['compute']:,} |" for n, c in counts["engine"].items()]
    return "\n".join(lines)


def load_figures(path: Path = FIGURES) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"counts": {}}


def write_figures(counted: dict, path: Path = FIGURES, merge: bool = False) -> None:
    """Merge `counted` into the figures file: the groups counted replace theirs (with `merge`, only the
    variants counted replace theirs: `--variants`), the others stay."""
    figures = load_figures(path)
    today = datetime.date.today().isoformat()
    for group, names in counted.items():
        figures["counts"][group] = {**figures["counts"].get(group, {}), **names} if merge else names
        figures.setdefault("recorded", {})[group] = {"date": today, "torch": torch.__version__}
    figures = {
        "command": COMMAND,
        "torch": torch.__version__,
        "date": today,
        "margin": f"a count may rise by {MARGIN_FRACTION:.0%} or {MARGIN_OPS} operations, whichever is larger",
        "shapes": SHAPES,
        "engine_sizes": ENGINE_SIZES,
        "recorded": figures["recorded"],
        "counts": {g: figures["counts"][g] for g in GROUPS if g in figures["counts"]},
    }
    # one line per variant: a diff shows which counts moved
    body = ",\n".join(
        f'  "{g}": {{\n' + ",\n".join(f"    {json.dumps(n)}: {json.dumps(c)}" for n, c in names.items()) + "\n  }"
        for g, names in figures.pop("counts").items()
    )
    head = json.dumps(figures, indent=1)[:-2]
    path.write_text(f'{head},\n "counts": {{\n{body}\n }}\n}}\n')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="record the counts in the figures file")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma separated, of {', '.join(GROUPS)}")
    p.add_argument("--variants", default=None, help="comma separated (default: every preset and the "
                   "self-attention reads)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the counts do not depend on them)")
    p.add_argument("--markdown", action="store_true", help="print the recorded figures as docs/benchmarks.md's "
                   "table (counts nothing)")
    p.add_argument("--figures", type=Path, default=FIGURES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(load_figures(a.figures)["counts"]))
        return 0
    groups = a.groups.split(",")
    if unknown := [g for g in groups if g not in GROUPS]:
        raise SystemExit(f"unknown group(s) {unknown}; known: {', '.join(GROUPS)}")
    torch.set_num_threads(a.threads)
    counted = count(groups, a.variants.split(",") if a.variants else None, progress=True)
    figures = load_figures(a.figures)
    print(table(counted, figures["counts"]))
    if a.write:
        write_figures(counted, a.figures, merge=bool(a.variants))
        print(f"\nwrote {a.figures}")
        return 0
    rises, notes = compare(figures["counts"], counted)
    if figures.get("torch") and figures["torch"] != torch.__version__:
        notes.append(f"recorded with torch {figures['torch']}, counted with {torch.__version__}: "
                     f"another torch may dispatch other operations")
    for line in notes:
        print(f"note: {line}")
    if rises:
        print("\nFAILED: operation counts rose beyond the margin "
              f"({MARGIN_FRACTION:.0%} or {MARGIN_OPS} ops, whichever is larger):")
        for line in rises:
            print(f"  {line}")
        print(f"A rise that is intended (a feature that needs the operations): record it with `{COMMAND}`.")
        return 1
    if any("fell" in n for n in notes):
        print(f"\ncounts fell: record the lower figures with `{COMMAND}` so that the guard holds them")
    else:
        print("\nok: no count rose beyond the margin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
