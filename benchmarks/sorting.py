"""Does the memory help on the sorting task? A CPU-scale version of paper Tables 4 and 7.

The sorting task (`memoria_ds.data.sorting`): a long stream of symbols from 20, whose
frequencies drift from one distribution to another, then a separator, then the 20 symbols
by descending count, teacher-forced. Only the last segment of an example holds the answer,
so a model that sees nothing before its segment must guess the counts from the symbols of
that segment; a memory can carry the earlier segments' counts to the answer.

Every variant trains from scratch on the same generated examples with the same optimiser
as `engine=torch` (AdamW on the toolkit's parameter groups, linear warm-up and decay,
clipping), the way the training loop does it: each example's segments in order with the
memory carried and reset at the example's first segment; segments without targets run
forward only; one update per batch of examples. Then it scores the test split with the
toolkit's `evaluate_sorting` (teacher-forced argmax accuracy over the 20 answer positions),
once as trained and once with the memory reset before every segment (`memoryless`: the model
then sees only the answer's segment); the difference is what the memory does on the task.

Chance, for a model that only learns that the answer is a permutation (never repeat a
symbol already given): the mean of 1 / (20 - k) over the answer positions k, 18.0%.
`--oracle` prints what exact counting reaches when it sees only the last segment, the last
two, ..., all of the input: the ceiling each variant's view allows.

    python benchmarks/sorting.py --segments 4                     # 5 variants x 3 seeds, 2 runs at a time
    python benchmarks/sorting.py --segments 4 --seeds 0 --variants transformer,memoria
    python benchmarks/sorting.py --oracle --segments 4,8,16       # the ceilings only, seconds
    python benchmarks/sorting.py --table a.json b.json            # one table from earlier --json files

Cost on a 2-core CPU (two runs at a time, one thread each), 6,000 updates at 4 segments:
about 6 min (`transformer`), 7 (`xl`), 10 (`memoria_wm`), 15 (`memoria`) per run; 8 and 16
segments cost about 1.6x and 3x that. docs/results.md has the results.

Variants are presets (`transformer`, `xl`, `memoria_wm`, `memoria_wm_stm`, `memoria`, ...)
with optional `+key=value` model settings, as in `benchmarks/real_text.py`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config

from memoria_ds.data.examples import ExampleStreams
from memoria_ds.data.reset import ResetPolicy
from memoria_ds.data.sorting import NUM_SYMBOLS, VOCAB_SIZE, generate_sorting, input_length_for, sorting_target
from memoria_ds.eval.sorting import evaluate_sorting
from memoria_ds.model import PRESETS, build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arguments  # noqa: E402
from recipe import curve, optimiser, parse_variant, update, watch_residual  # noqa: E402  (benchmarks/recipe.py: the same optimiser and variant syntax)

CHANCE = statistics.fmean(1.0 / (NUM_SYMBOLS - k) for k in range(NUM_SYMBOLS))


def memory_sizes(segment: int) -> dict:
    """The reproduction's rule (launch/repro/configs/sorting.yaml): N_wm L/8, K_stm L/4, K_ltm 5L/8, C_stm L/2."""
    return {"num_wm": max(1, segment // 8), "num_stm_reminded": max(1, segment // 4),
            "num_ltm_reminded": max(1, 5 * segment // 8), "stm_capacity": max(1, segment // 2),
            "initial_lifespan": 5.0, "alpha": 8.0, "search_depth": 10}  # fmt: skip


def make_model(spec: str, a: argparse.Namespace, seed: int) -> tuple[torch.nn.Module, dict]:
    preset, settings, knobs = parse_variant(spec)
    backbone = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=2 * a.segment, n_layer=a.layers, n_embd=a.width,
                          n_head=a.heads, resid_pdrop=a.dropout, embd_pdrop=a.dropout, attn_pdrop=a.dropout,
                          bos_token_id=0, eos_token_id=0)  # fmt: skip
    if any(PRESETS[part]["memory_type"] == "memoria" for part in preset.split("+")):  # `xl+memoria`: its parts
        settings["memoria"] = {**memory_sizes(a.segment), **settings.get("memoria", {})}
        settings.setdefault("memory_inner_dim_ratio", a.memory_width)  # the reproduction's, unless the variant says
    settings.setdefault("segment_length", a.segment)  # e.g. the infinity-former's basis: one function per token
    torch.manual_seed(seed)  # every preset draws the same backbone for one seed
    return build_model(backbone, preset, **settings), knobs


def train(spec: str, seed: int, a: argparse.Namespace, data) -> tuple[torch.nn.Module, list[float], list]:
    streams = ExampleStreams(data, batch_size=a.batch, segment_length=a.segment, shuffle=True, seed=seed,
                             drop_last=True)  # fmt: skip
    per_example = 1 if a.bptt_example else len(streams.scored_segments)
    a.steps = a.epochs * streams.num_batches * per_example  # updates, for the LR schedule
    model, knobs = make_model(spec, a, seed)
    model.to(a.device).train()
    opt, sched = optimiser(model, a, knobs)
    policy = ResetPolicy(at_document_start=True)
    (residual, hook), memory, losses, norms = watch_residual(model), None, [], []
    span: list[torch.Tensor] = []
    last = streams.segments_per_example - 1
    for epoch in range(a.epochs):
        for step in range(streams.steps_per_epoch):
            batch = streams.batch_at(epoch, step).to(a.device)
            scored = streams.has_targets(step)  # the other segments run forward only, to write the memory
            with torch.set_grad_enabled(scored or a.bptt_example):  # `--bptt-example`: the input's writes too
                out = model(batch.input_ids, shift_labels=batch.targets if scored else None, memory=memory,
                            reset=policy.reset_mask(batch))  # fmt: skip
            memory = out.memory
            if scored and not a.bptt_example:
                losses.append(update(out.loss, opt, sched, knobs, a.grad_clip, norms))
                memory.detach_()  # a kind that keeps its graph (memformer) does not reach the next update
            elif scored:
                span.append(out.loss)
            if a.bptt_example and step % streams.segments_per_example == last:  # one update per example
                update(torch.stack(span).mean(), opt, sched, knobs, a.grad_clip, norms)
                losses += [float(x.detach()) for x in span]
                span = []
                memory.detach_()
    hook.remove()
    return model, losses, (norms, residual)


def oracle(test, segment: int) -> list[float]:
    """Accuracy of exact counting over the last 1, 2, ..., K segments of the input (teacher-forced)."""
    first = np.asarray(test[0]["symbols"])
    k_segments = (len(first) + NUM_SYMBOLS + segment - 1) // segment
    out = []
    for k in range(1, k_segments + 1):
        start = max(0, k_segments * segment - k * segment)
        correct = 0
        for row in test:
            symbols, target = np.asarray(row["symbols"], np.int64), np.asarray(row["target"], np.int64)
            guess = sorting_target(symbols[start:])  # the answer the visible symbols give
            # teacher forcing: at answer position j the model knows target[:j]; it names the
            # first symbol of its own ranking not yet given
            given = set()
            for j in range(NUM_SYMBOLS):
                pick = next(s for s in guess if s not in given)
                correct += int(pick == target[j])
                given.add(int(target[j]))
        out.append(correct / (len(test) * NUM_SYMBOLS))
    return out


def run_one(a: argparse.Namespace, k: int, spec: str, seed: int, seen: list[float]) -> dict:
    """Train one variant on k-segment examples and score the test split."""
    torch.set_num_threads(a.threads)
    length = input_length_for(k, a.segment)
    train_ds = generate_sorting(a.train_examples, length, seed=a.data_seed, split="train")
    test_ds = generate_sorting(a.test_examples, length, seed=a.data_seed, split="test")
    t0 = time.perf_counter()
    model, losses, (norms, residual) = train(spec, seed, a, train_ds)
    train_s = time.perf_counter() - t0
    r = evaluate_sorting(model, test_ds, segment_length=a.segment, batch_size=a.batch, progress=False)
    bare = evaluate_sorting(model, test_ds, segment_length=a.segment, batch_size=a.batch, progress=False,
                            memoryless=True)  # the same model with its memory reset before every segment
    return dict(segments=k, variant=spec, seed=seed, accuracy=r.accuracy, answer_nll=r.nll,
                accuracy_memoryless=bare.accuracy, answer_nll_memoryless=bare.nll,
                train_loss_last=statistics.fmean(losses[-max(1, len(losses) // 10):]), updates=len(norms),
                train_s=train_s, oracle=seen, curve=curve(losses, norms, residual))  # fmt: skip


def report(r: dict) -> None:
    print(f"  {r['segments']:>2} segments  {r['variant']:<28} seed {r['seed']}  accuracy {r['accuracy']:.1%} "
          f"({r['accuracy_memoryless']:.1%} without memory)  answer nll {r['answer_nll']:.3f}  train loss "
          f"{r['train_loss_last']:.3f}  ({r['updates']} updates, {r['train_s']:.0f}s)", flush=True)  # fmt: skip


def check_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Mistakes in the options: one line, exit 2, before any data is generated."""
    a.segment_list = arguments.int_list(p, "--segments", a.segments, 1)
    a.seed_list = arguments.int_list(p, "--seeds", a.seeds, 0)
    a.variant_list = arguments.variants(p, a.variants, parse_variant)
    arguments.at_least(p, a, 1, "segment", "train_examples", "test_examples", "epochs", "batch", "layers", "width",
                       "heads", "threads", "jobs")  # fmt: skip
    arguments.at_least(p, a, 0, "data_seed", "weight_decay", "grad_clip")
    if not a.lr > 0:
        p.error(f"--lr {a.lr}: must be above 0")
    if not (0 < a.memory_width <= 1):
        p.error(f"--memory-width {a.memory_width}: a fraction of --width in (0, 1]")
    if not (0 <= a.dropout < 1):
        p.error(f"--dropout {a.dropout}: in [0, 1)")
    if a.width % a.heads:
        p.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    for k in a.segment_list:
        try:
            input_length_for(k, a.segment)
        except ValueError as e:
            p.error(f"--segments {k}: {e}")
    arguments.output_file(p, "--json", a.json)
    arguments.device(p, a.device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="transformer,xl,memoria_wm,memoria_wm_stm,memoria")
    p.add_argument("--segments", default="4,8,16", help="segments per example (the paper's 4K .. 32K at L=1024)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--segment", type=int, default=32, help="segment length L")
    p.add_argument("--train-examples", type=int, default=16000)
    p.add_argument("--test-examples", type=int, default=500)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--memory-width", type=float, default=1.0,
                   help="Memoria's memory-attention width / n_embd (1.0: the authors', as the reproduction config; "
                        "the package default is 1/8, which leaves 4 dimensions per head at this width)")
    p.add_argument("--dropout", type=float, default=0.0, help="GPT-2's three dropouts (its default is 0.1)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--bptt-example", action="store_true",
                   help="one update per example, every segment with gradients and the memory's graph kept across "
                        "them (optim.bptt_segments over an example; memformer's writer trains only so)")
    p.add_argument("--oracle", action="store_true", help="only print the counting oracle's accuracy")
    p.add_argument("--device", default="cpu", help="where each run trains and is scored (cpu, cuda, cuda:1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, one process each (2 on a 2-core machine)")
    p.add_argument("--json", default=None)
    p.add_argument("--print-args", action="store_true",
                   help="print the resolved options as JSON and exit, after their checks (what `memoria_ds.compare` "
                        "records as the recipe)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON", help="only print the table of earlier --json files")
    a = p.parse_args()
    if a.table:
        print_table([r for data in arguments.result_files(p, "--table", a.table) for r in data["results"]])
        return
    check_arguments(p, a)
    if a.print_args:
        print(json.dumps(vars(a)))
        return
    runs = []
    for k in a.segment_list:
        length = input_length_for(k, a.segment)
        generate_sorting(a.train_examples, length, seed=a.data_seed, split="train")  # cached for the workers
        seen = oracle(generate_sorting(a.test_examples, length, seed=a.data_seed, split="test"), a.segment)
        print(f"{k} segments of {a.segment} ({length} input symbols): chance {CHANCE:.1%}; exact counting over the "
              f"last 1..{k} segments: " + " ".join(f"{x:.1%}" for x in seen), flush=True)  # fmt: skip
        runs += [(k, spec, seed, seen) for spec in a.variant_list for seed in a.seed_list]
    if a.oracle:
        return
    results = []
    if a.jobs > 1:  # one run per process, each on --threads threads
        with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for rec in (f.result() for f in as_completed([pool.submit(run_one, a, *run) for run in runs])):
                results.append(rec)
                report(rec)
        order = {run[:3]: i for i, run in enumerate(runs)}
        results.sort(key=lambda r: order[r["segments"], r["variant"], r["seed"]])
    else:
        for run in runs:
            results.append(run_one(a, *run))
            report(results[-1])
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "chance": CHANCE, "results": results}, indent=2))
    print_table(results)


def spread(xs: list[float], fmt: str) -> str:
    """Mean ± half-range of `xs`, each formatted with `fmt`."""
    return f"{statistics.fmean(xs):{fmt}} ± {(max(xs) - min(xs)) / 2:{fmt}}"


def print_grid(title: str, results: list[dict], cell) -> None:
    """One line per variant, one column per segment count; `cell(runs)` formats the runs of one."""
    ks = sorted({r["segments"] for r in results})
    print(f"\n{title}")
    print(f"{'variant':<24}" + "".join(f"{f'{k} segments':>40}" for k in ks))
    for spec in dict.fromkeys(r["variant"] for r in results):
        runs = [[r for r in results if r["variant"] == spec and r["segments"] == k] for k in ks]
        print(f"{spec:<24}" + "".join(f"{cell(rs) if rs else '-':>40}" for rs in runs))


def print_table(results: list[dict]) -> None:
    """Accuracy and answer NLL per variant and segment count: mean ± half-range over seeds; then,
    for runs that have it, the accuracy without memory and what the memory adds."""
    print_grid(f"accuracy / answer NLL, mean ± half-range over seeds (chance {CHANCE:.1%})", results,
               lambda rs: f"{spread([r['accuracy'] for r in rs], '.1%')} / "
                          f"{spread([r['answer_nll'] for r in rs], '.3f')} (n={len(rs)})")  # fmt: skip
    memoryless = [r for r in results if "accuracy_memoryless" in r]  # (not in --json files of before 2026-11-26)
    if memoryless:
        print_grid("accuracy with the memory reset before every segment (the model sees only the answer's segment), "
                   "and what the memory adds: mean over seeds, in points", memoryless,
                   lambda rs: f"{spread([r['accuracy_memoryless'] for r in rs], '.1%')}, memory "
                              f"{100 * statistics.fmean(r['accuracy'] - r['accuracy_memoryless'] for r in rs):+.1f} "
                              f"(n={len(rs)})")  # fmt: skip


if __name__ == "__main__":
    main()
