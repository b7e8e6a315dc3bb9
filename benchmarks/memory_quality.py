"""How much a model gains from its memory, per variant: a small task only memory can solve.

Each example is a "document" of `--segments` segments of `--segment` tokens. The document
has a topic, `--topic` tokens drawn at random from the vocabulary; every token is one of
the topic's (uniformly) with probability `--p-topic`, else uniform over the vocabulary.
A model that knows the topic scores the `bound` NLL below; one that does not, about
ln(vocab). Within one short segment a model sees only part of the topic, so its loss on
later segments falls below the no-memory level only as far as its memory carries the topic
over from earlier segments (the previous one for `xl` and for Memoria's working memory,
older ones through Memoria's short- and long-term memory). The memory is reset at every
document, as in the sorting task.

    python benchmarks/memory_quality.py                                  # the default comparison
    python benchmarks/memory_quality.py --variants transformer,memoria_full_width,memoria --seeds 0,1,2

Every variant trains from scratch with the same data, steps and optimiser (AdamW, linear
warm-up and decay), then is scored on the same held-out documents with its memory carried
across their segments. Reported per variant and seed: the NLL of segment 0 (no memory can
help there) and the mean NLL of segments 1.. (where it can), and the gap between the two.
Variants are the names of `benchmarks/model_step.py` (presets, `memoria_width=R`,
`memoria_layers=K`). `--bptt K` updates once per K segments with the memory's graph kept
across them (Memformer's writer learns only so).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from model_step import variant_settings
from transformers import GPT2Config

from memoria_ds.model import PRESETS, build_model


def documents(n: int, a: argparse.Namespace, seed: int) -> torch.Tensor:
    """(n, segments * segment) int64 tokens: one topic per document."""
    g = torch.Generator().manual_seed(seed)
    length = a.segments * a.segment
    topics = torch.rand(n, a.vocab, generator=g).argsort(dim=1)[:, : a.topic]  # (n, topic) distinct tokens
    pick = torch.randint(0, a.topic, (n, length), generator=g)
    on_topic = torch.gather(topics, 1, pick)
    noise = torch.randint(0, a.vocab, (n, length), generator=g)
    return torch.where(torch.rand(n, length, generator=g) < a.p_topic, on_topic, noise)


def bound_nll(a: argparse.Namespace) -> float:
    """Expected NLL per token of a model that knows the document's topic exactly."""
    p_in = a.p_topic / a.topic + (1 - a.p_topic) / a.vocab
    p_out = (1 - a.p_topic) / a.vocab
    mass_in = a.topic * p_in
    return -(mass_in * math.log(p_in) + (1 - mass_in) * math.log(p_out))


def make_model(name: str, a: argparse.Namespace, seed: int) -> torch.nn.Module:
    preset, extra = variant_settings(name, a.layers)
    backbone = GPT2Config(
        vocab_size=a.vocab, n_positions=a.segment, n_layer=a.layers, n_embd=a.width, n_head=a.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    memoria = {"num_wm": a.num_wm, "num_stm_reminded": a.num_wm, "num_ltm_reminded": a.num_wm}
    memoria.update(stm_capacity=4 * a.num_wm, initial_lifespan=5.0, alpha=8.0, search_depth=10)
    if any(PRESETS[part]["memory_type"] == "memoria" for part in preset.split("+")):  # `xl+memoria`: its parts
        extra["memoria"] = memoria
    torch.manual_seed(seed)
    return build_model(backbone, preset, memory_init=a.init, **extra)


def updates_per_document(a: argparse.Namespace) -> int:
    """`--bptt K`: one update per K segments, the last span of a document possibly shorter."""
    return -(-a.segments // a.bptt)


def run_documents(model, docs: torch.Tensor, a: argparse.Namespace, train: bool, opt=None, sched=None):
    """Feed one batch of documents segment by segment with memory; returns per-segment NLLs.

    Training updates once per `a.bptt` segments on the mean of their losses, the memory's graph
    kept across them and detached at the span's end (as `optim.bptt_segments` does): Memformer's
    writer gets a gradient only from a span of two or more.
    """
    memory = model.empty_memory(docs.shape[0])
    reset = torch.ones(docs.shape[0], dtype=torch.bool)
    nlls, span = [], []
    for s in range(a.segments):
        x = docs[:, s * a.segment : (s + 1) * a.segment]
        out = model(x, labels=x, memory=memory, reset=reset if s == 0 else None)
        memory = out.memory
        nlls.append(out.loss.item())
        if train:
            span.append(out.loss)
            if len(span) == a.bptt or s == a.segments - 1:
                torch.stack(span).mean().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                span = []
                memory.detach_()  # a kind that keeps its graph (memformer) does not reach the next span
    return nlls


def train_and_score(name: str, seed: int, a: argparse.Namespace, train_docs, eval_docs) -> dict:
    model = make_model(name, a, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    batches = train_docs.shape[0] // a.batch
    total = batches * updates_per_document(a)
    warm = max(1, int(0.06 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / warm, max(0.0, (total - i) / (total - warm)))
    )
    t0 = time.perf_counter()
    for b in range(batches):
        run_documents(model, train_docs[b * a.batch : (b + 1) * a.batch], a, True, opt, sched)
    train_s = time.perf_counter() - t0
    model.eval()
    per_segment = [0.0] * a.segments
    n = eval_docs.shape[0] // a.batch
    with torch.no_grad():
        for b in range(n):
            for s, v in enumerate(run_documents(model, eval_docs[b * a.batch : (b + 1) * a.batch], a, False)):
                per_segment[s] += v / n
    later = statistics.fmean(per_segment[1:])
    return dict(
        variant=name, seed=seed, nll_first=per_segment[0], nll_later=later, gain=per_segment[0] - later,
        nll_per_segment=per_segment, train_s=train_s, params_m=sum(p.numel() for p in model.parameters()) / 1e6,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="transformer,xl,memoria_full_width,memoria_width=0.25,memoria,memoria_fast")
    p.add_argument("--seeds", default="0")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--topic", type=int, default=32, help="topic tokens per document")
    p.add_argument("--p-topic", type=float, default=0.9)
    p.add_argument("--segment", type=int, default=16)
    p.add_argument("--segments", type=int, default=8, help="segments per document")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-wm", type=int, default=8, help="N_wm = K_stm = K_ltm; C_stm = 4 N_wm")
    p.add_argument("--init", choices=["noop", "random"], default="noop", help="memory_init of the new modules")
    p.add_argument("--train-docs", type=int, default=6000)
    p.add_argument("--eval-docs", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bptt", type=int, default=1,
                   help="segments per update, the memory's graph kept across them (memformer's writer trains only so)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.bptt < 1:
        p.error(f"--bptt must be at least 1, got {a.bptt}")
    torch.set_num_threads(a.threads)
    train_docs, eval_docs = documents(a.train_docs, a, seed=1), documents(a.eval_docs, a, seed=2)
    print(f"NLL bounds: topic known {bound_nll(a):.3f}, uniform {math.log(a.vocab):.3f}", flush=True)
    print(f"{'variant':<22}{'seed':>5}{'params (M)':>11}{'NLL seg 0':>11}{'NLL seg 1..':>13}{'gain':>8}{'train (s)':>11}")
    results = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name in a.variants.split(","):
            r = train_and_score(name, seed, a, train_docs, eval_docs)
            results.append(r)
            print(
                f"{name:<22}{seed:>5}{r['params_m']:>11.3f}{r['nll_first']:>11.3f}{r['nll_later']:>13.3f}"
                f"{r['gain']:>8.3f}{r['train_s']:>11.0f}", flush=True,
            )  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "bound_nll": bound_nll(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
