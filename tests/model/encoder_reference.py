"""A slow, plainly written reference of the authors' Memoria BERT / RoBERTa forward, one document at a time.

Written from the authors' code (cosmoquester/memoria at e4ba6e2, experiment/longseq_formers/model/):

- `memoria_bert/modeling_memoria_bert.py`, `MemoriaBertEncoder.forward`: layers 0..l as plain BERT
  layers; after layer l (`i == config.memory_layer_index`) `self.abstractor(hidden_states)` gives the
  working memory, `memoria.add_working_memory(wm)` then `memoria.remind()` the reminded engrams; the
  layers above l (`use_memory_attention=i > memory_layer_index`) run `MemoriaBertLayer.forward`; after
  the last layer `memory_weights` = the mean of every memory layer's M_rem attention probabilities over
  layers, heads and (all) query positions, times `R * memoria_lifespan_extend_scale`, go to
  `memoria.adjust_lifespan_and_memories`.
- `MemoriaBertLayer.forward`: self-attention (`BertAttention`), then the one `memory_attention`
  (`BertAttention` used as a cross-attention, transformers 4.25.1) over the working memory, then over
  the reminded engrams, then `feed_forward_chunk`. HF 4.25's `BertAttention` is
  `LayerNorm(x + dense(softmax(q k^T / sqrt(hd) + mask) v))`; over no engram its context is 0.
- `memoria/abstractor.py`, `Abstractor.forward`: `output(feedforward(softmax(Q (W_k h)^T) W_v h))`, no
  scaling, no activation, no mask.
- `MemoriaBertForSequenceClassification`: `classifier(dropout(pooler(h)))`;
  `MemoriaRobertaForSequenceClassification`: `RobertaClassificationHead` on <s>.

At evaluation (no dropout), in float64, per document (the authors' batch of one: no padded engram
slots). The memory is `tests/memory/reference.py`'s `ReferenceMemory`, the slow reference of the rules
the toolkit's engine implements (docs/algorithm.md lists where those depart from the authors' package;
with one row and real engrams only, their lifespan increment `w * R * alpha` equals the engine's
`w / sum(w) * R * alpha`, since the mean probabilities sum to 1). Engrams are stored rounded to float32,
as the engine stores them.

Switches for the toolkit's other forms: `residual="add"` (`a + dense(...)`, no LayerNorm),
`abstractor="transformer"` (1/sqrt(D), the activation between the FFN's layers), and
`mask_padding=True`: the toolkit's departures at padding (the abstractor reads real tokens only; the
contribution averages over real query tokens only); with no padding they change nothing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch
from torch import Tensor


def load_memory_reference():
    """tests/memory/reference.py under a name no other test directory can shadow."""
    name = "memoria_ds_tests_memory_reference"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "memory" / "reference.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _linear(w: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def _layer_norm(w: dict[str, Tensor], name: str, x: Tensor, eps: float) -> Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]


def _gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _attend(q: Tensor, k: Tensor, v: Tensor, heads: int, key_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Multi-head attention of (L, D) queries over (M, D) keys/values; key_bias: (M,) additive. Returns
    the merged context (L, D) and the probabilities (heads, L, M); over no key, a zero context."""
    L, D = q.shape
    hd = D // heads
    if k.shape[0] == 0:
        return torch.zeros_like(q), q.new_zeros(heads, L, 0)
    qh = q.view(L, heads, hd).transpose(0, 1)  # (H, L, hd)
    kh = k.view(-1, heads, hd).transpose(0, 1)  # (H, M, hd)
    vh = v.view(-1, heads, hd).transpose(0, 1)
    scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)  # (H, L, M)
    if key_bias is not None:
        scores = scores + key_bias
    probs = scores.softmax(dim=-1)
    return (probs @ vh).transpose(0, 1).reshape(L, D), probs


