"""Can each kind's whole training step be captured, and does the captured step compute what
the eager one does? One answer per kind, first in the GPU check (issue 49).

    python benchmarks/capture_probe.py --device cuda --mode reduce-overhead --json probe.json
    python benchmarks/capture_probe.py --backend aot_eager --kinds memoria,xl      # on CPU: the structure

For each kind, in order of importance (the plain model, Memoria, `xl`, then every other
preset and the composites), a tiny GPT-2 model with that memory is built twice with the same
weights. One copy runs eagerly; the other is compiled whole (`model.compile(fullgraph=True,
dynamic=False)`: forward, loss and memory update in one graph, backward through AOTAutograd;
with `--mode reduce-overhead` on a GPU, as CUDA graphs). Both run the same six training
steps (the loop's reset and attention masks, a reset of some streams, a reload of the memory
from a saved state, a padded row), each step's loss and gradients kept as copies, as a
training loop keeps what it logs (a CUDA graph's output is overwritten by its next replay),
and the gradients cleared between steps.

Recorded per kind: `captured` (compiled whole and equal to eager within the tolerances),
`differs` (compiled, but a loss or a gradient is beyond them: the figures say by how much),
`skipped` (compiled, but inductor ran it without CUDA graphs: its reasons, which name the
operation and file:line), or `failed` (the error, the innermost frame of our code, the whole
traceback: `benchmarks/failures.py`). The JSON is rewritten after every kind, so a probe cut
short by `--deadline` (seconds) or a crash keeps every answer it reached; kinds it did not
reach are listed as such. Exit status 1 if any kind is not `captured`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config

from failures import from_exception, line_of  # benchmarks/failures.py: what, where, the whole traceback

LENGTH, BATCH, VOCAB = 16, 3, 257
SMALL_MEMORIA = dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, initial_lifespan=3.0,
                     alpha=2.0, search_depth=2)
FIRST = ("transformer", "memoria", "xl")  # the baseline and the kinds the design card trains
COMPOSITES = ("xl+memoria", "xl+memoria_gated")
LOSS_TOL, GRAD_TOL = 1e-4, 1e-3  # relative: the loss, and each gradient's error norm over its norm


def kinds_in_order() -> list[str]:
    from memoria_ds.model.config import PRESETS

    rest = sorted(p for p in PRESETS if p not in FIRST)
    return [*FIRST, *rest, *(c for c in COMPOSITES if c not in PRESETS)]


def build(kind: str, device: torch.device) -> torch.nn.Module:
    from memoria_ds.model import build_model

    config = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = build_model(config, kind, memoria=dict(SMALL_MEMORIA), memory_init="random", segment_length=LENGTH)
    return model.to(device).train()


def plan(device: torch.device) -> list[dict]:
    """Six steps: the loop's masks, a reset of some streams, a reload, a padded row."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH * 6), generator=gen).split(LENGTH, dim=1)
    none, full = torch.zeros(BATCH, dtype=torch.bool), torch.ones(BATCH, LENGTH, dtype=torch.long)
    padded = full.clone()
    padded[2, LENGTH // 2:] = 0  # a stream that ends inside the segment
    how = [dict(), dict(), dict(reset=torch.tensor([False, True, False])), dict(reload=True), dict(mask=padded),
           dict(reset=torch.tensor([True, False, True]))]
    return [dict(x=x.to(device), reset=h.get("reset", none).to(device), mask=h.get("mask", full).to(device),
                 reload=h.get("reload", False)) for x, h in zip(tokens, how)]


def run_steps(model: torch.nn.Module, steps: list[dict], graphs: bool) -> list[tuple[torch.Tensor, dict]]:
    """Each step's loss and gradients, as copies (a CUDA graph's outputs live until its next replay)."""
    torch.manual_seed(0)  # the same draws (dropout, the infinity-former's samples) in both runs
    memory, kept = model.empty_memory(BATCH), []
    for s in steps:
        if s["reload"]:  # a checkpoint's memory, as a resume rebuilds it: new tensors, read from a file
            saved = io.BytesIO()
            torch.save(memory.state_dict(), saved)
            saved.seek(0)
            memory = type(memory).from_state_dict(torch.load(saved, weights_only=True))
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        x = s["x"]
        out = model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory, reset=s["reset"],
                    attention_mask=s["mask"])
        out.loss.backward()
        kept.append((out.loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                                 if p.grad is not None}))
        model.zero_grad(set_to_none=True)
        memory = out.memory
        memory.detach_()
    return kept


