"""Longformer, BigBird and GPT-2 read by the classification loop without memory (`model/encoder/plain.py`): HF's
classes bit for bit, the loop's contract, plain HF checkpoints, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (AutoModelForSequenceClassification, BigBirdConfig, BigBirdForSequenceClassification,
                          GPT2Config, GPT2ForSequenceClassification, LongformerConfig,
                          LongformerForSequenceClassification)

from memoria_ds.model.encoder import build_encoder_model
from memoria_ds.model.encoder.plain import (SegmentBigBirdForSequenceClassification,
                                            SegmentGPT2ForSequenceClassification,
                                            SegmentLongformerForSequenceClassification, build_plain_classifier,
                                            plain_classifier_config)
from memoria_ds.model.recurrent import NoMemory

SHAPE = dict(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
             num_labels=3)
CONFIGS = {
    "longformer": (lambda: LongformerConfig(max_position_embeddings=66, attention_window=[8, 8], **SHAPE),
                   LongformerForSequenceClassification, SegmentLongformerForSequenceClassification),
    "big_bird": (lambda: BigBirdConfig(max_position_embeddings=64, block_size=4, num_random_blocks=1, **SHAPE),
                 BigBirdForSequenceClassification, SegmentBigBirdForSequenceClassification),
    # HF's GPT-2 finds a row's last token by the padding id (1 here, as `batch` pads); ours by the mask
    "gpt2": (lambda: GPT2Config(n_positions=64, pad_token_id=1, **SHAPE), GPT2ForSequenceClassification,
             SegmentGPT2ForSequenceClassification),
}


def batch(length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 40:] = 0  # a shorter document, right-padded
    ids[2, 40:] = 1
    return ids, mask


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_loop_reads_hfs_own_classifier_bit_for_bit(kind, tmp_path):
    make, hf_class, ours = CONFIGS[kind]
    torch.manual_seed(0)
    model = build_encoder_model(make(), "backbone").eval()
    assert type(model) is ours and model.memory_modules() == []
    ids, mask = batch()
    labels = torch.tensor([0, 2, -100])
    out = model(ids, attention_mask=mask, labels=labels, memory=None, reset=torch.ones(3, dtype=torch.bool))
    assert isinstance(out.memory, NoMemory) and out.memory.batch_size == 3 and out.memory_stats is None

    reference = hf_class(model.config).eval()
    reference.load_state_dict(model.state_dict())
    expected = reference(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(out.logits, expected)
    # the loss over labelled rows only (HF's mean would count the -100 row out too; all -100 gives 0, not NaN)
    assert torch.allclose(out.loss, nn.functional.cross_entropy(expected[:2], labels[:2]), atol=0, rtol=1e-6)
    none = model(ids, attention_mask=mask, labels=torch.full((3,), -100))
    assert none.loss.item() == 0.0
    # the memory a call returned goes back in; another batch's is refused
    assert model(ids, attention_mask=mask, memory=out.memory).memory is out.memory
    with pytest.raises(ValueError, match="has no memory"):
        model(ids, attention_mask=mask, memory=NoMemory(2))

    model.save_pretrained(tmp_path)  # a plain HF checkpoint: the Auto class loads HF's own class
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is hf_class
    assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, expected)
    again = build_encoder_model(str(tmp_path), "backbone").eval()
    assert type(again) is ours and torch.equal(again(ids, attention_mask=mask).logits, expected)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_new_head_for_other_classes_and_the_positions(kind, tmp_path):
    make, _, ours = CONFIGS[kind]
    build_encoder_model(make(), "backbone").save_pretrained(tmp_path)
    model = build_plain_classifier(str(tmp_path), num_labels=2, id2label={0: "false", 1: "true"})
    assert type(model) is ours and model.config.num_labels == 2 and model.config.label2id == {"false": 0, "true": 1}
    assert model.positions_per_segment == 64  # Longformer's start after its padding index, as RoBERTa's
    ids, mask = batch(65)
    with pytest.raises(ValueError, match="exceeds the 64 positions"):
        model(ids, attention_mask=mask)


def test_memoria_presets_and_other_types_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match="preset `backbone`"):
        build_encoder_model(CONFIGS["longformer"][0](), "memoria")
    from transformers import T5Config

    with pytest.raises(ValueError, match="Longformer, BigBird, GPT-2"):
        plain_classifier_config(T5Config())
    with pytest.raises(ValueError, match="no setting 'not_a_field'"):
        plain_classifier_config(CONFIGS["big_bird"][0](), not_a_field=1)


def test_the_evaluate_command_reads_a_saved_classifier_with_its_own_tokenizer(tmp_path):
    """`launch/evaluate.py DIR model.task=classification ...` on a saved classifier (not a run): its documents
    are tokenized by DIR's tokenizer unless `data.tokenizer` says otherwise (not the default backbone's)."""
    from memoria_ds.train.evaluate import parse

    model_dir = tmp_path / "clf"
    build_encoder_model(CONFIGS["longformer"][0](), "backbone").save_pretrained(model_dir)
    docs = tmp_path / "test.jsonl"
    docs.write_text('{"text": "a b", "label": 0}\n')
    common = [str(model_dir), "model.task=classification", "data.corpus=documents", f"data.files={{test: [{docs}]}}",
              "eval.split=test"]
    assert parse(common)[0].data.tokenizer == str(model_dir)
    from memoria_ds.data.evidence_documents import write_book_tokenizer

    other = write_book_tokenizer(tmp_path / "tok")
    assert parse([*common, f"data.tokenizer={other}"])[0].data.tokenizer == other
