"""`memorizing` (Memorizing Transformer): the kNN attention against a slow reference of the paper's
equations, the memory's FIFO and resets, its initialisation, and the model contract (the
contract tests of the other kinds, run on this one)."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import VOCAB, run_stream, segments
from test_causality import test_a_token_affects_only_what_comes_after_it as _causality
from test_checkpointing_and_attention import test_gradient_checkpointing_gives_the_same_loss_and_gradients as _ckpt
from test_checkpointing_and_attention import test_sdpa_and_eager_agree as _sdpa_eager
from test_generate import test_greedy_generate_matches_a_reference_decode as _generate
from test_memory_state import test_state_dict_round_trip_continues_identically as _round_trip
from test_memory_state import test_take_and_put_rows_keep_outputs as _rows

from memoria_ds.model import MemoriaGPT2Config, memory_from_state_dict
from memoria_ds.model.recurrent import MemorizingMemory
from memoria_ds.model.knn_attention import KNNSlots, initial_scale, knn_retrieve
from memoria_ds.setting_rules import SettingError


# ---------------------------------------------------------------------- the slow reference
def reference_stream(model, segs, resets=None, xl=False):
    """Logits of every segment, the paper's equations one query at a time over Python lists.

    With `xl` (the `memorizing` preset, as meliad runs it): every block's local attention also reads
    the previous segment's keys and values of that block (Transformer-XL's cache, detached), and the
    segments alternate between two banks of positions (0.., then n_positions // 2..); rows reset only
    at the first segment."""
    cfg, kind = model.config, model.memory_kind
    kind = kind.parts["memorizing"] if hasattr(kind, "parts") else kind
    if xl:
        assert resets is None or not any(any(r) for r in resets[1:])
    layer, size, topk = kind.layer, kind.settings.size, kind.settings.topk
    cache = [None] * cfg.n_layer  # per block: the previous segment's (k, v), (B, H, L, hd)
    H = cfg.n_head
    hd = cfg.n_embd // H
    knn = model.memory_net
    B = segs[0].shape[0]
    store = [[[] for _ in range(H)] for _ in range(B)]  # per row, per head: [(unit key, value)]
    out = []
    with torch.no_grad():
        for t, x in enumerate(segs):
            if resets is not None:
                for b in range(B):
                    if resets[t][b]:
                        store[b] = [[] for _ in range(H)]
            L = x.shape[1]
            start = (t % 2) * (cfg.n_positions // 2) if xl else 0
            h = model.transformer.wte(x) + model.transformer.wpe(start + torch.arange(L)[None])
            for i, block in enumerate(model.transformer.h):
                q, k, v = block.attn.c_attn(block.ln_1(h)).split(cfg.n_embd, dim=2)
                q, k, v = (z.view(B, L, H, hd).transpose(1, 2) for z in (q, k, v))  # (B, H, L, hd)
                past = cache[i] if xl and cache[i] is not None else (k[:, :, :0], v[:, :, :0])
                keys, vals = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)  # (B, H, P + L, hd)
                logits = q @ keys.transpose(-1, -2) / math.sqrt(hd)
                sees = torch.cat([torch.ones(L, keys.shape[2] - L, dtype=torch.bool),
                                  torch.ones(L, L, dtype=torch.bool).tril()], 1)  # every cached key, causal after
                logits = logits.masked_fill(~sees, -math.inf)
                heads = torch.softmax(logits, -1) @ vals  # V_c
                cache[i] = (k, v)
                if i == layer:
                    mixed = heads.clone()
                    for b in range(B):
                        for hh in range(H):
                            entries = store[b][hh]
                            if not entries:
                                continue  # an empty memory: the local attention alone
                            g = 1 / (1 + math.exp(-float(knn.gate_bias[hh])))
                            for pos in range(L):
                                qn = q[b, hh, pos] / q[b, hh, pos].norm()
                                sims = sorted(((float(qn @ key), val) for key, val in entries), key=lambda e: -e[0])
                                top = sims[:topk]
                                w = torch.softmax(torch.tensor([s for s, _ in top]) * abs(float(knn.scale[hh])), 0)
                                v_m = sum(wi * val for wi, (_, val) in zip(w, top))
                                mixed[b, hh, pos] = g * v_m + (1 - g) * heads[b, hh, pos]
                    heads = mixed
                    for b in range(B):
                        for hh in range(H):
                            store[b][hh] += [(k[b, hh, p] / k[b, hh, p].norm(), v[b, hh, p]) for p in range(L)]
                            store[b][hh] = store[b][hh][-size:]  # oldest out
                h = h + block.attn.c_proj(heads.transpose(1, 2).reshape(B, L, cfg.n_embd))
                h = h + block.mlp(block.ln_2(h))
            out.append(model.lm_head(model.transformer.ln_f(h)))
    return out


@pytest.mark.parametrize("settings", [dict(size=20, topk=4), dict(size=100, topk=32, layer=0)])
@pytest.mark.parametrize("segment_length", [None, 12], ids=["growing", "fixed"])
def test_model_matches_the_slow_reference(make_model, settings, segment_length):
    """From a memory that starts with no slots, or (a fixed `segment_length`) with `size` empty ones."""
    model = make_model("memorizing_no_cache", memory_init="random", memory_settings=settings, segment_length=segment_length)
    segs = segments(count=4)
    resets = [[True] * 3, [False] * 3, [False, True, False], [False] * 3]
    with torch.no_grad():
        memory, got = None, []
        for x, r in zip(segs, resets):
            o = model(x, memory=memory, reset=torch.tensor(r))
            memory = o.memory
            got.append(o.logits)
    want = reference_stream(model, segs, resets)
    for t, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"segment {t}")
    # eager on CPU a batch reset drops the slots no row holds, so both memories end as long as what they hold
    assert memory.length == min(settings["size"], 48)


@pytest.mark.parametrize("memory_init", ["noop", "random"])
def test_the_memorizing_preset_matches_the_slow_reference_with_an_xl_cache(make_model, memory_init):
    """The preset as meliad runs it: every block reads the previous segment through its cache, the kNN
    block its memory too, the gate starting at an even mix whatever `memory_init` says."""
    model = make_model("memorizing", memory_init=memory_init, segment_length=12,
                       memory_settings={"memorizing": {"size": 20, "topk": 4}})
    assert model.config.memory_type == "xl+memorizing" and model.config.xl_positions == "alternate"
    assert torch.equal(model.memory_net.gate_bias.data, torch.zeros(4))  # g = 0.5, meliad's zero init
    segs = segments(count=4)
    resets = [[True] * 3] + [[False] * 3] * 3
    with torch.no_grad():
        memory, got = None, []
        for x, r in zip(segs, resets):
            o = model(x, memory=memory, reset=torch.tensor(r))
            memory, _ = o.memory, got.append(o.logits)
    want = reference_stream(model, segs, resets, xl=True)
    for t, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"segment {t}")
    plain = reference_stream(model, segs, resets)  # without the cache: another model
    assert (got[1] - plain[1]).abs().max() > 1e-2


def test_the_gate_starts_where_the_setting_or_the_init_puts_it(make_model):
    gate = lambda m: m.memory_net.gate_bias.data.unique().tolist()  # noqa: E731
    assert gate(make_model("memorizing_no_cache")) == [-4.0]  # `noop`: close to the backbone
    assert gate(make_model("memorizing_no_cache", memory_init="random")) == [0.0]
    assert gate(make_model("memorizing_no_cache", memory_settings={"gate_bias": -1.5})) == [-1.5]
    # the preset's own settings merged with the user's, part by part: its gate stays
    model = make_model("memorizing", memory_settings={"memorizing": {"size": 64}})
    assert gate(model) == [0.0] and model.config.memory_settings["memorizing"]["size"] == 64
    assert gate(make_model("memorizing", memory_settings={"memorizing": {"gate_bias": 2.0}})) == [2.0]
    with pytest.raises(SettingError, match=r"memory_settings.memorizing.gate_bias"):
        make_model("memorizing", memory_settings={"memorizing": {"gate_bias": float("nan")}})
    with pytest.raises(SettingError, match=r"goes under its name: memory_settings.memorizing.size"):
        make_model("memorizing", memory_settings={"size": 64})


def test_a_negative_scale_is_a_temperature_as_meliad_takes_it():
    """meliad's `attention_scale_factor` is |scale|: a scale pushed below zero still ranks as cosine does."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g)
    slots = KNNSlots(torch.nn.functional.normalize(torch.randn(1, 2, 5, 4, generator=g), dim=-1),
                     torch.randn(1, 2, 5, 4, generator=g), torch.ones(1, 5, dtype=torch.bool))
    a, _ = knn_retrieve(q, slots, torch.tensor([3.0, -2.0]), 3)
    b, _ = knn_retrieve(q, slots, torch.tensor([3.0, 2.0]), 3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_retrieval_matches_a_loop_over_slots():
    g = torch.Generator().manual_seed(0)
    B, H, Q, M, hd, k = 2, 3, 5, 9, 4, 3
    q = torch.randn(B, H, Q, hd, generator=g)
    keys = torch.nn.functional.normalize(torch.randn(B, H, M, hd, generator=g), dim=-1)
    values = torch.randn(B, H, M, hd, generator=g)
    mask = torch.rand(B, M, generator=g) > 0.3
    mask[1] = False  # a row with nothing stored
    scale = torch.tensor([1.0, 3.0, 10.0])
    v_m, found = knn_retrieve(q, KNNSlots(keys, values, mask), scale, k)
    assert found.tolist() == [True, False] and torch.equal(v_m[1], torch.zeros_like(v_m[1]))
    for h in range(H):
        for i in range(Q):
            qn = q[0, h, i] / q[0, h, i].norm()
            sims = sorted([(float(qn @ keys[0, h, m]), m) for m in range(M) if mask[0, m]], reverse=True)[:k]
            w = torch.softmax(torch.tensor([s for s, _ in sims]) * scale[h], 0)
            want = sum(wi * values[0, h, m] for wi, (_, m) in zip(w, sims))
            torch.testing.assert_close(v_m[0, h, i], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- the memory
def test_memory_keeps_the_newest_normalised_pairs(make_model):
    model = make_model("memorizing_no_cache", memory_init="random", memory_settings={"size": 30})
    segs = segments(count=4)  # 48 tokens: the first 18 fall out
    layer = model.memory_kind.layer
    keys, values = [], []
    with torch.no_grad():
        memory = None
        for x in segs:
            out = model(x, memory=memory)
            memory = out.memory
    captured = {}

    def hook(_m, _i, output):
        captured.setdefault("kv", []).append(output)

    # the layer's keys/values, from its own c_attn over the same stream
    handle = model.transformer.h[layer].attn.c_attn.register_forward_hook(hook)
    with torch.no_grad():
        run_stream(model, segs)
    handle.remove()
    H, hd = model.config.n_head, model.config.n_embd // model.config.n_head
    for qkv in captured["kv"]:
        _, k, v = qkv.split(model.config.n_embd, dim=2)
        keys.append(k.view(3, 12, H, hd).transpose(1, 2))
        values.append(v.view(3, 12, H, hd).transpose(1, 2))
    k_all = torch.nn.functional.normalize(torch.cat(keys, 2), dim=-1)[:, :, -30:]
    v_all = torch.cat(values, 2)[:, :, -30:]
    assert memory.length == 30 and bool(memory.mask.all())
    torch.testing.assert_close(memory.keys, k_all, rtol=0, atol=1e-6)
    torch.testing.assert_close(memory.values, v_all, rtol=0, atol=1e-6)
    assert memory.keys.dtype == torch.float32 and not memory.keys.requires_grad


def test_a_reset_row_is_a_fresh_stream(make_model):
    model = make_model("memorizing_no_cache", memory_init="random")
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        keep = [o.logits for o in run_stream(model, segs[3:], memory=memory.clone())[0]]
        first = model(segs[3], memory=memory, reset=torch.tensor([False, True, False]))
        rest, _ = run_stream(model, segs[4:], memory=first.memory)
        fresh = [o.logits for o in run_stream(model, [s[1:2] for s in segs[3:]])[0]]
    for got, k, f in zip([first.logits] + [o.logits for o in rest], keep, fresh):
        torch.testing.assert_close(got[[0, 2]], k[[0, 2]], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1:2], f, rtol=0, atol=1e-5)


def test_a_reset_drops_the_slots_no_row_holds_and_reads_the_same(make_model):
    """On CPU a reset drops the oldest slots no row holds (a batch reset at its documents' start
    searches nothing it does not hold); the outputs equal those of the memory that keeps them."""
    model = make_model("memorizing_no_cache", memory_init="random")
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:2])
        old = memory.length
        memory.reset(torch.tensor([True, False, False]))  # rows 1 and 2 still hold every slot
        assert memory.length == old
        _, memory = run_stream(model, segs[2:3], memory=memory)  # row 0 holds only the newest segment
        memory.reset(torch.tensor([False, True, True]))
        assert memory.length == segs[2].shape[1] and bool(memory.mask[0].all()) and not memory.mask[1:].any()
        pad = old  # the same memory with `pad` masked slots at its old end, as it was kept before
        kept = MemorizingMemory(torch.cat([torch.zeros_like(memory.keys[:, :, :pad]), memory.keys], 2),
                                torch.cat([torch.zeros_like(memory.values[:, :, :pad]), memory.values], 2),
                                torch.cat([torch.zeros_like(memory.mask[:, :pad]), memory.mask], 1))
        got = [o.logits for o in run_stream(model, segs[3:], memory=memory)[0]]
        want = [o.logits for o in run_stream(model, segs[3:], memory=kept)[0]]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
        memory.reset()
        assert memory.length == 0 and memory.keys.shape[:2] == kept.keys.shape[:2]


def test_with_fixed_shapes_a_reset_keeps_the_length_and_reads_the_same(make_model, monkeypatch):
    """Where shapes must stay fixed (a compiled step, an accelerator: `static_shapes`), a reset masks and
    zeroes the reset rows' slots but never shortens the memory, even where no row holds its oldest slots
    any more (finding them is a host sync, and a shape from data recompiles a compiled step); the
    outputs equal those of the memory with those slots dropped."""
    from memoria_ds.model.recurrent import memorizing

    monkeypatch.setattr(memorizing, "static_shapes", lambda device: True)
    model = make_model("memorizing_no_cache", memory_init="random")
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:2])
        old = memory.length
        memory.reset(torch.tensor([True, False, False]))
        assert memory.length == old and not memory.mask[0].any() and not memory.keys[0].any()
        _, memory = run_stream(model, segs[2:3], memory=memory)  # row 0 holds only the newest segment
        memory.reset(torch.tensor([False, True, True]))
        newest = segs[2].shape[1]
        assert memory.length == old + newest and not memory.mask[:, :old].any()  # no row holds the old slots
        assert bool(memory.mask[0, old:].all()) and not memory.mask[1:].any()
        dropped = MemorizingMemory(memory.keys[:, :, old:].clone(), memory.values[:, :, old:].clone(),
                                   memory.mask[:, old:].clone())
        got = [o.logits for o in run_stream(model, segs[3:], memory=memory)[0]]
        want = [o.logits for o in run_stream(model, segs[3:], memory=dropped)[0]]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
        memory.reset()
        assert memory.length == 0 and memory.keys.shape[:2] == dropped.keys.shape[:2]


