"""Memoria's options beyond the paper: the engrams as self-attention slots (`memory_read`) and
the working memory's attention-reconstruction loss (`engram_loss`), each against a slow
reference written from its definition, plus the model contract (exact backbone on a
segment without memory, causality, save/load, decoding)."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import VOCAB, run_stream, segments
from transformers import GPT2LMHeadModel

from memoria_ds.model import MemoriaGPT2Config
from memoria_ds.model.layer import reminded_read
from memoria_ds.model.memory_attention import contribution
from memoria_ds.model.recurrent.memoria import MemoriaSlotRead, passage_reconstruction_loss


def _slow_reconstruction_loss(wm, passage, mask, active):
    """The definition, one query at a time."""
    total, count = 0.0, 0
    D = passage.shape[-1]
    for b in range(passage.shape[0]):
        if not active[b]:
            continue
        keys = [passage[b, j] for j in range(passage.shape[1]) if mask[b, j]]
        for i in range(passage.shape[1]):
            if not mask[b, i]:
                continue
            q = passage[b, i]
            s = torch.stack([q @ k / math.sqrt(D) for k in keys]).softmax(0)
            target = sum(w * k for w, k in zip(s, keys))
            s = torch.stack([q @ w / math.sqrt(D) for w in wm[b]]).softmax(0)
            read = sum(w * v for w, v in zip(s, wm[b]))
            total += float(((read - target) ** 2).mean())
            count += 1
    return total / max(count, 1)


def test_passage_reconstruction_loss_against_its_definition():
    gen = torch.Generator().manual_seed(0)
    wm, passage = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 6, 8, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6, [0] * 6], dtype=torch.bool)
    active = torch.tensor([True, True, True])
    got = passage_reconstruction_loss(wm, passage, mask, active)
    assert got.item() == pytest.approx(_slow_reconstruction_loss(wm, passage, mask, active), rel=1e-5)
    active = torch.tensor([True, False, True])
    assert passage_reconstruction_loss(wm, passage, mask, active).item() == pytest.approx(
        _slow_reconstruction_loss(wm, passage, mask, active), rel=1e-5)
    assert passage_reconstruction_loss(wm, passage, mask, torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_passage_reconstruction_loss_by_hand_and_its_gradient():
    # one row, one passage token p, one engram w: the token reads p itself and w itself
    p, w = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[0.0, 1.0]]], requires_grad=True)
    loss = passage_reconstruction_loss(w, p, torch.ones(1, 1, dtype=torch.bool), torch.ones(1, dtype=torch.bool))
    assert loss.item() == pytest.approx(((0 - 1) ** 2 + (1 - 2) ** 2) / 2)
    loss.backward()
    assert torch.allclose(w.grad, torch.tensor([[[-1.0, -1.0]]]))  # d/dw of mean((w - p)^2)
    # the passage (the target) takes no gradient
    p = torch.randn(1, 3, 2, requires_grad=True)
    passage_reconstruction_loss(torch.randn(1, 2, 2, requires_grad=True), p, torch.ones(1, 3, dtype=torch.bool),
                                torch.ones(1, dtype=torch.bool)).backward()
    assert p.grad is None


def _slot_model(make_model, **settings):
    torch.manual_seed(0)
    model = make_model("memoria", memory_read="self_attention", memory_init="random", **settings)
    return model


def _reference_logits(model, input_ids, engrams, slot_mask, biases=None):
    """A GPT-2 forward written out by hand, every block's keys/values preceded by the engrams'
    (projected by that block), the engram slots masked per row, the tokens causal; with
    `biases` (per block, (H,)), each head's engram-slot logits raised by its bias."""
    t = model.transformer
    B, L = input_ids.shape
    h = t.wte(input_ids) + t.wpe(torch.arange(L)[None])
    for i, block in enumerate(t.h):
        attn, H = block.attn, block.attn.num_heads
        hd = attn.head_dim

        def heads(x):
            return x.view(x.shape[0], x.shape[1], H, hd).transpose(1, 2)

        q, k, v = attn.c_attn(block.ln_1(h)).split(attn.split_size, dim=-1)
        _, ek, ev = attn.c_attn(block.ln_1(engrams)).split(attn.split_size, dim=-1)
        q, k, v, ek, ev = map(heads, (q, k, v, ek, ev))
        keys, values = torch.cat([ek, k], 2), torch.cat([ev, v], 2)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(hd)  # (B, H, L, E + L)
        if biases is not None:
            E = ek.shape[2]
            for head in range(H):
                scores[:, head, :, :E] += float(biases[i][head])
        allowed = torch.cat([slot_mask[:, None, :].expand(B, L, -1), torch.ones(L, L).tril().bool()[None].expand(B, -1, -1)], 2)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = (scores.softmax(-1) @ values).transpose(1, 2).reshape(B, L, -1)
        h = h + attn.c_proj(out)
        h = h + block.mlp(block.ln_2(h))
    return model.lm_head(t.ln_f(h))


