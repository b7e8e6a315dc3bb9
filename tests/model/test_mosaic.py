"""The Memory Mosaic model: each unit against a slow, obviously-correct loop, causality with
values that peek ahead, the paper's parameter count, padding, generation, save/load, the build.

(The whole model against the reference implementation: test_mosaic_reference.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from memoria_ds.model import build_model
from memoria_ds.model.mosaic import MemoryMosaicConfig, MemoryMosaicLMHeadModel, leaky_average, peek_ahead
from memoria_ds.model.mosaic.units import ContextualMemory

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny(**kw) -> MemoryMosaicConfig:
    values = dict(vocab_size=37, n_positions=32, n_layer=2, n_head=4, n_embd=32, embd_pdrop=0.0, attn_pdrop=0.0,
                  resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return MemoryMosaicConfig(**{**values, **kw})


def model_of(**kw) -> MemoryMosaicLMHeadModel:
    torch.manual_seed(0)
    return MemoryMosaicLMHeadModel(tiny(**kw)).double().eval()


def test_leaky_average_is_the_recurrence():
    """kbar_T = k_T + lambda kbar_{T-1}, lambda = exp(-rate), each head its own rate."""
    torch.manual_seed(1)
    k = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    rate = torch.tensor([0.0, 0.7, 3.0], dtype=torch.float64)
    want = torch.zeros_like(k)
    prev = torch.zeros_like(k[:, :, 0])
    for t in range(7):
        prev = k[:, :, t] + torch.exp(-rate).view(1, 3, 1) * prev
        want[:, :, t] = prev
    torch.testing.assert_close(leaky_average(k, rate), want, atol=1e-12, rtol=0)


def test_peek_ahead_by_hand():
    v = torch.arange(1.0, 4.0).view(1, 1, 3, 1)  # v_0..v_2 = 1, 2, 3
    out = peek_ahead(v, torch.tensor([0.25]))
    assert out.flatten().tolist() == [0.25 * 1 + 0.75 * 2, 0.25 * 2 + 0.75 * 3, 0.25 * 3 + 0.75 * 0]


def test_contextual_memory_is_kernel_smoothing_over_the_strict_past():
    """Eq. 8 with delta = 1, one position at a time: y_T = sum_{t<T} softmax_t(k_T.k_t) v_t; y_0 = 0."""
    torch.manual_seed(2)
    cfg = tiny()
    mem = ContextualMemory(cfg).double().eval()
    with torch.no_grad():
        for p in mem.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 9, cfg.n_embd, dtype=torch.float64)
    k, v = mem.key(x)[0], mem.value(x)  # (B, H, L, hd)
    y = torch.zeros_like(v)
    for T in range(1, 9):
        w = torch.softmax(k[:, :, T : T + 1] @ k[:, :, :T].transpose(-1, -2), dim=-1)  # (B, H, 1, T)
        y[:, :, T] = (w @ v[:, :, :T])[:, :, 0]
    want = mem.out_proj(y.transpose(1, 2).reshape(2, 9, cfg.n_embd))
    torch.testing.assert_close(mem(x), want, atol=1e-12, rtol=0)


def test_keys_and_values_are_normalised_and_scaled():
    cfg = tiny()
    model = model_of()
    mem = model.mosaic.h[0].context
    x = torch.randn(1, 5, cfg.n_embd, dtype=torch.float64)
    k, v = mem.key(x)[0], mem.value(x)
    # init: key scale exp(10 * 0.1) = e, value scale exp(10 * -0.05) = exp(-0.5); the last value
    # (its x_{T+1} is not there yet) has only c x_T in it, still of norm exp(-0.5)
    torch.testing.assert_close(k.norm(dim=-1), torch.full((1, 4, 5), math.e, dtype=torch.float64))
    torch.testing.assert_close(v.norm(dim=-1), torch.full((1, 4, 5), math.exp(-0.5), dtype=torch.float64))


def test_no_position_sees_its_future():
    """Values peek one step ahead, yet logits at positions < j never depend on token j."""
    model = model_of()
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(3))
    base = model(ids).logits
    for j in (0, 1, 7, 15):
        changed = ids.clone()
        changed[:, j] = (changed[:, j] + 1) % 37
        out = model(changed).logits
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=0, rtol=0)
        assert (out[:, j:] - base[:, j:]).abs().amax() > 1e-6  # and token j does matter from j on


def test_weights_match_a_gpt2_of_the_same_shape():
    """Paper Section 5 (footnote 4): pmem_size = 3.5 d (2688 at d = 768) gives every block the weight
    count of GPT-2's; what differs is GPT-2's position embedding and some biases and scalars:
    per block, GPT-2 12 d^2 + 13 d, the Memory Mosaic 5 d^2 + 2 d S + 9 d + 7 H."""
    assert MemoryMosaicConfig(n_embd=768, n_head=12).pmem_size == 2688
    d, H, L, P = 32, 4, 2, 32
    mosaic = sum(p.numel() for p in model_of().parameters())
    gpt2 = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(vocab_size=37, n_positions=P, n_embd=d, n_layer=L,
                                                             n_head=H)).parameters())
    assert mosaic == gpt2 - P * d - L * (13 * d - 9 * d - 7 * H)


def test_padded_positions_are_never_read():
    model = model_of()
    ids = torch.randint(0, 37, (1, 12), generator=torch.Generator().manual_seed(4))
    short = model(ids[:, :8]).logits
    mask = torch.tensor([[1] * 8 + [0] * 4])
    padded = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(padded[:, :8], short, atol=1e-12, rtol=0)
    left = model(torch.cat([ids[:, :3], ids[:, :8]], 1), attention_mask=torch.tensor([[0] * 3 + [1] * 8])).logits
    assert torch.isfinite(left).all()  # a query whose whole past is padding reads 0, not NaN


def test_labels_and_shift_labels_give_the_same_loss_and_memory_is_the_none_kind():
    model = model_of()
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(5))
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    a = model(ids, labels=ids)
    b = model(ids, shift_labels=shifted, memory=a.memory, reset=torch.tensor([True, False]))
    torch.testing.assert_close(a.loss, b.loss)
    assert a.memory_stats is None and a.memory.batch_size == 2
    with pytest.raises(ValueError, match="rows"):
        model(ids[:1], memory=a.memory)
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(6))
    grads = []
    for checkpointing in (False, True):
        model = model_of().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-12, rtol=0, msg=name)


def test_generate_is_greedy_decoding_of_the_whole_sequence():
    model = model_of()
    ids = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(7))
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(4):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_save_load_through_the_auto_classes(tmp_path):
    model = model_of()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert isinstance(loaded, MemoryMosaicLMHeadModel) and loaded.lm_head.weight is loaded.mosaic.wte.weight
    ids = torch.randint(0, 37, (1, 9))
    # equal weights (checked by the loader); the logits up to summation order (a loaded tensor may be laid out anew)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


def test_build_model_preset(tmp_path):
    model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40), "memory_mosaic", pmem_count=2)
    assert isinstance(model, MemoryMosaicLMHeadModel) and model.config.pmem_count == 2
    assert model.config.pmem_size == 4 * 16 - 8
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="from scratch"):
        build_model(str(tmp_path / "gpt2"), "memory_mosaic")
    model.save_pretrained(tmp_path / "mosaic")
    assert isinstance(build_model(str(tmp_path / "mosaic"), "memory_mosaic"), MemoryMosaicLMHeadModel)
    with pytest.raises(ValueError, match="holds a Memory Mosaic"):
        build_model(str(tmp_path / "mosaic"), "memoria")


@pytest.mark.parametrize("bad, match", [(dict(pmem_count=0), "pmem_count"), (dict(pmem_size=0), "pmem_size"),
                                        (dict(memory_type="xl"), "is .none."),
                                        (dict(mosaic_memory_length=0), "mosaic_memory_length"),
                                        (dict(n_head=5), "divide")])
def test_config_refuses_bad_settings(bad, match):
    with pytest.raises(StrictDataclassClassValidationError, match=match):  # HF's wrapper of our ValueError
        tiny(**bad)


def test_eager_attention_equals_sdpa():
    """`attn_implementation="eager"` (what FLOP counters see) computes what SDPA does."""
    model = model_of()
    ids = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    sdpa = model(ids, attention_mask=mask).logits
    model.config._attn_implementation = "eager"
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, sdpa, atol=1e-12, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_causal_path_equals_the_masked_path(implementation):
    """Without an attention mask the contextual memory reads (k[1:], k[:-1]) causally (SDPA's
    flash kernel on a GPU); with an all-ones mask, through the boolean mask: the same logits."""
    model = model_of()
    model.config._attn_implementation = implementation
    ids = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(model(ids).logits, model(ids, attention_mask=torch.ones_like(ids)).logits,
                               atol=1e-12, rtol=0)


def test_long_segments_train_with_finite_gradients():
    """fp32, 128 tokens, leak rates up to 5: exp(5 * 127) overflows; no gradient may be NaN."""
    torch.manual_seed(9)
    model = MemoryMosaicLMHeadModel(tiny(n_positions=128)).train()
    ids = torch.randint(0, 37, (2, 128))
    model(ids, labels=ids).loss.backward()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith(".leak"))
