"""Time one Memoria memory step: memoria_ds against the authors' package, side by side.

Both implementations run the same load, each in its own process (so each peak RSS is its
own), alternating, in one invocation, and the ratios are printed at the end:

    pip install memoria-pytorch==1.1.0          # the authors' package (extra: .[bench])
    python benchmarks/memory_step.py --rounds 2 --json results.json

The load is the paper's WikiText-103 memory settings (N_wm = K_stm = K_ltm = 50,
C_stm = 400, L0 = 9, alpha = 8, depth = 10), B = 4 rows, D = 768, 300 steps, random
engrams and random softmax contribution weights (64 query rows averaged, as in
shared/anchors/official_memoria_step.py), 2 CPU threads. Reported per implementation:
median step time over the second half (memory full), over the first half, peak RSS.

`--phases` times memoria_ds's step phase by phase (the engine's stage functions called one
by one, as `remind` and `memorize` call them) and prints the median of each.

`--compile MODE` also times memoria_ds with its engine compiled (`MemoryEngine(MODE)`,
a torch.compile mode: `default`, or `reduce-overhead` for CUDA graphs), side by side with
the eager engine; compilation happens in the first steps, so compare the second half.

`--device cuda` times memoria_ds alone on a GPU with CUDA synchronisation (the authors'
package is not timed there). `--worker ours|compiled|official` runs one measurement (used by the
driver; handy for profiling).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from failures import from_child, line_of  # benchmarks/failures.py: a worker's failure with its traceback


def _load_weights(batch: int, queries: int, mask: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Random softmax attention over the reminded engrams, averaged over query rows: (B, R)."""
    m = mask.shape[1]
    logits = torch.randn(batch, queries, m, generator=gen, device=mask.device)
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=1)


