"""Forward+backward step time and peak memory of Memoria GPT-2 against the plain backbone.

All variants run side by side in one invocation, on the same shapes, in interleaved
rounds (so a change of machine load hits them alike), each carrying its memory across
segments exactly as training does; the ratios to the plain backbone are printed at the end.

    python benchmarks/model_step.py                                   # CPU, small config
    python benchmarks/model_step.py --shape gpt2 --device cuda --dtype bf16
    python benchmarks/model_step.py --shape gpt2-large --device cuda --dtype bf16 --batch 8

Shapes (random weights; only the shapes matter for timing):
    small       4 layers, 256 wide, 4 heads, GPT-2's 50,257-token vocabulary
    gpt2        12 x 768, 12 heads        gpt2-large  36 x 1280, 20 heads
    tiny12x64   12 x 64, 4 heads (launch-bound: what each extra small operation costs)
    LxWxH       any other: L layers, W wide, H heads (e.g. 2x32x2, the tests' price shape)

Variants (`--variants`, comma separated): `transformer` (the plain backbone, the
reference of every ratio), `xl`, `compressive`, `infinity` (docs/baselines.md), `memoria`
(the default: the authors' sequential block,
memory attention at 1/8 of the width, every block), `memoria_fast` (the `memoria_fast`
preset: one query and one output projection for both uses), `memoria_full_width` (the
authors' width), `memoria_width=R` (the default block at width R * n_embd),
`memoria_layers=K` (the default block in every K-th block only); `memorizing` (the Memorizing
Transformer's kNN memory, 8192 pairs, prefilled to its cap) and `memorizing_size=M` (M pairs);
`memory_mosaic` (the Memory Mosaic of the same shape, docs/memory_mosaics.md) and
`memory_mosaic_carry` (its contextual memory carried across segments); `memformer` (Memformer's
1,024 slots, one segment per step). A Memoria variant with
`+compile` runs its memory engine compiled (`memory_compile="default"`), with
`+cudagraphs` as CUDA graphs (`"reduce-overhead"`). Any variant with `+model_compile`
runs the *whole* model compiled (`model.compile()`, as `model.compile=default` does in
training: backbone, memory attention, abstractor and engine, forward and backward, one graph
each), with `+model_cudagraphs` as CUDA graphs (`reduce-overhead`); compare
`memoria+model_compile` with `transformer+model_compile` (printed as "vs plain, same mode").
Compilation happens in the untimed warm-up steps (at least 3 for a compiled variant).

The memory has the paper's WikiText-103 settings (N_wm = K_stm = K_ltm = 50, C_stm =
400). Before timing, `--prefill` engine steps with random engrams bring each Memoria
memory near its steady-state occupancy (its cost grows as it fills), then `--warmup`
model steps run untimed. Reported per variant: the median step time (forward + backward)
and its ratio to `transformer` -- on CUDA the wall clock with a sync; on CPU the process's
CPU time, because on a machine shared with other jobs the wall clock of identical steps
swings by several times (the minimum wall clock is printed beside it) -- and
peak memory: CUDA `max_memory_allocated` during the timed steps, or on CPU the peak RSS
of a separate process running `--rss-steps` steps of that variant alone.

`--flops` counts the FLOPs of one forward + backward per variant instead (torch's
FlopCounterMode, eager attention so that attention matmuls are counted): the compute
ratio at GPU shapes, measurable without a GPU.

`--ops` counts the aten operations one forward + backward dispatches per variant (a
TorchDispatchMode over the third step, memory engine included): on a GPU each is at least
one kernel launch, so their ratio is what a host-bound step costs (issue 16's CPU target:
at most 1.5x the plain model at `--shape gpt2 --batch 2 --segment 64`). The most frequent
operations of each variant are printed beside the count. For a `+model_compile` variant,
which dispatches no aten op per operation, it counts the kernels its compiled graphs call
instead (inductor's fused kernels and the library calls, matmuls and attention, that
they make: what the host launches; torch.profiler over the fourth step). The `compute` column
leaves out the views (`view`, `transpose`, `expand`, `detach`, ...), which reshape a tensor on
the host and launch no kernel: the eager count closest to a GPU's kernel launches.
"""

