"""Run what a comparison is missing: one benchmark process per (variant, seed), one result file each.

A run is `benchmarks/real_text.py` or `benchmarks/sorting.py` itself, with `--variants V --seeds S
--json`, so the numbers are the scripts' own. A finished run (its `seed<N>.json`) is never run
again unless asked; a run stopped half-way left no result file and runs again; a run another
invocation is making (its `seed<N>.lock` held: `train/run_lock.py`'s `flock`, which the kernel
drops when that process ends, however it ends) is left to it. The CPU time of a
run is the child process's own (user + system, from the kernel's accounting of that process).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from ..train.run_lock import RunDirInUse, RunLock
from .recipes import Task, price_key, recipe_id, slug, split_variant
from .store import FORMAT, ROOT, read_json, run_path, write_json

# Named price settings: benchmarks/model_step.py options (and the device it needs)
PRICE_SETTINGS = {
    "cpu-small": ("--shape", "small", "--batch", "4", "--segment", "150", "--threads", "1", "--rounds", "10"),
    "cpu-tiny": ("--shape", "2x32x2", "--batch", "2", "--segment", "16", "--threads", "1", "--rounds", "2",
                 "--prefill", "2"),
    "gpu-gpt2": ("--shape", "gpt2", "--device", "cuda", "--dtype", "bf16", "--batch", "8", "--segment", "150",
                 "--rounds", "5"),
}


def resolved_args(task: Task, script_args: list[str], variants: list[str], seeds: list[int]) -> dict[str, Any]:
    """The script's own resolved options (`--print-args`): its parser and checks, its defaults.

    Raises:
        SystemExit: the script refused an option (its own one-line message, exit 2).
    """
    cmd = [sys.executable, str(ROOT / task.script), *task.defaults, *script_args, "--print-args",
           "--variants", ",".join(split_variant(v, task)[0] for v in variants),
           "--seeds", ",".join(map(str, seeds))]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(1))
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(done.returncode)
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare(folder: Path, recipe: dict[str, Any]) -> None:
    """The recipe's folder with its recipe.json (an existing one must be the same recipe)."""
    path = folder / "recipe.json"
    if path.exists():
        have = read_json(path).get("recipe")
        if have != recipe:
            raise SystemExit(f"{path}: another recipe lives in this folder (its id is not {recipe_id(recipe)}); "
                             f"move it away or give another --results")
        return
    write_json(path, {"format": FORMAT, "recipe": recipe, "id": recipe_id(recipe)})


def missing(folder: Path, variants: list[str], seeds: list[int], rerun: bool) -> list[tuple[str, int]]:
    """The (variant, seed) pairs without a result file, seed by seed (a half-done comparison
    has whole seeds first), the plain model first in each."""
    return [(v, s) for s in seeds for v in variants if rerun or not run_path(folder, slug(v), s).exists()]


def run_all(task: Task, recipe: dict[str, Any], folder: Path, todo: list[tuple[str, int]], script_args: list[str],
            threads: int, device: str, total: int) -> list[str]:
    """Run each missing pair with a progress bar (runs done, time left); return the failures."""
    from tqdm import tqdm

    failed = []
    done_before = total - len(todo)
    bar = tqdm(total=total, initial=done_before, unit="run", desc="compare", dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} runs [{elapsed}<{remaining}]")
    started = time.perf_counter()
    for i, (variant, seed) in enumerate(todo):
        bar.set_postfix_str(f"{variant} seed {seed}")
        outcome = run_one(task, recipe, folder, variant, seed, script_args, threads, device)
        if outcome:
            failed.append(outcome)
            bar.write(outcome)
        bar.update()
        # tqdm's rate counts the runs found done as instant; the time left is from this session's runs
        per_run = (time.perf_counter() - started) / (i + 1)
        bar.set_description_str(f"compare (~{_clock(per_run * (len(todo) - i - 1))} left)")
    bar.close()
    return failed


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def run_one(task: Task, recipe: dict[str, Any], folder: Path, variant: str, seed: int, script_args: list[str],
            threads: int, device: str) -> str | None:
    """One run: the script in a child process; its result written as `seed<N>.json`. Returns a
    line naming the failure and its log, or None."""
    out = run_path(folder, slug(variant), seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out.parent, name=out.with_suffix(".lock").name)
    try:
        lock.acquire(wait_s=0.0)
    except RunDirInUse:
        return f"{variant} seed {seed}: another process is running it ({lock.path}); left to it"
    try:
        bench_json = out.with_name(f".seed{seed}.bench.json")
        script_variant, flags = split_variant(variant, task)
        cmd = [sys.executable, str(ROOT / task.script), *task.defaults, *script_args, *flags,
               "--variants", script_variant, "--seeds", str(seed), "--threads", str(threads), "--json", str(bench_json)]
        if task.name == "sorting":
            cmd += ["--jobs", "1", "--device", device]
        log = out.with_suffix(".log")
        t0 = time.perf_counter()
        with log.open("w") as f:
            f.write(f"+ {shlex.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=_env(threads))
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not bench_json.exists():
            tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
            return f"{variant} seed {seed}: failed (exit {proc.returncode}): {tail[0]} (whole output: {log})"
        result = read_json(bench_json)["results"][0]
        write_json(out, record(task, recipe, variant, seed, result, cmd, usage.ru_utime + usage.ru_stime, wall))
        bench_json.unlink()
        return None
    finally:
        lock.path.unlink(missing_ok=True)  # while still held: nothing of this run is left behind
        lock.release()


def record(task: Task, recipe: dict[str, Any], variant: str, seed: int, result: dict[str, Any], cmd: list[str],
           cpu_s: float, wall_s: float) -> dict[str, Any]:
    """The result file of one run: what the table reads, and the script's whole result beside it."""
    out: dict[str, Any] = {"format": FORMAT, "recipe": recipe, "recipe_id": recipe_id(recipe), "variant": variant,
                           "seed": seed}
    if task.metric == "ppl":
        out.update(ppl=result["ppl"], memory_gain=result["memory_gain"])
    else:
        out.update(accuracy=result["accuracy"], accuracy_memoryless=result["accuracy_memoryless"],
                   updates=result["updates"])
    out.update(cpu_s=round(cpu_s, 2), wall_s=round(wall_s, 2), date=datetime.date.today().isoformat(),
               source={"kind": "run", "command": shlex.join(cmd), "machine": machine(),
                       "git_commit": _git_commit()},
               result=result)
    return out


def machine() -> str:
    """This machine in words (no host name)."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {platform.system()}, Python {platform.python_version()}, torch {torch}"


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


# ------------------------------------------------------------------------------ price

def price_missing(setting: str, variants: list[str], known: list[dict[str, Any]]) -> list[str]:
    """The price keys of `variants` with no price record under `setting` (stored or transcribed)."""
    have = {p["variant"] for p in known if p["setting"] == setting}
    keys = list(dict.fromkeys(price_key(v) for v in variants))
    return [k for k in keys if k not in have]


def measure_prices(root: Path, setting: str, keys: list[str]) -> str | None:
    """Time and count one forward + backward of each key beside the plain model
    (`benchmarks/model_step.py`, one process, interleaved rounds); write one price file per key.
    Returns a failure line, or None."""
    if not keys:
        return None
    names = ["transformer", *[k for k in keys if k != "transformer"]]
    folder = root / "price" / setting
    folder.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(ROOT / "benchmarks" / "model_step.py"), *PRICE_SETTINGS[setting],
            "--variants", ",".join(names)]
    ops_json, time_json = folder / f".ops-{os.getpid()}.json", folder / f".time-{os.getpid()}.json"
    runs = [([*base, "--json", str(time_json)], time_json)]
    if not setting.startswith("gpu"):
        runs.append(([*base, "--ops", "--json", str(ops_json)], ops_json))
    for cmd, _ in runs:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(1))
        if done.returncode != 0:
            return f"price ({setting}): {shlex.join(cmd)} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    timed = {r["variant"]: r for r in read_json(time_json)["results"]}
    ops = read_json(ops_json) if ops_json.exists() else {}
    for name in names:
        if name not in timed:
            continue
        p = {"variant": name, "setting": setting, "step_s": round(timed[name]["step_s"], 5),
             "step_ratio": round(timed[name]["ratio"], 3), "date": datetime.date.today().isoformat(),
             "source": {"kind": "run", "command": shlex.join(base), "machine": machine()}}
        if "peak_mb" in timed[name]:
            p["peak_ratio"] = round(timed[name]["mem_ratio"], 3)
        if ops:
            p.update(ops=ops["ops"][name], ops_ratio=round(ops["ops"][name] / ops["ops"]["transformer"], 3),
                     compute_ops=ops["compute_ops"][name],
                     compute_ops_ratio=round(ops["compute_ops"][name] / ops["compute_ops"]["transformer"], 3))
        write_json(folder / f"{slug(name)}.json", {"format": FORMAT, "price": p})
    for f in (ops_json, time_json):
        f.unlink(missing_ok=True)
    return None
