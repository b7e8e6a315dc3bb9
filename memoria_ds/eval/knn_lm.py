"""kNN-LM (Khandelwal et al., 2020) on top of any model of the toolkit, at evaluation.

Each scored position i with context representation q_i (the key) and model distribution
p_LM gets

    p_kNN(y) ∝ Σ_{(k_j, v_j) ∈ top-k nearest of q_i}  1[y = v_j] · exp(-||q_i - k_j||² / T)
    p(y)     = λ p_kNN(y) + (1 - λ) p_LM(y)

over a datastore of (key, next token) pairs: per stream, the text read so far (every
position j < i of the stream since its last memory reset: entry j's value is the token
after j, which position i has already seen; entry i itself holds the token i predicts, so it
is never a candidate), and optionally a shared datastore built from the training text
(`build_datastore`). The search is exact (squared L2, which the paper's FAISS index
approximates); the shared store can instead be searched through a FAISS index
(`index_datastore`, `KNNLMSettings.index`): its top k per position join the exact
candidates of the stream, scored by their exact distances from the full-precision keys (as the
authors' code does by default, `knnlm.py`'s `dist_func`) or, with `index_distances="index"`, by
the index's own quantised estimates (their `--no-load-keys --knn-sim-func do_not_recomp_l2`). A position with no candidate (the first token after a reset) is
scored by the model alone.

The model is not branched: the key is read by a forward hook on the GPT-2 module that
computes it (`capture_keys`), so "Memoria + kNN-LM" is the same trained Memoria model with
this evaluation option. Keys: `ffn_input` (the input of the last block's feed-forward
network after its layer norm: the paper's best key) or `final_hidden` (after `ln_f`: what
the LM head reads).

Notation: B rows (streams), L segment length, D width, N stream datastore entries,
S shared (training) entries, C = S + N + L candidates, K neighbours.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from memoria_ds.data.batch import IGNORE_INDEX
from memoria_ds.setting_rules import SettingError, check_fields, setting

KeyName = Literal["ffn_input", "final_hidden"]
KEYS = ("ffn_input", "final_hidden")


@dataclass(frozen=True)
class KNNLMSettings:
    """How kNN-LM scores (defaults: Khandelwal et al. 2020, WikiText-103; docs/field_memories.md).

    Every field is checked by its rule (`memoria_ds.setting_rules`; a `SettingError` names it).

    Args:
        k: neighbours retrieved per position (the paper: 1024; fewer when fewer are stored).
        lmbda: interpolation weight λ of p_kNN (the paper's tuned in-domain value: 0.25), below 1:
            at 1 the model's own distribution is dropped, and a token no neighbour holds gets
            probability 0 (an infinite perplexity).
        temperature: T dividing the negative squared distances (the paper: none, T = 1), finite.
        key: `ffn_input` (the paper's best) or `final_hidden`.
        max_entries: per-stream datastore cap, the oldest dropped first; None: unbounded
            (the paper keeps every entry).
        index: how the shared (training-text) datastore is searched: `exact`, or a FAISS
            `index_factory` string (e.g. `IVF4096,PQ64`, the authors' index; `Flat` is exact
            search through FAISS). The stream datastores are always searched exactly.
        nprobe: inverted lists probed per query by an `IVF` index (the paper's 32).
        index_distances: how an index's neighbours are scored: `exact` (their squared distances
            recomputed from the full-precision keys: the authors' default) or `index` (the
            index's estimates, e.g. a product quantiser's; less memory, the authors' faster option).
    """

    k: int = setting(1024, least=1)
    lmbda: float = setting(0.25, least=0, below=1, note="at 1 a token no neighbour holds gets probability 0")
    temperature: float = setting(1.0, above=0)
    key: KeyName = "ffn_input"
    max_entries: int | None = setting(None, least=1, none="no cap")
    index: str = "exact"
    nprobe: int = setting(32, least=1)
    index_distances: Literal["exact", "index"] = "exact"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.index != "exact":
            check_index_factory(self.index)  # the keys' width is checked when it is known (`check_index`)

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "lmbda": self.lmbda, "temperature": self.temperature, "key": self.key,
                "max_entries": self.max_entries, "index": self.index, "nprobe": self.nprobe,
                "index_distances": self.index_distances}


@dataclass
class Datastore:
    """(key, next token) entries of B streams (or one shared store, B = 1).

    Attributes:
        keys: (B, N, D) float32.
        values: (B, N) int64, the token that followed each key.
        valid: (B, N) bool, False for entries a reset forgot (and padding).
    """

    keys: Tensor
    values: Tensor
    valid: Tensor

    @classmethod
    def empty(cls, batch_size: int, dim: int, device: torch.device | str | None = None) -> Datastore:
        return cls(torch.zeros(batch_size, 0, dim, device=device), torch.zeros(batch_size, 0, dtype=torch.int64,
                   device=device), torch.zeros(batch_size, 0, dtype=torch.bool, device=device))

    @property
    def size(self) -> int:
        return self.valid.shape[1]

    @property
    def entries(self) -> int:
        """Entries a search can find (a reset or padding leaves columns that hold none)."""
        return int(self.valid.sum())

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Exact k nearest entries of a one-row (shared) store for every query, as `IndexedDatastore.search`.

        Args:
            queries: (B, L, D).

        Returns:
            dist: (B, L, K) squared distances; values: (B, L, K) int64; found: (B, L, K) bool.
        """
        dist = squared_distances(queries, self.keys).masked_fill(~self.valid[:, None, :], math.inf)  # (B, L, S)
        dist, idx = dist.topk(min(k, self.size), dim=2, largest=False)
        return dist, self.values[0][idx], torch.isfinite(dist)


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise ValueError("a kNN-LM FAISS `index` needs the faiss package: pip install faiss-cpu (or "
                         "memoria_ds[faiss]), or set the index to `exact`") from e
    return faiss


# The widths of GPT-2's keys (small to XL): an index is tried at these before the model's is known.
GPT2_WIDTHS = (768, 1024, 1280, 1600)


def check_index_factory(factory: str, dim: int | None = None) -> None:
    """Refuse a FAISS `index_factory` string that FAISS cannot build for `dim`-wide keys (a
    `SettingError` keyed `index`, one line), before any work.

    `dim`: the keys' width (a product quantiser must divide it); None, before the model is known:
    refuse only a string that builds at no GPT-2 width (`GPT2_WIDTHS`).
    """
    faiss = _faiss()
    reason = ""
    for width in (dim,) if dim is not None else GPT2_WIDTHS:
        try:
            faiss.index_factory(width, factory, faiss.METRIC_L2)
            return
        except RuntimeError as e:
            reason = reason or str(e).strip().splitlines()[-1].split(": ", 1)[-1]
    keys = f"this model's {dim}-wide keys" if dim is not None else f"keys of any GPT-2 width {list(GPT2_WIDTHS)}"
    raise SettingError("index", f"({factory!r}) is not a FAISS index_factory string for {keys} ({reason}); e.g. "
                       f"`IVF4096,PQ64`, `HNSW32` or `Flat`, or `exact`")


def training_entries(factory: str, dim: int) -> int:
    """The fewest entries FAISS trains the index of `factory` on at `dim` wide keys (0: it needs no
    training): an IVF's lists and a product quantiser's 2**nbits codes are k-means centroids, and
    k-means needs a point per centroid. Other trained parts (PCA, OPQ) are not counted."""
    faiss = _faiss()
    index = faiss.index_factory(dim, factory, faiss.METRIC_L2)
    if index.is_trained:
        return 0
    need = 1
    ivf = faiss.try_extract_index_ivf(index)
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    if ivf is not None:
        quantizer = faiss.downcast_index(ivf.quantizer)  # a multi-index (IMI) trains its sub-quantisers only
        need = max(need, int(quantizer.pq.ksub) if hasattr(quantizer, "pq") else int(ivf.nlist))
    elif isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    pq = getattr(inner, "pq", None)
    if pq is not None:
        need = max(need, int(pq.ksub))
    return need


def check_index(factory: str, dim: int, entries: int | None, limit: str) -> None:
    """Refuse (a `SettingError` keyed `index`) an index FAISS cannot build for `dim`-wide keys, or cannot
    train on a datastore of `entries` entries (None: not known yet); `limit` names what caps them."""
    check_index_factory(factory, dim)
    need = training_entries(factory, dim)
    if entries is not None and entries < need:
        raise SettingError("index", f"({factory!r}) is trained on the training-text datastore and needs at least "
                           f"{need} entries (a centroid per IVF list or product-quantiser code), but {limit} caps "
                           f"it at {entries}: allow more entries, use a smaller index (fewer lists, e.g. `IVF"
                           f"{max(1, entries // 39)},Flat`), or `exact`")


@dataclass
class IndexedDatastore:
    """A shared datastore of one row searched through a FAISS index (squared L2).

    Attributes:
        index: the FAISS index over the entries' keys (entry i is id i).
        values: (N,) int64, the token that followed each key.
        keys: (N, D) float32 full-precision keys (entry i's), to score the index's neighbours by
            their exact distances; None: by the index's estimates.
    """

    index: Any
    values: Tensor
    keys: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.index.ntotal)

    @property
    def entries(self) -> int:
        return self.size

    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """The index's k nearest entries of every query.

        Args:
            queries: (B, L, D).

        Returns:
            dist: (B, L, K) float32 squared distances (exact, from `keys`; else as the index
            estimates them); values: (B, L, K) int64; found: (B, L, K) bool, False where the
            index returned fewer than K.
        """
        B, L, D = queries.shape
        k = min(k, self.size)
        dist, ids = self.index.search(queries.detach().reshape(-1, D).float().cpu().contiguous().numpy(), k)
        dist = torch.from_numpy(dist).to(queries.device).view(B, L, k)
        ids = torch.from_numpy(ids).to(queries.device).view(B, L, k)
        found = ids >= 0
        values = self.values.to(queries.device)[ids.clamp_min(0)]
        if self.keys is not None:  # the neighbours' exact distances (the index only picked them)
            near = self.keys.to(queries.device)[ids.clamp_min(0)]  # (B, L, K, D)
            dist = (queries.detach().float()[:, :, None, :] - near).pow(2).sum(-1)  # (B, L, K)
        return dist.clamp_min(0.0), values, found


def index_datastore(store: Datastore, factory: str, nprobe: int = 32, distances: str = "exact") -> IndexedDatastore:
    """`store` (one row, e.g. `build_datastore`'s) indexed by FAISS's `index_factory(D, factory)`,
    trained on its own keys where the index needs training (IVF centroids, product quantisers).
    `distances`: `exact` keeps the full-precision keys to score the neighbours the index finds
    (`KNNLMSettings.index_distances`); `index` scores them by the index's estimates.

    FAISS's k-means is seeded, so every rank builds the same index from the same store.
    """
    faiss = _faiss()
    valid = store.valid[0]
    keys = store.keys[0][valid].detach().float().cpu().contiguous().numpy()
    check_index_factory(factory, keys.shape[1])
    index = faiss.index_factory(keys.shape[1], factory, faiss.METRIC_L2)
    if not index.is_trained:
        try:
            index.train(keys)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[-1].split(": ", 1)[-1]
            raise ValueError(f"kNN-LM `index` {factory!r} cannot be trained on the {keys.shape[0]} entries of the "
                             f"training-text datastore ({reason}): use fewer centroids or more entries") from None
    index.add(keys)
    if "IVF" in factory:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    if distances not in ("exact", "index"):
        raise ValueError(f"kNN-LM `index_distances` must be 'exact' or 'index', got {distances!r}")
    full = torch.from_numpy(keys) if distances == "exact" else None  # (N, D) float32, entry i's
    return IndexedDatastore(index, store.values[0][valid].detach().to(torch.int64).cpu(), full)


def reset_rows(store: Datastore, reset: Tensor) -> Datastore:
    """`store` with the rows where the (B,) bool `reset` is True emptied."""
    return Datastore(store.keys, store.values, store.valid & ~reset.to(store.valid.device, torch.bool)[:, None])


def append(store: Datastore, keys: Tensor, values: Tensor, valid: Tensor, max_entries: int | None = None) -> Datastore:
    """`store` with one segment's entries added at the new end.

    Args:
        keys: (B, L, D). values: (B, L) int64 next tokens. valid: (B, L) bool.
        max_entries: keep at most this many entries per row (the oldest go).

    Columns that hold no row's entry (all rows reset, padding) are dropped, so the store
    does not grow with forgotten text.
    """
    k = torch.cat([store.keys, keys.detach().float()], dim=1)  # (B, N + L, D)
    v = torch.cat([store.values, values.to(torch.int64)], dim=1)
    m = torch.cat([store.valid, valid.to(torch.bool)], dim=1)
    keep = m.any(dim=0)  # (N + L,) an evaluation-time host sync, once per segment
    if not bool(keep.all()):
        k, v, m = k[:, keep], v[:, keep], m[:, keep]
    if max_entries is not None and m.shape[1] > max_entries:
        k, v, m = k[:, -max_entries:], v[:, -max_entries:], m[:, -max_entries:]
    return Datastore(k, v, m)


def squared_distances(queries: Tensor, keys: Tensor) -> Tensor:
    """||q - k||² for every pair: (B, L, D) x (B or 1, N, D) -> (B, L, N), float32, >= 0."""
    q = queries.float()
    k = keys.float()
    qq = (q * q).sum(-1, keepdim=True)  # (B, L, 1)
    kk = (k * k).sum(-1)[:, None, :]  # (B or 1, 1, N)
    return (qq + kk - 2.0 * torch.matmul(q, k.transpose(1, 2))).clamp_min_(0.0)  # (B, L, N)


def knn_log_prob(
    queries: Tensor,
    targets: Tensor,
    store: Datastore,
    segment_values: Tensor,
    segment_valid: Tensor,
    settings: KNNLMSettings,
    shared: Datastore | IndexedDatastore | None = None,
) -> tuple[Tensor, Tensor]:
    """log p_kNN(target) of every position of a segment, from strictly earlier entries.

    Candidates of position i: the row's stream store and the segment's own entries j < i (j's
    value is the token after j, already read by i), merged with the shared store's k nearest
    (its `search`: exact, or a FAISS index's).

    Args:
        queries: (B, L, D) keys of this segment's positions.
        targets: (B, L) int64 the tokens to score (any value where not scored).
        store: the stream datastore before this segment (B rows).
        segment_values: (B, L) int64 the token after each position (its entry's value).
        segment_valid: (B, L) bool, positions whose entry exists (a real next token).
        settings: k and temperature.
        shared: a datastore of one row read by every row (training text), or its FAISS index, or None.

    Returns:
        log_p: (B, L) float32 log p_kNN(target) (-inf where no neighbour holds the target).
        found: (B, L) bool, positions with at least one candidate.
    """
    B, L, _ = queries.shape
    device = queries.device
    dist, allowed, values = [], [], []
    if store.size:
        dist.append(squared_distances(queries, store.keys))  # (B, L, N)
        allowed.append(store.valid[:, None, :].expand(B, L, -1))
        values.append(store.values)
    earlier = torch.ones(L, L, dtype=torch.bool, device=device).tril(-1)  # (L, L) j < i
    dist.append(squared_distances(queries, queries))  # (B, L, L)
    allowed.append(earlier[None] & segment_valid.to(torch.bool)[:, None, :])
    values.append(segment_values.to(torch.int64))
    scores = -torch.cat(dist, dim=2) / settings.temperature  # (B, L, C)
    allowed_all = torch.cat(allowed, dim=2)
    scores = scores.masked_fill(~allowed_all, -math.inf)
    found = allowed_all.any(dim=2)  # (B, L)
    top, idx = scores.topk(min(settings.k, scores.shape[2]), dim=2)  # (B, L, K)
    neighbour = torch.cat(values, dim=1).gather(1, idx.flatten(1)).view_as(idx)  # (B, L, K)
    if shared is not None and shared.size:  # the shared store's k nearest (exact or an index's) join the others
        d, v, ok = shared.search(queries, settings.k)  # (B, L, K')
        top = torch.cat([top, (-d / settings.temperature).masked_fill(~ok, -math.inf)], dim=2)
        neighbour = torch.cat([neighbour, v], dim=2)
        found = found | ok.any(dim=2)
        top, idx = top.topk(min(settings.k, top.shape[2]), dim=2)
        neighbour = neighbour.gather(2, idx)
    top = torch.where(found[..., None], top, torch.zeros_like(top))  # no candidate: no NaN from softmax
    log_w = torch.log_softmax(top, dim=2)
    hit = (neighbour == targets[..., None]) & torch.isfinite(top)
    log_p = torch.logsumexp(log_w.masked_fill(~hit, -math.inf), dim=2)
    return log_p, found


def interpolate(lm_log_prob: Tensor, knn_log_p: Tensor, found: Tensor, lmbda: float) -> Tensor:
    """log(λ p_kNN + (1 - λ) p_LM) of the targets; the model alone where no candidate was found."""
    lm = lm_log_prob.float()
    if lmbda == 0.0:
        return lm
    mixed = torch.logaddexp(math.log(lmbda) + knn_log_p,
                            (math.log1p(-lmbda) if lmbda < 1.0 else -math.inf) + lm)
    return torch.where(found, mixed, lm)


@dataclass
class KNNScorer:
    """The per-stream kNN-LM state of one evaluation: feed it each segment in order.

    Args:
        settings: the kNN-LM settings.
        shared: a training-text datastore read by every stream (or its FAISS index), or None.
    """

    settings: KNNLMSettings
    shared: Datastore | IndexedDatastore | None = None
    store: Datastore | None = field(default=None, init=False)

    def segment_nll(self, keys: Tensor, logits: Tensor, batch: Any, reset: Tensor | None,
                    scored_targets: Tensor) -> tuple[Tensor, Tensor]:
        """(kNN-LM NLL, model-only NLL) of the scored targets, then this segment's entries stored.

        Args:
            keys: (B, L, D) this segment's keys. logits: (B, L, V).
            batch: the `StreamBatch` (its `targets` give the entries' values, even where a
                protocol does not score them).
            reset: (B,) bool rows whose stream starts afresh before this segment, or None.
            scored_targets: (B, L) the targets scored (-100 elsewhere).

        Returns:
            Two (K,) float32 vectors over the scored positions, in row-major order.
        """
        B, L, D = keys.shape
        if self.store is None:
            self.store = Datastore.empty(B, D, keys.device)
        if reset is not None:
            self.store = reset_rows(self.store, reset)
        values = batch.targets
        valid = values != IGNORE_INDEX
        mask = scored_targets != IGNORE_INDEX
        tgt = scored_targets.clamp_min(0)
        lm = torch.log_softmax(logits.float(), dim=-1).gather(2, tgt[..., None]).squeeze(2)  # (B, L)
        knn, found = knn_log_prob(keys, tgt, self.store, values.clamp_min(0), valid, self.settings, self.shared)
        mixed = interpolate(lm, knn, found, self.settings.lmbda)
        self.store = append(self.store, keys, values.clamp_min(0), valid, self.settings.max_entries)
        return -mixed[mask], -lm[mask]


def key_module(model: Any, key: KeyName) -> torch.nn.Module:
    """The GPT-2 submodule whose output is the kNN-LM key (inside a DeepSpeed engine, peft or an adapter)."""
    from transformers import GPT2Model

    for module in model.modules():
        if isinstance(module, GPT2Model):
            return module.h[-1].ln_2 if key == "ffn_input" else module.ln_f
    raise ValueError(f"kNN-LM reads its keys from a GPT-2 backbone, and {type(model).__name__} has none")


class KeyCapture:
    """The keys of the latest forward (read `.keys` after each model call)."""

    keys: Tensor | None = None


@contextlib.contextmanager
def capture_keys(model: Any, key: KeyName) -> Iterator[KeyCapture]:
    """A forward hook that keeps the (B, L, D) key of every model call, removed on exit."""
    held = KeyCapture()

    def hook(_module, _inputs, output):
        held.keys = output.detach()

    handle = key_module(model, key).register_forward_hook(hook)
    try:
        yield held
    finally:
        handle.remove()


def build_datastore(model: Any, streams: Any, settings: KNNLMSettings, *, reset: Any, device: torch.device,
                    steps: int | None = None, max_entries: int | None = None) -> Datastore:
    """A shared datastore of (key, next token) from `streams` read by `model` with its memory.

    Args:
        streams: e.g. `TokenStreams` over the training split.
        reset: the `ResetPolicy` the streams are read with.
        steps: segments to read (default: all).
        max_entries: stop once this many entries are stored.

    Returns:
        A one-row `Datastore` of every stream's entries.
    """
    from memoria_ds.data.segments import run_segments
    from memoria_ds.eval.scoring import evaluating

    keys, values = [], []
    count = 0
    with evaluating(model), capture_keys(model, settings.key) as held:
        for seg in run_segments(model, streams, reset=reset, device=device, steps=steps):
            valid = seg.batch.targets != IGNORE_INDEX  # (B, L)
            keys.append(held.keys.float()[valid])  # (n, D)
            values.append(seg.batch.targets[valid])
            count += keys[-1].shape[0]
            if max_entries is not None and count >= max_entries:
                break
    k = torch.cat(keys)[:max_entries]
    v = torch.cat(values)[:max_entries]
    return Datastore(k[None], v[None], torch.ones(1, k.shape[0], dtype=torch.bool, device=k.device))


__all__ = ["KEYS", "Datastore", "IndexedDatastore", "KNNLMSettings", "KNNScorer", "append", "build_datastore",
           "capture_keys", "check_index", "check_index_factory", "index_datastore", "interpolate", "key_module",
           "knn_log_prob", "reset_rows", "squared_distances", "training_entries"]
