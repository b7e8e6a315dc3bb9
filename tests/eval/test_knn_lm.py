"""kNN-LM at evaluation: hand-computed interpolation, a slow list-datastore reference, causality,
resets, and the evaluation of real tiny models (none / xl / memoria) with it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from memoria_ds.data import ResetPolicy, TokenCorpus, TokenStreams
from memoria_ds.data.batch import IGNORE_INDEX
from memoria_ds.data.segments import run_segments
from memoria_ds.eval import evaluate_lm, full_protocol, memoryless_protocol, paper_protocol
from memoria_ds.eval.knn_lm import (Datastore, KNNLMSettings, KNNScorer, build_datastore, capture_keys,
                                    interpolate, knn_log_prob)
from memoria_ds.eval.scoring import evaluating
from memoria_ds.model import build_model

SMALL_MEMORY = dict(num_wm=4, num_stm_reminded=4, num_ltm_reminded=4, stm_capacity=8, initial_lifespan=3.0,
                    search_depth=2)


# ---------------------------------------------------------------------- the slow reference
def reference_nll(segments, settings: KNNLMSettings, shared=()):
    """kNN-LM NLL of the scored targets, one token at a time over Python lists.

    segments: dicts with keys (B, L, D), logits (B, L, V), values (B, L) (the token after
    each position, -100 for none), scored (B, L) (-100 where not scored), reset (B,) bool.
    shared: (key, value) pairs every row also searches.
    """
    B = segments[0]["keys"].shape[0]
    stores = [[] for _ in range(B)]
    out, lm_out = [], []
    for seg in segments:
        L = seg["keys"].shape[1]
        for b in range(B):
            if seg["reset"][b]:
                stores[b] = []
        per_row = []
        for b in range(B):
            row = []
            for i in range(L):
                q = seg["keys"][b, i].double().tolist()
                t = int(seg["scored"][b, i])
                if t != IGNORE_INDEX:
                    lm_p = math.exp(float(torch.log_softmax(seg["logits"][b, i].double(), -1)[t]))
                    cands = list(shared) + stores[b]
                    p = lm_p
                    if cands:
                        d = sorted(((sum((x - y) ** 2 for x, y in zip(q, key)), v) for key, v in cands),
                                   key=lambda e: e[0])[: settings.k]
                        w = [math.exp(-(dist - d[0][0]) / settings.temperature) for dist, _ in d]
                        p_knn = sum(wi for wi, (_, v) in zip(w, d) if v == t) / sum(w)
                        p = settings.lmbda * p_knn + (1 - settings.lmbda) * lm_p
                    row.append((i, -math.log(p), -math.log(lm_p)))
                v = int(seg["values"][b, i])
                if v != IGNORE_INDEX:
                    stores[b].append((q, v))  # after position i's own prediction: never its own entry
            per_row.append(row)
            if settings.max_entries is not None:
                stores[b] = stores[b][-settings.max_entries:]
        for row in per_row:  # row-major order, as the fast scorer returns them
            out += [x for _, x, _ in row]
            lm_out += [y for _, _, y in row]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lm_out, dtype=torch.float64)


def fast_nll(segments, settings: KNNLMSettings, shared: Datastore | None = None):
    scorer = KNNScorer(settings, shared)
    got, lm = [], []
    for seg in segments:
        nll, lm_nll = scorer.segment_nll(seg["keys"], seg["logits"], SimpleNamespace(targets=seg["values"]),
                                         seg["reset"], seg["scored"])
        got.append(nll)
        lm.append(lm_nll)
    return torch.cat(got).double(), torch.cat(lm).double()


def random_segments(B=3, L=7, D=4, V=6, count=4, seed=0, resets=True, pad_last=True):
    g = torch.Generator().manual_seed(seed)
    segs = []
    for s in range(count):
        values = torch.randint(0, V, (B, L), generator=g)
        if pad_last and s == count - 1:
            values[0, -3:] = IGNORE_INDEX  # a stream that ends early
        scored = values.clone()
        scored[1, 2] = IGNORE_INDEX  # a position not scored still stores its entry
        reset = torch.zeros(B, dtype=torch.bool) if s else torch.ones(B, dtype=torch.bool)
        if resets and s == 2:
            reset[2] = True
        segs.append(dict(keys=torch.randn(B, L, D, generator=g), logits=torch.randn(B, L, V, generator=g),
                         values=values, scored=scored, reset=reset))
    return segs


# ---------------------------------------------------------------------- hand-computed values
def test_interpolation_by_hand() -> None:
    # query 0.5 between keys 0 and 1 (d^2 = 0.25 each), key 3 far (d^2 = 6.25); k = 2
    store = Datastore(torch.tensor([[[0.0], [1.0], [3.0]]]), torch.tensor([[2, 0, 2]]), torch.ones(1, 3, dtype=torch.bool))
    s = KNNLMSettings(k=2, lmbda=0.25)
    q = torch.tensor([[[0.5]]])
    log_p, found = knn_log_prob(q, torch.tensor([[2]]), store, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), s)
    assert bool(found) and float(log_p.exp()) == pytest.approx(0.5)
    lm = torch.log(torch.tensor([[0.1]]))
    assert float(interpolate(lm, log_p, found, 0.25).exp()) == pytest.approx(0.25 * 0.5 + 0.75 * 0.1)
    # k = 3 and T = 2: weights exp(-0.125), exp(-0.125), exp(-3.125)
    s3 = KNNLMSettings(k=3, lmbda=0.25, temperature=2.0)
    log_p, _ = knn_log_prob(q, torch.tensor([[2]]), store, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), s3)
    w = [math.exp(-0.125), math.exp(-0.125), math.exp(-3.125)]
    assert float(log_p.exp()) == pytest.approx((w[0] + w[2]) / sum(w), rel=1e-6)
    # a target no neighbour holds: p_kNN = 0, the model's share alone
    log_p, found = knn_log_prob(q, torch.tensor([[5]]), store, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), s)
    assert float(log_p) == -math.inf
    assert float(interpolate(lm, log_p, found, 0.25).exp()) == pytest.approx(0.75 * 0.1)


def test_no_candidate_is_scored_by_the_model_alone() -> None:
    s = KNNLMSettings(k=4, lmbda=0.5)
    keys = torch.randn(1, 1, 3)
    logits = torch.randn(1, 1, 5)
    seg = dict(keys=keys, logits=logits, values=torch.tensor([[2]]), scored=torch.tensor([[2]]),
               reset=torch.ones(1, dtype=torch.bool))
    nll, lm = fast_nll([seg], s)
    assert torch.isfinite(nll).all() and torch.equal(nll, lm)
    assert float(nll) == pytest.approx(-float(torch.log_softmax(logits[0, 0], -1)[2]), rel=1e-6)


# ---------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("settings", [
    KNNLMSettings(k=1024, lmbda=0.25),
    KNNLMSettings(k=3, lmbda=0.6, temperature=0.5),
    KNNLMSettings(k=1, lmbda=0.9, key="final_hidden"),
])
def test_stream_datastore_matches_the_slow_reference(settings) -> None:
    segs = random_segments()
    got, lm = fast_nll(segs, settings)
    ref, ref_lm = reference_nll(segs, settings)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm, ref_lm, rtol=1e-5, atol=1e-5)
    assert (got != lm).any()  # the datastore is used


def test_capped_datastore_matches_the_slow_reference() -> None:
    settings = KNNLMSettings(k=4, lmbda=0.5, max_entries=10)
    segs = random_segments(resets=False, pad_last=False, count=5)
    got, _ = fast_nll(segs, settings)
    ref, _ = reference_nll(segs, settings)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    uncapped, _ = fast_nll(segs, KNNLMSettings(k=4, lmbda=0.5))
    assert not torch.allclose(got, uncapped)


def test_shared_datastore_matches_the_slow_reference() -> None:
    settings = KNNLMSettings(k=5, lmbda=0.4)
    g = torch.Generator().manual_seed(3)
    sk, sv = torch.randn(9, 4, generator=g), torch.randint(0, 6, (9,), generator=g)
    shared = Datastore(sk[None], sv[None], torch.ones(1, 9, dtype=torch.bool))
    segs = random_segments(seed=1)
    got, _ = fast_nll(segs, settings, shared)
    ref, _ = reference_nll(segs, settings, shared=[(k.double().tolist(), int(v)) for k, v in zip(sk, sv)])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- causality and resets
def test_a_prediction_never_reads_its_own_or_later_entries() -> None:
    settings = KNNLMSettings(k=2, lmbda=0.5)
    segs = random_segments(B=2, L=8, count=2, resets=False, pad_last=False)
    for seg in segs:
        seg["scored"] = seg["values"].clone()
    base, _ = fast_nll(segs, settings)
    L = 8
    for i in range(L):
        last = dict(segs[-1])
        # everything stored after position i changes: the keys after i, the values from
        # i + 1 on (position i's own value is its target, which it scores)
        values, keys = last["values"].clone(), last["keys"].clone()
        values[:, i + 1:] = (values[:, i + 1:] + 1) % 6
        keys[:, i + 1:] = torch.randn_like(keys[:, i + 1:])
        last.update(values=values, keys=keys, scored=values.clone())
        got, _ = fast_nll([segs[0], last], settings)
        torch.testing.assert_close(got[: 2 * L], base[: 2 * L])  # the first segment
        torch.testing.assert_close(got[2 * L:].view(2, L)[:, : i + 1], base[2 * L:].view(2, L)[:, : i + 1])
    # its own entry is at distance 0 and holds its target: were it a candidate, the first
    # position of a fresh stream would find it; it finds nothing and is scored by the model
    keys = torch.randn(1, 1, 4)
    _, found = knn_log_prob(keys, torch.tensor([[3]]), Datastore.empty(1, 4), torch.tensor([[3]]),
                            torch.ones(1, 1, dtype=torch.bool), KNNLMSettings(k=1))
    assert not bool(found)


def test_reset_forgets_the_row_only() -> None:
    settings = KNNLMSettings(k=4, lmbda=0.5)
    a = random_segments(B=2, count=3, resets=False, pad_last=False)
    for seg in a:
        seg["scored"] = seg["values"].clone()
    b = [dict(s) for s in a]
    b[2] = dict(b[2], reset=torch.tensor([False, True]))
    ga, _ = fast_nll(a, settings)
    gb, _ = fast_nll(b, settings)
    L = a[0]["keys"].shape[1]
    torch.testing.assert_close(ga[: -2 * L], gb[: -2 * L])  # the first two segments
    torch.testing.assert_close(ga[-2 * L: -L], gb[-2 * L: -L])  # row 0 of the third
    assert not torch.allclose(ga[-L:], gb[-L:])  # row 1 forgot its past
    # a row reset before the segment sees what a fresh scorer sees for it
    row1 = {name: t[1:] for name, t in a[2].items()} | {"reset": torch.tensor([True])}
    fresh, _ = fast_nll([row1], settings)
    torch.testing.assert_close(gb[-L:], fresh)


def test_settings_refuse_bad_values() -> None:
    for bad in (dict(k=0), dict(lmbda=1.5), dict(lmbda=1.0), dict(temperature=0.0), dict(temperature=math.inf),
                dict(key="h"), dict(max_entries=0), dict(k=True)):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}`"):
            KNNLMSettings(**bad)


# ---------------------------------------------------------------------- real models
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=257, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    path = tmp_path_factory.mktemp("backbone")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 257, (20,), generator=g).tolist()
    docs = [base * 3 + torch.randint(0, 257, (n,), generator=g).tolist() for n in (10, 13, 30)]  # repeats to find
    corpus = TokenCorpus.from_token_lists(docs, metadata={"corpus": "toy", "split": "test"})
    return path, corpus


def segments_of(model, corpus, protocol, key):
    streams = TokenStreams(corpus, num_streams=protocol.num_streams, segment_length=protocol.segment_length,
                           tail="pad")
    segs = []
    with evaluating(model), capture_keys(model, key) as held:
        for seg in run_segments(model, streams, reset=protocol.reset, device=torch.device("cpu")):
            scored = seg.batch.targets.clone()
            if not protocol.score_segment_first:
                scored[:, -1] = IGNORE_INDEX
            segs.append(dict(keys=held.keys.clone(), logits=seg.logits.clone(), values=seg.batch.targets,
                             scored=scored, reset=seg.reset))
    return segs


@pytest.mark.parametrize("preset", ["transformer", "xl", "memoria"])
@pytest.mark.parametrize("protocol", [full_protocol(16, 2, "document_start"), paper_protocol(16),
                                      memoryless_protocol(16, 3)])
def test_evaluation_with_knn_lm_matches_the_reference(setup, preset, protocol) -> None:
    path, corpus = setup
    model = build_model(path, preset, memoria=SMALL_MEMORY, memory_init="random")
    settings = KNNLMSettings(k=8, lmbda=0.3)
    plain = evaluate_lm(model, corpus, protocol, progress=False)
    got = evaluate_lm(model, corpus, protocol, progress=False, knn=settings)
    ref, ref_lm = reference_nll(segments_of(model, corpus, protocol, settings.key), settings)
    assert got.scored_tokens == plain.scored_tokens == ref.numel()
    assert got.nll_sum == pytest.approx(float(ref.sum()), rel=1e-5)
    assert got.knn_lm["lm_nll"] == pytest.approx(plain.nll, rel=1e-6)
    assert got.knn_lm["lm_nll"] == pytest.approx(float(ref_lm.mean()), rel=1e-5)
    assert got.knn_lm["k"] == 8 and got.knn_lm["datastore"] == "stream"
    if protocol.name != "memoryless":
        assert got.nll < plain.nll  # the repeated text is found in the datastore


def test_lambda_zero_is_the_plain_evaluation(setup) -> None:
    path, corpus = setup
    model = build_model(path, "xl")
    protocol = full_protocol(16, 1)
    plain = evaluate_lm(model, corpus, protocol, progress=False)
    got = evaluate_lm(model, corpus, protocol, progress=False, knn=KNNLMSettings(lmbda=0.0))
    assert got.nll_sum == pytest.approx(plain.nll_sum, rel=1e-6)


def test_keys_are_what_the_paper_names(setup) -> None:
    # ffn_input: the last block's ln_2 output, recomputed here from HF's own hidden states
    path, corpus = setup
    model = build_model(path, "transformer").eval()
    hf = GPT2LMHeadModel.from_pretrained(path).eval()
    x = torch.as_tensor(corpus.tokens[:16], dtype=torch.int64)[None]
    with torch.no_grad():
        with capture_keys(model, "ffn_input") as held:
            out = model(x)
        h = hf.transformer(x, output_hidden_states=True).hidden_states[-2]  # input of the last block
        block = hf.transformer.h[-1]
        expected = block.ln_2(block.attn(block.ln_1(h))[0] + h)
        torch.testing.assert_close(held.keys, expected, rtol=1e-5, atol=1e-5)
        with capture_keys(model, "final_hidden") as held:
            out = model(x)
        torch.testing.assert_close(model.lm_head(held.keys), out.logits)
    assert not model.transformer.h[-1].ln_2._forward_hooks  # removed on exit


def test_training_text_datastore(setup) -> None:
    path, corpus = setup
    model = build_model(path, "transformer")
    settings = KNNLMSettings(k=8, lmbda=0.3)
    streams = TokenStreams(corpus, num_streams=1, segment_length=16, tail="pad")
    store = build_datastore(model, streams, settings, reset=ResetPolicy(), device=torch.device("cpu"))
    assert store.size == corpus.num_tokens - 1
    protocol = full_protocol(16, 1)
    got = evaluate_lm(model, corpus, protocol, progress=False, knn=settings, knn_store=store)
    segs = segments_of(model, corpus, protocol, settings.key)
    shared = [(k.double().tolist(), int(v)) for k, v in zip(store.keys[0], store.values[0])]
    ref, _ = reference_nll(segs, settings, shared=shared)
    assert got.nll_sum == pytest.approx(float(ref.sum()), rel=1e-5)
    assert got.knn_lm["datastore"] == "stream+shared" and got.knn_lm["shared_entries"] == store.size
    with pytest.raises(ValueError, match="pass `knn`"):
        evaluate_lm(model, corpus, protocol, progress=False, knn_store=store)


# ---------------------------------------------------------------------- the run configuration
def test_run_config_key_turns_it_on(setup) -> None:
    from memoria_ds.eval.configured import describe, evaluate_split
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    cfg = load(RunConfig, None, ["eval.knn_lm.enabled=true", "eval.knn_lm.k=8", "eval.knn_lm.lmbda=0.3",
                                 "data.segment_length=16", "eval.protocols=[full,memoryless]"])
    assert cfg.eval.knn_lm.settings() == KNNLMSettings(k=8, lmbda=0.3)
    path, corpus = setup
    model = build_model(path, "xl")
    results = evaluate_split(model, corpus, data=cfg.data, evaluation=cfg.eval, label="m", rank=0, world_size=1,
                             device=torch.device("cpu"), out_dir=None, sorting_batch_size=1)
    direct = evaluate_lm(model, corpus, full_protocol(16, 1), progress=False, knn=KNNLMSettings(k=8, lmbda=0.3))
    assert results[0].nll_sum == pytest.approx(direct.nll_sum, rel=1e-6)
    assert all(r.knn_lm is not None for r in results)
    line, values = describe(results[0])
    assert "kNN-LM" in line and values["lm_ppl"] == results[0].knn_lm["lm_ppl"]
    for bad, match in ((["eval.knn_lm.lmbda=2.0"], "lmbda"), (["eval.knn_lm.key=h"], "key"),
                       (["eval.knn_lm.enabled=true", "data.corpus=sorting"], "sorting")):
        with pytest.raises(ConfigError, match=match):
            load(RunConfig, None, bad)


def test_run_config_builds_the_training_text_datastore(setup) -> None:
    """`eval.knn_lm.train_datastore`: the shared store is the training split read with
    `train_streams` streams and the evaluation's reset, capped at `train_max_entries`."""
    from memoria_ds.eval.configured import evaluate_split
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    path, corpus = setup
    g = torch.Generator().manual_seed(7)
    train = TokenCorpus.from_token_lists([corpus.tokens[:40].tolist(), torch.randint(0, 257, (50,), generator=g).tolist()],
                                         metadata={"corpus": "toy", "split": "train"})
    model = build_model(path, "xl")
    settings = KNNLMSettings(k=8, lmbda=0.3)
    for cap in (None, 37):
        overrides = ["eval.knn_lm.enabled=true", "eval.knn_lm.k=8", "eval.knn_lm.lmbda=0.3", "data.segment_length=16",
                     "eval.protocols=[full]", "eval.knn_lm.train_datastore=true", "eval.knn_lm.train_streams=2"]
        cfg = load(RunConfig, None, overrides + ([f"eval.knn_lm.train_max_entries={cap}"] if cap else []))
        (got,) = evaluate_split(model, corpus, data=cfg.data, evaluation=cfg.eval, label="m", rank=0, world_size=1,
                                device=torch.device("cpu"), out_dir=None, sorting_batch_size=1, train_corpus=train)
        # the same store built by hand: 2 streams over the training split, reset at each document start
        streams = TokenStreams(train, num_streams=2, segment_length=16, tail="pad")
        reset = full_protocol(16, 2, cfg.eval.reset).reset
        store = build_datastore(model, streams, settings, reset=reset, device=torch.device("cpu"), max_entries=cap)
        assert store.size == (cap or train.num_tokens - 1)  # every token but the split's last has a next one
        direct = evaluate_lm(model, corpus, full_protocol(16, 1), progress=False, knn=settings, knn_store=store)
        assert got.nll_sum == pytest.approx(direct.nll_sum, rel=1e-6)
        assert got.knn_lm["datastore"] == "stream+shared" and got.knn_lm["shared_entries"] == store.size
    with pytest.raises(ValueError, match="needs the training split"):
        evaluate_split(model, corpus, data=cfg.data, evaluation=cfg.eval, label="m", rank=0, world_size=1,
                       device=torch.device("cpu"), out_dir=None, sorting_batch_size=1)
    for bad, match in ((["eval.knn_lm.train_max_entries=0"], "train_max_entries"),
                       (["eval.knn_lm.train_streams=0"], "train_streams")):
        with pytest.raises(ConfigError, match=match):
            load(RunConfig, None, bad)


