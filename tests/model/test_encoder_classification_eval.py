"""The classifier's evaluation (memoria_ds/eval/classification.py) against a slow reference: each document
read alone, segment by segment through its own fresh memory, the argmax of its last segment; macro-F1 by hand."""

from __future__ import annotations

import datasets
import pytest
import torch
from encoder_helpers import randomize, tiny_encoder

from memoria_ds.data.documents import document_segments
from memoria_ds.data.labelled import LabelledDocuments
from memoria_ds.eval.classification import evaluate_classification, macro_f1

CLS, SEP = 2, 3


def test_macro_f1_by_hand():
    # true 0: 2 right, 1 called 1; true 1: 1 right, 1 called 2; class 2 never true, predicted once
    confusion = torch.tensor([[2, 1, 0], [0, 1, 1], [0, 0, 0]])
    f1 = [2 * 2 / (3 + 2), 2 * 1 / (2 + 2), 0.0]
    assert macro_f1(confusion) == pytest.approx(sum(f1) / 3)
    # a class neither true nor predicted is left out (scikit-learn's labels = those present)
    assert macro_f1(torch.tensor([[3, 0, 0], [1, 2, 0], [0, 0, 0]])) == pytest.approx((6 / 7 + 4 / 5) / 2)


@pytest.mark.parametrize("memoryless,aggregate,preset", [(False, "last", "memoria"), (True, "last", "memoria"),
                                                         (False, "mean", "memoria"), (True, "mean", "memoria"),
                                                         (False, "mean", "backbone")])
def test_accuracy_and_f1_are_the_reference_documents_read_one_at_a_time(memoryless, aggregate, preset):
    torch.manual_seed(0)
    model = tiny_encoder("bert", preset)
    with torch.no_grad():
        randomize(model, seed=3)
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(10, 50, (int(n),), generator=gen).tolist() for n in (3, 17, 9, 30, 1, 12, 25)]
    labels = [0, 2, 1, 1, 0, 2, 2]
    data = LabelledDocuments(datasets.Dataset.from_dict({"input_ids": docs, "label": labels}), ["a", "b", "c"],
                             CLS, SEP, 0, 50, {})
    L, K = 8, 4
    result = evaluate_classification(model, data, segment_length=L, max_segments=K, batch_size=3, device="cpu",
                                     memoryless=memoryless, aggregate=aggregate)
    confusion, nll = torch.zeros(3, 3, dtype=torch.long), 0.0
    with torch.no_grad():
        for tokens, label in zip(docs, labels):
            memory, every = None, []
            for seg in document_segments(tokens, L, K, CLS, SEP):
                ids = torch.tensor(seg)[None]
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), memory=None if memoryless else memory)
                memory = out.memory
                every.append(out.logits[0])
            # `last`: the last segment's logits; `mean`: the mean of the segments' logits
            logits = out.logits[0] if aggregate == "last" else torch.stack(every).mean(0)
            confusion[label, int(logits.argmax())] += 1
            nll += float(torch.nn.functional.cross_entropy(logits[None], torch.tensor([label])))
    assert result.correct == int(confusion.diagonal().sum()) and result.scored_tokens == 7
    assert result.macro_f1 == pytest.approx(macro_f1(confusion))
    assert result.nll == pytest.approx(nll / 7, rel=1e-5)
    assert result.protocol["confusion"] == confusion.tolist() and result.protocol["aggregate"] == aggregate
