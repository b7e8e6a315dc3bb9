"""The Memoria encoder computes what the authors' Memoria BERT / RoBERTa computes (tests/model/encoder_reference.py):
logits of every segment and the memory after five segments of two documents, one of them reset, and the toolkit's
departure at padding (docs/encoders.md)."""

from __future__ import annotations

import pytest
import torch
from encoder_helpers import PAD, document_segments, randomize, tiny_encoder
from encoder_reference import AuthorsEncoderReference

from memoria_ds.memory import KIND_NAMES

# float32 model against the float64 reference (the engine's engrams are float32 in both)
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)  # measured: at most 7e-7 apart
LIFE_TOL = dict(rtol=1e-5, atol=5e-5)  # measured: at most 7e-6 apart

FORMS = {  # the authors' model, and the toolkit's default arithmetic (drawn at random, so not a no-op)
    "authors": dict(preset="memoria_authors", residual="post_norm", abstractor="authors"),
    "default": dict(preset="memoria", residual="add", abstractor="transformer"),
}


def run_both(family: str, form: str, attn: str = "sdpa", pad_last: int = 0, mask_padding: bool = True,
             memoria: dict | None = None):
    """Five segments of two documents through the model and, row by row, through the reference; row 0 starts
    a new document before segment 3; row 1's last segment ends in `pad_last` pad tokens."""
    f = FORMS[form]
    settings = {} if f["preset"] == "memoria_authors" else {"memory_init": "random"}
    model = tiny_encoder(family, f["preset"], attn_implementation=attn, memoria=memoria or {}, **settings)
    randomize(model)
    refs = [AuthorsEncoderReference(model.state_dict(), model.config, family, f["residual"], f["abstractor"],
                                    mask_padding) for _ in range(2)]
    segs = document_segments(family)
    memory, model_logits, ref_logits, reminded_ltm = None, [], [], 0
    for t, ids in enumerate(segs):
        mask = torch.ones_like(ids)
        if t == len(segs) - 1 and pad_last:
            mask[1, -pad_last:] = 0
            ids = ids.masked_fill(mask == 0, PAD[family])
        reset = torch.tensor([t == 3, False])
        with torch.no_grad():
            out = model(ids, attention_mask=mask, memory=memory, reset=reset)
        memory = out.memory
        reminded_ltm += int(out.memory_stats.reminded_ltm.sum())
        if t == 3:
            refs[0].reset()
        model_logits.append(out.logits)
        ref_logits.append(torch.stack([refs[b].segment(ids[b], mask[b].bool()) for b in range(2)]).float())
    if model.config.memoria["use_ltm"]:
        assert reminded_ltm > 0, "no LTM engram was reminded: the comparison would not reach the LTM search"
    return model, memory, refs, model_logits, ref_logits


def assert_same_memory(memory, refs, config) -> None:
    """The engine's state row by row equals the reference memory: the same engrams (by uid), kinds, vectors,
    lifespans and co-retrieval counts."""
    state = memory.state
    for b, ref in enumerate(r.memory for r in refs):
        live = [s for s in range(state.capacity) if int(state.kind[b, s]) != 0]
        by_uid = {int(state.uid[b, s]): s for s in live}
        assert sorted(by_uid) == ref.uids(), f"row {b}: engrams {sorted(by_uid)} != reference {ref.uids()}"
        for uid, slot in by_uid.items():
            e = ref.engrams[uid]
            assert KIND_NAMES[int(state.kind[b, slot])] == e.kind
            torch.testing.assert_close(state.vectors[b, slot], torch.tensor(e.vector, dtype=torch.float32),
                                       rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state.lifespan[b, slot].item(), e.lifespan, **LIFE_TOL)
            for other, slot2 in by_uid.items():
                assert int(state.counts[b, slot, slot2]) == ref.count(uid, other), f"row {b}: count {uid}->{other}"
        assert int(state.step[b]) == ref.step


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("form", ["authors", "default"])
def test_logits_and_memory_equal_the_authors_forward(family, form):
    model, memory, refs, got, want = run_both(family, form)
    for t, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **LOGIT_TOL, msg=lambda m: f"segment {t}: {m}")
    assert_same_memory(memory, refs, model.config)
    # what was compared reached every part of the memory (run_both checks that LTM engrams were reminded)
    kinds = {e.kind for e in refs[1].memory.engrams.values()}
    assert kinds >= {"stm", "ltm"} and refs[0].memory.step == 2 and refs[1].memory.step == 5
    # and the memory changes the logits by far more than the tolerance
    fresh = tiny_encoder(family, FORMS[form]["preset"], **({} if form == "authors" else {"memory_init": "random"}))
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        alone = fresh(document_segments(family)[4]).logits  # the last segment with an empty memory
    assert (alone[1] - got[4][1]).abs().max() > 100 * LOGIT_TOL["atol"]