class AuthorsEncoderReference:
    """One document through the authors' Memoria encoder, segment by segment.

    Args:
        weights: the toolkit model's state dict (its names: the backbone's HF names, `abstractor.*`,
            `memory_layers.{i}.memory_attention.*`), converted to float64 here.
        config: the toolkit model's config (sizes, `memory_layer_index`, the Memoria settings).
        family: `"bert"` or `"roberta"`.
        residual / abstractor / mask_padding: the forms above (module docstring).
    """

    def __init__(self, weights: dict[str, Tensor], config, family: str, residual: str = "post_norm",
                 abstractor: str = "authors", mask_padding: bool = False) -> None:
        self.w = {k: v.detach().double() for k, v in weights.items()}
        self.cfg, self.family = config, family
        self.residual, self.abstractor_style, self.mask_padding = residual, abstractor, mask_padding
        self.memory = load_memory_reference().ReferenceMemory(config.memoria_config)

    def reset(self) -> None:
        self.memory.reset()

    # ------------------------------------------------------------------ pieces
    def _embed(self, ids: Tensor) -> Tensor:
        w, p = self.w, self.family
        if p == "bert":
            positions = torch.arange(ids.shape[0])
        else:  # RoBERTa: positions count real tokens from padding_idx + 1 (create_position_ids_from_input_ids)
            real = (ids != self.cfg.pad_token_id).long()
            positions = torch.cumsum(real, dim=0) * real + self.cfg.pad_token_id
        e = f"{p}.embeddings"
        x = (w[f"{e}.word_embeddings.weight"][ids] + w[f"{e}.position_embeddings.weight"][positions]
             + w[f"{e}.token_type_embeddings.weight"][torch.zeros_like(ids)])
        return _layer_norm(w, f"{p}.embeddings.LayerNorm", x, self.cfg.layer_norm_eps)

    def _self_attention(self, i: int, x: Tensor, key_bias: Tensor) -> Tensor:
        w, n, eps = self.w, f"{self.family}.encoder.layer.{i}.attention", self.cfg.layer_norm_eps
        q, k, v = (_linear(w, f"{n}.self.{name}", x) for name in ("query", "key", "value"))
        ctx, _ = _attend(q, k, v, self.cfg.num_attention_heads, key_bias)
        return _layer_norm(w, f"{n}.output.LayerNorm", x + _linear(w, f"{n}.output.dense", ctx), eps)

    def _feed_forward(self, i: int, a: Tensor) -> Tensor:
        w, n = self.w, f"{self.family}.encoder.layer.{i}"
        h = _linear(w, f"{n}.output.dense", _gelu(_linear(w, f"{n}.intermediate.dense", a)))
        return _layer_norm(w, f"{n}.output.LayerNorm", a + h, self.cfg.layer_norm_eps)

    def _memory_attention(self, i: int, a: Tensor, engrams: Tensor) -> tuple[Tensor, Tensor]:
        """The authors' `memory_attention` (a BertAttention) as a cross-attention over `engrams` (M, D)."""
        w, n, D = self.w, f"memory_layers.{i}.memory_attention", self.cfg.hidden_size
        kv = w[f"{n}.kv_proj.weight"], w[f"{n}.kv_proj.bias"]  # their key and value weights, side by side
        k = engrams @ kv[0][:D].T + kv[1][:D]
        v = engrams @ kv[0][D:].T + kv[1][D:]
        ctx, probs = _attend(_linear(w, f"{n}.q_proj", a), k, v, self.cfg.num_attention_heads, None)
        if self.residual == "add" and engrams.shape[0] == 0:  # the toolkit's additive form adds nothing then
            return a, probs
        out = a + _linear(w, f"{n}.out_proj", ctx)
        if self.residual == "post_norm":
            out = _layer_norm(w, f"{n}.ln", out, self.cfg.layer_norm_eps)
        return out, probs

    def _working_memory(self, h: Tensor, real: Tensor) -> Tensor:
        w = self.w
        key, value = _linear(w, "abstractor.key", h), _linear(w, "abstractor.value", h)  # (L, D)
        scores = w["abstractor.queries"] @ key.T  # (N, L)
        if self.abstractor_style == "transformer":
            scores = scores / math.sqrt(h.shape[-1])
        if self.mask_padding and bool(real.any()):
            scores = scores.masked_fill(~real, float("-inf"))
        pooled = scores.softmax(dim=-1) @ value  # (N, D)
        inner = _linear(w, "abstractor.ffn_in", pooled)
        if self.abstractor_style == "transformer":
            inner = _gelu(inner)  # the backbone's activation ("gelu" in these tests)
        return _linear(w, "abstractor.ffn_out", inner)

    def _classify(self, h: Tensor) -> Tensor:
        w, first = self.w, h[0]
        if self.family == "bert":
            return _linear(w, "classifier", torch.tanh(_linear(w, "bert.pooler.dense", first)))
        return _linear(w, "classifier.out_proj", torch.tanh(_linear(w, "classifier.dense", first)))

    # ------------------------------------------------------------------ the memory (the engine's rules)
    def _remind(self, wm: Tensor) -> tuple[Tensor, object]:
        """Write the (N, D) working memory, remind: the (R, D) reminded engrams and what `_memorize` needs."""
        retrieval = self.memory.remind(wm.float().double().tolist())  # stored as the engine stores it
        vectors = [self.memory.engrams[u].vector for u in retrieval.reminded]
        return torch.tensor(vectors, dtype=torch.float64).view(-1, wm.shape[1]), retrieval

    def _memorize(self, retrieval, weights: Tensor) -> None:
        """weights: (R,) mean M_rem attention probabilities."""
        self.memory.memorize(retrieval, {u: float(weights[j]) for j, u in enumerate(retrieval.reminded)})

    # ------------------------------------------------------------------ one segment
    def segment(self, ids: Tensor, real: Tensor) -> Tensor:
        """Classify one segment of this document and take the memory step. ids, real: (L,). Returns (K,) logits."""
        cfg = self.cfg
        key_bias = (1.0 - real.double()) * torch.finfo(torch.float64).min  # HF 4.25's extended mask
        x = self._embed(ids)
        probs_per_layer = []
        engrams = handle = None
        for i in range(cfg.num_hidden_layers):
            a = self._self_attention(i, x, key_bias)
            if i > cfg.memory_layer_index:
                a, _ = self._memory_attention(i, a, engrams[:num_wm])  # the working memory
                a, probs = self._memory_attention(i, a, engrams[num_wm:])  # the reminded engrams
                probs_per_layer.append(probs)
            x = self._feed_forward(i, a)
            if i == cfg.memory_layer_index:
                wm = self._working_memory(x, real)  # (N, D)
                num_wm = wm.shape[0]
                reminded, handle = self._remind(wm)
                engrams = torch.cat([wm, reminded])  # the layers read the working memory as the forward made it
        # contribution: the mean over memory layers, heads and query positions (all, or the real ones)
        probs = torch.stack(probs_per_layer)  # (layers, H, L, R)
        queries = real if self.mask_padding else torch.ones_like(real)
        weights = probs.mean(dim=(0, 1))[queries].mean(dim=0)  # (R,)
        self._memorize(handle, weights)
        return self._classify(x)


