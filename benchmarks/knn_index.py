"""What searching kNN-LM's training-text datastore costs: exact search against a FAISS index.

A shared datastore of `--entries` random keys of `--dim` (GPT-2 small's 768 by default) is
searched by the kNN-LM scorer itself (`knn_log_prob`) for one segment of `--batch` streams of
`--segment` tokens, k = `--k` neighbours, as `eval.knn_lm.index` configures it: `exact`
(every key compared) and each FAISS `index_factory` string of `--indexes`. Reported per
index: the build time (training and adding), the median process CPU time of one segment's
search over `--rounds` rounds after one untimed, its ratio to exact, and the recall of the
exact k nearest among the index's k (how approximate it is; on random keys, a hard case for
quantisation).

    python benchmarks/knn_index.py --entries 200000 --indexes "Flat;IVF1024,Flat;IVF1024,PQ64;HNSW32"

`--indexes` is `;`-separated (a factory string has commas of its own).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memoria_ds.eval.knn_lm import Datastore, KNNLMSettings, index_datastore, knn_log_prob, squared_distances

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
    a = p.parse_args()
    if min(a.entries, a.dim, a.batch, a.segment, a.k, a.rounds, a.threads, a.nprobe) < 1:
        p.error("--entries, --dim, --batch, --segment, --k, --rounds, --threads and --nprobe: integers >= 1")
    torch.set_num_threads(a.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(a.threads)
    except ImportError:
        p.error("FAISS is not installed: pip install faiss-cpu (or memoria_ds[faiss])")
    g = torch.Generator().manual_seed(0)
    store = Datastore(torch.randn(1, a.entries, a.dim, generator=g), torch.randint(0, 50257, (1, a.entries),
                      generator=g), torch.ones(1, a.entries, dtype=torch.bool))  # fmt: skip
    queries = torch.randn(a.batch, a.segment, a.dim, generator=g)
    targets = torch.randint(0, 50257, (a.batch, a.segment), generator=g)
    valid = torch.ones(a.batch, a.segment, dtype=torch.bool)
    empty = Datastore.empty(a.batch, a.dim)
    settings = KNNLMSettings(k=a.k)
    truth = squared_distances(queries, store.keys).topk(min(a.k, a.entries), dim=2, largest=False).indices

    def timed(shared) -> float:
        times = []
        for r in range(a.rounds + 1):
            c0 = time.process_time()
            knn_log_prob(queries, targets, empty, targets, valid, settings, shared)
            if r:
                times.append(time.process_time() - c0)
        return statistics.median(times)

    exact_s = timed(store)
    print(f"entries={a.entries} dim={a.dim} batch={a.batch} segment={a.segment} k={a.k} nprobe={a.nprobe} "
          f"threads={a.threads} rounds={a.rounds}")
    print(f"{'index':<18}{'build (s)':>10}{'CPU s / segment':>17}{'vs exact':>10}{'recall@k':>10}")
    print(f"{'exact':<18}{0.0:>10.1f}{exact_s:>17.3f}{1.0:>10.2f}{1.0:>10.3f}")
    for factory in [f.strip() for f in a.indexes.split(";") if f.strip()]:
        t0 = time.perf_counter()
        indexed = index_datastore(store, factory, a.nprobe)
        build_s = time.perf_counter() - t0
        search_s = timed(indexed)
        _, ids = indexed.index.search(queries.reshape(-1, a.dim).numpy(), truth.shape[2])
        found = torch.from_numpy(ids).view_as(truth)
        recall = statistics.fmean(len(set(t.tolist()) & set(f.tolist())) / truth.shape[2]
                                  for t, f in zip(truth.reshape(-1, truth.shape[2]), found.reshape(-1, truth.shape[2])))
        print(f"{factory:<18}{build_s:>10.1f}{search_s:>17.3f}{search_s / exact_s:>10.2f}{recall:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
