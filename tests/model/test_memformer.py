"""The Memformer kind: the whole model against a slow reference of the paper's equations, the
forgetting by hand, the gradient through segments (and none once detached), and the model
contract (stated init, causality, save/load, resets, row operations, generate)."""

import io
import math

import pytest
import torch
import torch.nn.functional as F
from memformer_reference import ReferenceMemformer
from model_helpers import (
    assert_a_reset_row_starts_a_fresh_stream, assert_only_later_tokens_change, assert_row_operations_keep_outputs,
    changed_token, run_stream, segments,
)

from memoria_ds.model import MemoriaGPT2Config, MemoriaGPT2LMHeadModel, build_model, memory_from_state_dict
from memoria_ds.model.recurrent import MemformerMemory, MemformerSettings


def _model(make_model, init="random", **settings):
    defaults = dict(num_slots=5)
    defaults.update(settings)
    model = make_model("memformer", memory_settings=defaults, memory_init=init)
    if init == "random":  # slot biases of unequal sizes: some slots forget faster than others
        with torch.no_grad():
            model.memory_net.slot_bias.weight.mul_(torch.linspace(5, 50, defaults["num_slots"])[:, None])
    return model


def _logits(model, segs, memory=None):
    with torch.no_grad():
        outs, _ = run_stream(model, segs, memory=memory)
    return [o.logits for o in outs]


# ------------------------------------------------------------------ against the slow reference


@pytest.mark.parametrize("settings", [dict(num_slots=5, temperature=0.5), dict(num_slots=3, temperature=1.0)],
                         ids=["k5-tau0.5", "k3-tau1"])
def test_matches_the_reference_over_segments(make_model, settings):
    """Logits of every segment and the slots equal the reference's, with a row reset on the way."""
    model = _model(make_model, **settings)
    segs = segments(batch=2, length=10, count=4, seed=1)
    ref = ReferenceMemformer(model, rows=2)
    memory = None
    for t, x in enumerate(segs):
        reset = torch.tensor([False, t == 2])
        if t == 2:
            ref.reset(1)
        with torch.no_grad():
            out = model(x, memory=memory, reset=reset if memory is not None else None)
        memory = out.memory
        for row in range(2):
            torch.testing.assert_close(out.logits[row], ref.step(row, x[row]), rtol=1e-4, atol=1e-4,
                                       msg=f"segment {t} row {row}")
            torch.testing.assert_close(memory.slots[row], torch.stack(ref.slots[row]), rtol=1e-4, atol=1e-5)


