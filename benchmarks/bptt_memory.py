"""What a span of K segments per optimiser step costs (`optim.bptt_segments`), with and without
memory replay back-propagation (`optim.bptt_recompute`): CPU time and peak memory of one span.

Each configuration runs in its own process (so its peak RSS is its own): a `memformer` model of
`--shape` (random weights, `memory_init="random"`), `--batch` streams of `--segment` tokens; one
span = K segments forwarded in order through the training loop's own `_forward`, carrying the
slots with their graph, then one backward of the mean loss. Reported: the median process CPU
time of `--rounds` spans after one untimed span, per segment, and the process's peak RSS.

    python benchmarks/bptt_memory.py --spans 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from types import SimpleNamespace

from failures import run_child  # benchmarks/failures.py: a worker's failure with its traceback

SHAPES = {"small": dict(n_layer=4, n_embd=256, n_head=4), "gpt2": dict(n_layer=12, n_embd=768, n_head=12)}


def worker(a: argparse.Namespace, span: int, recompute: bool) -> dict:
    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model
    from memoria_ds.train.loop import _forward

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    backbone = GPT2Config(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **SHAPES[a.shape])
    model = build_model(backbone, a.variant, memory_init="random").train()
    gen = torch.Generator().manual_seed(a.seed)
    tokens = torch.randint(0, backbone.vocab_size, (a.batch, a.segment * span + 1), generator=gen)
    no_reset = torch.zeros(a.batch, dtype=torch.bool)
    times = []
    memory = None
    for r in range(a.rounds + 1):
        c0 = time.process_time()
        losses = []
        for k in range(span):
            x = tokens[:, k * a.segment:(k + 1) * a.segment].contiguous()
            y = tokens[:, k * a.segment + 1:(k + 1) * a.segment + 1].contiguous()  # the aligned targets
            out = _forward(model, SimpleNamespace(input_ids=x, attention_mask=None), memory, no_reset, y, recompute)
            memory = out.memory
            losses.append(out.loss)
        torch.stack(losses).mean().backward()
        memory.detach_()
        model.zero_grad(set_to_none=True)
        if r:
            times.append(time.process_time() - c0)
    return {"span": span, "recompute": recompute, "cpu_s_per_segment": statistics.median(times) / span,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--variant", default="memformer", help="a preset (any kind runs; only a graph-keeping one "
                                                           "gets gradients across segments)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--segment", type=int, default=150)
    p.add_argument("--spans", default="1,2,4,8", help="K values")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        span, recompute = a.worker.split(",")
        print(json.dumps(worker(a, int(span), recompute == "1")))
        return
    try:
        spans = [int(s) for s in a.spans.split(",")]
    except ValueError:
        spans = [0]
    if any(s < 1 for s in spans) or a.rounds < 1 or a.batch < 1 or a.segment < 1:
        p.error(f"--spans {a.spans!r}, --rounds, --batch and --segment: integers >= 1 (comma-separated for --spans)")
    args = sys.argv[1:]
    results = []
    for span in spans:
        for recompute in (False, True):
            done = run_child([sys.executable, __file__, *args, "--worker", f"{span},{int(recompute)}"],
                             f"the worker for span {span}, recompute {recompute}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"variant={a.variant} shape={a.shape} batch={a.batch} segment={a.segment} threads={a.threads} "
          f"rounds={a.rounds}")
    print(f"{'K':>3} {'recompute':>10} {'CPU s / segment':>16} {'peak (MiB)':>11}")
    for r in results:
        recompute = str(r["recompute"]).lower()
        print(f"{r['span']:>3} {recompute:>10} {r['cpu_s_per_segment']:>16.3f} {r['peak_mib']:>11.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