def test_no_gradient_flows_into_the_memory_but_into_the_gate_and_queries(make_model):
    model = make_model("memorizing_no_cache", memory_init="random").train()
    memory = None
    for x in segments(count=3):
        out = model(x, labels=x, memory=memory)
        memory = out.memory
        assert not memory.keys.requires_grad and not memory.values.requires_grad
    model.zero_grad()
    model(segments(count=1, seed=5)[0], labels=segments(count=1, seed=5)[0], memory=memory).loss.backward()
    knn = model.memory_net
    assert knn.gate_bias.grad.abs().min() > 0 and knn.scale.grad.abs().min() > 0


# ---------------------------------------------------------------------- initialisation and config
@pytest.mark.parametrize("init,bias", [("noop", -4.0), ("random", 0.0)])
def test_stated_initialisation_and_a_first_segment_that_is_the_backbone(make_model, init, bias):
    model = make_model("memorizing_no_cache", memory_init=init, memory_settings={"topk": 32})
    backbone = make_model("transformer")
    backbone.load_state_dict(model.state_dict(), strict=False)
    assert model.memory_kind.layer == 1  # round(0.75 * 2) - 1: the top block of 2
    knn = model.memory_net
    assert [n for n, _ in model.named_parameters() if n.startswith("memory")] == [
        "memory_net.gate_bias", "memory_net.scale"]  # the kind's only weights
    assert torch.equal(knn.gate_bias.data, torch.full((4,), bias))
    assert torch.equal(knn.scale.data, torch.full((4,), math.log2(32 * 31)))
    assert initial_scale(1) == 1.0
    x = segments(count=2)
    with torch.no_grad():
        first = model(x[0])
        torch.testing.assert_close(first.logits, backbone(x[0]).logits, rtol=0, atol=0)  # empty memory
        assert (model(x[1], memory=first.memory).logits - backbone(x[1]).logits).abs().max() > 0


def test_layer_defaults_and_validation(backbone_config):
    from transformers import GPT2Config

    from memoria_ds.model.recurrent import memory_kind

    assert memory_kind(MemoriaGPT2Config.from_backbone(backbone_config, "memorizing_no_cache")).layer == 1
    twelve = backbone_config.to_dict() | {"n_layer": 12}
    cfg = MemoriaGPT2Config.from_backbone(GPT2Config(**twelve), "memorizing_no_cache")
    assert memory_kind(cfg).layer == 8  # the paper's 9th of 12
    assert cfg.memory_settings == {"layer": None, "size": 8192, "topk": 32, "gate_bias": None}  # resolved, so config.json is explicit
    for bad, match in (({"layer": 2}, r"`memory_settings.layer` \(2\) must be a block index in \[0, 2\)"),
                       ({"layer": -1}, "`memory_settings.layer`"), ({"size": 0}, "`memory_settings.size`"),
                       ({"topk": 0}, "`memory_settings.topk`"), ({"layer": True}, "`memory_settings.layer` \(True\)"),
                       ({"k": 3}, r"`memory_settings.k` is an unknown memorizing setting")):
        with pytest.raises(Exception, match=match):  # HF's strict-dataclass error, caused by a ValueError
            MemoriaGPT2Config.from_backbone(backbone_config, "memorizing_no_cache", memory_settings=bad)