def test_padding_is_not_written(make_model):
    """A padded position is left out of the write: the slots equal those of the segment without it."""
    model = _model(make_model)
    x = segments(batch=1, length=10, count=1)[0]
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 7:] = 0
    with torch.no_grad():
        padded = model(x, attention_mask=mask).memory
        short = model(x[:, :7]).memory
    torch.testing.assert_close(padded.slots, short.slots, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the stated initialisation, the forgetting


def test_initial_slots_are_the_normalised_biases_and_noop_starts_at_the_backbone(make_model):
    model = _model(make_model, init="noop")
    v = model.memory_net.slot_bias.weight
    torch.testing.assert_close(model.memory_net.initial_slots(), v / v.norm(dim=-1, keepdim=True))
    assert all(float(o.weight.detach().abs().max()) == 0 for o in model.memory_net.read_out)
    plain = MemoriaGPT2LMHeadModel(MemoriaGPT2Config.from_backbone(model.config, "transformer")).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    segs = segments(count=3)
    for a, b in zip(_logits(model, segs), _logits(plain, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the reader adds exactly 0 while W_O is 0


def test_an_unattended_slot_forgets_towards_its_initial_value(make_model):
    """With no token to attend to, a slot attends to itself: m <- (m + v) / ||m + v|| by hand, and
    it moves along the sphere to v / ||v|| (the paper's terminal state = initial state)."""
    net = _model(make_model, num_slots=2).memory_net
    v = net.slot_bias.weight.detach()
    m = F.normalize(torch.randn(1, 2, v.shape[1]), dim=-1)
    hidden = torch.randn(1, 4, v.shape[1])
    none = torch.zeros(1, 4, dtype=torch.bool)
    with torch.no_grad():
        got = net.write(m, hidden, none)
    want = torch.stack([(m[0, i] + v[i]) / math.sqrt(float(((m[0, i] + v[i]) ** 2).sum())) for i in range(2)])
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    target = F.normalize(v, dim=-1)
    cos = []
    with torch.no_grad():
        for _ in range(200):
            m = net.write(m, hidden, none)
            cos.append(F.cosine_similarity(m[0], target, dim=-1))
    cos = torch.stack(cos)  # (steps, slots)
    assert bool((cos[1:] >= cos[:-1] - 1e-6).all()), "the distance to the initial slot only shrinks"
    assert float(cos[-1].min()) > 0.999


# ------------------------------------------------------------------ gradients through segments


def test_the_next_segments_loss_reaches_the_write_through_the_carried_slots(make_model):
    """K = 2: the loss of segment 2 has a gradient on the writer's weights (only through segment 1's
    write); once the slots are detached between the segments (K = 1), it has none."""
    model = _model(make_model).train()
    x1, x2 = segments(count=2)
    writer = [model.memory_net.write_query.weight, model.memory_net.write_key.weight,
              model.memory_net.write_value.weight]
    for detach, nonzero in ((False, True), (True, False)):
        memory = model(x1, labels=x1).memory
        if detach:
            memory.detach_()
        loss2 = model(x2, labels=x2, memory=memory).loss
        grads = torch.autograd.grad(loss2, writer, allow_unused=True)
        sizes = [0.0 if g is None else float(g.abs().sum()) for g in grads]
        assert all(s > 0 for s in sizes) if nonzero else all(s == 0 for s in sizes), (detach, sizes)
    loss1 = model(x1, labels=x1).loss  # a segment's own loss never reaches its own write
    grads = torch.autograd.grad(loss1, writer, allow_unused=True)
    assert all(g is None or float(g.abs().sum()) == 0 for g in grads)


def test_a_reset_inside_a_span_keeps_the_graph_usable(make_model):
    """A reset changes the slots out of place: backward through a span with a reset row works, and
    the reset row's segment-2 loss has no gradient on the writer through segment 1."""
    model = _model(make_model).train()
    x1, x2 = segments(batch=2, count=2)
    memory = model(x1, labels=x1).memory
    out = model(x2, memory=memory, reset=torch.tensor([False, True]))
    row_loss = F.cross_entropy(out.logits[1, :-1], x2[1, 1:])
    g = torch.autograd.grad(row_loss, model.memory_net.write_query.weight, allow_unused=True, retain_graph=True)[0]
    assert g is None or float(g.abs().sum()) == 0
    F.cross_entropy(out.logits[0, :-1], x2[0, 1:]).backward()
    assert float(model.memory_net.write_query.weight.grad.abs().sum()) > 0


# ------------------------------------------------------------------ the contract


@pytest.mark.parametrize("t,pos", [(2, 0), (2, 7), (1, 11)])
def test_a_token_affects_only_what_comes_after_it(make_model, t, pos):
    model = _model(make_model)
    segs = segments(count=5)
    a, b = _logits(model, segs), _logits(model, changed_token(segs, t, pos))
    assert_only_later_tokens_change(a, b, t, pos)


def test_save_and_load_keep_the_model(make_model, tmp_path):
    model = _model(make_model, temperature=0.7)
    model.save_pretrained(tmp_path)
    loaded = build_model(tmp_path).eval()
    assert loaded.config.memory_settings == model.config.memory_settings
    segs = segments(count=3)
    for a, b in zip(_logits(model, segs), _logits(loaded, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_round_trip_continues_identically(make_model):
    model = _model(make_model)
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    restored = memory_from_state_dict(torch.load(buffer))
    assert isinstance(restored, MemformerMemory)
    for a, b in zip(_logits(model, segs[3:], memory.clone()), _logits(model, segs[3:], restored)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="`fresh` has shape"):
        memory_from_state_dict(memory.state_dict() | {"fresh": memory.fresh[:1]})
    with pytest.raises(ValueError, match="`fresh` is missing"):
        memory_from_state_dict({"kind": "memformer", "format": 1, "slots": memory.slots})
    with pytest.raises(ValueError, match="non-finite"):
        memory_from_state_dict(memory.state_dict() | {"slots": memory.slots * float("nan")})
    other = _model(make_model, num_slots=4)
    with pytest.raises(ValueError, match="slots"):
        other(segs[0], memory=restored)


def test_take_and_put_rows_keep_outputs(make_model):
    model = _model(make_model)
    segs = segments(batch=4, count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    assert_row_operations_keep_outputs(model, segs[3:], memory, _logits, atol=1e-6)


# a diverged step's row: its NaN must never reach a later segment
@pytest.mark.parametrize("poison", [(), ("slots",)])
def test_a_reset_row_starts_a_fresh_stream(make_model, poison):
    model = _model(make_model)
    segs = segments(count=6)
    assert_a_reset_row_starts_a_fresh_stream(model, segs, _logits, poison)


def test_generate_reads_the_memory(make_model):
    model = _model(make_model)
    segs = segments(batch=1, count=3)
    with torch.no_grad():
        _, memory = run_stream(model, segs)
    before = memory.clone()
    prompt = segments(batch=1, length=4, count=1, seed=5)[0]
    out = model.generate(prompt, memory=memory, max_new_tokens=3, do_sample=False, pad_token_id=0)
    fresh = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
    torch.testing.assert_close(memory.slots, before.slots, rtol=0, atol=0)  # decoding leaves the memory alone
    with torch.no_grad():  # the first generated token's logits come from the memory read
        assert not torch.equal(model(prompt, memory=memory.clone()).logits, model(prompt).logits)
    del fresh


# ------------------------------------------------------------------ settings


def test_settings_resolve_and_reject_bad_values(backbone_config):
    config = MemoriaGPT2Config.from_backbone(backbone_config, "memformer")
    assert config.memory_settings == MemformerSettings().to_dict() == {"num_slots": 1024, "temperature": 0.5}
    with pytest.raises(ValueError, match="num_slots"):
        MemoriaGPT2Config.from_backbone(backbone_config, "memformer", memory_settings={"num_slots": 0})
    with pytest.raises(ValueError, match="temperature"):
        MemoriaGPT2Config.from_backbone(backbone_config, "memformer", memory_settings={"temperature": 0})
    with pytest.raises(ValueError, match="unknown memformer setting"):
        MemoriaGPT2Config.from_backbone(backbone_config, "memformer", memory_settings={"slots": 4})


def test_activation_checkpointing_keeps_the_gradients_through_segments(make_model):
    """Training's non-reentrant block checkpointing: the same gradients over a span of 2 segments."""
    model = _model(make_model).train()
    x1, x2 = segments(count=2)

    def grads():
        model.zero_grad()
        memory = model(x1, labels=x1).memory
        (model(x1, labels=x1).loss + model(x2, labels=x2, memory=memory).loss).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and "memory_net.write_query.weight" in plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
