"""Gradient checkpointing and the attention implementation change nothing but speed and memory."""

import pytest
import torch
from model_helpers import losses_and_grads, run_stream, segments


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast", "xl"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(make_model, preset):
    model = make_model(preset, memory_init="random").train()
    segs = segments(count=4)
    loss_a, grad_a, _ = losses_and_grads(model, segs)
    model.activation_checkpointing_enable()
    assert all(b.gradient_checkpointing for b in model.memory_blocks)
    loss_b, grad_b, _ = losses_and_grads(model, segs)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-6)
    assert grad_a.keys() == grad_b.keys()
    for n in grad_a:
        torch.testing.assert_close(grad_a[n], grad_b[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast", "xl"])
def test_sdpa_and_eager_agree(make_model, preset):
    sdpa = make_model(preset, memory_init="random", attn_implementation="sdpa")
    eager = make_model(preset, memory_init="random", attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    segs = segments(count=4)
    with torch.no_grad():
        a, _ = run_stream(sdpa, segs)
        b, _ = run_stream(eager, segs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=1e-5)


def test_padded_positions_are_neither_attended_nor_stored(make_model):
    """Right padding in the last segment: real positions are unaffected by what the padding holds."""
    model = make_model("memoria", memory_init="random")
    segs = segments(count=3)
    mask = torch.ones_like(segs[1])
    mask[0, 8:] = 0
    other = [s.clone() for s in segs]
    other[1][0, 8:] = 7
    with torch.no_grad():
        a, _ = run_stream(model, segs, attention_mask=mask)
        b, _ = run_stream(model, other, attention_mask=mask)
    torch.testing.assert_close(a[1].logits[0, :8], b[1].logits[0, :8], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[2].logits[0], b[2].logits[0], rtol=0, atol=1e-6)