def _fourth_segment(model):
    """(the 4th segment, the read it sees, the model's logits) after 3 segments of 3 rows, row 1 reset."""
    segs = segments(batch=3, length=10, count=4)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        reset = torch.tensor([False, True, False])
        probe = memory.clone()
        probe.reset(reset)
        read, _ = model.memory_kind.read(probe, torch.float32, model.abstractor)
        return segs[3], read, model(segs[3], memory=memory, reset=reset).logits


def test_engram_slots_compute_the_hand_written_forward(make_model):
    model = _slot_model(make_model)
    assert model.memory_modules() == [model.abstractor]  # no cross-attention: the blocks' own weights
    x, read, got = _fourth_segment(model)
    assert isinstance(read, MemoriaSlotRead) and read.slot_mask[0].any() and not read.slot_mask[1].any()
    with torch.no_grad():
        expected = _reference_logits(model, x, read.engrams, read.slot_mask)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_a_segment_without_memory_is_exactly_the_backbone_and_tokens_stay_causal(make_model, backbone_config):
    model = _slot_model(make_model)
    plain = GPT2LMHeadModel(backbone_config).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k in plain.state_dict()})
    x = segments(batch=2, length=10, count=1)[0]
    with torch.no_grad():
        assert torch.allclose(model(x).logits, plain(x).logits, atol=1e-6)
        segs = segments(batch=2, length=10, count=3, seed=3)
        _, memory = run_stream(model, segs[:2])
        changed = segs[2].clone()
        changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
        a = model(segs[2], memory=memory.clone()).logits
        b = model(changed, memory=memory.clone()).logits
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])
    # and the memory is used: the same segment without it scores otherwise
    with torch.no_grad():
        assert not torch.allclose(a, model(segs[2]).logits, atol=1e-4)


def test_the_contribution_is_the_attention_over_the_reminded_engrams(make_model):
    model = _slot_model(make_model)
    segs = segments(batch=2, length=8, count=4)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        probe = memory.clone()
        read, _ = model.memory_kind.read(probe, torch.float32, model.abstractor)
        block = model.transformer.h[0]
        inputs = read.memory_inputs(None, use_sdpa=True)
        q = torch.randn(2, block.attn.num_heads, 8, block.attn.head_dim)
        from memoria_ds.model.layer import engram_key_values

        keys, _ = engram_key_values(block, read.engrams)
        got = contribution([reminded_read(block, q, keys, inputs)], inputs)
    N, R = model.config.memoria_config.num_wm, read.reminded_mask.shape[1]
    for b in range(2):
        real = [r for r in range(R) if read.reminded_mask[b, r]]
        assert real, "the test needs reminded engrams"
        expect = torch.zeros(R)
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                s = torch.stack([q[b, h, i] @ keys[b, h, N + r] / math.sqrt(block.attn.head_dim) for r in real])
                expect[real] += s.softmax(0) / (q.shape[1] * q.shape[2])
        assert torch.allclose(got[b], expect, atol=1e-5)


def test_options_save_load_and_decode(make_model, tmp_path):
    model = _slot_model(make_model, engram_loss=0.5)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path).eval()
    assert again.config.memory_read == "self_attention" and again.config.engram_loss == 0.5
    segs = segments(batch=2, length=8, count=3)
    with torch.no_grad():
        outs_a, mem_a = run_stream(model, segs)
        outs_b, mem_b = run_stream(again, segs)
        assert torch.equal(outs_a[-1].logits, outs_b[-1].logits)
        ids = model.generate(segs[0][:, :4], memory=mem_a, max_new_tokens=3, do_sample=False)
        first = model(segs[0][:, :4], memory=mem_a.clone()).logits[:, -1].argmax(-1)
    assert torch.equal(ids[:, 4], first)


