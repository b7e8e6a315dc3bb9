"""The Compressive Transformer kind: its compression against hand values and torch's conv1d, the
whole model against a slow reference of the paper's Algorithm 1, its losses' gradients, and
the model contract (first segment = backbone, causality, save/load, resets, row operations)."""

import io

import pytest
import torch
import torch.nn.functional as F
from compressive_reference import ReferenceCompressive
from model_helpers import (
    VOCAB, assert_a_reset_row_starts_a_fresh_stream, assert_only_later_tokens_change,
    assert_row_operations_keep_outputs, changed_token, run_stream, segments,
)

from memoria_ds.model import MemoriaGPT2Config, MemoriaGPT2LMHeadModel, build_model, memory_from_state_dict
from memoria_ds.model.recurrent import CompressiveMemory, CompressiveSettings
from memoria_ds.model.recurrent.compression import GroupLinear, pad_to_rate, pool, reconstruction_error


def _model(make_model, **settings):
    defaults = dict(memory_length=6, compressed_length=4)
    defaults.update(settings)
    return make_model("compressive", memory_settings=defaults)


def _logits(model, segs, memory=None):
    with torch.no_grad():
        outs, _ = run_stream(model, segs, memory=memory)
    return [o.logits for o in outs]


# ------------------------------------------------------------------ the compression, by hand


def test_group_linear_is_a_strided_conv1d():
    torch.manual_seed(0)
    net = GroupLinear(dim=6, rate=3)
    slots = torch.randn(2, 2, 9, 3)  # (B, H, E, hd): D = 6 channels over 9 slots
    got = net(slots)  # (B, H, 3, hd)
    conv_weight = net.linear.weight.view(6, 3, 6).transpose(1, 2)
    signal = slots.transpose(1, 2).reshape(2, 9, 6).transpose(1, 2)  # (B, D, E)
    want = F.conv1d(signal, conv_weight, net.linear.bias, stride=3)  # (B, D, 3)
    torch.testing.assert_close(got.transpose(1, 2).reshape(2, 3, 6), want.transpose(1, 2))


def test_pooling_by_hand():
    slots = torch.tensor([1.0, 5.0, -2.0, 7.0, 3.0, 4.0]).view(1, 1, 6, 1)
    mask = torch.tensor([[False, True, True, True, False, False]])
    assert pool(slots, mask, 2, "mean").flatten().tolist() == [5.0, 2.5, 0.0]  # empty slots left out; none: 0
    assert pool(slots, mask, 2, "max").flatten().tolist() == [5.0, 7.0, 0.0]
    assert pool(slots, torch.ones(1, 6, dtype=torch.bool), 3, "mean").flatten().tolist() == pytest.approx([4 / 3, 14 / 3])


def test_evicted_slots_are_padded_at_the_old_end():
    slots, mask = pad_to_rate(torch.ones(1, 1, 5, 2), torch.ones(1, 5, dtype=torch.bool), 4)
    assert slots.shape == (1, 1, 8, 2) and mask.tolist() == [[False] * 3 + [True] * 5]
    assert slots[0, 0, :3].abs().sum() == 0


def test_reconstruction_error_by_hand():
    # one query, one head of width 1: attention over two old slots vs one compressed slot
    q = torch.tensor([[[[0.0]]]])  # a zero query attends uniformly
    old = (torch.tensor([[[[1.0], [3.0]]]]), torch.tensor([[[[2.0], [6.0]]]]), torch.tensor([[True, True]]))
    new = (torch.tensor([[[[0.5]]]]), torch.tensor([[[[1.0]]]]), torch.tensor([[True]]))
    err = reconstruction_error(q, torch.tensor([[True]]), old, new)
    assert err.item() == pytest.approx((4.0 - 1.0) ** 2)  # mean(2, 6) = 4 against 1
    # a row without any evicted token is left out; so is a padded query
    none = (old[0], old[1], torch.tensor([[False, False]]))
    assert reconstruction_error(q, torch.tensor([[True]]), none, new).item() == 0.0
    assert reconstruction_error(q, torch.tensor([[False]]), old, new).item() == 0.0


# ------------------------------------------------------------------ against the slow reference


