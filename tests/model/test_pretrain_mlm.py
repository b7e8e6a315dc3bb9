"""The masked-language-model stand-in for a pretrained encoder (`memoria_ds/model/encoder/pretrain_mlm.py`): its
loss falls, it is seeded, and the saved folder is a BERT checkpoint that a classifier starts from."""

from __future__ import annotations

import json

import pytest
import torch

from memoria_ds.data.lifelong_tasks import write_lifelong_tasks, write_task_tokenizer
from memoria_ds.model.encoder.pretrain_mlm import pretrain_mlm


@pytest.fixture(scope="module")
def texts_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    files = write_lifelong_tasks(root / "tasks", tasks=2, classes=2, counts={"train": 40, "test": 2})
    texts = [json.loads(line)["text"] for path in files["train"] for line in open(path, encoding="utf-8")]
    return texts, write_task_tokenizer(root / "tok", tasks=2, classes=2), root


def test_the_loss_falls_the_run_is_seeded_and_a_classifier_loads_it(texts_and_tokenizer):
    from transformers import AutoTokenizer, BertForMaskedLM, BertForSequenceClassification

    texts, tok, root = texts_and_tokenizer
    losses = pretrain_mlm(texts, tok, root / "a", steps=80, batch_size=8, seed=3)
    assert losses["last_loss"] < losses["first_loss"] - 1.0  # from ln(vocab) towards the words' frequencies
    again = pretrain_mlm(texts, tok, root / "b", steps=80, batch_size=8, seed=3)
    assert again == losses
    mlm = BertForMaskedLM.from_pretrained(root / "a")
    classifier = BertForSequenceClassification.from_pretrained(root / "a", num_labels=4)
    for name, tensor in classifier.bert.state_dict().items():
        if not name.startswith("pooler"):  # (the pooler is not part of a masked language model)
            assert torch.equal(tensor, mlm.bert.state_dict()[name]), name
    assert AutoTokenizer.from_pretrained(root / "a").mask_token == "[MASK]"


def test_bad_settings_are_refused(texts_and_tokenizer):
    texts, tok, root = texts_and_tokenizer
    with pytest.raises(ValueError, match="need texts"):
        pretrain_mlm([], tok, root / "never")
    with pytest.raises(ValueError, match="positions"):
        pretrain_mlm(texts, tok, root / "never", max_length=128)
