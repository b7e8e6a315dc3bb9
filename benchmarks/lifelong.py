"""Does MbPA++'s episodic memory keep earlier tasks? The paper's lifelong table at CPU scale.

Tasks from the bundled book (`memoria_ds/data/lifelong_tasks.py`: each task its own 3 classes and cue
words), learned one after another by a tiny BERT (2 layers, `--width` 128) pre-trained by masked language
modelling on the tasks' unlabelled text (`memoria_ds/model/encoder/pretrain_mlm.py`: the stand-in for a
pretrained BERT, and the frozen key network). Three runs of `launch/classify.py` per seed, each read twice where it can be:

| run | settings | `full` reading | `adapted` reading |
|---|---|---|---|
| sequential | tasks in turn, the memory written, no replay (`episodic.replay_every=0`) | sequential fine-tuning | local adaptation alone |
| replay | tasks in turn, sparse replay | experience replay alone | MbPA++ |
| multitask | every task's documents shuffled together | multitask (upper bound) | |

Writing the memory changes nothing of the training (its draws have their own generator), so the
sequential run's `full` reading is plain sequential fine-tuning. Every run reads the test split after
each task (`eval.after_each_task=[full]`): the forgetting curve; `adapted` is read at the end.

    python benchmarks/lifelong.py --out /tmp/ll                       # 3 seeds, 2 runs at a time
    python benchmarks/lifelong.py --out /tmp/ll --table               # the table and plot from what ran

Writes `<out>/results.json` (every reading of every run), `<out>/table.md` and `<out>/forgetting.png`.
Cost on a 2-core CPU: about an hour for 3 seeds at the default width 128, 45 minutes at width 64
(docs/episodic.md has the results).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (("sequential fine-tuning", "sequential", "full"), ("local adaptation alone", "sequential", "adapted"),
        ("experience replay alone", "replay", "full"), ("MbPA++", "replay", "adapted"),
        ("multitask (upper bound)", "multitask", "full"))


def prepare(out: Path, seed: int, args: argparse.Namespace) -> dict:
    """The seed's tasks, tokenizer and pre-trained encoder (made once)."""
    from memoria_ds.data.lifelong_tasks import write_lifelong_tasks, write_task_tokenizer
    from memoria_ds.model.encoder.pretrain_mlm import pretrain_mlm

    data = out / f"seed{seed}" / "data"
    files = write_lifelong_tasks(data, tasks=args.tasks, classes=3, counts={"train": args.train, "test": args.test},
                                 seed=seed)
    encoder = out / f"seed{seed}" / "encoder"
    if not (encoder / "config.json").exists():
        tokenizer = write_task_tokenizer(data / "tokenizer", tasks=args.tasks, classes=3)
        texts = [json.loads(line)["text"] for path in files["train"] for line in open(path, encoding="utf-8")]
        width = {"hidden_size": args.width, "num_attention_heads": max(1, args.width // 32),
                 "intermediate_size": 2 * args.width}
        losses = pretrain_mlm(texts, tokenizer, encoder, steps=args.mlm_steps, seed=seed, settings=width)
        (encoder / "mlm.json").write_text(json.dumps(losses))
    return {"files": files, "encoder": str(encoder)}


def command(run_dir: Path, variant: str, prepared: dict, seed: int, args: argparse.Namespace) -> list[str]:
    files = prepared["files"]
    cmd = [sys.executable, str(ROOT / "launch" / "classify.py"), "engine=torch", f"run_dir={run_dir}", f"seed={seed}",
           f"model.backbone={prepared['encoder']}", "model.preset=backbone", f"data.tokenizer={prepared['encoder']}",
           "data.files={train: [%s], test: [%s]}" % (", ".join(files["train"]), ", ".join(files["test"])),
           "data.segment_length=40", "data.max_segments=1", "optim.bptt_segments=1", "optim.micro_batch_size=8",
           "optim.epochs=1", f"optim.lr={args.lr}", "optim.warmup_ratio=0.0", "optim.schedule=constant",
           "optim.precision=fp32", "eval.split=test", "checkpoint.every=0", "log.every=50"]
    if variant == "multitask":
        return cmd + ["data.in_order=false", "eval.protocols=[full]"]
    replay = args.replay_every if variant == "replay" else 0
    return cmd + ["data.in_order=true", "eval.after_each_task=[full]", "eval.protocols=[full, adapted]",
                  "episodic.enabled=true", f"episodic.replay_every={replay}", f"episodic.replay_size={args.replay_size}"]


def run(out: Path, variant: str, seed: int, prepared: dict, args: argparse.Namespace) -> None:
    run_dir = out / f"seed{seed}" / variant
    if (run_dir / "summary.json").exists():
        return
    log = out / f"seed{seed}" / f"{variant}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        subprocess.run(command(run_dir, variant, prepared, seed, args), stdout=f, stderr=subprocess.STDOUT,
                       env=env, check=True, cwd=ROOT)


