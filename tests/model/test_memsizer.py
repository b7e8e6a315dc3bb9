"""The MemSizer model: its attention against the recurrence one token at a time, the positions
against fairseq's table, the stated initialisation, causality, padding, the parameter count,
generation, save/load, the build, bf16 and LoRA on its weights.

(The whole model against the reference implementation: test_memsizer_reference.py; its memory
carried across segments: test_memsizer_carry.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from memsizer_reference import fairseq_sinusoids
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from memoria_ds.model import apply_lora, build_model
from memoria_ds.model.memsizer import MemSizerAttention, MemSizerConfig, MemSizerLMHeadModel, sinusoids

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]
V = 37


def tiny(**kw) -> MemSizerConfig:
    values = dict(vocab_size=V, n_positions=32, n_layer=2, n_head=4, n_embd=32, memsizer_slots=8, embd_pdrop=0.0,
                  attn_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return MemSizerConfig(**{**values, **kw})


def model_of(**kw) -> MemSizerLMHeadModel:
    torch.manual_seed(0)
    return MemSizerLMHeadModel(tiny(**kw)).double().eval()


def _ids(shape, seed):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("carried", [False, True])
def test_the_attention_is_the_recurrence_one_token_at_a_time(carried):
    """S_t = S_{t-1} + k_t v_t^T, y_t = phi_t S_t / sqrt(t) (the reference's incremental_revatt), by a
    Python loop over tokens: over a segment, from an empty memory or one carried from 5 earlier tokens,
    with padding at the end of row 1 (neither stored nor counted)."""
    torch.manual_seed(1)
    attn = MemSizerAttention(tiny()).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 and p.shape[0] in (8, 32) else 0.0))
    B, L, K, D = 2, 7, 8, 32
    x = torch.randn(B, L, D, dtype=torch.float64)
    keep = torch.ones(B, L, 1, dtype=torch.float64)
    keep[1, 5:] = 0
    start = torch.randn(B, K, D, dtype=torch.float64) if carried else None
    t0 = torch.tensor([5, 5]) if carried else torch.tensor([0, 0])
    seen = keep[..., 0].cumsum(1) + t0[:, None]  # (B, L)
    y, after = attn(x, seen.clamp(min=1).rsqrt()[..., None], keep, start)
    phi, k, v = attn.project(x)
    for b in range(B):
        S = start[b].clone() if carried else torch.zeros(K, D, dtype=torch.float64)
        t = int(t0[b])
        for i in range(L):
            if keep[b, i, 0] == 0:
                continue
            S = S + torch.outer(k[b, i], v[b, i])
            t += 1
            torch.testing.assert_close(y[b, i], phi[b, i] @ S / math.sqrt(t), atol=1e-12, rtol=0)
        if carried:
            torch.testing.assert_close(after[b], S, atol=1e-12, rtol=0)
    # phi is each head's softmax over the slots, averaged over the heads
    q = attn.c_attn(x)[..., : 4 * K].view(B, L, 4, K)
    torch.testing.assert_close(phi, q.softmax(-1).mean(2), atol=1e-15, rtol=0)
    torch.testing.assert_close(phi.sum(-1), torch.ones(B, L, dtype=torch.float64))


@pytest.mark.parametrize("dim", [16, 17])
def test_positions_are_fairseqs_sinusoids(dim):
    table = fairseq_sinusoids(40, dim)
    positions = torch.tensor([[2, 3, 39], [7, 2, 2]])
    torch.testing.assert_close(sinusoids(positions, dim), table[positions], atol=1e-14, rtol=0)
    # far into a carried stream: computed in float64, the second frequency's angle (2.7e6 rad at D = 16,
    # which float32 rounds by up to 0.12 rad) gives its sine and cosine to 1e-8
    p, half = 10**7 + 3, dim // 2
    angle = p * math.exp(-math.log(10000) / (half - 1))
    far = sinusoids(torch.tensor([[p]]), dim)[0, 0]
    assert abs(far[1].item() - math.sin(angle)) < 1e-8 and abs(far[half + 1].item() - math.cos(angle)) < 1e-8


def test_the_stated_initialisation():
    """The embedding N(0, D^-1/2) (the reference's, for its sqrt(D) scale); Phi, W_k, W_v Xavier uniform
    each with its own fan and gain (q_init_scale 32, kv_init_scale 1: the reference's LM); biases 0;
    layer norms 1/0; GPT-2's MLP N(0, 0.02), its output projection N(0, 0.02 / sqrt(2 n_layer))."""
    torch.manual_seed(3)
    D, H, K, n = 256, 4, 32, 3
    model = MemSizerLMHeadModel(tiny(n_embd=D, n_head=H, memsizer_slots=K, n_layer=n, vocab_size=2000))
    assert model.lm_head.weight is model.memsizer.wte.weight
    assert abs(model.memsizer.wte.weight.std().item() - D**-0.5) < 0.02 * D**-0.5
    for block in model.memsizer.h:
        w = block.attn.c_attn.weight  # (D, H K + K + D)
        for part, fan_out, gain in ((w[:, : H * K], H * K, 32**-0.5), (w[:, H * K : H * K + K], K, 1.0),
                                    (w[:, H * K + K :], D, 1.0)):
            bound = gain * math.sqrt(6 / (D + fan_out))
            assert part.abs().max().item() <= bound and part.abs().max().item() > 0.97 * bound
            assert abs(part.std().item() - bound / math.sqrt(3)) < 0.05 * bound
        assert not block.attn.c_attn.bias.any()
        for norm in (block.ln_1, block.ln_2, block.attn.k_norm, block.attn.v_norm):
            assert bool((norm.weight == 1).all()) and not norm.bias.any()
        assert abs(block.mlp.c_fc.weight.std().item() - 0.02) < 0.001
        assert abs(block.mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(2 * n)) < 0.001
        assert not block.mlp.c_fc.bias.any() and not block.mlp.c_proj.bias.any()


def test_no_position_sees_its_future():
    model = model_of()
    ids = _ids((2, 16), 3)
    base = model(ids).logits
    for j in (0, 1, 7, 15):
        changed = ids.clone()
        changed[:, j] = (changed[:, j] + 1) % V
        out = model(changed).logits
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=0, rtol=0)
        assert (out[:, j:] - base[:, j:]).abs().amax() > 1e-6  # and token j does matter from j on


def test_the_weight_count():
    """Per block: two layer norms, the fused projection D (H K + K + D) + H K + K + D, the key and value
    norms 2 K + 2 D, GPT-2's MLP 8 D^2 + 5 D; the embedding (tied) and ln_f. No position embedding, no
    output projection in the attention: fewer weights than GPT-2 of the same shape."""
    D, H, K, L, P = 32, 4, 8, 2, 32
    block = 4 * D + D * (H * K + K + D) + H * K + K + D + 2 * K + 2 * D + 8 * D * D + 5 * D
    count = sum(p.numel() for p in model_of().parameters())
    assert count == V * D + L * block + 2 * D
    gpt2 = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=L,
                                                             n_head=H)).parameters())
    # GPT-2's attention is 4 D^2 + 4 D; ours (H K + K) (D + 1) for Phi and W_k, D^2 + D for W_v, 2 K + 2 D norms
    assert gpt2 - count == P * D + L * (3 * D * D + D - (H * K + K) * (D + 1) - 2 * K)


