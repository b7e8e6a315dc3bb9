"""The Transformer-XL baseline: cached keys/values of the previous segment, per row."""

import pytest
import torch
from model_helpers import VOCAB, run_stream, segments


def _depends(model, segs, t_changed, t_seen, pos=None) -> bool:
    """Do the logits of segment `t_seen` change when a token of segment `t_changed` changes?"""
    changed = [s.clone() for s in segs]
    p = slice(None) if pos is None else pos
    changed[t_changed][:, p] = (changed[t_changed][:, p] + 1) % VOCAB
    with torch.no_grad():
        a, _ = run_stream(model, segs)
        b, _ = run_stream(model, changed)
    return bool((a[t_seen].logits - b[t_seen].logits).abs().max() > 1e-6)


def test_one_layer_sees_exactly_the_previous_segment(backbone_config, make_model):
    backbone_config.n_layer = 1
    model = make_model("xl")
    segs = segments(count=4)
    assert _depends(model, segs, 2, 3)
    assert not _depends(model, segs, 1, 3)  # t depends on t-1 but not on t-2
    assert not _depends(model, segs, 0, 3)


def test_receptive_field_grows_with_depth(make_model):
    """As in Transformer-XL: the keys cached at layer 1 saw the memory before them, so a
    2-layer model reaches back 2 segments, and no further."""
    model = make_model("xl")
    segs = segments(count=4)
    assert _depends(model, segs, 2, 3) and _depends(model, segs, 1, 3)
    assert not _depends(model, segs, 0, 3)


def test_memory_length(backbone_config, make_model):
    backbone_config.n_layer = 1
    short = make_model("xl", xl_memory_length=5)
    segs = segments(count=3, length=12)
    assert _depends(short, segs, 1, 2, pos=11)  # the last 5 tokens are kept
    assert not _depends(short, segs, 1, 2, pos=6)  # earlier ones are not
    long = make_model("xl", xl_memory_length=24)  # two segments of memory
    assert _depends(long, segs, 0, 2)
    with torch.no_grad():
        _, memory = run_stream(long, segs[:1])
    assert memory.keys.shape == (3, 1, 4, 24, 16) and memory.mask.sum(1).tolist() == [12, 12, 12]


def test_runs_over_more_segments_than_positions(make_model):
    model = make_model("xl")
    with torch.no_grad():
        outs, memory = run_stream(model, segments(count=30, length=12, batch=1))  # 360 tokens > n_positions 256
    assert torch.isfinite(outs[-1].logits).all() and memory.length == 12


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_per_row_reset(make_model, attn):
    model = make_model("xl", attn_implementation=attn)
    segs = segments(count=3)
    reset = torch.tensor([False, True, False])
    with torch.no_grad():
        _, memory = run_stream(model, segs[:2])
        kept = model(segs[2], memory=memory.clone()).logits
        out = model(segs[2], memory=memory, reset=reset).logits
        fresh = model(segs[2]).logits  # no memory: the plain backbone
    torch.testing.assert_close(out[1], fresh[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[[0, 2]], kept[[0, 2]], rtol=0, atol=0)
    assert (out[1] - kept[1]).abs().max() > 1e-4