from __future__ import annotations

import argparse
import json
import resource
from collections import Counter
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config

from memoria_ds.memory import memorize, remind
from memoria_ds.compare.recipes import split_variants
from memoria_ds.model import PRESETS, build_model

from failures import from_exception, line_of, run_child  # noqa: E402  (benchmarks/failures.py)
from recipe import parse_variant  # noqa: E402  (benchmarks/recipe.py: `preset+key=value` variant names)

SHAPES = {
    "small": dict(n_layer=4, n_embd=256, n_head=4),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "tiny12x64": dict(n_layer=12, n_embd=64, n_head=4),  # launch-bound: the per-op overhead is the cost
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


COMPILE_SUFFIXES = {"+compile": "default", "+cudagraphs": "reduce-overhead"}  # the engine's `memory_compile`
MODEL_COMPILE_SUFFIXES = {"+model_compile": "default", "+model_cudagraphs": "reduce-overhead"}  # `model.compile()`


def shape_of(name: str) -> dict:
    """A named shape of SHAPES, or `LxWxH` (layers, width, heads; GPT-2's vocabulary).

    Raises:
        argparse.ArgumentTypeError: neither a name nor three positive whole numbers with W a multiple of H.
    """
    if name in SHAPES:
        return SHAPES[name]
    try:
        n_layer, n_embd, n_head = (int(x) for x in name.split("x"))
    except ValueError:
        n_layer = n_embd = n_head = 0
    if min(n_layer, n_embd, n_head) < 1 or n_embd % n_head:
        raise argparse.ArgumentTypeError(f"{name!r}: one of {sorted(SHAPES)} or LxWxH (e.g. 2x32x2; W a multiple of H)")
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head)


def model_compile_mode(name: str) -> tuple[str, str | None]:
    """(the variant without its whole-model compile suffix, that suffix's torch.compile mode or None)."""
    for suffix, mode in MODEL_COMPILE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], mode
    return name, None


def variant_settings(name: str, n_layer: int) -> tuple[str, dict]:
    """(preset, extra `build_model` settings) of a variant name, for a backbone of `n_layer` blocks."""
    for suffix, mode in COMPILE_SUFFIXES.items():
        if name.endswith(suffix):
            preset, extra = variant_settings(name[: -len(suffix)], n_layer)
            return preset, {**extra, "memory_compile": mode}
    if name.startswith("memoria_layers="):
        every = int(name.split("=", 1)[1])
        return "memoria", {"memory_layers": list(range(every - 1, n_layer, every))}
    if name.startswith("memoria_width="):
        return "memoria", {"memory_inner_dim_ratio": float(name.split("=", 1)[1])}
    if name.startswith("memorizing_size="):  # the Memorizing Transformer with a memory of M pairs
        return "memorizing", {"memory_settings": {"memorizing": {"size": int(name.split("=", 1)[1])}}}
    if "+" in name:  # `preset+key=value...`, as real_text.py and sorting.py name a variant (optimiser knobs ignored)
        try:
            preset, settings, _ = parse_variant(name)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        return preset, settings
    presets = tuple(PRESETS)
    if name not in presets:
        raise SystemExit(f"unknown variant {name!r}; known: {sorted(presets)}, memoria_layers=K, memoria_width=R, "
                         f"memorizing_size=M or preset+key=value")
    return name, {}


def make_model(name: str, a: argparse.Namespace) -> torch.nn.Module:
    shape = shape_of(a.shape)
    name, whole = model_compile_mode(name)
    preset, extra = variant_settings(name, shape["n_layer"])
    backbone = GPT2Config(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape)
    extra.setdefault("segment_length", a.segment)  # the infinity-former's basis: one function per token
    model = build_model(backbone, preset, memory_init="random", attn_implementation=a.attn, **extra)
    model = model.to(device=a.device, dtype=DTYPES[a.dtype]).train()
    if whole is not None:
        model.compile(mode=whole, dynamic=False)  # in place, as training's `model.compile` does
    return model


