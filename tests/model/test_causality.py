"""Causality: a token changes nothing before it, and (memory on) does change later segments."""

import pytest
import torch
from model_helpers import VOCAB, run_stream, segments


def _logits(model, segs):
    with torch.no_grad():
        outs, _ = run_stream(model, segs)
    return [o.logits for o in outs]


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast", "xl"])
@pytest.mark.parametrize("t,pos", [(2, 0), (2, 7), (1, 11)])
def test_a_token_affects_only_what_comes_after_it(make_model, preset, t, pos):
    model = make_model(preset, memory_init="random")
    segs = segments(count=4)
    changed = [s.clone() for s in segs]
    changed[t][:, pos] = (changed[t][:, pos] + 1) % VOCAB
    a, b = _logits(model, segs), _logits(model, changed)
    for i in range(t):
        torch.testing.assert_close(a[i], b[i], rtol=0, atol=0)  # earlier segments: bit-identical
    torch.testing.assert_close(a[t][:, :pos], b[t][:, :pos], rtol=0, atol=1e-6)  # earlier positions of t
    assert (a[t][:, pos] - b[t][:, pos]).abs().max() > 1e-4  # the changed position itself
    for i in range(t + 1, 4):  # the memory carries the change forward
        assert (a[i] - b[i]).abs().max() > 1e-6, f"segment {i} ignores segment {t}"


def test_noop_init_learns_to_use_memory(make_model):
    """From the exact no-op, a few training steps make later segments depend on earlier ones."""
    model = make_model("memoria")
    segs = segments(count=4)
    changed = [s.clone() for s in segs]
    changed[0][:, 3] = (changed[0][:, 3] + 1) % VOCAB
    a, b = _logits(model, segs), _logits(model, changed)
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)  # the no-op: nothing carries over

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3):
        memory = None
        for x in segs:
            out = model(x, labels=x, memory=memory)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            memory = out.memory
    model.eval()
    a, b = _logits(model, segs), _logits(model, changed)
    torch.testing.assert_close(a[0][:, :3], b[0][:, :3], rtol=0, atol=1e-6)
    assert (a[2] - b[2]).abs().max() > 1e-5