def test_padding_is_neither_read_nor_counted():
    """Right padding leaves the real positions as the shorter sequence; left padding too (positions and
    t count real tokens only), where the reference, which never pads a language model, would read it."""
    model = model_of()
    ids = _ids((1, 12), 4)
    short = model(ids[:, :8]).logits
    right = model(ids, attention_mask=torch.tensor([[1] * 8 + [0] * 4])).logits
    torch.testing.assert_close(right[:, :8], short, atol=1e-12, rtol=0)
    left = model(torch.cat([ids[:, :3], ids[:, :8]], 1), attention_mask=torch.tensor([[0] * 3 + [1] * 8])).logits
    torch.testing.assert_close(left[:, 3:], short, atol=1e-12, rtol=0)
    assert torch.isfinite(left).all()


def test_labels_and_shift_labels_give_the_same_loss_and_memory_is_the_none_kind():
    model = model_of()
    ids = _ids((2, 10), 5)
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    a = model(ids, labels=ids)
    b = model(ids, shift_labels=shifted, memory=a.memory, reset=torch.tensor([True, False]))
    torch.testing.assert_close(a.loss, b.loss)
    assert a.memory_stats is None and a.memory.batch_size == 2 and model.memory_kind.name == "none"
    with pytest.raises(ValueError, match="rows"):
        model(ids[:1], memory=a.memory)
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = _ids((2, 10), 6)
    grads = []
    for checkpointing in (False, True):
        model = model_of().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-12, rtol=0, msg=name)