def prefill(model, memory, steps: int) -> None:
    """Fill a Memoria memory with real engine steps on random engrams (model untouched); a
    Memorizing Transformer's kNN memory to its cap with random unit keys (its steady state); a
    composite's parts each so."""
    kinds = model.config.memory_kinds
    if not steps or not {"memorizing", "memoria"} & set(kinds):
        return
    parts = memory.parts() if len(kinds) > 1 else {kinds[0]: memory}
    kind = model.memory_kind
    if "memorizing" in parts:
        part = parts["memorizing"]
        cfg, B = model.config, part.batch_size
        size = (kind.parts["memorizing"] if len(kinds) > 1 else kind).settings.size
        shape = (B, cfg.n_head, size, cfg.n_embd // cfg.n_head)
        gen = torch.Generator().manual_seed(0)
        part.keys = torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1).to(part.device)
        part.values = torch.randn(shape, generator=gen).to(part.device)
        part.mask = torch.ones(B, size, dtype=torch.bool, device=part.device)
    if "memoria" in parts:
        cfg = model.config.memoria_config
        state = parts["memoria"].state
        gen = torch.Generator(device=state.device).manual_seed(0)
        for _ in range(steps):
            wm = torch.randn(state.batch_size, cfg.num_wm, state.dim, generator=gen, device=state.device)
            r = remind(state, wm, cfg)
            memorize(state, r, torch.rand(r.reminded_slots.shape, generator=gen, device=state.device), cfg)


class Runner:
    """One variant: its model, its memory, its data stream, one timed step at a time."""

    def __init__(self, name: str, a: argparse.Namespace) -> None:
        self.name, self.a = name, a
        torch.manual_seed(a.seed)
        self.model = make_model(name, a)
        self.memory = self.model.empty_memory(a.batch, a.device)
        prefill(self.model, self.memory, a.prefill)
        gen = torch.Generator().manual_seed(a.seed)
        self.tokens = torch.randint(0, self.model.config.vocab_size, (a.batch, a.segment * 8), generator=gen).to(
            a.device
        )
        self.t = 0
        self.times: list[float] = []  # wall clock
        self.cpu_times: list[float] = []  # CPU time of this process (all its threads)

    def step(self, timed: bool) -> None:
        a = self.a
        start = (self.t % 8) * a.segment
        x = self.tokens[:, start : start + a.segment]
        self.t += 1
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        out = self.model(x, labels=x, memory=self.memory)
        out.loss.backward()
        self.memory = out.memory.detach_()  # one segment per step, as training's optim.bptt_segments=1
        sync()
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)
        self.model.zero_grad(set_to_none=True)


def flops_of(name: str, a: argparse.Namespace) -> float:
    """FLOPs of one forward + backward (torch's FlopCounterMode; matmuls and attention).

    Shapes are static (M_rem is padded to K_stm + K_ltm), so one step on a fresh memory
    counts what every step costs; the memory engine's own work (sorting, gathers) is not
    matmul work and is not counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    r = Runner(name, a)
    r.step(timed=False)  # the first segment has no memory; count the second
    with FlopCounterMode(display=False) as counter:
        r.step(timed=False)
    return float(counter.get_total_flops())


def ops_of(name: str, a: argparse.Namespace) -> tuple[int, list[tuple[str, int]]]:
    """aten ops dispatched by one forward + backward (the third step: memory in use), and the
    most frequent ones; for a whole-model compiled variant, the kernels its graphs call."""
    if model_compile_mode(name)[1] is not None:
        return kernels_of(name, a)
    r = Runner(name, a)
    r.step(timed=False)
    r.step(timed=False)
    with OpCounter() as counter:
        r.step(timed=False)
    return sum(counter.by_op.values()), counter.by_op.most_common(), counter.compute


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name, and those that are not views."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.compute = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[func.overloadpacket.__name__] += 1
        self.compute += not is_metadata_only(func)
        return func(*args, **(kwargs or {}))

    def result(self) -> dict:
        return {"ops": sum(self.by_op.values()), "compute": self.compute, "by_op": dict(sorted(self.by_op.items()))}


def is_metadata_only(func) -> bool:
    """A view (`view`, `transpose`, `expand`, `detach`, ...; its schema says it aliases its input) or
    `_unsafe_view`: it changes a tensor's shape or strides on the host and launches no kernel."""
    return bool(getattr(func, "is_view", False)) or func.overloadpacket.__name__ in ("_unsafe_view", "lift_fresh")


