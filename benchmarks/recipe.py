"""The training recipe the CPU-scale benchmarks share (real_text.py, sorting.py, model_step.py):
variant names (`preset+key=value+opt.knob=value`), the optimiser with the toolkit's parameter
groups and schedules, one update, and what a run records of its training (gradient norms by
group, the final residual's norm, the curve in windows)."""

from __future__ import annotations

import ast
import statistics

import torch

from memoria_ds.model import PRESETS
from memoria_ds.train.engine import constant_after, delayed_warmup_decay, param_groups

# Optimiser knobs a variant may set with `+opt.NAME=VALUE` (diagnosis experiments).
OPT_KNOBS = {
    "clip": "joint",  # joint: one global norm over all parameters (the toolkit); separate: backbone and memory apart
    "memory_lr": 1.0,  # learning-rate multiplier of the memory modules
    "memory_delay": 0,  # updates the memory modules wait (lr 0) before their own warm-up (optim.memory_delay_steps)
    "pkm_value_lr": 1e-3,  # the PKM layers' value tables: this constant rate, no weight decay (optim.pkm_value_lr); None: with the rest
}


def parse_variant(spec: str) -> tuple[str, dict, dict]:
    """`preset+key=value+opt.knob=value` -> (preset, model settings, optimiser knobs). The preset may
    be a composite, its parts joined by `+` before the first pair (`xl+memoria+engram_loss=1.0`).

    Raises:
        ValueError: an unknown preset or optimiser knob, a pair without `=`, a knob's bad value.
    """
    parts = spec.split("+")
    first = next((i for i, part in enumerate(parts) if "=" in part), len(parts))
    preset, pairs = "+".join(parts[:first]), parts[first:]
    if parts[0] not in PRESETS:
        raise ValueError(f"unknown preset {parts[0]!r} in {spec!r}; known: {sorted(PRESETS)}")
    joined = [part for part in parts[1:first] if part not in PRESETS]
    if joined:
        raise ValueError(f"{joined[0]!r} in {spec!r} is not key=value (e.g. {parts[0]}+opt.memory_lr=0.3), nor a "
                         f"preset to join (e.g. xl+memoria)")
    settings, knobs = {}, dict(OPT_KNOBS)
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"{pair!r} in {spec!r} is not key=value (e.g. {preset}+opt.memory_lr=0.3)")
        key, value = pair.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        if key.startswith("opt."):
            if key[4:] not in OPT_KNOBS:
                raise ValueError(f"unknown optimiser knob {key!r} in {spec!r}; known: {sorted(OPT_KNOBS)}")
            knobs[key[4:]] = value
        else:
            settings[key] = value
    _check_knobs(spec, knobs)
    return preset, settings, knobs


def _check_knobs(spec: str, knobs: dict) -> None:
    if knobs["clip"] not in ("joint", "separate"):
        raise ValueError(f"opt.clip={knobs['clip']!r} in {spec!r}: joint or separate")
    lr = knobs["memory_lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"opt.memory_lr={lr!r} in {spec!r}: a number above 0")
    delay = knobs["memory_delay"]
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"opt.memory_delay={delay!r} in {spec!r}: a whole number of updates, at least 0")
    value_lr = knobs["pkm_value_lr"]
    if value_lr is not None and (isinstance(value_lr, bool) or not isinstance(value_lr, (int, float)) or
                                 not value_lr > 0):
        raise ValueError(f"opt.pkm_value_lr={value_lr!r} in {spec!r}: a number above 0, or None (the PKM values "
                         f"with the other parameters)")