def test_eager_attention_equals_the_authors_forward():
    _, memory, refs, got, want = run_both("bert", "authors", attn="eager")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **LOGIT_TOL)
    assert_same_memory(memory, refs, None)


@pytest.mark.parametrize("form", ["authors", "default"])
@pytest.mark.parametrize("ablation", [{"use_stm": False, "use_ltm": False}, {"use_ltm": False}],
                         ids=["memoria_wm", "memoria_wm_stm"])
def test_the_ablations_equal_the_authors_forward(form, ablation):
    """Table 7's ablations on the encoder: nothing reminded (their attention over no engram: a zero context),
    or short-term engrams only."""
    model, memory, refs, got, want = run_both("bert", form, memoria=ablation)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **LOGIT_TOL)
    assert_same_memory(memory, refs, model.config)


@pytest.mark.parametrize("form", ["authors", "default"])
def test_padding_is_read_by_nothing(form):
    """A padded last segment: the model equals the reference that leaves padding out of the abstractor and
    of the contribution (the toolkit's departure), and not the authors' unmasked arithmetic."""
    model, memory, refs, got, want = run_both("roberta", form, pad_last=3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **LOGIT_TOL)
    assert_same_memory(memory, refs, model.config)
    *_, authors = run_both("roberta", form, pad_last=3, mask_padding=False)
    assert (authors[4][1] - got[4][1]).abs().max() > 100 * LOGIT_TOL["atol"]


def test_the_authors_own_abstractor_and_memory_package_give_the_same_forward():
    """Their `Abstractor` and `Memoria` classes in the forward (memoria-pytorch 1.1.0), where the package and the
    engine agree: every STM engram reminded (K_stm at least what STM can hold, so no ranking is involved) and no LTM
    retrieval (K_ltm = 0: their search reminds engram 0 of an empty LTM, docs/algorithm.md), over four segments, one
    row reset. The logits and each engram's lifespan (fed by the attention weights) are theirs."""
    pytest.importorskip("memoria")
    from encoder_reference import PackageEncoderReference

    settings = dict(num_wm=4, num_stm_reminded=16, num_ltm_reminded=0, stm_capacity=16, initial_lifespan=3.0,
                    alpha=2.0)
    for family in ("bert", "roberta"):
        model = tiny_encoder(family, "memoria_authors", memoria=settings)
        randomize(model)
        refs = [PackageEncoderReference(model.state_dict(), model.config, family) for _ in range(2)]
        memory = None
        for t, ids in enumerate(document_segments(family, count=4)):
            with torch.no_grad():
                out = model(ids, memory=memory, reset=torch.tensor([t == 2, False]))
            memory = out.memory
            if t == 2:
                refs[0].reset()
            want = torch.stack([refs[b].segment(ids[b], torch.ones_like(ids[b], dtype=torch.bool)) for b in range(2)])
            torch.testing.assert_close(out.logits, want.float(), **LOGIT_TOL)
        state = memory.state
        for b, ref in enumerate(refs):
            theirs = ref.package.engrams
            live = state.kind[b] != 0
            assert int(live.sum()) == theirs.memory_length  # the same engrams are alive
            ours = sorted(state.lifespan[b][live].tolist())
            torch.testing.assert_close(torch.tensor(ours), theirs.lifespan[0].sort().values, **LIFE_TOL)
        assert int(out.memory_stats.reminded_stm.min()) > 0