def kernels_of(name: str, a: argparse.Namespace) -> tuple[int, list[tuple[str, int]]]:
    """Kernels called by the compiled graphs of one forward + backward (the fourth step), by name.

    A TorchDispatchMode would make dynamo run the model eagerly, so torch.profiler is used:
    every event directly under a compiled graph's call ("## Call CompiledFxGraph ... ##") is
    one kernel of inductor's or one library call (mm, addmm, bmm, attention).
    """
    from collections import Counter

    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    inductor_config.cpp.enable_kernel_profile = True  # name inductor's C++ kernels in the profile
    r = Runner(name, a)
    for _ in range(3):
        r.step(timed=False)
    cuda = [ProfilerActivity.CUDA] if a.device.startswith("cuda") else []
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        r.step(timed=False)
    kernels: Counter[str] = Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if parent is not None and parent.name.startswith("## Call CompiledFxGraph"):
            kernels["inductor kernel" if e.name.startswith(("graph_", "triton_")) else e.name] += 1
    return sum(kernels.values()), kernels.most_common(), sum(kernels.values())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rss_of(name: str, a: argparse.Namespace) -> float:
    """Peak RSS (MiB) of a fresh process running `--rss-steps` steps of one variant."""
    cmd = [sys.executable, __file__, "--worker", name, *sys.argv[1:]]
    out = run_child(cmd, f"the {name!r} RSS worker").stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