def test_the_engram_loss_joins_the_training_loss_only(make_model):
    model = _slot_model(make_model, engram_loss=2.0).train()
    segs = segments(batch=2, length=8, count=3)
    memory = None
    for x in segs[:2]:
        memory = model(x, memory=memory).memory
    x = segs[2]
    frozen = memory.clone()
    out = model(x, labels=x, memory=memory)
    with torch.no_grad():
        scored = model(x, labels=x, memory=frozen.clone())
        wm = model.abstractor(frozen.prev_hidden, frozen.prev_mask)
        extra = passage_reconstruction_loss(wm, frozen.prev_hidden, frozen.prev_mask, frozen.has_previous)
    assert extra > 0 and out.loss.item() == pytest.approx(scored.loss.item() + 2.0 * extra.item(), rel=1e-5)
    # the paper's model: no such term
    plain = make_model("memoria").train()
    assert plain.config.engram_loss == 0.0 and plain.config.memory_read == "cross_attention"


# ---------------------------------------------------------------------- engram_bias
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_engram_bias_computes_the_hand_written_forward(make_model, attn):
    model = _slot_model(make_model, engram_bias=-4.0, attn_implementation=attn)
    biases = [b.engram_bias.bias for b in model.memory_blocks]
    assert all(torch.equal(b.data, torch.full((model.config.n_head,), -4.0)) for b in biases)  # the stated start
    with torch.no_grad():  # distinct values per block and head, so a broadcast error shows
        for i, b in enumerate(biases):
            b.copy_(torch.arange(b.numel(), dtype=torch.float32) * 0.7 - 1.5 - i)
    x, read, got = _fourth_segment(model)
    with torch.no_grad():
        expected = _reference_logits(model, x, read.engrams, read.slot_mask, biases=[b.data for b in biases])
        unbiased = _reference_logits(model, x, read.engrams, read.slot_mask)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert not torch.allclose(got, unbiased, atol=1e-3)


def test_engram_bias_zero_is_no_bias_and_a_segment_without_memory_is_the_backbone(make_model, backbone_config):
    plain_slots = _slot_model(make_model)
    zero = _slot_model(make_model, engram_bias=0.0)
    zero.load_state_dict(plain_slots.state_dict(), strict=False)
    segs = segments(batch=2, length=10, count=3)
    with torch.no_grad():
        a, _ = run_stream(plain_slots, segs)
        b, _ = run_stream(zero, segs)
        for x, y in zip(a, b):
            assert torch.allclose(x.logits, y.logits, atol=1e-5)
        backbone = GPT2LMHeadModel(backbone_config).eval()
        backbone.load_state_dict({k: v for k, v in zero.state_dict().items() if k in backbone.state_dict()})
        assert torch.allclose(zero(segs[0]).logits, backbone(segs[0]).logits, atol=1e-6)


def test_engram_bias_learns_and_is_a_memory_weight(make_model, tmp_path):
    model = _slot_model(make_model, engram_bias=-2.0).train()
    slot_biases = [b.engram_bias for b in model.memory_blocks]
    assert all(m in model.memory_modules() for m in slot_biases)  # trainable under LoRA, in the memory's group
    memory = None
    for x in segments(batch=2, length=8, count=2):
        memory = model(x, memory=memory).memory
    x = segments(batch=2, length=8, count=1, seed=4)[0]
    model(x, labels=x, memory=memory).loss.backward()
    assert all(m.bias.grad is not None and m.bias.grad.abs().sum() > 0 for m in slot_biases)
    model.eval()
    with torch.no_grad():
        slot_biases[0].bias.add_(1.0)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path).eval()
    assert again.config.engram_bias == -2.0
    assert torch.equal(again.memory_blocks[0].engram_bias.bias, slot_biases[0].bias)


@pytest.mark.parametrize("settings,says", [
    ({"engram_bias": -4.0}, "`engram_bias` biases the engram slots of `memory_read='self_attention'`"),
    ({"memory_read": "self_attention", "engram_bias": float("inf")}, "`engram_bias` (inf) must be a finite number"),
    ({"memory_read": "both"}, "`memory_read` must be one of"),
    ({"memory_read": "self_attention", "memory_layers": [0]}, "leave `memory_layers` unset"),
    ({"engram_loss": -1.0}, "`engram_loss` (-1.0) must be a finite weight >= 0"),
    ({"engram_loss": float("nan")}, "must be a finite weight"),
])
def test_bad_option_values_are_refused(backbone_config, settings, says):
    with pytest.raises(Exception) as e:  # huggingface_hub's strict-dataclass error, carrying ours
        MemoriaGPT2Config.from_backbone(backbone_config, "memoria", **settings)
    assert says in str(e.value)
