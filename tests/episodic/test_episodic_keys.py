"""KeyEncoder: a frozen, separate copy that makes fp32 keys (the first token's state; a causal model's last)."""

from __future__ import annotations

import torch
from episodic_helpers import VOCAB, random_batch, tiny_bert_config
from transformers import BertModel, RobertaConfig, RobertaForSequenceClassification

from memoria_ds.episodic import KeyEncoder


def storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


def test_keys_are_the_first_token_state_and_never_move_when_the_model_trains(tiny_classifier):
    model = tiny_classifier
    encoder = KeyEncoder(model)
    assert storages(encoder).isdisjoint(storages(model))
    ids, mask = random_batch(4, 6, torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        expected = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    keys = encoder(ids, mask)
    assert keys.shape == (4, 16) and keys.dtype == torch.float32 and not keys.requires_grad
    assert torch.equal(keys, expected)

    before = {n: p.clone() for n, p in model.named_parameters()}
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=1.0)
    model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    optimiser.step()
    assert not torch.equal(model.bert.embeddings.word_embeddings.weight,
                           before["bert.embeddings.word_embeddings.weight"])  # the step moved the model
    assert torch.equal(encoder(ids, mask), keys)
    assert all(p.grad is None and not p.requires_grad for p in encoder.parameters())


def test_stays_in_eval_mode_so_keys_are_deterministic(tiny_classifier):
    encoder = KeyEncoder(tiny_classifier).train()  # dropout 0.1 in the config: eval must hold anyway
    assert not any(m.training for m in encoder.modules())
    ids, mask = random_batch(3, 5, torch.Generator().manual_seed(1))
    assert torch.equal(encoder(ids, mask), encoder(ids, mask))


def test_bare_encoders_roberta_and_low_precision_give_float32_keys():
    torch.manual_seed(0)
    bert = BertModel(tiny_bert_config()).to(torch.bfloat16)
    assert KeyEncoder(bert)(*random_batch(2, 4, torch.Generator().manual_seed(2))).dtype == torch.float32
    roberta = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, num_labels=3, pad_token_id=1))
    encoder = KeyEncoder(roberta)
    assert storages(encoder).isdisjoint(storages(roberta)) and encoder.key_dim == 16
    ids, mask = random_batch(2, 4, torch.Generator().manual_seed(3))
    ids[:, 0] = 0  # <s>
    roberta.eval()
    with torch.no_grad():
        expected = roberta.roberta(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    assert torch.equal(encoder(ids, mask), expected)


def test_a_causal_models_key_is_its_last_real_tokens_state_whatever_the_padding():
    """GPT-2 sees the whole input only at its last token: the key is that token's state, so a document's key is
    the same alone and right-padded in a batch (the first token would key every document by its first word)."""
    import pytest
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2,
                                                     n_head=2, num_labels=3)).eval()
    encoder = KeyEncoder(model)
    assert encoder.pooling == "last" and KeyEncoder(model, pooling="first").pooling == "first"
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # the second document has 4 tokens
    ids[1, 4:] = 0
    keys = encoder(ids, mask)
    with torch.no_grad():
        alone = model.transformer(input_ids=ids[1:, :4]).last_hidden_state[0, -1]
        whole = model.transformer(input_ids=ids[:1]).last_hidden_state[0, -1]
    assert torch.allclose(keys[1], alone, atol=1e-6) and torch.allclose(keys[0], whole, atol=1e-6)
    with pytest.raises(ValueError, match="`first` or `last`"):
        KeyEncoder(model, pooling="mean")