# ---------------------------------------------------------------------- the FAISS index of the shared store
def _shared(n=300, d=8, v=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return Datastore(torch.randn(1, n, d, generator=g), torch.randint(0, v, (1, n), generator=g),
                     torch.ones(1, n, dtype=torch.bool))


@pytest.mark.parametrize("factory, nprobe", [("Flat", 1), ("IVF8,Flat", 8)])
def test_an_exact_faiss_index_scores_as_the_exact_search(factory, nprobe) -> None:
    """`Flat`, and an IVF index probing all of its lists, find the exact neighbours: the same NLL
    as the exact shared store (and so as the slow reference, above)."""
    from memoria_ds.eval.knn_lm import index_datastore

    shared = _shared()
    segs = random_segments(D=8, seed=1)
    for k in (5, 40):
        exact, _ = fast_nll(segs, KNNLMSettings(k=k, lmbda=0.4), shared)
        indexed, _ = fast_nll(segs, KNNLMSettings(k=k, lmbda=0.4), index_datastore(shared, factory, nprobe))
        torch.testing.assert_close(indexed, exact, rtol=1e-4, atol=1e-4)


def test_an_approximate_index_finds_most_true_neighbours_and_scores_near_the_exact_search() -> None:
    from memoria_ds.eval.knn_lm import index_datastore

    shared = _shared(n=2000)
    queries = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(5))
    approx = index_datastore(shared, "IVF16,PQ4", nprobe=4)
    dist, values, found = approx.search(queries, 10)
    assert dist.shape == values.shape == found.shape == (2, 16, 10) and bool(found.all())
    exact = squared_distances_of(queries, shared).topk(10, dim=2, largest=False).indices  # (2, 16, 10)
    _, ids = approx.index.search(queries.reshape(-1, 8).numpy(), 10)
    recall = sum(len(set(a.tolist()) & set(b)) for a, b in zip(exact.reshape(-1, 10), ids.tolist())) / exact.numel()
    assert recall > 0.3, recall  # a 4-byte code of 8 floats, 4 of 16 lists: approximate, not random (0.005)
    torch.testing.assert_close(values, shared.values[0][torch.from_numpy(ids)].view(2, 16, 10))
    segs = random_segments(D=8, seed=1)
    exact_nll, _ = fast_nll(segs, KNNLMSettings(k=10, lmbda=0.25), shared)
    approx_nll, _ = fast_nll(segs, KNNLMSettings(k=10, lmbda=0.25), approx)
    assert torch.isfinite(approx_nll).all() and abs(float(approx_nll.mean() - exact_nll.mean())) < 0.1