def compare(got: list[tuple[torch.Tensor, dict]], want: list[tuple[torch.Tensor, dict]]) -> tuple[float, float, str | None]:
    """(largest relative loss difference, largest relative gradient error norm, where that was)
    between the compiled steps `got` and the eager steps `want`. A gradient the eager step does
    not have counts only if it is non-zero (with no path from the loss, AOTAutograd gives zeros)."""
    loss = max(abs(g[0] - w[0]).item() / max(abs(w[0]).item(), 1e-12) for g, w in zip(got, want))
    grad, worst = 0.0, None
    for i, ((_, gg), (_, wg)) in enumerate(zip(got, want)):
        for name, w in wg.items():
            g = gg.get(name, torch.zeros_like(w))
            err = ((g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)).item()
            if err > grad:
                grad, worst = err, f"step {i + 1}: {name}"
        for name in sorted(set(gg) - set(wg)):
            if gg[name].any():
                grad, worst = float("inf"), f"step {i + 1}: {name} (no gradient in eager)"
    return loss, grad, worst


class _Skips(logging.Handler):
    """Inductor's reasons for running a graph without CUDA graphs ("skipping cudagraphs due to ...")."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "skipping cudagraphs" in text:
            self.reasons.append(" ".join(text.split())[:500])


def probe(kind: str, device: torch.device, mode: str | None, backend: str | None) -> dict:
    t0 = time.time()
    try:
        eager = build(kind, device)
        compiled = build(kind, device)
        compiled.load_state_dict(eager.state_dict())
        steps = plan(device)
        want = run_steps(eager, steps, graphs=False)
        torch._dynamo.reset()
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        compiled.compile(fullgraph=True, dynamic=False, **({"backend": backend} if backend else {"mode": mode}))
        handler = _Skips()
        logging.getLogger("torch").addHandler(handler)
        try:
            got = run_steps(compiled, steps, graphs=device.type == "cuda" and mode in ("reduce-overhead", "max-autotune"))
        finally:
            logging.getLogger("torch").removeHandler(handler)
        skipped = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
    except Exception as e:  # noqa: BLE001  (a kind that cannot be captured is an answer, not a crash)
        return {"status": "failed", **from_exception(e).as_dict(), "seconds": round(time.time() - t0, 1)}
    loss, grad, worst = compare(got, want)
    status = "skipped" if skipped else "captured" if loss <= LOSS_TOL and grad <= GRAD_TOL else "differs"
    result = {"status": status, "max_loss_rel_diff": loss, "max_grad_rel_diff": grad, "worst_grad": worst,
              "seconds": round(time.time() - t0, 1)}
    if skipped:
        result["cudagraph_skips"] = skipped
        result["skip_reasons"] = handler.reasons or ["(inductor gave no reason: run with TORCH_LOGS=perf_hints)"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="reduce-overhead", help="torch.compile mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--backend", default=None, help="a torch.compile backend instead of a mode (aot_eager: "
                                                   "the capture alone, fast, on CPU)")
    p.add_argument("--kinds", default="all", help="comma-separated presets or composites, or `all`")
    p.add_argument("--deadline", type=float, default=None, help="seconds; kinds not begun by then are not probed")
    p.add_argument("--json", default=None, help="write the answers here (after every kind)")
    a = p.parse_args()
    every = kinds_in_order()
    kinds = every if a.kinds == "all" else [k for k in a.kinds.split(",") if k]
    from memoria_ds.model.config import resolve_preset

    for k in kinds:
        try:
            resolve_preset(k)
        except ValueError as e:
            p.error(f"--kinds: {e}")
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 against fp32
    torch._logging.set_logs(perf_hints=True)  # inductor says why it skips CUDA graphs (the handler keeps it)
    device, t0 = torch.device(a.device), time.time()
    report = {"device": str(device), "torch": torch.__version__, "mode": None if a.backend else a.mode,
              "backend": a.backend, "kinds": {}, "not_reached": []}

    def write() -> None:
        report["seconds"] = round(time.time() - t0, 1)
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))

    for i, kind in enumerate(kinds):
        if a.deadline is not None and time.time() - t0 > a.deadline:
            report["not_reached"] = kinds[i:]
            break
        r = report["kinds"][kind] = probe(kind, device, a.mode, a.backend)
        why = f": {line_of(r)}" if r["status"] == "failed" else (
            f": {r['skip_reasons'][0]}" if r["status"] == "skipped" else "")
        print(f"{kind:<22}{r['status']:<9}{r['seconds']:>7.1f} s" + (
            f"  loss {r['max_loss_rel_diff']:.1e} grad {r['max_grad_rel_diff']:.1e}" if "max_loss_rel_diff" in r
            else "") + why, flush=True)
        if r["status"] == "failed":
            print(r["detail"], file=sys.stderr, flush=True)  # the whole traceback, for the log
        write()
    write()
    if report["not_reached"]:
        print(f"not reached before the deadline of {a.deadline:.0f} s: {', '.join(report['not_reached'])}")
    bad = [k for k, r in report["kinds"].items() if r["status"] != "captured"]
    return 1 if bad or report["not_reached"] else 0


if __name__ == "__main__":
    sys.exit(main())
