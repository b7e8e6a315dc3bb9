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


def _positions_seen(model, segs, reset_at=None):
    """The rows of position ids the embedding reads for each segment of a stream."""
    seen = []
    hook = model.transformer.wpe.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    memory = None
    try:
        with torch.no_grad():
            for t, x in enumerate(segs):
                reset = reset_at.get(t) if reset_at else None
                memory = model(x, memory=memory, reset=reset).memory
    finally:
        hook.remove()
    return [p.expand(segs[0].shape[0], -1) for p in seen], memory


def test_alternating_positions_put_the_cached_segment_in_the_other_bank(backbone_config, make_model):
    """`xl` (the preset) alternates segments between positions 0..L-1 and S..S+L-1, S = n_positions // 2,
    so the cached previous segment never shares a position with the current one; a reset row
    starts again in bank 0 (the plain backbone's positions), the others go on alternating."""
    model = make_model("xl")
    assert model.config.xl_positions == "alternate"
    S, L = backbone_config.n_positions // 2, 12
    base = torch.arange(L)
    reset = torch.tensor([False, True, False])
    seen, memory = _positions_seen(model, segments(count=4, length=L), reset_at={2: reset})
    assert torch.equal(seen[0], base.expand(3, -1))
    assert torch.equal(seen[1], (base + S).expand(3, -1))
    assert torch.equal(seen[2][0], base) and torch.equal(seen[2][1], base) and torch.equal(seen[2][2], base)
    assert torch.equal(seen[3][0], base + S) and torch.equal(seen[3][1], base + S)
    assert memory.segments.tolist() == [4, 2, 4]
    reset_row = torch.tensor([False, False, True])
    seen, _ = _positions_seen(model, segments(count=3, length=L), reset_at={1: reset_row})
    assert torch.equal(seen[1][2], base) and torch.equal(seen[1][0], base + S)  # the reset row is a segment behind


def test_shared_positions_keep_every_segment_at_0_to_L(make_model):
    """`xl_positions="shared"` (what configs saved before the field existed mean) is unchanged."""
    model = make_model("xl", xl_positions="shared")
    seen, _ = _positions_seen(model, segments(count=3))
    assert all(torch.equal(p, torch.arange(12).expand(3, -1)) for p in seen)


def test_alternating_positions_make_the_cached_keys_distinguishable(backbone_config, make_model):
    """The defect `shared` has: a one-layer model with a cached copy of the current segment
    cannot tell the copy from the current tokens by position, so the copy at position j
    gets the same attention score as the current token at j. With banks it differs."""
    backbone_config.n_layer = 1
    x = segments(count=1)[0]
    scores = {}
    for mode in ("shared", "alternate"):
        model = make_model("xl", xl_positions=mode, attn_implementation="eager")
        seen = []
        hook = model.transformer.h[0].attn.register_forward_hook(
            lambda m, args, kwargs, out: seen.append(out[1]), with_kwargs=True
        )
        with torch.no_grad():
            memory = model(x).memory  # segment 0: cache it
            out = model(x, memory=memory)  # the same tokens again
        hook.remove()
        probs = seen[-1]  # (B, H, L, M + L): memory keys first
        L = x.shape[1]
        scores[mode] = (probs[..., :L].diagonal(dim1=-2, dim2=-1), probs[..., L:].diagonal(dim1=-2, dim2=-1))
        assert torch.isfinite(out.logits).all()
    cached, current = scores["shared"]
    torch.testing.assert_close(cached, current)  # identical keys at identical positions: a coin toss
    cached, current = scores["alternate"]
    assert (cached - current).abs().max() > 1e-4


def test_alternating_positions_need_segments_in_half_the_positions(backbone_config, make_model):
    with pytest.raises(ValueError, match="positions a segment may use|exceed"):
        make_model("xl")(segments(count=1, length=backbone_config.n_positions // 2 + 1)[0])
    model = make_model("xl", xl_positions="shared")  # the whole range stays usable
    assert torch.isfinite(model(segments(count=1, length=backbone_config.n_positions // 2 + 1)[0]).logits).all()


def test_segment_counts_survive_row_operations_and_state_dicts(make_model):
    from memoria_ds.model import XLMemory

    model = make_model("xl")
    _, memory = run_stream(model, segments(count=3))
    memory.segments = torch.tensor([3, 1, 2])
    again = XLMemory.from_state_dict(memory.state_dict())
    assert again.segments.tolist() == [3, 1, 2]
    old = {k: v for k, v in memory.state_dict().items() if k != "segments"}  # saved before the field existed
    assert XLMemory.from_state_dict(old).segments.tolist() == [0, 0, 0]
    assert memory.take_rows([2, 0]).segments.tolist() == [2, 3]
    assert XLMemory.cat([memory, memory.take_rows([1])]).segments.tolist() == [3, 1, 2, 1]
    memory.put_rows([0], memory.take_rows([1]))
    assert memory.segments.tolist() == [1, 1, 2] and memory.clone().segments.tolist() == [1, 1, 2]