def test_an_index_neighbours_are_scored_by_their_exact_distances_unless_asked_otherwise() -> None:
    """As the authors' knnlm.py by default: the index only picks the neighbours; their distances are
    recomputed from the full-precision keys. `index_distances="index"` keeps the quantiser's estimates
    (their `--no-load-keys --knn-sim-func do_not_recomp_l2`)."""
    from memoria_ds.eval.knn_lm import index_datastore

    shared = _shared(n=2000)
    queries = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(6))
    exact = index_datastore(shared, "IVF16,PQ4", nprobe=4)
    quantised = index_datastore(shared, "IVF16,PQ4", nprobe=4, distances="index")
    assert exact.keys is not None and quantised.keys is None
    dist, values, found = exact.search(queries, 10)
    est, values_q, found_q = quantised.search(queries, 10)
    _, ids = exact.index.search(queries.reshape(-1, 8).numpy(), 10)
    ids = torch.from_numpy(ids).view(2, 16, 10)
    assert bool(found.all()) and torch.equal(values, values_q) and torch.equal(found, found_q)
    want = (queries[:, :, None, :] - shared.keys[0][ids]).pow(2).sum(-1)  # a plain loop's arithmetic, per pair
    torch.testing.assert_close(dist, want, rtol=1e-5, atol=1e-5)
    assert (est - want).abs().max() > 1e-2  # a 4-byte code of 8 floats: the estimates are not the distances
    with pytest.raises(ValueError, match="index_distances"):
        KNNLMSettings(index="IVF16,PQ4", index_distances="approximate")


