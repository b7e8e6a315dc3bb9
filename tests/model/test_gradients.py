"""Gradients reach the abstractor and the memory attention; nothing flows into stored memory."""

import torch
from model_helpers import run_stream, segments


def _memory_params(model):
    return {n: p for n, p in model.named_parameters() if n.startswith(("abstractor.", "memory_blocks."))}


def test_every_memory_parameter_gets_a_gradient(make_model):
    model = make_model("memoria", memory_init="random").train()
    segs = segments(count=4)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])  # STM is populated: M_rem is used
    out = model(segs[3], labels=segs[3], memory=memory)
    assert int(out.memory_stats.reminded_stm.min()) > 0
    out.loss.backward()
    params = _memory_params(model)
    assert params and all(p.grad is not None for p in params.values())
    zero = [n for n, p in params.items() if p.grad.abs().max() == 0]
    assert not zero, f"no gradient reached {zero}"


def test_noop_init_trains_from_the_output_projection(make_model):
    model = make_model("memoria").train()
    segs = segments(count=3)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:2])
    model(segs[2], labels=segs[2], memory=memory.clone()).loss.backward()
    grads = {n: p.grad for n, p in _memory_params(model).items()}
    assert all(grads[n].abs().max() > 0 for n in grads if ".out_proj." in n)
    assert all(grads[n].abs().max() == 0 for n in grads if "q_proj" in n or n.startswith("abstractor."))
    # one step on the output projections opens the path to everything else
    with torch.no_grad():
        for n, p in _memory_params(model).items():
            if ".out_proj." in n:
                p.sub_(0.1 * p.grad)
    model.zero_grad()
    model(segs[2], labels=segs[2], memory=memory.clone()).loss.backward()
    assert all(p.grad.abs().max() > 0 for n, p in _memory_params(model).items() if "ln_" not in n or "bias" in n)


def test_nothing_backpropagates_into_stored_memory(make_model):
    model = make_model("memoria", memory_init="random").train()
    segs = segments(count=4)
    memory = None
    for x in segs:  # a backward per segment: a stored tensor attached to an old graph would fail here
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
        for name, t in {**memory.state.tensors(), "prev_hidden": memory.prev_hidden}.items():
            assert not t.requires_grad, name
    # the gradient of a segment is the same whether the memory was built with or without autograd
    model.zero_grad()
    with torch.no_grad():
        _, frozen = run_stream(model, segs[:3])
    model(segs[3], labels=segs[3], memory=frozen).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, live = run_stream(model, segs[:3])  # with autograd on
    model(segs[3], labels=segs[3], memory=live).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-7, msg=n)


def test_xl_cache_is_detached(make_model):
    model = make_model("xl").train()
    memory = None
    for x in segments(count=3):
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
        assert not memory.keys.requires_grad and not memory.values.requires_grad
