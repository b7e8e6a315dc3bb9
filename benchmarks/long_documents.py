"""Does a memory carry a long document's evidence to where it is classified? Three readings, seeds side by side.

    python benchmarks/long_documents.py --seeds 0,1,2 --jobs 2 --json long_documents.json

The task (memoria_ds/data/evidence_documents.py): passages of the bundled book, each telling its
class once in its first 40%, so that its last segment never holds it. Each run is the toolkit's
own classification loop through the real launcher (`deepspeed launch/classify.py`, ZeRO-1 on CPU),
a from-scratch tiny BERT (2 layers, width 64) over the task's tokenizer, segments of 64 tokens (at
most 6), 8 documents per batch, one optimiser step per batch of documents (`optim.bptt_segments=6`:
the authors' stepping; with one step per segment the backbone did not learn the task at all,
docs/encoders.md), 6 epochs of 2,400 documents, scored on 200 test documents from another part
of the book. Memoria's memory is small and remembers every short-term engram: 4 working-memory
engrams per segment, a short-term memory of 24 (six segments' worth), all 24 reminded, 4 from the
long-term memory (with 8 of 32 reminded by similarity, as first tried, it did not carry the
evidence: 22.5% at the last segment after 12 epochs). Per seed:

    truncated      `model.preset=backbone`, the last segment alone (the `full` reading)
    segment mean   the same run, the mean of its segments' logits (`launch/evaluate.py ... eval.aggregate=mean`)
    memoria        `model.preset=memoria`, the last segment with the memory (the paper's reading)
    memoria reset  the same run with its memory reset before every segment (`memoryless`)

Runs already finished under `--out` are read, not run again. Printed: accuracy and macro-F1 per
seed, and their mean ± half-range over the seeds; `--json` keeps every figure with the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from arguments import int_list  # benchmarks/arguments.py
from failures import ChildFailed, run_child  # benchmarks/failures.py: a failed run's stderr, what and where

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memoria_ds.data.evidence_documents import write_book_tokenizer, write_evidence_documents  # noqa: E402

SEGMENT, SEGMENTS, MICRO = 64, 6, 8
BACKBONE = ("num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 2, intermediate_size: 128, "
            "max_position_embeddings: 66, hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0")
MEMORY = ("memory_layer_index: 0, memoria: {num_wm: 4, num_stm_reminded: 24, num_ltm_reminded: 4, stm_capacity: 24, "
          "search_depth: 2}")
SETTINGS = {"backbone": f"{{{BACKBONE}}}", "memoria": f"{{{BACKBONE}, {MEMORY}}}"}  # `model.settings` per preset
READINGS = {"truncated": ("backbone", "full", "last"), "segment mean": ("backbone", "full", "mean"),
            "memoria": ("memoria", "full", "last"), "memoria reset": ("memoria", "memoryless", "last")}


def _env(threads: int) -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")


def train_command(a: argparse.Namespace, data: Path, preset: str, seed: int, run: Path, port: int) -> list[str]:
    launcher = str(Path(sys.executable).parent / "deepspeed")
    return [launcher, "--num_gpus", "1", "--master_port", str(port), str(ROOT / "launch" / "classify.py"),
            f"run_dir={run}", f"seed={seed}", "model.backbone=bert", "model.from_scratch=true", f"model.preset={preset}",
            f"model.settings={SETTINGS[preset]}", f"data.tokenizer={data / 'tokenizer'}",
            f"data.files={{train: [{data / 'train.jsonl'}], test: [{data / 'test.jsonl'}]}}",
            f"data.segment_length={SEGMENT}", f"data.max_segments={SEGMENTS}", f"optim.micro_batch_size={MICRO}",
            f"optim.bptt_segments={SEGMENTS}", f"optim.epochs={a.epochs}", f"optim.lr={a.lr}",
            "optim.precision=fp32", "eval.split=test", "eval.protocols=[full, memoryless]", "log.every=25",
            "log.tensorboard=false", "log.progress=false", "checkpoint.every=0", "checkpoint.export=false",
            f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}"]


def one_run(a: argparse.Namespace, data: Path, preset: str, seed: int, port: int) -> dict:
    """Train (unless done before) and read the figures of one (preset, seed)."""
    run = Path(a.out) / f"{preset}_s{seed}"
    cmd = train_command(a, data, preset, seed, run, port)
    if not (run / "summary.json").exists():
        run_child(cmd, f"the {preset} run of seed {seed}", cwd=ROOT, env=_env(a.threads))
    evals = {r["protocol"]["name"]: r for r in json.loads((run / "summary.json").read_text())["eval"]}
    out = {("full", "last"): evals["full"], ("memoryless", "last"): evals["memoryless"]}
    if preset == "backbone":  # the same model read by the mean of its segments' logits
        scored = run / "eval_mean"
        if not list(scored.glob("test_classification_full*.json")):
            run_child([sys.executable, str(ROOT / "launch" / "evaluate.py"), str(run), "--out", str(scored),
                       "eval.aggregate=mean", "eval.protocols=[full]"], f"the segment-mean reading of seed {seed}",
                      cwd=ROOT, env=_env(a.threads))
        (path,) = scored.glob("test_classification_full*.json")
        out[("full", "mean")] = json.loads(path.read_text())
    return {"preset": preset, "seed": seed, "command": " ".join(cmd),
            "readings": {f"{p}/{agg}": {"accuracy": r["accuracy"], "macro_f1": r["macro_f1"]}
                         for (p, agg), r in out.items()}}


def spread(xs: list[float]) -> str:
    return f"{100 * statistics.fmean(xs):.1f} ± {100 * (max(xs) - min(xs)) / 2:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=str(ROOT / "runs" / "long_documents"), help="data and run directories")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-docs", type=int, default=2400)
    p.add_argument("--test-docs", type=int, default=200)
    p.add_argument("--jobs", type=int, default=1, help="runs side by side")
    p.add_argument("--threads", type=int, default=1, help="threads per run")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    seeds = int_list(p, "--seeds", a.seeds, 0)
    if min(a.epochs, a.train_docs, a.test_docs, a.jobs, a.threads) < 1 or a.lr <= 0:
        p.error("--epochs, --train-docs, --test-docs, --jobs and --threads must be at least 1, --lr above 0")
    # finished runs under --out are reused: only those of these settings (another's would be reported as these)
    recipe = {k: getattr(a, k) for k in ("epochs", "lr", "train_docs", "test_docs")}
    stamp = Path(a.out) / "recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) != recipe:
        p.error(f"--out {a.out} holds runs of other settings ({stamp.read_text().strip()}); choose another --out")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(recipe))
    data = Path(a.out) / "data"
    if not (data / "test.jsonl").exists():
        write_evidence_documents(data, {"train": a.train_docs, "test": a.test_docs})
        write_book_tokenizer(data / "tokenizer")
    jobs = [(preset, seed) for seed in seeds for preset in ("backbone", "memoria")]
    with ThreadPoolExecutor(a.jobs) as pool:  # a run that fails is reported; the others still run
        futures = [pool.submit(one_run, a, data, preset, seed, 29600 + 7 * seed + len(preset)) for preset, seed in jobs]
    runs, failed = [], []
    for (preset, seed), future in zip(jobs, futures):
        try:
            runs.append(future.result())
        except ChildFailed as e:
            failed.append(f"{preset}, seed {seed}: {e}")
    if failed:
        print("failed (rerun to retry them; finished runs are kept):\n" + "\n".join(failed), file=sys.stderr)
        return 1
    by = {(r["preset"], r["seed"]): r["readings"] for r in runs}
    table = {}
    print(f"{'reading':<16}" + "".join(f"{'seed ' + str(s):>14}" for s in seeds) + f"{'mean ± half-range':>22}")
    for name, (preset, protocol, agg) in READINGS.items():
        acc = [by[preset, s][f"{protocol}/{agg}"]["accuracy"] for s in seeds]
        f1 = [by[preset, s][f"{protocol}/{agg}"]["macro_f1"] for s in seeds]
        table[name] = {"accuracy": acc, "macro_f1": f1}
        print(f"{name:<16}" + "".join(f"{100 * x:>13.1f}%" for x in acc) + f"{spread(acc):>21}%"
              f"   macro-F1 {spread(f1)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