def optimiser(model, a, knobs):
    """AdamW over the toolkit's groups: backbone and memory modules apart (for the `memory_lr` and
    `clip` knobs), and the PKM layers' value tables last, at `pkm_value_lr`, constant, no weight
    decay (`optim.pkm_value_lr`); a model without PKM layers gets the groups it always had."""
    memory_ids = {id(p) for m in model.memory_modules() for p in m.parameters()}
    value_lr = knobs["pkm_value_lr"]
    value_ids = ({id(p) for p in model.pkm_value_parameters()}
                 if value_lr is not None and hasattr(model, "pkm_value_parameters") else set())
    groups = []
    for g in param_groups(model, a.weight_decay):
        for is_mem in (False, True):
            ps = [p for p in g["params"] if (id(p) in memory_ids) == is_mem and id(p) not in value_ids]
            if ps:
                scale = knobs["memory_lr"] if is_mem else 1.0
                groups.append({**g, "params": ps, "lr": a.lr * scale, "memory": is_mem, "values": False})
    values = [p for p in model.parameters() if id(p) in value_ids and p.requires_grad]
    if values:
        groups.append({"params": values, "weight_decay": 0.0, "lr": value_lr, "memory": True, "values": True})
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    # the toolkit's schedules (optim.memory_delay_steps = the knob memory_delay; the values constant after it)
    span = getattr(a, "bptt", 1)  # updates: one per span of `--bptt` segments
    updates, delay = -(-a.steps // span), int(knobs["memory_delay"]) // span
    factors = [constant_after(delay) if g["values"] else delayed_warmup_decay(updates, 0.06, delay if g["memory"] else 0)
               for g in groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factors)
    return opt, sched


def clip(opt, knobs, max_norm: float) -> float:
    if knobs["clip"] == "joint":
        ps = [p for g in opt.param_groups for p in g["params"]]
        return float(torch.nn.utils.clip_grad_norm_(ps, max_norm))
    norms = []
    for is_mem in (False, True):
        ps = [p for g in opt.param_groups if g["memory"] == is_mem for p in g["params"]]
        if ps:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ps, max_norm)))
    return norms[0]


def group_norms(opt) -> tuple[float, float]:
    """(backbone, memory modules) gradient norms before clipping."""
    out = []
    for is_mem in (False, True):
        grads = [p.grad for g in opt.param_groups if g["memory"] == is_mem for p in g["params"] if p.grad is not None]
        out.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
    return out[0], out[1]


def watch_residual(model):
    """(list, hook handle): the list gets, at every forward until the handle is removed, the
    mean norm of the final residual stream (ln_f's input). A memory path that swamps the
    backbone shows as this growing by orders of magnitude."""
    seen: list[float] = []
    trunk = model.base_model  # GPT-2's `transformer`, a Memory Mosaic's `mosaic`, a MemSizer's `memsizer`
    handle = trunk.ln_f.register_forward_pre_hook(
        lambda _m, args: seen.append(float(args[0].detach().norm(dim=-1).mean())))
    return seen, handle


def curve(losses: list[float], norms: list[tuple[float, float]], residual: list[float], points: int = 20) -> list[dict]:
    """The training curve in `points` windows: mean loss, mean backbone / memory gradient norms,
    and the mean final-residual norm (over the window's forwards, also unscored ones)."""
    size, per = max(1, len(losses) // points), max(1, len(residual) // max(1, len(losses)))
    share = len(norms) / max(1, len(losses))  # 1, or 1/K with one update per K losses (`--bptt`)

    def grads(i: int) -> list[tuple[float, float]]:
        start = int(i * share)
        return norms[start:max(int((i + size) * share), start + 1)] or [(float("nan"), float("nan"))]

    return [{"update": i + size, "loss": statistics.fmean(losses[i:i + size]),
             "grad_backbone": statistics.fmean(n[0] for n in grads(i)),
             "grad_memory": statistics.fmean(n[1] for n in grads(i)),
             "residual_norm": statistics.fmean(residual[i * per:(i + size) * per] or [float("nan")])}
            for i in range(0, len(losses) - size + 1, size)]  # fmt: skip


def update(loss: torch.Tensor, opt, sched, knobs: dict, grad_clip: float,
           norms: list[tuple[float, float]] | None = None) -> float:
    """One optimiser step on `loss` (backward, clipping, step, schedule); returns the loss.
    `norms`, if given, gets this step's (backbone, memory) gradient norms before clipping."""
    loss.backward()
    if norms is not None:
        norms.append(group_norms(opt))
    if grad_clip:
        clip(opt, knobs, grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
