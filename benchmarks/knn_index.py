"""What searching kNN-LM's training-text datastore costs: exact search against a FAISS index.

A shared datastore of `--entries` random keys of `--dim` (GPT-2 small's 768 by default) is
searched by the kNN-LM scorer itself (`knn_log_prob`) for one segment of `--batch` streams of
`--segment` tokens, k = `--k` neighbours, as `eval.knn_lm.index` configures it: `exact`
(every key compared) and each FAISS `index_factory` string of `--indexes`. Reported per
index: the build time (training and adding), the median process CPU time of one segment's
search over `--rounds` rounds after one untimed, its ratio to exact, and its recall@k: the
share of the index's k neighbours that are as near as the exact k-th nearest (the exact k
nearest found, counting ties among equal keys, which repeated text makes; on random keys, a
hard case for quantisation, ties never happen).

    python benchmarks/knn_index.py --entries 200000 --indexes "Flat;IVF1024,Flat;IVF1024,PQ64;HNSW32"
    python benchmarks/knn_index.py --model runs/quickstart/export --text moby_dick --entries 100000

`--indexes` is `;`-separated (a factory string has commas of its own). With `--model` (what
`launch/evaluate.py` takes: a run directory, a save_pretrained directory or a hub id) the keys
are that model's own: the datastore is the toolkit's (`eval.configured.train_datastore`: the model reads `--text`,
`benchmarks/real_text.py`'s names or a path, GPT-2-tokenized, in `--batch` streams of
`--segment` tokens with its memory, keeping kNN-LM's key of every position), its first
`--entries` entries are searched and the next `--batch` x `--segment` are the queries;
`--dim` is then the model's width.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_text import known_text, training_tokens  # noqa: E402  (the long texts it trains on)

from memoria_ds.eval.knn_lm import Datastore, KNNLMSettings, index_datastore, knn_log_prob, squared_distances


def model_keys(a: argparse.Namespace, model: torch.nn.Module,
               docs: list[list[int]]) -> tuple[Datastore, torch.Tensor, torch.Tensor]:
    """(the store of the model's first `a.entries` keys over `docs`, the next B x L keys as
    queries (B, L, D), their next tokens (B, L)), read as kNN-LM's training datastore is."""
    from memoria_ds.data.reset import ResetPolicy
    from memoria_ds.data.token_corpus import TokenCorpus
    from memoria_ds.eval.configured import train_datastore

    wanted = a.entries + a.batch * a.segment
    with torch.no_grad():
        full = train_datastore(model, TokenCorpus.from_token_lists(docs), KNNLMSettings(k=a.k),
                               segment_length=a.segment, streams=a.batch, reset=ResetPolicy(at_document_start=True),
                               max_entries=wanted, device=torch.device("cpu"))  # fmt: skip
    store = Datastore(full.keys[:, : a.entries], full.values[:, : a.entries], full.valid[:, : a.entries])
    queries = full.keys[0, a.entries : wanted].reshape(a.batch, a.segment, -1)
    return store, queries, full.values[0, a.entries : wanted].reshape(a.batch, a.segment)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--segment", type=int, default=128)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--indexes", default="Flat;IVF1024,Flat;IVF1024,PQ64")
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="search this model's kNN-LM keys over --text, not random keys")
    p.add_argument("--text", default="moby_dick", help="with --model: the text it reads (real_text.py's names, a path)")
    a = p.parse_args()
    if min(a.entries, a.dim, a.batch, a.segment, a.k, a.rounds, a.threads, a.nprobe) < 1:
        p.error("--entries, --dim, --batch, --segment, --k, --rounds, --threads and --nprobe: integers >= 1")
    if a.model is not None and not known_text(a.text):
        p.error(f"--text {a.text}: not a path nor one of real_text.py's texts")
    torch.set_num_threads(a.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(a.threads)
    except ImportError:
        p.error("FAISS is not installed: pip install faiss-cpu (or memoria_ds[faiss])")
    if a.model is not None:
        from memoria_ds.data.tokenize import gpt2_tokenizer_offline
        from memoria_ds.train.evaluate import load_model, resolve_model

        docs = training_tokens([a.text], gpt2_tokenizer_offline())
        keys, wanted = sum(len(d) - 1 for d in docs), a.entries + a.batch * a.segment  # a last token has no next
        if keys < wanted:
            p.error(f"--text {a.text} gives {keys} keys; --entries {a.entries} and {a.batch} x {a.segment} queries "
                    f"need {wanted}: lower --entries or give a longer text")
        try:  # a run directory, a save_pretrained directory or a hub id, as launch/evaluate.py takes
            model = load_model(resolve_model(a.model)[0], torch.device("cpu"), "fp32")
        except (OSError, ValueError) as e:  # ValueError: ConfigError too
            p.error(f"--model {a.model}: {str(e).splitlines()[0]}")
        store, queries, targets = model_keys(a, model, docs)
        a.dim = queries.shape[2]
    else:
        g = torch.Generator().manual_seed(0)
        store = Datastore(torch.randn(1, a.entries, a.dim, generator=g), torch.randint(0, 50257, (1, a.entries),
                          generator=g), torch.ones(1, a.entries, dtype=torch.bool))  # fmt: skip
        queries = torch.randn(a.batch, a.segment, a.dim, generator=g)
        targets = torch.randint(0, 50257, (a.batch, a.segment), generator=g)
    valid = torch.ones(a.batch, a.segment, dtype=torch.bool)
    empty = Datastore.empty(a.batch, a.dim)
    settings = KNNLMSettings(k=a.k)
    distances = squared_distances(queries, store.keys)  # (B, L, N)
    kth = distances.topk(min(a.k, a.entries), dim=2, largest=False).values[..., -1:]  # (B, L, 1): the k-th nearest

    def timed(shared) -> float:
        times = []
        for r in range(a.rounds + 1):
            c0 = time.process_time()
            knn_log_prob(queries, targets, empty, targets, valid, settings, shared)
            if r:
                times.append(time.process_time() - c0)
        return statistics.median(times)

    exact_s = timed(store)
    keys = f"{a.model} over {a.text}" if a.model else "random"
    print(f"keys={keys} entries={a.entries} dim={a.dim} batch={a.batch} segment={a.segment} k={a.k} "
          f"nprobe={a.nprobe} threads={a.threads} rounds={a.rounds}")
    print(f"{'index':<18}{'build (s)':>10}{'CPU s / segment':>17}{'vs exact':>10}{'recall@k':>10}")
    print(f"{'exact':<18}{0.0:>10.1f}{exact_s:>17.3f}{1.0:>10.2f}{1.0:>10.3f}")
    for factory in [f.strip() for f in a.indexes.split(";") if f.strip()]:
        t0 = time.perf_counter()
        indexed = index_datastore(store, factory, a.nprobe)
        build_s = time.perf_counter() - t0
        search_s = timed(indexed)
        _, ids = indexed.index.search(queries.reshape(-1, a.dim).numpy(), min(a.k, a.entries))
        found = torch.from_numpy(ids).view(a.batch, a.segment, -1)  # -1: no neighbour
        got = distances.gather(2, found.clamp_min(0)).masked_fill(found < 0, float("inf"))
        # an index's neighbour counts if it is as near as the exact k-th (ties: equal keys of repeated text)
        recall = float((got <= kth + 1e-5 * kth.abs() + 1e-6).double().mean())
        print(f"{factory:<18}{build_s:>10.1f}{search_s:>17.3f}{search_s / exact_s:>10.2f}{recall:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
