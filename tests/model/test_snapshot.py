"""Memory snapshots (issue 18 item 3): read once, save, load in another model object, answer with it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from memoria_ds.model import SnapshotMismatch, build_model, load_snapshot, model_fingerprint, read, save_snapshot
from memoria_ds.safe_io import is_pickle

MEMORY = dict(num_wm=4, num_stm_reminded=4, num_ltm_reminded=4, stm_capacity=8, search_depth=2)


def _model(preset="memoria", seed=0, **memoria):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    kwargs = {"memoria": dict(MEMORY, **memoria)} if preset.startswith("memoria") else {}
    return build_model(cfg, preset, memory_init="random", **kwargs).eval()


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_read_once_then_answer_from_the_snapshot(tmp_path, preset):
    model = _model(preset)
    book = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))
    question = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    memory = read(model, book, segment_length=16)
    path = save_snapshot(tmp_path / "book.memory.safetensors", model, memory, stream_ids=[7, 3], description="book")
    assert not is_pickle(path)
    with torch.no_grad():
        expected = model.generate(question, memory=memory, max_new_tokens=5, do_sample=False)
        fresh = model.generate(question, memory=None, max_new_tokens=5, do_sample=False)

    # another model object with the same weights (as after from_pretrained): the same answers
    again = _model(preset)
    snap = load_snapshot(path, again)
    assert snap.stream_ids == [7, 3] and snap.description == "book"
    with torch.no_grad():
        got = again.generate(question, memory=snap.memory, max_new_tokens=5, do_sample=False)
        logits = again(question, memory=load_snapshot(path, again).memory).logits
        ref = model(question, memory=memory).logits
    assert torch.equal(got, expected)
    assert torch.allclose(logits, ref, atol=1e-6)
    with torch.no_grad():
        alone = again(question, memory=None).logits
    assert (logits - alone).abs().max() > 1e-6, "the memory changes what the model computes"
    assert fresh.shape == got.shape

    # one stream's rows, by id
    one = load_snapshot(path, again, stream_ids=[3])
    assert one.memory.batch_size == 1 and one.stream_ids == [3]
    with pytest.raises(ValueError, match=r"no rows for stream ids \[5\]"):
        load_snapshot(path, again, stream_ids=[5])


def test_another_models_snapshot_is_refused(tmp_path):
    model = _model()
    memory = read(model, torch.randint(0, 97, (1, 40)), segment_length=16)
    path = save_snapshot(tmp_path / "s.safetensors", model, memory)
    for other in (_model(seed=1), _model(stm_capacity=16), _model("xl")):
        assert model_fingerprint(other) != model_fingerprint(model)
        with pytest.raises(SnapshotMismatch, match="holds the memory of another model.*read the text again"):
            load_snapshot(path, other)
    # a bf16 copy of the same model is the same model
    assert model_fingerprint(_model().to(torch.bfloat16)) == model_fingerprint(model)
    with pytest.raises(ValueError, match="one distinct id per row"):
        save_snapshot(tmp_path / "t.safetensors", model, memory, stream_ids=[1, 2])


def test_the_documented_example_runs(tmp_path, monkeypatch):
    """The snapshot example in docs/model.md, extracted and run as it is."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "model.md").read_text()
    start = text.index("```python\n# runs as it is (tests/model/test_snapshot.py")
    code = text[start + len("```python\n"): text.index("```\n", start + 10)]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/model.md", "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "alice.memory.safetensors").is_file()


def test_every_description_length_loads_and_a_crafted_snapshot_is_a_value_error(tmp_path):
    """Header lengths whose first byte is 0x80 (descriptions of 115-122 characters here) are
    safetensors like any other; damaged fields are one ValueError, not a crash further on."""
    from memoria_ds.safe_io import load_tree, save_tree

    model = _model()
    memory = read(model, torch.randint(0, 97, (2, 40)), segment_length=16)
    for n in range(100, 140):
        path = save_snapshot(tmp_path / "s.safetensors", model, memory, description="d" * n)
        assert load_snapshot(path, model).description == "d" * n
    tree = load_tree(path)
    for change, says in [
        (lambda t: t.update(memory=[t["memory"]]), "field(s) memory are not"),
        (lambda t: t["memory"].update(state="s"), "a memory state must be a mapping"),
        (lambda t: t.update(stream_ids=[0, 0]), "field(s) stream_ids are not"),
        (lambda t: t.update(stream_ids=[0, 1, 2]), "3 stream ids for a memory of 2 rows"),
        (lambda t: t.update(description=5), "field(s) description are not"),
        (lambda t: t["memory"]["state"]["lifespan"].fill_(float("nan")), "non-finite values in `state.lifespan`"),
    ]:
        crafted = {**tree, "memory": {**tree["memory"], "state": dict(tree["memory"]["state"])}}
        crafted["memory"]["state"]["lifespan"] = tree["memory"]["state"]["lifespan"].clone()
        change(crafted)
        save_tree(crafted, tmp_path / "c.safetensors")
        with pytest.raises(ValueError, match="c.safetensors") as e:
            load_snapshot(tmp_path / "c.safetensors", model)
        assert says in str(e.value)
