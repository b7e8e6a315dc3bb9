"""Does the memory pay on real text? Train on some books, score held-out ones, by position.

Every variant trains from scratch on the same token streams (the toolkit's `TokenStreams`
and reset policy, GPT-2's BPE), with the same optimiser as `engine=torch` (AdamW on the
same parameter groups, linear warm-up and decay, clipping), for the same number of steps.
Each held-out text is then cut into documents of `--eval-segments` segments; every
document starts with an empty memory and is read segment by segment with its memory
carried. Reported per variant: held-out perplexity per text, and the mean NLL by segment
position inside the documents (segment 0 has no memory to use; the later ones are where a
memory must help). Mean and spread over seeds.

    python benchmarks/real_text.py                                       # the default comparison
    python benchmarks/real_text.py --variants transformer,memoria --seeds 0 --steps 300
    python benchmarks/real_text.py --train my_books/*.txt --heldout other/*.txt

Texts: by default four public-domain books of the Canterbury corpus, taken from the
source distribution of the PyPI package `brotli` (its test data): *Paradise Lost*
(plrabn12), the Library of Congress *Workshop on Electronic Texts* (lcet10) to train on;
*Alice's Adventures in Wonderland* (alice29) and *As You Like It* (asyoulik) held out.
`--train` / `--heldout` take any local .txt files instead.

Variants are presets (`transformer`, `xl`, `memoria`, `memoria_full_width`, ...) with
optional `+key=value` model settings, e.g. `memoria+memory_init=random` or
`xl+xl_memory_length=32`; `+opt.X=...` sets an optimiser knob of this script (see
`OPT_KNOBS`), e.g. `memoria+opt.clip=separate`.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config

from memoria_ds.data.reset import ResetPolicy
from memoria_ds.data.streams import TokenStreams
from memoria_ds.data.token_corpus import TokenCorpus
from memoria_ds.data.tokenize import gpt2_tokenizer_offline
from memoria_ds.model import PRESETS, build_model
from memoria_ds.train.engine import linear_warmup_decay, param_groups

CANTERBURY = {"alice29", "asyoulik", "lcet10", "plrabn12"}
BROTLI_SDIST = "brotli==1.2.1"
CACHE = Path(os.environ.get("MEMORIA_DS_TEXTS", Path.home() / ".cache" / "memoria_ds" / "texts"))

# Optimiser knobs a variant may set with `+opt.NAME=VALUE` (diagnosis experiments).
OPT_KNOBS = {
    "clip": "joint",  # joint: one global norm over all parameters (the toolkit); separate: backbone and memory apart
    "memory_lr": 1.0,  # learning-rate multiplier of the memory modules
}


def canterbury(name: str) -> Path:
    """A Canterbury text from brotli's sdist (downloaded once with pip, cached)."""
    path = CACHE / f"{name}.txt"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(CACHE), BROTLI_SDIST], check=True)  # fmt: skip
        sdist = next(CACHE.glob("[Bb]rotli-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                stem = Path(member.name).stem
                if Path(member.name).parent.name == "testdata" and member.name.endswith(".txt") and stem in CANTERBURY:
                    (CACHE / f"{stem}.txt").write_bytes(tar.extractfile(member).read())
    return path


def load_texts(names: list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        path = canterbury(n) if n in CANTERBURY else Path(n)
        if not path.exists():
            raise SystemExit(f"no such text {n!r}: give a path or one of {sorted(CANTERBURY)}")
        out[path.stem] = path.read_text(encoding="utf-8", errors="replace")
    return out


def parse_variant(spec: str) -> tuple[str, dict, dict]:
    """`preset+key=value+opt.knob=value` -> (preset, model settings, optimiser knobs)."""
    preset, *pairs = spec.split("+")
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    settings, knobs = {}, dict(OPT_KNOBS)
    for pair in pairs:
        key, value = pair.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        if key.startswith("opt."):
            if key[4:] not in OPT_KNOBS:
                raise SystemExit(f"unknown optimiser knob {key!r}; known: {sorted(OPT_KNOBS)}")
            knobs[key[4:]] = value
        else:
            settings[key] = value
    return preset, settings, knobs


def make_model(spec: str, a: argparse.Namespace, seed: int) -> tuple[torch.nn.Module, dict]:
    preset, settings, knobs = parse_variant(spec)
    # two segments of positions: `xl` alternates between two banks (the others use the first)
    backbone = GPT2Config(vocab_size=a.vocab_size, n_positions=2 * a.segment, n_layer=a.layers,
                          n_embd=a.width, n_head=a.heads)  # fmt: skip
    if PRESETS[preset]["memory_type"] == "memoria":
        memoria = {"num_wm": a.num_wm, "num_stm_reminded": a.num_wm, "num_ltm_reminded": a.num_wm,
                   "stm_capacity": 8 * a.num_wm}  # fmt: skip
        memoria.update(settings.pop("memoria", {}))
        settings["memoria"] = memoria
    torch.manual_seed(seed)  # every preset draws the same backbone for one seed (tests/model/test_noop_init.py)
    return build_model(backbone, preset, **settings), knobs


def optimiser(model, a, knobs):
    memory_ids = {id(p) for m in model.memory_modules() for p in m.parameters()}
    groups = []
    for g in param_groups(model, a.weight_decay):
        for is_mem in (False, True):
            ps = [p for p in g["params"] if (id(p) in memory_ids) == is_mem]
            if ps:
                scale = knobs["memory_lr"] if is_mem else 1.0
                groups.append({**g, "params": ps, "lr": a.lr * scale, "memory": is_mem})
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(a.steps, 0.06))
    return opt, sched


def clip(opt, knobs, max_norm: float) -> float:
    if knobs["clip"] == "joint":
        ps = [p for g in opt.param_groups for p in g["params"]]
        return float(torch.nn.utils.clip_grad_norm_(ps, max_norm))
    norms = []
    for is_mem in (False, True):
        ps = [p for g in opt.param_groups if g["memory"] == is_mem for p in g["params"]]
        if ps:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ps, max_norm)))
    return norms[0]


