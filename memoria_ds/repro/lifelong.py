"""MbPA++'s lifelong text-classification table (de Masson d'Autume et al. 2019, Table 1), as runs of
`launch/classify.py`: the four orders of the five data sets (`memoria_ds/data/lifelong_text.py`), three runs
each, five readings.

| run | settings | `full` reading | `adapted` reading |
|---|---|---|---|
| sequential | data sets in turn, the memory written, no replay | ENC-DEC (sequential fine-tuning) | MBPA (local adaptation alone) |
| replay | data sets in turn, 100 examples replayed every 10,000 | REPLAY | MbPA++ |
| multitask | every data set's examples shuffled together | MTL (the upper bound) | |

Every run reads the test split after each data set (`eval.after_each_task=[full]`: the forgetting curve)
and at the end. The paper's settings: BERT-base (`bert-base-uncased`, a separate frozen copy as the key
network), one pass, batch 32, Adam at 3e-5 without warm-up, sequences of 128 tokens, K = 32 neighbours,
L = 30 steps, lambda = 1e-3; where the paper is silent the public port's (Daikon-Sun/EM-in-LLL): gradient
clipping at 1, local learning rate 2e-3 (`settings.py`).

    python -m memoria_ds.repro.lifelong --data data/mbpa --print report        # the dry run: every run resolved
    python -m memoria_ds.repro.lifelong --data data/mbpa --print commands      # what launch/repro/lifelong.sh runs
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..data.lifelong_text import BY_NAME, ORDERS, TEST_PER_DATASET, TRAIN_PER_DATASET, num_classes

METHODS = ("sequential", "replay", "multitask")
READINGS = {"sequential": {"full": "ENC-DEC", "adapted": "MBPA"}, "replay": {"full": "REPLAY", "adapted": "MbPA++"},
            "multitask": {"full": "MTL"}}
SETTINGS = ("model.task=classification", "data.corpus=documents", "model.backbone=bert-base-uncased",
            "model.preset=backbone", "data.segment_length=128", "data.max_segments=1", "optim.bptt_segments=1",
            "optim.micro_batch_size=32", "optim.epochs=1", "optim.lr=3e-5", "optim.warmup_ratio=0.0",
            "optim.schedule=constant", "optim.grad_clip=1.0", "optim.precision=bf16", "eval.split=test",
            "episodic.neighbours=32", "episodic.adapt_steps=30", "episodic.adapt_l2=1e-3", "episodic.adapt_lr=2e-3",
            "episodic.replay_size=100", "checkpoint.every=2000")


@dataclass(frozen=True)
class LifelongRun:
    order: int
    method: str
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def command(self) -> list[str]:
        return ["deepspeed", "launch/classify.py", "--deepspeed", "ds_configs/zero2.json", *self.overrides]


def runs(data: Path, run_root: Path, orders: list[int], methods: list[str], train: int = TRAIN_PER_DATASET,
         test: int = TEST_PER_DATASET) -> list[LifelongRun]:
    """Every selected run; `data` is what `python -m memoria_ds.data.lifelong_text` wrote."""
    out = []
    for order in orders:
        names = ORDERS[order]
        files = "{train: [%s], test: [%s]}" % tuple(", ".join(str(data / n / f"{s}.jsonl") for n in names)
                                                    for s in ("train", "test"))
        for method in methods:
            run_dir = run_root / f"order{order}" / method
            extra = (["data.in_order=false", "eval.protocols=[full]"] if method == "multitask" else
                     ["data.in_order=true", "eval.after_each_task=[full]", "eval.protocols=[full, adapted]",
                      "episodic.enabled=true", f"episodic.replay_every={10_000 if method == 'replay' else 0}"])
            out.append(LifelongRun(order, method, run_dir,
                                   (f"run_dir={run_dir}", f"data.files={files}", *SETTINGS, *extra)))
    return out


def resolve(run: LifelongRun):
    """The run's configuration as the launcher would read it (a bad setting stops here)."""
    from ..train.config import RunConfig
    from ..train.parse import load

    return load(RunConfig, None, list(run.overrides))


def report(selected: list[LifelongRun], train: int, test: int) -> str:
    """The dry run: each run's command and resolved settings, and what it costs in steps and adaptations."""
    lines = [f"MbPA++ lifelong text classification: {len(selected)} runs; 5 data sets x {train:,} training and "
             f"{test:,} test examples; {num_classes()} classes"]
    for run in selected:
        cfg = resolve(run)
        documents = 5 * train
        steps = documents // cfg.optim.micro_batch_size  # per rank count x ranks: one GPU as written
        replays = documents // cfg.episodic.replay_every if cfg.episodic.enabled and cfg.episodic.replay_every else 0
        adapted = "adapted" in cfg.eval.protocols
        lines += ["", f"order {run.order} ({' -> '.join(ORDERS[run.order])}), {run.method}: readings "
                  + ", ".join(f"{p} = {name}" for p, name in READINGS[run.method].items()),
                  "  " + shlex.join(run.command),
                  f"  {steps:,} steps of {cfg.optim.micro_batch_size} on one GPU (documents in order: "
                  f"{cfg.data.in_order}), {replays} replays of {cfg.episodic.replay_size}"
                  + (f"; episodic memory {documents:,} documents" if cfg.episodic.enabled else ""),
                  f"  evaluation: {5 * test:,} test documents "
                  + ("after each of the 5 data sets" if cfg.eval.after_each_task else "at the end")
                  + (f"; the adapted reading at the end: {5 * test:,} x {cfg.episodic.adapt_steps} local steps on "
                     f"{cfg.episodic.neighbours} neighbours" if adapted else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="what `python -m memoria_ds.data.lifelong_text` wrote")
    p.add_argument("--run-root", type=Path, default=Path("runs/mbpa"))
    p.add_argument("--orders", default="1,2,3,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--print", choices=("report", "commands"), default="report")
    a = p.parse_args(argv)
    try:
        orders = [int(o) for o in a.orders.split(",")]
        methods = a.methods.split(",")
        bad = [o for o in orders if o not in ORDERS] + [m for m in methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown order(s) or method(s) {bad}: orders {sorted(ORDERS)}, methods {list(METHODS)}")
        selected = runs(a.data, a.run_root, orders, methods)
        if a.print == "report":
            print(report(selected, TRAIN_PER_DATASET, TEST_PER_DATASET))
        else:
            missing = [str(a.data / n / "train.jsonl") for n in BY_NAME if not (a.data / n / "train.jsonl").is_file()]
            if missing:
                raise ValueError(f"{missing[0]} is missing: write the data first (python -m "
                                 f"memoria_ds.data.lifelong_text {a.data} --source ZHANG_CSV_DIR)")
            for run in selected:
                resolve(run)
                print(f"{run.run_dir}/launch.log\t{shlex.join(run.command)}")
    except ValueError as e:  # (a ConfigError is a ValueError)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()


__all__ = ["METHODS", "READINGS", "LifelongRun", "resolve", "runs"]
