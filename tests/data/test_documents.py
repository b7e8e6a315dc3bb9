"""DocumentStreams against a slow reference: every document, cut by hand, lands in its row's
segments with its special tokens, mask, label and last-segment flag; resume and re-sharding."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from memoria_ds.data import DocumentStreams, document_segments

CLS, SEP, PAD = 101, 102, 0


def _dataset(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1000, 2000, size=n).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": docs, "label": [i % 3 for i in range(len(lengths))]})


def _reference(ds, order, batch_size, L, K, rank, world):
    """{(batch, k, global row): (ids, mask, label, last)} by hand, one document at a time."""
    body = L - 2
    out = {}
    per = batch_size // world
    for i in range(-(-len(order) // batch_size)):
        for slot in range(rank * per, (rank + 1) * per):
            j = i * batch_size + slot
            doc = ds[int(order[j])] if j < len(order) else None
            tokens = doc["input_ids"] if doc else []
            n = max(1, min(K, -(-len(tokens) // body))) if doc else 0
            for k in range(K):
                ids, mask = [PAD] * L, [0] * L
                if k < n:
                    seg = [CLS] + tokens[k * body:(k + 1) * body] + [SEP]
                    ids[:len(seg)], mask[:len(seg)] = seg, [1] * len(seg)
                label = doc["label"] if doc and k < n else -100
                out[(i, k, slot)] = (ids, mask, label, bool(doc) and k == n - 1)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_every_segment_is_what_the_reference_cuts(world):
    ds = _dataset([0, 3, 6, 7, 13, 30, 5])  # empty, one segment, exactly one, two, ... truncated
    L, K, B = 8, 3, 4
    for rank in range(world):
        streams = DocumentStreams(ds, batch_size=B, segment_length=L, max_segments=K, rank=rank, world_size=world,
                                  cls_id=CLS, sep_id=SEP, pad_id=PAD)
        ref = _reference(ds, np.arange(len(ds)), B, L, K, rank, world)
        assert streams.steps_per_epoch == 2 * K and streams.truncated == 1
        for step, batch in enumerate(streams):
            i, k = divmod(step, K)
            assert bool(batch.doc_start.all()) == (k == 0) and not bool(batch.doc_start.any()) == (k != 0)
            assert (batch.targets == -100).all()
            for r, slot in enumerate(batch.stream_ids.tolist()):
                ids, mask, label, last = ref[(i, k, slot)]
                assert batch.input_ids[r].tolist() == ids and batch.attention_mask[r].tolist() == mask
                assert int(batch.labels[r]) == label and bool(batch.last[r]) == last, (step, slot)


def test_a_document_cut_by_hand():
    assert [s.tolist() for s in document_segments(list(range(1, 8)), 5, 9, CLS, SEP)] == [
        [CLS, 1, 2, 3, SEP], [CLS, 4, 5, 6, SEP], [CLS, 7, SEP]]
    assert [s.tolist() for s in document_segments([], 5, 9, CLS, SEP)] == [[CLS, SEP]]
    assert [s.tolist() for s in document_segments(list(range(1, 8)), 3, 2)] == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="no room for text"):
        document_segments([1], 2, 1, CLS, SEP)


def test_resume_and_reshard_continue_the_same_batches():
    ds = _dataset([4, 9, 17, 2, 11, 8, 6, 3])
    kw = dict(batch_size=4, segment_length=6, max_segments=3, shuffle=True, seed=5, cls_id=CLS, sep_id=SEP)
    whole = DocumentStreams(ds, **kw)
    batches = [b for _, b in zip(range(9), iter(whole))]  # into the second epoch
    first = DocumentStreams(ds, **kw)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    for world in (1, 2):
        parts = []
        for rank in range(world):
            s = DocumentStreams(ds, **kw, rank=rank, world_size=world)
            s.load_state_dict(state)
            parts.append([b for _, b in zip(range(5), iter(s))])
        for n, want in enumerate(batches[4:]):
            got = [p[n] for p in parts]
            for name in ("input_ids", "attention_mask", "labels", "last", "stream_ids"):
                assert torch.equal(torch.cat([getattr(g, name) for g in got]), getattr(want, name)), (n, name)
    other = DocumentStreams(ds, **{**kw, "max_segments": 2})
    with pytest.raises(ValueError, match="max_segments"):
        other.load_state_dict(state)


def test_bad_documents_are_refused():
    with pytest.raises(ValueError, match="missing"):
        DocumentStreams(datasets.Dataset.from_dict({"input_ids": [[1]]}), batch_size=1, segment_length=4,
                        max_segments=1)
    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "label": [-1]})
    with pytest.raises(ValueError, match="class index"):
        DocumentStreams(bad, batch_size=1, segment_length=4, max_segments=1).batch_at(0, 0)


def test_labels_map_to_a_trained_models_classes_when_a_split_lacks_one(tmp_path):
    from memoria_ds.data.labelled import load_labelled_documents

    path = tmp_path / "dev.jsonl"
    path.write_text('{"text": "a b", "label": "gamma"}\n{"text": "c", "label": "alpha"}\n')
    alone = load_labelled_documents(files={"validation": [str(path)]}, splits=("validation",))["validation"]
    assert alone.label_names == ["alpha", "gamma"] and alone.dataset["label"] == [1, 0]
    trained = load_labelled_documents(files={"validation": [str(path)]}, splits=("validation",),
                                      label_names=["alpha", "beta", "gamma"])["validation"]
    assert trained.label_names == ["alpha", "beta", "gamma"] and trained.dataset["label"] == [2, 0]
    with pytest.raises(ValueError, match="not among the model's classes"):
        load_labelled_documents(files={"validation": [str(path)]}, splits=("validation",), label_names=["alpha"])


def _task_stream(tasks, batch_size, max_segments=1, shuffle=False):
    ds = _dataset([5] * len(tasks)).add_column("task", tasks)
    return DocumentStreams(ds, batch_size=batch_size, segment_length=8, max_segments=max_segments, shuffle=shuffle,
                           drop_last=True, pad_id=PAD, cls_id=CLS, sep_id=SEP)


def _task_ends_by_walking(streams, bptt, total):
    """Step by step: the steps after which every document of some task (in some epoch) has been read."""
    K, B, n = streams.segments_per_example, streams.batch_size, streams.num_batches * streams.batch_size
    tasks = list(streams.dataset["task"])[:n]
    ends = []
    for step in range(1, total + 1):
        read_before = ((step - 1) * bptt // K) * B  # documents whose every segment has been read, all epochs
        read_now = (step * bptt // K) * B
        finished = [e * n + i for e in range(total * bptt // (K * streams.num_batches) + 1) for i in range(n)
                    if i == n - 1 or tasks[i] != tasks[i + 1]]  # each task's last document, per epoch
        if any(read_before <= j < read_now for j in finished):
            ends.append(step)
    return ends


def test_task_ends_by_hand_and_against_a_walk():
    tasks = [0] * 5 + [1] * 7 + [2] * 4  # 16 documents; batches of 3: 5 batches, the 16th document unread
    streams = _task_stream(tasks, batch_size=3)
    assert streams.task_end_steps(1, 10) == [2, 4, 5, 7, 9, 10]  # two epochs
    assert streams.task_end_steps(1, 8) == [2, 4, 5, 7]
    two = _task_stream(tasks, batch_size=3, max_segments=2)  # 2 segments a document
    assert two.task_end_steps(1, 10) == [4, 8, 10] and two.task_end_steps(2, 10) == [2, 4, 5, 7, 9, 10]
    for K, bptt, B, total in [(1, 1, 2, 13), (2, 1, 4, 12), (2, 2, 3, 9), (3, 3, 2, 16), (1, 1, 6, 6)]:
        streams = _task_stream(tasks, batch_size=B, max_segments=K)
        assert streams.task_end_steps(bptt, total) == _task_ends_by_walking(streams, bptt, total), (K, bptt, B)


def test_task_ends_need_documents_in_order_with_tasks():
    with pytest.raises(ValueError, match="in order"):
        _task_stream([0, 0, 1, 1], batch_size=2, shuffle=True).task_end_steps(1, 2)
    streams = DocumentStreams(_dataset([5] * 4), batch_size=2, segment_length=8, max_segments=1, pad_id=PAD,
                              cls_id=CLS, sep_id=SEP)
    with pytest.raises(ValueError, match="`task` column"):
        streams.task_end_steps(1, 2)