@pytest.mark.parametrize("settings", [
    dict(memory_length=6, compressed_length=4, compression_rate=4, compression="conv"),
    dict(memory_length=5, compressed_length=3, compression_rate=3, compression="conv"),
    dict(memory_length=4, compressed_length=5, compression_rate=2, compression="mean"),
    dict(memory_length=7, compressed_length=2, compression_rate=3, compression="max"),
], ids=["conv4", "conv3-uneven", "mean2", "max3"])
@pytest.mark.parametrize("segment_length", [None, 12], ids=["growing", "fixed"])
def test_matches_the_reference_over_segments(make_model, settings, segment_length):
    """Logits of every segment and the reconstruction loss equal the slow reference's, from a memory
    that starts with no slots or (a fixed `segment_length`) with every slot empty."""
    model = make_model("compressive", memory_settings=settings, segment_length=segment_length)
    model.train()  # train mode: the loss is computed (dropout is 0)
    segs = segments(batch=2, length=12, count=4, seed=1)
    ref = ReferenceCompressive(model, rows=2)
    memory = None
    for t, x in enumerate(segs):
        out = model(x, labels=x, memory=memory)
        memory = out.memory
        errors = [None] * model.config.n_layer
        for row in range(2):
            logits, layer_errors = ref.step(row, x[row])
            torch.testing.assert_close(out.logits[row], logits, rtol=1e-4, atol=1e-4, msg=f"segment {t} row {row}")
            for i, e in enumerate(layer_errors):
                if e is not None:
                    errors[i] = (e[0] + (errors[i][0] if errors[i] else 0), e[1] + (errors[i][1] if errors[i] else 0))
        per_layer = [e[0] / e[1] if e else torch.tensor(0.0) for e in errors]
        want = settings.get("reconstruction_weight", 1.0) * torch.stack([torch.as_tensor(p) for p in per_layer]).mean()
        pending_loss = out.loss - F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if settings["compression"] == "conv":
            torch.testing.assert_close(pending_loss, want.to(pending_loss.dtype), rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(pending_loss, torch.tensor(0.0), rtol=0, atol=1e-6)  # nothing to train


def test_first_segment_is_the_backbone(make_model):
    model = _model(make_model)
    plain = MemoriaGPT2LMHeadModel(MemoriaGPT2Config.from_backbone(model.config, "transformer")).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    x = segments(count=1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=0)


# ------------------------------------------------------------------ the losses' gradients


def test_reconstruction_loss_trains_only_the_compression_and_lm_loss_never_reaches_it(make_model):
    model = _model(make_model).train()
    segs = segments(count=3)
    memory = None
    for x in segs[:2]:
        memory = model(x, labels=x, memory=memory).memory
    out = model(segs[2], labels=segs[2], memory=memory)
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), segs[2][:, 1:].reshape(-1))
    aux = out.loss - lm
    assert aux.item() > 0
    net = list(model.memory_net.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("memory_net.")]
    aux_grads = torch.autograd.grad(aux, net + rest, allow_unused=True, retain_graph=True)
    assert all(g is not None and g.abs().sum() > 0 for g in aux_grads[:len(net)])
    assert all(g is None or g.abs().sum() == 0 for g in aux_grads[len(net):])
    lm_grads = torch.autograd.grad(lm, net, allow_unused=True)
    assert all(g is None or g.abs().sum() == 0 for g in lm_grads)


def test_evaluation_adds_no_loss(make_model):
    model = _model(make_model)  # eval mode
    segs = segments(count=3)
    memory = None
    for x in segs:
        out = model(x, labels=x, memory=memory)
        memory = out.memory
        lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, lm, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the contract


@pytest.mark.parametrize("t,pos", [(2, 0), (2, 7), (1, 11)])
def test_a_token_affects_only_what_comes_after_it(make_model, t, pos):
    model = _model(make_model, memory_length=3, compressed_length=6, compression_rate=2)
    segs = segments(count=5)
    a, b = _logits(model, segs), _logits(model, changed_token(segs, t, pos))
    assert_only_later_tokens_change(a, b, t, pos)