def group_norms(opt) -> tuple[float, float]:
    """(backbone, memory modules) gradient norms before clipping."""
    out = []
    for is_mem in (False, True):
        grads = [p.grad for g in opt.param_groups if g["memory"] == is_mem for p in g["params"] if p.grad is not None]
        out.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
    return out[0], out[1]


def watch_residual(model):
    """(list, hook handle): the list gets, at every forward until the handle is removed, the
    mean norm of the final residual stream (ln_f's input). A memory path that swamps the
    backbone shows as this growing by orders of magnitude."""
    seen: list[float] = []
    handle = model.transformer.ln_f.register_forward_pre_hook(
        lambda _m, args: seen.append(float(args[0].detach().norm(dim=-1).mean())))
    return seen, handle


def curve(losses: list[float], norms: list[tuple[float, float]], residual: list[float], points: int = 20) -> list[dict]:
    """The training curve in `points` windows: mean loss, mean backbone / memory gradient norms,
    and the mean final-residual norm (over the window's forwards, also unscored ones)."""
    size, per = max(1, len(losses) // points), max(1, len(residual) // max(1, len(losses)))
    return [{"update": i + size, "loss": statistics.fmean(losses[i:i + size]),
             "grad_backbone": statistics.fmean(n[0] for n in norms[i:i + size]),
             "grad_memory": statistics.fmean(n[1] for n in norms[i:i + size]),
             "residual_norm": statistics.fmean(residual[i * per:(i + size) * per] or [float("nan")])}
            for i in range(0, len(losses) - size + 1, size)]  # fmt: skip


def update(loss: torch.Tensor, opt, sched, knobs: dict, grad_clip: float,
           norms: list[tuple[float, float]] | None = None) -> float:
    """One optimiser step on `loss` (backward, clipping, step, schedule); returns the loss.
    `norms`, if given, gets this step's (backbone, memory) gradient norms before clipping."""
    loss.backward()
    if norms is not None:
        norms.append(group_norms(opt))
    if grad_clip:
        clip(opt, knobs, grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def train(spec: str, seed: int, a, corpus: TokenCorpus) -> tuple[torch.nn.Module, list[float], list]:
    model, knobs = make_model(spec, a, seed)
    model.train()
    opt, sched = optimiser(model, a, knobs)
    streams = TokenStreams(corpus, num_streams=a.streams, segment_length=a.segment, tail="drop",
                           shuffle_documents=False, seed=seed)  # fmt: skip
    policy = ResetPolicy.parse(a.reset)
    (residual, hook), memory, losses, norms = watch_residual(model), None, [], []
    batches = iter(streams)
    for step in range(a.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(streams)
            batch = next(batches)
        out = model(batch.input_ids, shift_labels=batch.targets, memory=memory, reset=policy.reset_mask(batch, step))
        memory = out.memory
        losses.append(update(out.loss, opt, sched, knobs, a.grad_clip, norms))
    hook.remove()
    return model, losses, (norms, residual)


@torch.no_grad()
def score(model, tokens: list[int], a, use_memory: bool = True) -> list[tuple[float, int]]:
    """(sum NLL, count) per segment position, over documents of `--eval-segments` segments.

    `use_memory=False` resets every row before every segment: the same model with its memory
    taken away (the difference is what the memory itself is worth to the trained model).
    """
    model.eval()
    doc_len = a.eval_segments * a.segment
    n_docs = len(tokens) // (doc_len + 1)
    x = torch.tensor(tokens[: n_docs * (doc_len + 1)]).view(n_docs, doc_len + 1)
    inputs, targets = x[:, :-1], x[:, 1:]
    out_sums = [[0.0, 0] for _ in range(a.eval_segments)]
    for r0 in range(0, n_docs, a.eval_batch):
        rows = slice(r0, r0 + a.eval_batch)
        memory = None
        for s in range(a.eval_segments):
            cols = slice(s * a.segment, (s + 1) * a.segment)
            reset = None if use_memory else torch.ones(inputs[rows].shape[0], dtype=torch.bool)
            out = model(inputs[rows, cols], memory=memory, reset=reset)
            memory = out.memory
            nll = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), targets[rows, cols].flatten(),
                                                    reduction="sum")  # fmt: skip
            out_sums[s][0] += float(nll)
            out_sums[s][1] += targets[rows, cols].numel()
    return [(s, n) for s, n in out_sums]


def position_buckets(n: int) -> list[tuple[int, int]]:
    """Segment index ranges [0], [1], [2, 4), [4, 8), ... up to n."""
    out, lo = [(0, 1)], 1
    while lo < n:
        hi = min(n, max(lo + 1, 2 * lo))
        out.append((lo, hi))
        lo = hi
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="transformer,xl,memoria,memoria_full_width")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--train", default="plrabn12,lcet10", help="comma-separated Canterbury names or .txt paths")
    p.add_argument("--heldout", default="alice29,asyoulik")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--segment", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-wm", type=int, default=16, help="N_wm = K_stm = K_ltm; C_stm = 8 N_wm (the paper's ratio)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--reset", default="document_start", help="training reset policy (data.reset)")
    p.add_argument("--eval-segments", type=int, default=16, help="segments per held-out document")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--full-vocab", action="store_true",
                   help="GPT-2's 50,257 ids (default: only the ids the texts use, renumbered: same tokens, 4x faster)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    tok = gpt2_tokenizer_offline()
    eos = tok.eos_token_id
    train_docs = {k: tok(v)["input_ids"] + [eos] for k, v in load_texts(a.train.split(",")).items()}
    held = {k: tok(v)["input_ids"] for k, v in load_texts(a.heldout.split(",")).items()}
    a.vocab_size = len(tok)
    if not a.full_vocab:
        ids = sorted({t for d in [*train_docs.values(), *held.values()] for t in d})
        new = {t: i for i, t in enumerate(ids)}
        train_docs = {k: [new[t] for t in d] for k, d in train_docs.items()}
        held = {k: [new[t] for t in d] for k, d in held.items()}
        a.vocab_size = len(ids)
    corpus = TokenCorpus.from_token_lists(list(train_docs.values()))
    print(f"train: {', '.join(train_docs)} ({corpus.num_tokens} tokens; {a.steps} steps of {a.streams} x "
          f"{a.segment} = {a.steps * a.streams * a.segment / corpus.num_tokens:.2f} epochs); held out: "
          + ", ".join(f"{k} ({len(v)} tokens)" for k, v in held.items()) + f"; vocabulary {a.vocab_size}", flush=True)  # fmt: skip

    buckets = position_buckets(a.eval_segments)
    results = []
    for spec in a.variants.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            t0 = time.perf_counter()
            model, losses, (norms, residual) = train(spec, seed, a, corpus)
            train_s = time.perf_counter() - t0
            per_text = {name: score(model, toks, a) for name, toks in held.items()}
            ppl = {name: math.exp(sum(s for s, _ in v) / sum(n for _, n in v)) for name, v in per_text.items()}
            by_pos = [sum(v[i][0] for v in per_text.values()) / sum(v[i][1] for v in per_text.values())
                      for i in range(a.eval_segments)]  # fmt: skip
            bucket_nll = [statistics.fmean(by_pos[lo:hi]) for lo, hi in buckets]
            without = {name: score(model, toks, a, use_memory=False) for name, toks in held.items()}
            nll = lambda d: sum(s for v in d.values() for s, _ in v) / sum(n for v in d.values() for _, n in v)
            memory_gain = nll(without) - nll(per_text)  # nats per token the trained model gets from its memory
            r = dict(variant=spec, seed=seed, train_loss_last100=statistics.fmean(losses[-100:]),
                     train_loss_curve=[statistics.fmean(losses[i:i + 100]) for i in range(0, len(losses), 100)],
                     ppl=ppl, nll_by_segment=by_pos, nll_by_bucket=bucket_nll, memory_gain=memory_gain,
                     curve=curve(losses, norms, residual), train_s=train_s)  # fmt: skip
            results.append(r)
            print(f"{spec:<40} seed {seed}  train {r['train_loss_last100']:.3f}  "
                  + "  ".join(f"{k} {v:.1f}" for k, v in ppl.items())
                  + "  nll by seg " + " ".join(f"{x:.3f}" for x in bucket_nll)
                  + f"  memory gain {memory_gain:.4f}  ({train_s:.0f}s)", flush=True)  # fmt: skip

    print("\nmean ± spread (min..max) over seeds")
    head = ["train loss", "memory gain"] + [f"ppl {k}" for k in held] + [f"seg {lo}" + (f"-{hi - 1}" if hi - lo > 1 else "") for lo, hi in buckets]
    print(f"{'variant':<40}" + "".join(f"{h:>16}" for h in head))
    for spec in a.variants.split(","):
        rs = [r for r in results if r["variant"] == spec]
        cols = [[r["train_loss_last100"] for r in rs], [r["memory_gain"] for r in rs]]
        cols += [[r["ppl"][k] for r in rs] for k in held]
        cols += [[r["nll_by_bucket"][i] for r in rs] for i in range(len(buckets))]
        print(f"{spec:<40}" + "".join(f"{statistics.fmean(c):>9.3f} ±{(max(c) - min(c)) / 2:<6.3f}" for c in cols))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


if __name__ == "__main__":
    main()