def test_state_dict_refuses_another_kind_or_shape(make_model):
    model = make_model("memorizing_no_cache")
    with torch.no_grad():
        _, memory = run_stream(model, segments(count=2))
    sd = memory.state_dict()
    assert type(memory_from_state_dict(sd)) is MemorizingMemory
    with pytest.raises(ValueError, match="inconsistent"):
        MemorizingMemory.from_state_dict(sd | {"mask": sd["mask"][:, :3]})
    with pytest.raises(ValueError, match="kind"):
        MemorizingMemory.from_state_dict(sd | {"kind": "xl"})
    with pytest.raises(TypeError, match="XLMemory"):
        model(segments(count=1)[0], memory=make_model("xl").empty_memory(3))
    other = make_model("memorizing_no_cache", n_head=2)
    with pytest.raises(ValueError, match="heads"):
        other(segments(count=1)[0], memory=memory)


def test_save_and_load_keep_the_knn_parameters(make_model, tmp_path):
    model = make_model("memorizing_no_cache", memory_init="random")
    with torch.no_grad():
        model.memory_net.gate_bias.add_(torch.arange(4.0))
    model.save_pretrained(tmp_path)
    from memoria_ds.model import MemoriaGPT2LMHeadModel

    again = MemoriaGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    segs = segments(count=3)
    with torch.no_grad():
        a, _ = run_stream(model, segs)
        b, _ = run_stream(again, segs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=0)


# ---------------------------------------------------------------------- the contract tests of every kind
@pytest.mark.parametrize("t,pos", [(2, 0), (2, 7), (1, 11)])
def test_causality(make_model, t, pos):
    _causality(make_model, "memorizing_no_cache", t, pos)


def test_gradient_checkpointing(make_model):
    _ckpt(make_model, "memorizing_no_cache")


def test_sdpa_and_eager(make_model):
    _sdpa_eager(make_model, "memorizing_no_cache")


def test_state_dict_round_trip(make_model):
    _round_trip(make_model, "memorizing_no_cache")


def test_take_and_put_rows(make_model):
    _rows(make_model, "memorizing_no_cache")


def test_generate(make_model):
    _generate(make_model, "memorizing_no_cache")


def test_bf16(make_model):
    model = make_model("memorizing_no_cache", memory_init="random").to(torch.bfloat16)
    with torch.no_grad():
        outs, memory = run_stream(model, segments(count=3))
    assert memory.keys.dtype == torch.float32 and all(torch.isfinite(o.logits).all() for o in outs)
    assert outs[-1].logits.dtype == torch.bfloat16


def test_tokens_change_only_later_segments_through_the_memory(make_model):
    model = make_model("memorizing_no_cache", memory_init="random")
    segs = segments(count=3)
    changed = [s.clone() for s in segs]
    changed[0][:, 5] = (changed[0][:, 5] + 1) % VOCAB
    with torch.no_grad():
        a, _ = run_stream(model, segs)
        b, _ = run_stream(model, changed)
    assert (a[2].logits - b[2].logits).abs().max() > 1e-5  # segment 2 reads segment 0 only through the memory