def squared_distances_of(queries, store):
    from memoria_ds.eval.knn_lm import squared_distances

    return squared_distances(queries, store.keys)


def test_a_bad_index_is_refused_before_any_work() -> None:
    from memoria_ds.eval.knn_lm import index_datastore
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    with pytest.raises(ValueError, match="not a FAISS index_factory string"):
        KNNLMSettings(index="IVF4096,Bogus")
    with pytest.raises(ValueError, match="nprobe"):
        KNNLMSettings(nprobe=0)
    with pytest.raises(ValueError, match="cannot be trained on the 300 entries"):
        index_datastore(_shared(), "IVF4096,Flat")
    for bad, match in ((["eval.knn_lm.index=IVF8,Flat"], "train_datastore=true"),
                       (["eval.knn_lm.train_datastore=true", "eval.knn_lm.index=Nope"], "index_factory")):
        with pytest.raises(ConfigError, match=match):
            load(RunConfig, None, bad)
    cfg = load(RunConfig, None, ["eval.knn_lm.train_datastore=true", "eval.knn_lm.index=IVF4096,PQ64",
                                 "eval.knn_lm.nprobe=32"])
    assert cfg.eval.knn_lm.settings().to_dict()["index"] == "IVF4096,PQ64"


def test_run_config_searches_the_training_text_through_its_index(setup) -> None:
    """`eval.knn_lm.index=Flat`: the configured evaluation scores as the exact training-text store does."""
    from memoria_ds.eval.configured import evaluate_split
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import load

    path, corpus = setup
    train = TokenCorpus.from_token_lists([corpus.tokens[:60].tolist()], metadata={"corpus": "toy", "split": "train"})
    model = build_model(path, "xl")
    got = {}
    for index in ("exact", "Flat"):
        cfg = load(RunConfig, None, ["eval.knn_lm.enabled=true", "eval.knn_lm.k=8", "data.segment_length=16",
                                     "eval.protocols=[full]", "eval.knn_lm.train_datastore=true",
                                     "eval.knn_lm.train_streams=2", f"eval.knn_lm.index={index}"])
        (got[index],) = evaluate_split(model, corpus, data=cfg.data, evaluation=cfg.eval, label="m", rank=0,
                                       world_size=1, device=torch.device("cpu"), out_dir=None, sorting_batch_size=1,
                                       train_corpus=train)
    assert got["Flat"].nll_sum == pytest.approx(got["exact"].nll_sum, rel=1e-5)
    assert got["Flat"].knn_lm["index"] == "Flat" and got["Flat"].knn_lm["shared_entries"] == 59