def worker(a: argparse.Namespace) -> None:
    r = Runner(a.worker, a)
    for _ in range(a.rss_steps):
        r.step(timed=False)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: unlike ru_maxrss it is not inherited from the parent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", help=f"{', '.join(sorted(SHAPES))} or LxWxH (layers, width, heads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--segment", type=int, default=150)
    p.add_argument("--variants", default="transformer,xl,memoria,memoria_fast,memoria_full_width")
    p.add_argument("--rounds", type=int, default=10, help="timed steps per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefill", type=int, default=40, help="engine steps that fill the memory before timing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--rss", action="store_true", help="also measure peak RSS per variant on CPU (subprocesses)")
    p.add_argument("--rss-steps", type=int, default=3)
    p.add_argument("--flops", action="store_true", help="count FLOPs per variant instead of timing")
    p.add_argument("--ops", action="store_true", help="count dispatched aten ops per variant instead of timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        shape_of(a.shape)
    except argparse.ArgumentTypeError as e:
        p.error(f"--shape {e}")
    torch.set_num_threads(a.threads)
    if a.worker:
        return worker(a)

    try:
        names = split_variants(a.variants)
    except ValueError as e:
        p.error(str(e))
    if names[0] != "transformer":
        names = ["transformer"] + [n for n in names if n != "transformer"]
    if a.ops:
        counts = {n: ops_of(n, a) for n in names}
        print(f"\naten ops of one forward + backward (+model_*: kernels called): shape={a.shape} batch={a.batch} "
              f"segment={a.segment}; compute = without views (no kernel launched)")
        print(f"{'variant':<20}{'ops':>8}{'ratio':>8}{'compute':>9}{'ratio':>8}   most frequent")
        base_total, _, base_compute = counts[names[0]]
        for n in names:
            total, common, compute = counts[n]
            top = ", ".join(f"{op} {c}" for op, c in common[:6])
            print(f"{n:<20}{total:>8}{total / base_total:>8.3f}{compute:>9}{compute / base_compute:>8.3f}   {top}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "ops": {n: c[0] for n, c in counts.items()},
                           "compute_ops": {n: c[2] for n, c in counts.items()}}, f, indent=2)
        return
    if a.flops:
        a.attn = "eager"  # attention as matmuls, which the counter sees (SDPA kernels it may not)
        counts = {n: flops_of(n, a) for n in names}
        print(f"\nFLOPs of one forward + backward: shape={a.shape} batch={a.batch} segment={a.segment}")
        for n in names:
            print(f"{n:<20}{counts[n] / 1e12:>10.3f} TFLOP{counts[n] / counts[names[0]]:>8.3f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "flops": counts}, f, indent=2)
        return
    runners, failed = [], {}
    for n in names:  # a variant that fails to build or compile is left out; the others are still measured
        try:
            r = Runner(n, a)
            for _ in range(max(a.warmup, 3) if model_compile_mode(n)[1] else a.warmup):
                r.step(timed=False)
        except Exception as e:
            if n == names[0]:
                raise
            failed[n] = from_exception(e).as_dict()  # the error, where in our code, the whole traceback
            print(f"{failed[n]['detail']}variant {n} failed and is left out: {line_of(failed[n])}", file=sys.stderr,
                  flush=True)
            continue
        runners.append(r)
    peak = {}
    for i in range(a.rounds):
        for r in runners:
            if a.device.startswith("cuda") and i == 0:
                torch.cuda.reset_peak_memory_stats()
            r.step(timed=True)
            if a.device.startswith("cuda") and i == 0:
                peak[r.name] = torch.cuda.max_memory_allocated() / 2**20
    if a.rss and not a.device.startswith("cuda"):
        peak = {n: rss_of(n, a) for n in names}

    cuda = a.device.startswith("cuda")
    # On a GPU the wall clock (with a sync) is the measure. On a CPU shared with other jobs
    # the wall clock swings by several times between identical steps; the process's CPU
    # time (1 thread by default) is what the step costs, so its median is the headline.
    key = (lambda r: statistics.median(r.times)) if cuda else (lambda r: statistics.median(r.cpu_times))
    base, base_wall = key(runners[0]), min(runners[0].times)
    rows = []
    print(
        f"\nshape={a.shape} device={a.device} dtype={a.dtype} attn={a.attn} batch={a.batch} segment={a.segment} "
        f"threads={a.threads} rounds={a.rounds}"
    )
    head = "median wall (s)" if cuda else "median CPU (s)"
    print(
        f"{'variant':<20}{'params (M)':>11}{head:>16}{'ratio':>8}{'min wall (s)':>14}{'ratio':>8}"
        f"{'peak (MiB)':>12}{'ratio':>8}"
    )
    for r in runners:
        med, wall = key(r), min(r.times)
        n_params = sum(p.numel() for p in r.model.parameters()) / 1e6
        row = dict(
            variant=r.name,
            params_m=n_params,
            step_s=med,
            ratio=med / base,
            min_wall_s=wall,
            wall_ratio=wall / base_wall,
            times=r.times,
            cpu_times=r.cpu_times,
        )
        line = f"{r.name:<20}{n_params:>11.1f}{med:>16.4f}{med / base:>8.3f}{wall:>14.4f}{wall / base_wall:>8.3f}"
        if r.name in peak:
            row.update(peak_mb=peak[r.name], mem_ratio=peak[r.name] / peak[names[0]])
            line += f"{peak[r.name]:>12.0f}{peak[r.name] / peak[names[0]]:>8.3f}"
        base_name, whole = model_compile_mode(r.name)
        plain = next((q for q in runners if q.name == "transformer" + r.name[len(base_name):]), None) if whole else None
        if plain is not None:  # a compiled variant against the plain model compiled the same way
            row.update(ratio_same_mode=med / key(plain))
            line += f"   vs plain, same mode: {med / key(plain):.3f}"
        print(line)
        rows.append(row)
    for n, why in failed.items():
        print(f"{n:<20}failed: {line_of(why)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": rows, "failed": failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
