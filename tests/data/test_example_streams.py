"""ExampleStreams: examples fed segment by segment, ranks, padding rows, resume."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from memoria_ds.data import ExampleStreams, generate_sorting, sorting_sequence


@pytest.fixture(scope="module")
def sorting(tmp_path_factory):
    return generate_sorting(7, 17, seed=5, cache_dir=str(tmp_path_factory.mktemp("sorting")))


def test_segments_reassemble_each_example(sorting) -> None:
    streams = ExampleStreams(sorting, batch_size=3, segment_length=10)
    assert streams.example_length == 37 and streams.segments_per_example == 4
    assert streams.num_batches == 3 and len(streams) == 12
    batches = list(streams)
    for i in range(3):
        segs = batches[i * 4 : (i + 1) * 4]
        assert [bool(b.doc_start.all()) for b in segs] == [True, False, False, False]
        inputs = torch.cat([b.input_ids for b in segs], dim=1)
        targets = torch.cat([b.targets for b in segs], dim=1)
        for row in range(3):
            j = i * 3 + row
            if j >= len(sorting):  # the padding rows of the last batch score nothing
                assert (targets[row] == -100).all() and segs[0].attention_mask[row].sum() == 0
                continue
            x, y = sorting_sequence(np.array(sorting[j]["symbols"]), np.array(sorting[j]["target"]))
            assert inputs[row, :37].tolist() == x.tolist() and targets[row, :37].tolist() == y.tolist()
            assert (targets[row, 37:] == -100).all()
    scored = sum(int((b.targets != -100).sum()) for b in batches)
    assert scored == 20 * len(sorting)


def test_ranks_split_the_rows_and_drop_last(sorting) -> None:
    whole = ExampleStreams(sorting, batch_size=4, segment_length=8, drop_last=True)
    assert whole.num_batches == 1
    parts = [ExampleStreams(sorting, batch_size=4, segment_length=8, drop_last=True, rank=r, world_size=2)
             for r in range(2)]
    for t in range(len(whole)):
        ref = whole.batch_at(0, t)
        got = [p.batch_at(0, t) for p in parts]
        assert torch.equal(torch.cat([g.input_ids for g in got]), ref.input_ids)
        assert torch.equal(torch.cat([g.stream_ids for g in got]), ref.stream_ids)
    with pytest.raises(ValueError, match="multiple of the world size"):
        ExampleStreams(sorting, batch_size=3, segment_length=8, world_size=2)


def test_resume_and_shuffle(sorting) -> None:
    kw = dict(batch_size=2, segment_length=16, shuffle=True, seed=1)
    ref = ExampleStreams(sorting, **kw)
    reference = list(ref) + list(ref)
    run = ExampleStreams(sorting, **kw)
    it = iter(run)
    head = [next(it) for _ in range(5)]
    resumed = ExampleStreams(sorting, **kw)
    resumed.load_state_dict(run.state_dict())
    tail = list(resumed) + list(resumed)
    got = head + tail
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        assert torch.equal(a.input_ids, b.input_ids) and (a.epoch, a.step) == (b.epoch, b.step)
    assert not torch.equal(reference[0].input_ids, reference[len(ref)].input_ids), "a new order each epoch"


def test_position_jumps_and_rolls_over_like_token_streams(sorting) -> None:
    streams = ExampleStreams(sorting, batch_size=2, segment_length=16, shuffle=True, seed=3)
    assert len(streams) == 12 and (streams.epoch, streams.step) == (0, 0)
    streams.set_position(2, 11)  # the last step of epoch 2
    first, second = list(streams)[0], next(iter(streams))
    assert (first.epoch, first.step) == (2, 11) and torch.equal(first.input_ids, streams.batch_at(2, 11).input_ids)
    assert (second.epoch, second.step) == (3, 0)
    streams.set_position(1, 12)  # the end of epoch 1 is the start of epoch 2
    assert (streams.epoch, streams.step) == (2, 0)
    with pytest.raises(ValueError, match="no position"):
        streams.set_position(0, 13)
    state = streams.state_dict() | {"step": 40}
    with pytest.raises(ValueError, match="outside the epoch"):
        streams.load_state_dict(state)


def test_aligned_columns_and_mismatched_lengths() -> None:
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6]], "targets": [[2, 3, -100], [5, 6, -100]]})
    b = ExampleStreams(ds, batch_size=2, segment_length=2).batch_at(0, 1)
    assert b.input_ids.tolist() == [[3, 0], [6, 0]] and b.targets.tolist() == [[-100, -100], [-100, -100]]
    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "targets": [[2, 3, -100], [-100]]})
    with pytest.raises(ValueError, match="one length"):
        ExampleStreams(bad, batch_size=2, segment_length=2).batch_at(0, 0)


def test_the_segments_that_hold_targets(sorting) -> None:
    """17 symbols + SEP + 19 answer inputs = 37 tokens in segments of 10: targets at 16-36."""
    streams = ExampleStreams(sorting, batch_size=3, segment_length=10)
    assert streams.scored_segments == {1, 2, 3}
    scored = [k for k in range(4) if any(int((b.targets != -100).sum()) for b in list(streams)[k::4])]
    assert scored == [1, 2, 3]
    assert [streams.has_targets(s) for s in range(6)] == [False, True, True, True, False, True]
    # 12 steps an epoch, 9 with targets; 14 steps: one epoch and 2 steps of the next (1 with targets)
    assert streams.count_target_steps(12) == 9 and streams.count_target_steps(14) == 10
    assert ExampleStreams(sorting, batch_size=3, segment_length=40).scored_segments == {0}


def test_examples_of_another_layout_are_refused() -> None:
    rows = [{"input_ids": list(range(8)), "targets": [-100] * 6 + [1, 2]},
            {"input_ids": list(range(8)), "targets": [3] + [-100] * 7}]
    streams = ExampleStreams(datasets.Dataset.from_list(rows), batch_size=2, segment_length=4)
    assert streams.scored_segments == {1}
    with pytest.raises(ValueError, match=r"targets in segments \[0, 1\], the first example only in \[1\]"):
        streams.batch_at(0, 0)