class PackageEncoderReference(AuthorsEncoderReference):
    """The same forward with the authors' own `Abstractor` and `Memoria` classes (PyPI `memoria-pytorch`
    1.1.0, cosmoquester/memoria memoria/), called as `MemoriaBertEncoder.forward` calls them:
    `add_working_memory(wm)`, `remind()`, then `adjust_lifespan_and_memories(indices, w * R * alpha)`.
    The package's float32 arithmetic is its own; only the settings where it and the engine agree give
    equal results (the test says which, and docs/algorithm.md why elsewhere)."""

    def __init__(self, weights: dict[str, Tensor], config, family: str) -> None:
        super().__init__(weights, config, family, residual="post_norm", abstractor="authors")
        from memoria import Abstractor, Memoria

        m = config.memoria_config
        self.package = Memoria(num_reminded_stm=m.num_stm_reminded, stm_capacity=m.stm_capacity,
                               ltm_search_depth=m.search_depth, initial_lifespan=int(m.initial_lifespan),
                               num_final_ltms=m.num_ltm_reminded)
        self.alpha = m.alpha
        self.their_abstractor = Abstractor(m.num_wm, config.hidden_size, config.intermediate_size).double()
        w = self.w
        with torch.no_grad():
            self.their_abstractor.query_embeddings.copy_(w["abstractor.queries"][None])
            for theirs, ours in (("key_transform", "key"), ("value_transform", "value"), ("feedforward", "ffn_in"),
                                 ("output", "ffn_out")):
                getattr(self.their_abstractor, theirs).weight.copy_(w[f"abstractor.{ours}.weight"])
                getattr(self.their_abstractor, theirs).bias.copy_(w[f"abstractor.{ours}.bias"])

    def reset(self) -> None:
        self.package.reset_memory()

    def _working_memory(self, h: Tensor, real: Tensor) -> Tensor:
        with torch.no_grad():
            return self.their_abstractor(h[None])[0]

    def _remind(self, wm: Tensor) -> tuple[Tensor, object]:
        self.package.add_working_memory(wm[None].float())
        reminded, indices = self.package.remind()  # (1, R, D) float32, (1, R)
        return reminded[0].double(), indices

    def _memorize(self, indices, weights: Tensor) -> None:
        delta = weights.float()[None] * weights.shape[0] * self.alpha  # their `memory_weights *= R * scale`
        self.package.adjust_lifespan_and_memories(indices, delta)


__all__ = ["AuthorsEncoderReference", "PackageEncoderReference", "load_memory_reference"]