def test_the_compressed_memory_reaches_beyond_the_memory(make_model):
    """With a one-layer memory of 3 slots, a token 2 segments back reaches only through the compressed memory."""
    model = _model(make_model, memory_length=3, compressed_length=6, compression_rate=2)
    segs = segments(count=4)
    changed = [s.clone() for s in segs]
    changed[0][:, 2] = (changed[0][:, 2] + 1) % VOCAB
    a, b = _logits(model, segs), _logits(model, changed)
    assert (a[2] - b[2]).abs().max() > 1e-6
    xl = make_model("xl", xl_memory_length=3)
    xl.load_state_dict(model.state_dict(), strict=False)
    a, b = _logits(xl, segs), _logits(xl, changed)
    assert (a[1] - b[1]).abs().max() > 0  # the receptive field of 2 layers
    torch.testing.assert_close(a[3], b[3], rtol=0, atol=0)  # xl with 3 slots has forgotten it by segment 3


def test_save_and_load_keep_the_model(make_model, tmp_path):
    model = _model(make_model, compression_rate=3)
    model.save_pretrained(tmp_path)
    loaded = build_model(tmp_path).eval()
    assert loaded.config.memory_settings == model.config.memory_settings
    segs = segments(count=4)
    for a, b in zip(_logits(model, segs), _logits(loaded, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_round_trip_continues_identically(make_model):
    model = _model(make_model)
    segs = segments(count=6)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    restored = memory_from_state_dict(torch.load(buffer))
    assert isinstance(restored, CompressiveMemory)
    for a, b in zip(_logits(model, segs[3:], memory.clone()), _logits(model, segs[3:], restored)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    broken = memory.state_dict() | {"compressed_mask": memory.compressed_mask[:, :1]}
    with pytest.raises(ValueError, match=r"`compressed_mask` has shape \(\d+, 1\), expected \(B=\d+, C=\d+\)"):
        memory_from_state_dict(broken)


def test_take_and_put_rows_keep_outputs(make_model):
    model = _model(make_model)
    segs = segments(batch=4, count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    assert_row_operations_keep_outputs(model, segs[3:], memory, _logits, atol=1e-6)


# a diverged step's row: its NaN must never reach a later segment
@pytest.mark.parametrize("poison", [(), ("keys", "compressed_values")])
def test_a_reset_row_starts_a_fresh_stream(make_model, poison):
    model = _model(make_model)
    segs = segments(count=6)
    assert_a_reset_row_starts_a_fresh_stream(model, segs, _logits, poison)


def test_reset_all_rows_is_a_fresh_memory(make_model):
    model = _model(make_model)
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    memory.reset()
    for a, b in zip(_logits(model, segs[3:], memory), _logits(model, segs[3:])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_generate_reads_the_memory(make_model):
    model = _model(make_model)
    segs = segments(batch=1, count=3)
    with torch.no_grad():
        _, memory = run_stream(model, segs)
    before = memory.clone()
    prompt = segments(batch=1, length=4, count=1, seed=5)[0]
    out = model.generate(prompt, memory=memory, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
    torch.testing.assert_close(memory.keys, before.keys, rtol=0, atol=0)  # decoding leaves the memory alone


# ------------------------------------------------------------------ settings


def test_settings_resolve_and_reject_bad_values(backbone_config):
    config = MemoriaGPT2Config.from_backbone(backbone_config, "compressive")
    assert config.memory_settings == CompressiveSettings().to_dict()
    assert CompressiveSettings().lengths(150) == (75, 75)  # the paper's WikiText-103 baseline: 75 + 75
    assert CompressiveSettings().lengths(50) == (25, 25)
    with pytest.raises(ValueError, match="compression_rate"):
        MemoriaGPT2Config.from_backbone(backbone_config, "compressive", memory_settings={"compression_rate": 0})
    with pytest.raises(ValueError, match="unknown compressive setting"):
        MemoriaGPT2Config.from_backbone(backbone_config, "compressive", memory_settings={"rate": 4})
    with pytest.raises(ValueError, match="compression"):
        MemoriaGPT2Config.from_backbone(backbone_config, "compressive", memory_settings={"compression": "gzip"})
    with pytest.raises(ValueError, match="takes no `memory_settings`"):
        MemoriaGPT2Config.from_backbone(backbone_config, "xl", memory_settings={"compression_rate": 4})
