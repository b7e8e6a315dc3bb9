"""Local adaptation against a slow, obviously-correct reference; the base model left untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from episodic_helpers import random_batch, tiny_bert_config
from transformers import BertForSequenceClassification

from memoria_ds.episodic import (
    ADAPT_L2,
    ADAPT_LR,
    ADAPT_STEPS,
    NEIGHBOURS,
    EpisodicMemory,
    KeyEncoder,
    adapt_and_predict,
    local_adaptation,
    write,
)


def reference_adaptation(model, neighbours, query, steps, lr, l2, optimizer="sgd", momentum=0.0):
    """A deep copy, a plain loop of torch.optim steps on loss + l2 * ||p - p0||^2, then predict."""
    adapted = copy.deepcopy(model).eval()
    base = [p.detach().clone() for p in model.parameters()]  # a real copy of theta
    if optimizer == "sgd":
        opt = torch.optim.SGD(adapted.parameters(), lr=lr, momentum=momentum)
    else:
        opt = torch.optim.Adam(adapted.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = adapted(**neighbours).loss
        loss = loss + l2 * sum(((p - p0) ** 2).sum() for p, p0 in zip(adapted.parameters(), base))
        loss.backward()
        opt.step()
    with torch.no_grad():
        return adapted(input_ids=query["input_ids"], attention_mask=query["attention_mask"]).logits


def batches(k: int = 6, q: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids, mask = random_batch(k, 7, g, min_len=2)
    qids, qmask = random_batch(q, 5, g, min_len=2)
    neighbours = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (k,), generator=g)}
    return neighbours, {"input_ids": qids, "attention_mask": qmask}


def base_logits(model, query):
    with torch.no_grad():
        return copy.deepcopy(model).eval()(**query).logits


def test_defaults_are_the_papers():
    assert (NEIGHBOURS, ADAPT_STEPS, ADAPT_L2, ADAPT_LR) == (32, 30, 1e-3, 1e-3)


@pytest.mark.parametrize("settings", [
    dict(steps=30, lr=1e-3, l2=1e-3),  # the paper's
    dict(steps=12, lr=0.05, l2=2.0),  # a strong pull: an aliased theta would show here
    dict(steps=10, lr=0.02, l2=1e-3, momentum=0.9),  # Daikon-Sun's optimiser
    dict(steps=10, lr=5e-3, l2=0.5, optimizer="adam"),  # h3lio5's optimiser (AdamW without decay)
])
def test_matches_the_reference_loop(tiny_classifier, settings):
    model = tiny_classifier
    neighbours, query = batches()
    got = local_adaptation(model, neighbours, query, **settings)
    want = reference_adaptation(model, neighbours, query, **settings)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (got - base_logits(model, query)).abs().max() > 1e-3  # the steps did change the prediction


def test_base_weights_buffers_grads_and_modes_are_unchanged(tiny_classifier):
    model = tiny_classifier.train()
    model.bert.encoder.eval()  # a mixed mode that must come back as it was
    modes = [m.training for m in model.modules()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    before = base_logits(model, batches()[1])
    neighbours, query = batches()
    memory = _memory_from(model, neighbours)
    local_adaptation(model, neighbours, query, steps=5, lr=0.1, l2=1.0)
    adapt_and_predict(model, memory, KeyEncoder(model)(**query), query, k=4, steps=5, lr=0.1, optimizer="adam")
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert p.grad is None and p.requires_grad
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(base_logits(model, query), before)


def test_the_l2_pull_holds_the_weights_near_the_base(tiny_classifier):
    neighbours, query = batches(seed=3)
    base = base_logits(tiny_classifier, query)

    def moved(l2: float) -> float:
        logits = local_adaptation(tiny_classifier, neighbours, query, steps=20, lr=0.005, l2=l2)
        return float((logits - base).abs().max())

    # lr * 2 * l2 = 1 for l2 = 100: each step lands on theta - lr * grad(CE), one step's worth from the base
    free, some, pulled = moved(0.0), moved(10.0), moved(100.0)
    assert free > 0.1
    assert pulled < some < free
    assert pulled < 0.1 * free
    assert local_adaptation(tiny_classifier, neighbours, query, steps=0).equal(base)


def _memory_from(model, neighbours) -> EpisodicMemory:
    keys = KeyEncoder(model)(neighbours["input_ids"], neighbours["attention_mask"])
    return write(EpisodicMemory.empty(keys.shape[1]), keys, neighbours["input_ids"], neighbours["attention_mask"],
                 neighbours["labels"], 0)


def test_adapt_and_predict_adapts_each_query_on_its_own_neighbours(tiny_classifier):
    model = tiny_classifier
    g = torch.Generator().manual_seed(5)
    ids, mask = random_batch(12, 6, g, min_len=2)
    labels = torch.randint(0, 3, (12,), generator=g)
    encoder = KeyEncoder(model)
    memory = write(EpisodicMemory.empty(encoder.key_dim), encoder(ids, mask), ids, mask, labels, 0)
    qids, qmask = random_batch(3, 6, g, min_len=2)
    query_keys = encoder(qids, qmask)
    settings = dict(steps=8, lr=0.05, l2=0.1)
    got = adapt_and_predict(model, memory, query_keys, {"input_ids": qids, "attention_mask": qmask}, k=4, **settings)
    assert got.shape == (3, 3)
    for q in range(3):
        dist = ((memory.keys.double() - query_keys[q].double()) ** 2).sum(1)
        rows = sorted(range(12), key=lambda r: (float(dist[r]), r))[:4]
        width = int(mask[rows].sum(1).max())
        neighbours = {"input_ids": ids[rows, :width], "attention_mask": mask[rows, :width], "labels": labels[rows]}
        want = reference_adaptation(model, neighbours, {"input_ids": qids[q:q + 1], "attention_mask": qmask[q:q + 1]},
                                    **settings)
        torch.testing.assert_close(got[q:q + 1], want, atol=1e-6, rtol=0)


def test_bad_settings_are_refused(tiny_classifier):
    neighbours, query = batches()
    for kwargs, match in [(dict(optimizer="rmsprop"), "optimizer"), (dict(steps=-1), "steps"), (dict(lr=0.0), "lr > 0"),
                          (dict(optimizer="adam", momentum=0.9), "momentum")]:
        with pytest.raises(ValueError, match=match):
            local_adaptation(tiny_classifier, neighbours, query, **kwargs)
    with pytest.raises(ValueError, match="missing"):
        local_adaptation(tiny_classifier, {"input_ids": neighbours["input_ids"]}, query)
    regression = BertForSequenceClassification(tiny_bert_config(num_labels=1))
    with pytest.raises(ValueError, match="single-label sequence classifier"):
        local_adaptation(regression, neighbours, query)
