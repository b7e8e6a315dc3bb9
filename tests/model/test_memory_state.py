"""The recurrent memory object: resets per row, checkpoints, row re-sharding, one step per forward."""

import io

import pytest
import torch
from model_helpers import run_stream, segments

from memoria_ds.model import MemoriaMemory, NoMemory, XLMemory, memory_from_state_dict


def _continue(model, memory, segs):
    with torch.no_grad():
        outs, _ = run_stream(model, segs, memory=memory)
    return [o.logits for o in outs]


@pytest.mark.parametrize("preset", ["memoria", "xl", "transformer"])
def test_state_dict_round_trip_continues_identically(make_model, preset):
    model = make_model(preset, memory_init="random")
    segs = segments(count=6)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    restored = memory_from_state_dict(torch.load(buffer), config=model.config.memoria_config)
    assert type(restored) is type(memory)
    expected = _continue(model, memory.clone(), segs[3:])
    for a, b in zip(expected, _continue(model, restored, segs[3:])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_take_and_put_rows_keep_outputs(make_model, preset):
    model = make_model(preset, memory_init="random")
    segs = segments(batch=4, count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    full = _continue(model, memory.clone(), segs[3:])
    rows = [2, 0]
    part = _continue(model, memory.take_rows(rows), [s[rows] for s in segs[3:]])
    for a, b in zip(full, part):
        torch.testing.assert_close(a[rows], b, rtol=0, atol=1e-6)
    # re-shard: rebuild the 4-row memory from two halves put into a fresh one
    rebuilt = model.empty_memory(4)
    rebuilt.put_rows([3, 1], memory.take_rows([3, 1]))
    rebuilt.put_rows(torch.tensor([0, 2]), memory.take_rows([0, 2]))
    for a, b in zip(full, _continue(model, rebuilt, segs[3:])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    joined = type(memory).cat([memory.take_rows([0, 1]), memory.take_rows([2, 3])])
    for a, b in zip(full, _continue(model, joined, segs[3:])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_reset_row_starts_a_fresh_stream(make_model):
    """A reset row behaves exactly like a new stream from that segment on; other rows are untouched."""
    model = make_model("memoria", memory_init="random")
    segs = segments(count=6)
    reset = torch.tensor([False, True, False])
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        untouched = _continue(model, memory.clone(), segs[3:])
        outs = [model(segs[3], memory=memory, reset=reset)]
        outs += run_stream(model, segs[4:], memory=outs[0].memory)[0]
        fresh = _continue(model, None, [s[1:2] for s in segs[3:]])  # row 1 alone, from scratch
    for got, keep, new in zip([o.logits for o in outs], untouched, fresh):
        torch.testing.assert_close(got[[0, 2]], keep[[0, 2]], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1:2], new, rtol=0, atol=1e-5)
    first = outs[0].memory_stats  # the reset row took no memory step: it reports an empty memory
    assert first.engrams[1].tolist() == [model.config.memoria_config.capacity, 0, 0, 0]
    assert int(first.reminded_stm[1]) == 0 and int(first.reminded_stm[0]) > 0


def test_reset_all_rows_is_a_fresh_memory(make_model):
    model = make_model("memoria", memory_init="random")
    segs = segments(count=5)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        memory.reset()
        assert not memory.has_previous.any()
        for a, b in zip(_continue(model, memory, segs[3:]), _continue(model, None, segs[3:])):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_one_memory_step_per_forward(make_model):
    """Also under gradient checkpointing (blocks are recomputed in backward) and no_grad."""
    model = make_model("memoria", memory_init="random").train()
    model.activation_checkpointing_enable()
    memory = None
    for x in segments(count=3):
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
    with torch.no_grad():
        memory = model(segments(count=1)[0], memory=memory).memory
    assert memory.state.step.tolist() == [3, 3, 3]  # the first segment had nothing to memorize


def test_memory_is_updated_in_place_and_returned(make_model):
    model = make_model("memoria")
    memory = model.empty_memory(3)
    with torch.no_grad():
        out = model(segments(count=1)[0], memory=memory)
    assert out.memory is memory and memory.has_previous.all()


def test_wrong_memory_is_an_actionable_error(make_model):
    model = make_model("memoria")
    x = segments(count=1)[0]
    with pytest.raises(ValueError, match="take_rows"):
        model(x, memory=model.empty_memory(2))
    with pytest.raises(TypeError, match="MemoriaMemory"):
        model(x, memory=make_model("xl").empty_memory(3))
    with pytest.raises(ValueError, match="reset"):
        model(x, memory=model.empty_memory(3), reset=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="not both"):
        model(x, labels=x, shift_labels=x)
    with pytest.raises(ValueError, match="kind"):
        memory_from_state_dict({"kind": "lstm", "format": 1})
    with pytest.raises(ValueError, match="format"):
        XLMemory.from_state_dict({"kind": "xl", "format": 99})


def test_no_memory_object(make_model):
    model = make_model("transformer")
    with torch.no_grad():
        out = model(segments(count=1)[0])
    assert isinstance(out.memory, NoMemory) and out.memory.batch_size == 3 and out.memory_stats is None
    assert NoMemory.from_state_dict(out.memory.state_dict()).batch_size == 3
    assert out.memory.take_rows([0, 2]).batch_size == 2


def test_memoria_memory_put_rows_pads_shorter_previous_segments(make_model):
    model = make_model("memoria", memory_init="random")
    with torch.no_grad():
        long = model(segments(count=1, length=12)[0]).memory
        short = model(segments(count=1, length=5, batch=1)[0]).memory
    long.put_rows([1], short)
    assert long.prev_hidden.shape[1] == 12 and long.prev_mask.sum(1).tolist() == [12, 5, 12]
    assert isinstance(MemoriaMemory.cat([long, short]), MemoriaMemory)


def _poison(memory, row: int) -> None:
    """Fill every floating tensor of `row` with NaN, as a diverged forward would leave it."""
    if isinstance(memory, MemoriaMemory):
        memory.prev_hidden[row] = float("nan")
        for t in (memory.state.vectors, memory.state.sq_norms, memory.state.lifespan):
            t[row] = float("nan")
    elif isinstance(memory, XLMemory):
        memory.keys[row] = float("nan")
        memory.values[row] = float("nan")


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_a_reset_row_forgets_non_finite_values(make_model, preset):
    """The training loop resets the rows of a micro-batch whose loss was not finite (no host
    sync to decide more): their stale NaN must never reach a later segment."""
    model = make_model(preset, memory_init="random")
    segs = segments(count=6)
    reset = torch.tensor([False, True, False])
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        _poison(memory, 1)
        outs = [model(segs[3], memory=memory, reset=reset)]
        outs += run_stream(model, segs[4:], memory=outs[0].memory)[0]
        fresh = _continue(model, None, [s[1:2] for s in segs[3:]])
    for got, new in zip([o.logits for o in outs], fresh):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[1:2], new, rtol=0, atol=1e-5)