def readings(out: Path) -> list[dict]:
    """Every reading of every run: seed, variant, protocol, step, each task's accuracy."""
    found = []
    for path in sorted(glob.glob(str(out / "seed*" / "*" / "eval" / "step_*_classification_*.json"))):
        p = Path(path)
        result = json.loads(p.read_text())
        found.append({"seed": int(p.parents[2].name[4:]), "variant": p.parents[1].name,
                      "protocol": result["protocol"]["name"], "step": int(p.name.split("_")[1]),
                      "accuracy": result["accuracy"],
                      "per_task": [t["accuracy"] for t in result["protocol"]["per_task"]]})
    return found


def table(found: list[dict]) -> str:
    """Final accuracy over all tasks, and on the first task, mean ± sd over seeds."""
    def final(variant: str, protocol: str) -> list[dict]:
        rows = [r for r in found if r["variant"] == variant and r["protocol"] == protocol]
        last = {}
        for r in rows:
            if r["step"] >= last.get(r["seed"], {"step": -1})["step"]:
                last[r["seed"]] = r
        return [last[s] for s in sorted(last)]

    def cell(values: list[float]) -> str:
        values = [100 * v for v in values]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.1f} ± {sd:.1f}"

    lines = ["| method | accuracy, all tasks (%) | first task (%) | last task (%) | seeds |", "|---|---|---|---|---|"]
    for name, variant, protocol in ROWS:
        rows = final(variant, protocol)
        if rows:
            lines.append(f"| {name} | {cell([r['accuracy'] for r in rows])} | "
                         f"{cell([r['per_task'][0] or 0 for r in rows])} | {cell([r['per_task'][-1] or 0 for r in rows])}"
                         f" | {len(rows)} |")
    return "\n".join(lines)


def plot(found: list[dict], path: Path) -> None:
    """The forgetting curve: each task's accuracy after each task, mean over seeds, sequential against replay; the
    end read with local adaptation as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [("sequential", "sequential fine-tuning"), ("replay", "experience replay")]
    tasks = max(len(r["per_task"]) for r in found)
    fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 3.6), sharey=True)
    for ax, (variant, title) in zip(axes, variants):
        rows = [r for r in found if r["variant"] == variant and r["protocol"] == "full"]
        steps = sorted({r["step"] for r in rows})
        for t in range(tasks):
            means = [statistics.mean([(r["per_task"][t] or 0) for r in rows if r["step"] == s]) for s in steps]
            line, = ax.plot(range(1, len(steps) + 1), [100 * m for m in means], marker="o", label=f"task {t}")
            adapted = [(r["per_task"][t] or 0) for r in found if r["variant"] == variant and r["protocol"] == "adapted"]
            if adapted:  # the end, read with local adaptation: a cross beside the last point
                ax.plot([len(steps) + 0.15], [100 * statistics.mean(adapted)], marker="x", markersize=9,
                        color=line.get_color(), linestyle="none")
        ax.set_title(f"{title} (x: {'local adaptation' if variant == 'sequential' else 'MbPA++'} at the end)")
        ax.set_xlabel("tasks learned")
        ax.set_xticks(range(1, len(steps) + 1))
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--train", type=int, default=4000, help="training documents per task")
    parser.add_argument("--test", type=int, default=60, help="test documents per task")
    parser.add_argument("--mlm-steps", type=int, default=1500)
    parser.add_argument("--width", type=int, default=128, help="the encoder's hidden size (2 layers)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--replay-every", type=int, default=400)
    parser.add_argument("--replay-size", type=int, default=32)
    parser.add_argument("--variants", default="sequential,replay,multitask")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="only collect what ran")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # each job one core
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.table:
        with ThreadPoolExecutor(args.jobs) as pool:
            prepared = dict(zip(seeds, pool.map(lambda s: prepare(args.out, s, args), seeds)))
            jobs = [pool.submit(run, args.out, v, s, prepared[s], args) for s in seeds for v in args.variants.split(",")]
            for job in jobs:
                job.result()
    found = readings(args.out)
    (args.out / "results.json").write_text(json.dumps(found, indent=1))
    text = table(found)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    if any(r["variant"] in ("sequential", "replay") for r in found):
        plot(found, args.out / "forgetting.png")
        print(f"forgetting curve: {args.out / 'forgetting.png'}")


if __name__ == "__main__":
    main()