def test_generate_is_greedy_decoding_of_the_whole_sequence():
    model = model_of()
    ids = _ids((2, 5), 7)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(4):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_save_load_through_the_auto_classes(tmp_path):
    model = model_of(memory_type="memsizer", q_init_scale=8.0)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert isinstance(loaded, MemSizerLMHeadModel) and loaded.lm_head.weight is loaded.memsizer.wte.weight
    assert loaded.config.memory_type == "memsizer" and loaded.config.q_init_scale == 8.0
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name  # loaded as saved, not initialised again
    ids = _ids((1, 9), 8)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


def test_build_model_presets(tmp_path):
    backbone = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40)
    model = build_model(backbone, "memsizer", memsizer_slots=4)
    assert isinstance(model, MemSizerLMHeadModel) and model.config.memsizer_slots == 4
    assert model.memory_kind.name == "none" and build_model(backbone, "memsizer_carry").memory_kind.name == "memsizer"
    assert build_model(backbone, "memsizer").config.memsizer_slots == 32  # the reference's WikiText-103 model
    GPT2LMHeadModel(backbone).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="builds a MemSizer.*from scratch"):
        build_model(str(tmp_path / "gpt2"), "memsizer")
    model.save_pretrained(tmp_path / "memsizer")
    assert isinstance(build_model(str(tmp_path / "memsizer"), "memsizer"), MemSizerLMHeadModel)
    with pytest.raises(ValueError, match="holds a MemSizer"):
        build_model(str(tmp_path / "memsizer"), "memoria")
    with pytest.raises(ValueError, match="builds a Memory Mosaic"):
        build_model(str(tmp_path / "memsizer"), "memory_mosaic")


@pytest.mark.parametrize("bad, match", [(dict(memsizer_slots=0), "memsizer_slots"),
                                        (dict(q_init_scale=0.0), "q_init_scale"),
                                        (dict(kv_init_scale=-1.0), "kv_init_scale"),
                                        (dict(memory_type="xl"), "is .none."),
                                        (dict(memory_type="mosaic"), "is .none."),
                                        (dict(n_embd=2, n_head=1), "at least 4"),
                                        (dict(pkm_layers=[0]), "pkm_layers")])
def test_config_refuses_bad_settings(bad, match):
    with pytest.raises(StrictDataclassClassValidationError, match=match):  # HF's wrapper of our ValueError
        tiny(**bad)


def test_bf16_runs_close_to_fp32():
    model = model_of().float()
    ids = _ids((2, 16), 9)
    want = model(ids).logits
    low = model.to(torch.bfloat16)
    out = low(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    assert (out.logits.float() - want).abs().max() < 0.05 * want.abs().max()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in low.parameters())


def test_lora_adapts_its_projections_and_starts_as_the_model():
    """peft LoRA with the toolkit's targets (c_attn, c_proj, c_fc: GPT-2's Conv1D names, which the
    MemSizer's fused q/k/v projection and MLP keep): only the adapters train, and they start at 0."""
    plain = model_of().float()
    wrapped = apply_lora(model_of().float(), r=4)
    lora = [m for m in wrapped.modules() if isinstance(m, LoraLayer)]
    assert len(lora) == 3 * 2 and all(m.fan_in_fan_out for m in lora)  # c_attn, c_fc, mlp.c_proj per block
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    ids = _ids((2, 12), 10)
    torch.testing.assert_close(wrapped(ids).logits, plain(ids).logits, atol=1e-6, rtol=0)
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    opt = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    wrapped.train()
    for _ in range(2):  # LoRA's B starts at 0: two steps move both
        wrapped(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in wrapped.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable
