"""Training throughput of Memoria GPT-2 against the plain backbone, through the real loop.

Each variant is a real run of `launch/finetune.py` under the `deepspeed` launcher (same
corpus, segment length, batch, precision and DeepSpeed config), alternating in rounds in
one invocation; tokens/s come from each run's metrics.jsonl, skipping the first logging
window (start-up, first allocations). Printed last: median tokens/s per variant and the
ratio to the plain backbone.

    python benchmarks/train_throughput.py                          # CPU, small model
    python benchmarks/train_throughput.py --shape gpt2 --gpus 1 --deepspeed ds_configs/single_gpu.json \
        --precision bf16 --micro-batch 8 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from failures import run_child  # benchmarks/failures.py: a run's failure with its traceback

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "small": "{n_layer: 4, n_embd: 256, n_head: 4}",
    "gpt2": "{n_layer: 12, n_embd: 768, n_head: 12}",
}


def run_variant(preset: str, a: argparse.Namespace, workdir: Path, port: int) -> dict:
    run_dir = workdir / f"{preset}-{port}"
    settings = SHAPES[a.shape].rstrip("}") + ", n_positions: 1024}"
    args = [
        f"run_dir={run_dir}", "model.backbone=gpt2", "model.from_scratch=true", f"model.preset={preset}",
        f"model.settings={settings}", f"data.corpus={a.corpus}", f"data.segment_length={a.segment}",
        f"optim.micro_batch_size={a.micro_batch}", f"optim.max_steps={a.steps}", f"optim.precision={a.precision}",
        f"log.every={a.log_every}", "log.tensorboard=false", "log.progress=false", "checkpoint.every=0",
        "checkpoint.export=false", "eval.at_end=false", f"deepspeed={ROOT / a.deepspeed}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if a.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(a.threads))
    cmd = [shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(a.gpus),
           "--master_port", str(port), str(ROOT / "launch" / "finetune.py"), *args]
    run_child(cmd, f"the {preset} run", cwd=ROOT, env=env)  # a failure: its stderr, then what and where
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][1:]  # skip the first window
    return {"preset": preset, "tokens_per_s": statistics.median(r["tok/s"] for r in train),
            "windows": len(train), "final_loss": train[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="transformer,memoria,memoria_full_width",
                   help="model presets; the first is the baseline of the ratios")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--corpus", default="bundled")
    p.add_argument("--segment", type=int, default=150)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--deepspeed", default="ds_configs/cpu.json")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        port = 29650
        for r in range(a.rounds):
            for v in variants:
                port += 1
                res = run_variant(v, a, Path(tmp), port)
                runs[v].append(res)
                print(f"round {r + 1} {v:>14}: {res['tokens_per_s']:10.1f} tokens/s ({res['windows']} windows, "
                      f"loss {res['final_loss']:.3f})", flush=True)
    # time ratios: of the medians, and the median of each round's own ratio (the variants of
    # a round ran back to back, so it is the steadier figure on a shared machine)
    base = statistics.median(x["tokens_per_s"] for x in runs[variants[0]])
    summary = {"config": vars(a), "runs": runs, "ratio_to_baseline": {}, "median_round_ratio": {}}
    print(f"\n{'variant':>14} {'median tokens/s':>16} {'time ratio':>11} {'per-round ratios':>24} {'median':>7}")
    for v in variants:
        med = statistics.median(x["tokens_per_s"] for x in runs[v])
        rounds = [b["tokens_per_s"] / x["tokens_per_s"] for b, x in zip(runs[variants[0]], runs[v])]
        summary["ratio_to_baseline"][v] = base / med
        summary["median_round_ratio"][v] = statistics.median(rounds)
        per_round = " ".join(f"{x:.3f}" for x in rounds)
        print(f"{v:>14} {med:16.1f} {base / med:11.3f} {per_round:>24} {statistics.median(rounds):7.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