def _setup(a: argparse.Namespace):
    """The memory settings of the load, a fresh seeded state, its device, and a device sync."""
    from memoria_ds.memory import MemoriaConfig, MemoryState

    device = torch.device(a.device)
    cfg = MemoriaConfig(
        num_wm=a.num_wm, num_stm_reminded=a.num_stm_rem, num_ltm_reminded=a.num_ltm_rem,
        stm_capacity=a.stm_capacity, initial_lifespan=a.initial_lifespan, alpha=a.alpha,
        search_depth=a.depth, search=a.search, count_dtype=a.count_dtype,
    )
    torch.manual_seed(a.seed)
    state = MemoryState.empty(cfg, a.batch_size, a.hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return cfg, state, device, sync


def run_ours(a: argparse.Namespace, mode: str | None = None) -> dict:
    from memoria_ds.memory import MemoryEngine

    engine = MemoryEngine(mode)
    cfg, state, device, sync = _setup(a)
    times, engrams = [], 0.0
    for _ in range(a.steps):
        wm = torch.randn(a.batch_size, a.num_wm, a.hidden, device=device)
        sync()
        t0 = time.perf_counter()
        retrieval = engine.remind(state, wm, cfg)
        weights = _load_weights(a.batch_size, a.queries, retrieval.reminded_mask, None)
        stats = engine.memorize(state, retrieval, weights, cfg)
        sync()
        times.append(time.perf_counter() - t0)
    engrams = stats.engrams[:, 1:].sum(dim=1).float().mean().item()
    result = _summary("memoria_ds" if mode is None else f"memoria_ds+{mode}", a, times)
    if engine.fell_back:
        result["fell_back"] = engine.fell_back
    result.update(capacity=cfg.capacity, count_dtype=cfg.count_dtype, engrams_per_row_end=engrams,
                  found_ltm_end=stats.found_ltm.float().mean().item(), device=str(device))
    if device.type == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_phases(a: argparse.Namespace) -> dict:
    """Median wall time (ms) of each stage of memoria_ds's step, over the second half of the run."""
    from memoria_ds.memory import memorize
    from memoria_ds.memory import retrieve as R
    from memoria_ds.memory.encode import write_working_memory

    cfg, state, device, sync = _setup(a)
    times: dict[str, list[float]] = {}

    def timed(name, fn, *args):
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        sync()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    for _ in range(a.steps):
        wm = torch.randn(a.batch_size, a.num_wm, a.hidden, device=device)
        rank, order = timed("recency order", R.recency_order, state.uid)
        wm_slots, evicted = timed("write working memory", write_working_memory, state, wm, rank, cfg)
        wm_sq = state.sq_norms.gather(1, wm_slots)
        rows = R._Rows(state)
        cues = timed("STM score + pick", R.remind_stm, state, rows, wm, wm_sq, rank, cfg)
        ltm, found = timed("LTM search + score + pick", R.remind_ltm, state, rows, wm, wm_sq, cues, rank, order, cfg)
        retrieval = timed("assemble M_rem", R.assemble, rows, wm_slots, evicted, cues, ltm, found, cfg)
        weights = _load_weights(a.batch_size, a.queries, retrieval.reminded_mask, None)
        timed("memorize", memorize, state, retrieval, weights, cfg)
    half = a.steps // 2
    return {name: 1e3 * statistics.median(t[half:]) for name, t in times.items()}


def run_official(a: argparse.Namespace) -> dict:
    from memoria import Memoria  # the authors' package, PyPI memoria-pytorch

    torch.manual_seed(a.seed)
    mem = Memoria(
        num_reminded_stm=a.num_stm_rem, stm_capacity=a.stm_capacity, ltm_search_depth=a.depth,
        initial_lifespan=a.initial_lifespan, num_final_ltms=a.num_ltm_rem,
    )
    times = []
    for _ in range(a.steps):
        wm = torch.randn(a.batch_size, a.num_wm, a.hidden)
        t0 = time.perf_counter()
        mem.add_working_memory(wm)
        _engrams, indices = mem.remind()
        weights = _load_weights(a.batch_size, a.queries, indices >= 0, None)
        # the authors' GPT-2 passes (mean attention) * |M_rem| * alpha, padding included
        mem.adjust_lifespan_and_memories(indices, weights * indices.size(1) * a.alpha)
        times.append(time.perf_counter() - t0)
    result = _summary("memoria-pytorch", a, times)
    result.update(engrams_per_row_end=float(mem.engrams.data.size(1)), device="cpu")
    return result


def _summary(name: str, a: argparse.Namespace, times: list[float]) -> dict:
    half = len(times) // 2
    return {
        "impl": name,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "hidden": a.hidden,
        "threads": torch.get_num_threads(),
        "median_step_ms_second_half": 1e3 * statistics.median(times[half:]),
        "median_step_ms_first_half": 1e3 * statistics.median(times[:half]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _worker_cmd(a: argparse.Namespace, impl: str) -> list[str]:
    keep = ["steps", "batch_size", "hidden", "num_wm", "num_stm_rem", "num_ltm_rem", "stm_capacity",
            "initial_lifespan", "alpha", "depth", "queries", "threads", "seed", "search", "count_dtype", "device", "compile"]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl]
    for k in keep:
        if getattr(a, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return cmd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--num-wm", type=int, default=50)
    p.add_argument("--num-stm-rem", type=int, default=50)
    p.add_argument("--num-ltm-rem", type=int, default=50)
    p.add_argument("--stm-capacity", type=int, default=400)
    p.add_argument("--initial-lifespan", type=float, default=9.0)
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--queries", type=int, default=64, help="rows of random attention averaged")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--search", default="graph", choices=["graph", "exhaustive"])
    p.add_argument("--count-dtype", default="int16", choices=["int16", "int32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=1, help="alternating runs of each implementation")
    p.add_argument("--skip-official", action="store_true", help="time memoria_ds only")
    p.add_argument("--compile", default=None, help="also time the engine compiled with this torch.compile mode")
    p.add_argument("--worker", choices=["ours", "compiled", "official"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--phases", action="store_true", help="time memoria_ds's step phase by phase")
    p.add_argument("--json", default=None, help="also write all results here")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    if a.phases:
        phases = run_phases(a)
        for name, ms in phases.items():
            print(f"{name:>26}: {ms:7.3f} ms")
        print(f"{'sum':>26}: {sum(phases.values()):7.3f} ms")
        return 0
    if a.worker is not None:
        a.initial_lifespan = int(a.initial_lifespan) if a.worker == "official" else a.initial_lifespan
        run = {"ours": lambda: run_ours(a), "compiled": lambda: run_ours(a, a.compile), "official": lambda: run_official(a)}
        print(json.dumps(run[a.worker]()))
        return 0

    impls = ["ours"] if (a.skip_official or a.device != "cpu") else ["official", "ours"]
    impls += ["compiled"] if a.compile else []
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    failed: dict[str, dict] = {}  # an implementation whose worker failed: its error, where, its whole stderr
    for r in range(a.rounds):
        for impl in [i for i in impls if i not in failed]:
            out = subprocess.run(_worker_cmd(a, impl), capture_output=True, text=True)
            if out.returncode != 0:  # the worker's traceback goes to this stderr (a log) and the JSON
                failed[impl] = from_child(out, f"the {impl!r} worker").as_dict()
                print(out.stderr, file=sys.stderr, flush=True)
                print(f"round {r + 1} {impl:>16}: failed: {line_of(failed[impl])}", flush=True)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[impl].append(res)
            print(f"round {r + 1} {res['impl']:>16}: {res['median_step_ms_second_half']:9.2f} ms/step "
                  f"(first half {res['median_step_ms_first_half']:.2f}), peak RSS {res['peak_rss_mb']:.0f} MB, "
                  f"engrams/row {res['engrams_per_row_end']:.0f}", flush=True)
            if res.get("fell_back"):
                print(f"  the engine could not be compiled and ran eagerly: {res['fell_back']}", flush=True)

    def best(impl: str, key: str) -> float:
        return min(x[key] for x in runs[impl])

    runs = {impl: done for impl, done in runs.items() if impl not in failed}
    summary = {"config": {k: v for k, v in vars(a).items() if k not in ("worker", "json")}, "runs": runs,
               "failed": failed}
    if "official" in runs and "ours" in runs:
        ratios = [o["median_step_ms_second_half"] / m["median_step_ms_second_half"]
                  for o, m in zip(runs["official"], runs["ours"])]
        summary["speedup_per_round"] = ratios
        summary["speedup_median"] = statistics.median(ratios)
        summary["rss_ratio"] = best("ours", "peak_rss_mb") / best("official", "peak_rss_mb")
        rss_ratios = [m["peak_rss_mb"] / o["peak_rss_mb"] for o, m in zip(runs["official"], runs["ours"])]
        summary["rss_ratio_per_round"] = rss_ratios
        print(f"\nspeedup (authors' step time / ours), per round: {', '.join(f'{x:.1f}x' for x in ratios)}; "
              f"median {summary['speedup_median']:.1f}x")
        print(f"peak RSS ours / authors': {summary['rss_ratio']:.3f} (smallest of each: "
              f"{best('ours', 'peak_rss_mb'):.0f} MB / {best('official', 'peak_rss_mb'):.0f} MB); per round "
              f"{', '.join(f'{x:.3f}' for x in rss_ratios)}")
    if "compiled" in runs and "ours" in runs:
        ratios = [c["median_step_ms_second_half"] / m["median_step_ms_second_half"]
                  for c, m in zip(runs["compiled"], runs["ours"])]
        summary["compiled_over_eager_per_round"] = ratios
        print(f"compiled ({a.compile}) / eager step time, per round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
