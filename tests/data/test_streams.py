"""Stream layout invariants, document flags, resume and re-sharding (Contract 3)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memoria_ds.data import StreamLayout, TokenCorpus, TokenStreams


def make_corpus(seed: int = 0, num_docs: int = 9, max_len: int = 40, vocab: int = 50) -> TokenCorpus:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, rng.integers(0 if i == 3 else 1, max_len)).tolist() for i in range(num_docs)]
    return TokenCorpus.from_token_lists(docs)


def all_tokens(corpus: TokenCorpus) -> np.ndarray:
    return np.asarray(corpus.tokens, dtype=np.int64)


def doc_ids(corpus: TokenCorpus) -> np.ndarray:
    """Slow reference: the document of every token."""
    return np.concatenate([np.full(n, d) for d, n in enumerate(corpus.doc_lengths)])


def read_rank(streams: TokenStreams, epoch: int = 0) -> list:
    return [streams.batch_at(epoch, t) for t in range(streams.steps_per_epoch)]


def stream_inputs(batches: list, row: int) -> np.ndarray:
    """The real input tokens of one row over an epoch, in order."""
    return np.concatenate([b.input_ids[row][b.attention_mask[row].bool()].numpy() for b in batches])


@pytest.mark.parametrize("num_streams,seg", [(1, 7), (3, 5), (4, 16), (7, 3), (13, 1)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_token_once_in_order_in_one_stream(num_streams: int, seg: int, world_size: int) -> None:
    corpus = make_corpus()
    if num_streams % world_size:
        with pytest.raises(ValueError, match="multiple of the data-parallel world size"):
            TokenStreams(corpus, num_streams=num_streams, segment_length=seg, world_size=world_size)
        return
    tokens = all_tokens(corpus)
    per_stream: dict[int, np.ndarray] = {}
    for rank in range(world_size):
        streams = TokenStreams(corpus, num_streams=num_streams, segment_length=seg, rank=rank, world_size=world_size)
        batches = read_rank(streams)
        for row, sid in enumerate(streams.stream_ids):
            assert sid not in per_stream, "a stream is owned by two ranks"
            per_stream[sid] = stream_inputs(batches, row)
            assert all(int(b.stream_ids[row]) == sid for b in batches)
    assert sorted(per_stream) == list(range(num_streams))
    # Concatenating the streams in id order gives the split, each token once, in order.
    np.testing.assert_array_equal(np.concatenate([per_stream[s] for s in range(num_streams)]), tokens)
    lengths = [per_stream[s].size for s in range(num_streams)]
    assert max(lengths) - min(lengths) <= 1, "streams are as equal as possible"


@pytest.mark.parametrize("num_streams,seg", [(1, 4), (3, 5), (5, 2)])
def test_targets_are_the_next_token_of_the_split(num_streams: int, seg: int) -> None:
    corpus = make_corpus(1)
    tokens = all_tokens(corpus)
    streams = TokenStreams(corpus, num_streams=num_streams, segment_length=seg)
    starts = streams.layout.starts
    scored = 0
    for t, b in enumerate(read_rank(streams)):
        for row in range(num_streams):
            for i in range(seg):
                pos = int(starts[row]) + t * seg + i
                target = int(b.targets[row, i])
                if pos < starts[row + 1]:
                    assert b.attention_mask[row, i] == 1 and int(b.input_ids[row, i]) == tokens[pos]
                    assert target == (tokens[pos + 1] if pos + 1 < tokens.size else -100)
                else:  # padding past the stream's end
                    assert b.attention_mask[row, i] == 0 and target == -100
                scored += target != -100
    assert scored == tokens.size - 1, "every token but the first is a target exactly once"


def test_drop_tail_feeds_full_segments_and_drops_each_stream_remainder() -> None:
    corpus = make_corpus(2)
    tokens = all_tokens(corpus)
    streams = TokenStreams(corpus, num_streams=3, segment_length=6, tail="drop")
    batches = read_rank(streams)
    assert all(bool(b.attention_mask.all()) for b in batches)
    starts = streams.layout.starts
    n_fed = streams.steps_per_epoch * 6
    assert n_fed == (tokens.size // 3) // 6 * 6
    for row in range(3):
        np.testing.assert_array_equal(stream_inputs(batches, row), tokens[starts[row] : starts[row] + n_fed])


def test_doc_start_flags_match_a_reference() -> None:
    corpus = make_corpus(3, num_docs=30, max_len=12)
    ids = doc_ids(corpus)
    seg, num_streams = 5, 4
    streams = TokenStreams(corpus, num_streams=num_streams, segment_length=seg)
    starts = streams.layout.starts
    doc_first = set(corpus.doc_offsets[:-1][corpus.doc_lengths > 0].tolist())
    for t, b in enumerate(read_rank(streams)):
        for row in range(num_streams):
            p0 = int(starts[row]) + t * seg
            end = min(p0 + seg, int(starts[row + 1]))
            if t == 0:
                expected = True
            elif p0 >= end:
                expected = False  # nothing left in this stream
            else:
                expected = ids[p0] != ids[p0 - seg]
            assert bool(b.doc_start[row]) == expected, (t, row)
            first = [p - p0 for p in range(p0, end) if p in doc_first]
            assert int(b.doc_start_pos[row]) == (first[0] if first else -1)


def test_doc_start_when_a_document_starts_mid_segment() -> None:
    corpus = TokenCorpus.from_token_lists([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]])
    streams = TokenStreams(corpus, num_streams=1, segment_length=4)
    flags = [(bool(b.doc_start[0]), int(b.doc_start_pos[0])) for b in read_rank(streams)]
    # segments: [1 2 3 4] [5 6 | 7 8] [9 10 11 12] [13]
    assert flags == [(True, 0), (False, 2), (True, -1), (False, -1)]


def test_shuffled_documents_are_a_seeded_permutation_per_epoch() -> None:
    corpus = make_corpus(4, num_docs=12)
    docs = [corpus.document(i).astype(np.int64) for i in range(corpus.num_documents)]
    streams = TokenStreams(corpus, num_streams=2, segment_length=5, shuffle_documents=True, seed=7)
    reads = []
    for epoch in range(3):
        batches = read_rank(streams, epoch)
        seq = np.concatenate([stream_inputs(batches, 0), stream_inputs(batches, 1)])
        perm = np.random.default_rng([7, epoch]).permutation(len(docs))
        np.testing.assert_array_equal(seq, np.concatenate([docs[i] for i in perm]))
        reads.append(seq)
    assert not np.array_equal(reads[0], reads[1])
    again = TokenStreams(corpus, num_streams=2, segment_length=5, shuffle_documents=True, seed=7)
    np.testing.assert_array_equal(stream_inputs(read_rank(again, 1), 0), stream_inputs(read_rank(streams, 1), 0))


def assert_same_batch(a, b) -> None:
    for name in ("input_ids", "targets", "attention_mask", "doc_start", "doc_start_pos", "stream_ids"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0, msg=name)
    assert (a.epoch, a.step, a.global_step) == (b.epoch, b.step, b.global_step)


@pytest.mark.parametrize("k", [0, 1, 5, 9, 13])
def test_resume_at_step_k_equals_the_uninterrupted_run(k: int) -> None:
    corpus = make_corpus(5)
    kwargs = dict(num_streams=2, segment_length=8, shuffle_documents=True, seed=3)
    uninterrupted = TokenStreams(corpus, **kwargs)
    reference = [b for _ in range(2) for b in uninterrupted]  # two epochs
    first = TokenStreams(corpus, **kwargs)
    it = iter(first)
    seen = []
    while len(seen) < k:
        try:
            seen.append(next(it))
        except StopIteration:
            it = iter(first)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-serialisable
    resumed = TokenStreams(corpus, **kwargs)
    resumed.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < len(reference):
        rest.extend(resumed)
    for a, b in zip(seen + rest, reference):
        assert_same_batch(a, b)


def test_state_holds_every_stream_position() -> None:
    corpus = make_corpus(6)
    streams = TokenStreams(corpus, num_streams=4, segment_length=3, rank=1, world_size=2)
    it = iter(streams)
    next(it), next(it)
    state = streams.state_dict()
    assert state["step"] == 2 and len(state["stream_positions"]) == 4
    assert state["stream_positions"] == [int(s) + 6 for s in streams.layout.starts[:-1]]


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (2, 4)])
def test_resharding_keeps_every_stream(old_world: int, new_world: int) -> None:
    corpus = make_corpus(7)
    kwargs = dict(num_streams=4, segment_length=4)
    k = 3
    old = [TokenStreams(corpus, rank=r, world_size=old_world, **kwargs) for r in range(old_world)]
    for s in old:
        it = iter(s)
        for _ in range(k):
            next(it)
    state = old[0].state_dict()
    assert all(s.state_dict()["stream_positions"] == state["stream_positions"] for s in old)
    full = TokenStreams(corpus, **kwargs)  # uninterrupted, all streams in one process
    expected = [full.batch_at(0, t) for t in range(k, full.steps_per_epoch)]
    new = [TokenStreams(corpus, rank=r, world_size=new_world, **kwargs) for r in range(new_world)]
    for s in new:
        s.load_state_dict(state)
    got = list(zip(*[list(s) for s in new]))
    assert len(got) == len(expected)
    for parts, ref in zip(got, expected):
        assert torch.equal(torch.cat([p.stream_ids for p in parts]), ref.stream_ids)
        assert torch.equal(torch.cat([p.input_ids for p in parts]), ref.input_ids)
        assert torch.equal(torch.cat([p.targets for p in parts]), ref.targets)
        assert torch.equal(torch.cat([p.doc_start for p in parts]), ref.doc_start)


def test_state_from_another_layout_or_corpus_is_refused() -> None:
    corpus = make_corpus(8)
    state = TokenStreams(corpus, num_streams=2, segment_length=4).state_dict()
    with pytest.raises(ValueError, match="num_streams"):
        TokenStreams(corpus, num_streams=4, segment_length=4).load_state_dict(state)
    with pytest.raises(ValueError, match="corpus_fingerprint"):
        TokenStreams(make_corpus(9), num_streams=2, segment_length=4).load_state_dict(
            {**state, "num_tokens": make_corpus(9).num_tokens, "num_documents": 9}
        )
    bad = dict(state, stream_positions=[0, 1])
    with pytest.raises(ValueError, match="corrupt"):
        TokenStreams(corpus, num_streams=2, segment_length=4).load_state_dict(bad)


def test_layout_arithmetic_and_errors() -> None:
    layout = StreamLayout(num_tokens=10, num_streams=4, segment_length=2)
    assert layout.starts.tolist() == [0, 3, 6, 8, 10]  # the first N % B streams get one more
    assert layout.steps_per_epoch == 2
    assert StreamLayout(10, 4, 2, tail="drop").steps_per_epoch == 1
    with pytest.raises(ValueError, match="use fewer streams"):
        StreamLayout(3, 4, 2)
    with pytest.raises(ValueError, match="tail='pad'"):
        StreamLayout(10, 4, 3, tail="drop")


def test_epoch_iteration_moves_to_the_next_epoch() -> None:
    corpus = make_corpus(10)
    streams = TokenStreams(corpus, num_streams=2, segment_length=16)
    first = list(streams)
    assert len(first) == len(streams) and streams.epoch == 1 and streams.step == 0
    second = list(streams)
    assert second[0].epoch == 1 and second[0].global_step == len(streams)
    assert bool(second[0].doc_start.all()), "every row restarts at an epoch start"
