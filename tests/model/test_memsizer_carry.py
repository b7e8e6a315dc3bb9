"""The `memsizer` memory kind: each layer's key-value memory S and the stream's length t carried across
segments.

The defining check: a stream read segment by segment (one token at a time included: the recurrent
form) gives the logits of the same stream read at once (the parallel form), in float64 and in
fp32. Then causality across segments, resets, rows moved and stacked, padding, a saved memory,
that nothing flows back into the memory, and that the state does not grow.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import (assert_a_reset_row_starts_a_fresh_stream, assert_only_later_tokens_change,
                           assert_row_operations_keep_outputs, changed_token, run_stream)

from memoria_ds.model import KINDS, build_model, memory_from_state_dict
from memoria_ds.model.memsizer import MemSizerConfig, MemSizerLMHeadModel
from memoria_ds.model.recurrent import MemSizerMemory

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V = 257  # model_helpers' vocabulary


def model_of(memory_type: str = "memsizer", dtype=torch.float64, **kw) -> MemSizerLMHeadModel:
    values = dict(vocab_size=V, n_positions=64, n_layer=2, n_head=4, n_embd=32, memsizer_slots=8, embd_pdrop=0.0,
                  attn_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0, memory_type=memory_type)
    torch.manual_seed(0)
    model = MemSizerLMHeadModel(MemSizerConfig(**{**values, **kw})).to(dtype).eval()
    with torch.no_grad():  # the norms off 1/0, so that every part of the carried state matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def segments_of(model, ids: torch.Tensor, L: int, memory=None):
    out = []
    for s in range(0, ids.shape[1], L):
        o = model(ids[:, s : s + L], memory=memory)
        memory = o.memory
        out.append(o.logits)
    return torch.cat(out, 1), memory


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("L", [1, 5, 8])
def test_reading_in_segments_equals_reading_at_once(L, dtype, atol):
    model = model_of(dtype=dtype)
    ids = torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))
    whole = model(ids).logits  # one segment: the parallel form
    carried, memory = segments_of(model, ids, L)  # L = 1: the recurrent form, one token at a time
    torch.testing.assert_close(carried, whole, atol=atol, rtol=0)
    assert isinstance(memory, MemSizerMemory) and memory.tokens.tolist() == [24] * 3
    assert memory.sums.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the preset that carries nothing (same weights) equals it on the first segment only
    plain = model_of("none", dtype=dtype)
    alone = torch.cat([plain(ids[:, s : s + L]).logits for s in range(0, 24, L)], 1)
    torch.testing.assert_close(alone[:, :L], whole[:, :L], atol=atol, rtol=0)
    assert (alone[:, L:] - whole[:, L:]).abs().amax() > 1e-3


def test_a_token_changes_only_what_comes_after_it_and_the_memory_carries_it():
    model = model_of()
    segs = list(torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(2)).split(8, dim=1))
    with torch.no_grad():
        a = [o.logits for o in run_stream(model, segs)[0]]
        b = [o.logits for o in run_stream(model, changed_token(segs, 1, 3))[0]]
    assert_only_later_tokens_change(a, b, t=1, pos=3)


def _logits(model, segs, memory=None):
    with torch.no_grad():
        return [o.logits for o in run_stream(model, segs, memory=memory)[0]]


def test_a_reset_row_reads_as_a_fresh_stream_even_after_a_diverged_step():
    model = model_of()
    segs = list(torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(3)).split(8, dim=1))
    assert_a_reset_row_starts_a_fresh_stream(model, segs, _logits, poison=("sums",), keep_atol=0)
    memory = run_stream(model, segs[:2])[1]
    memory.reset()
    assert not memory.sums.any() and not memory.tokens.any()


def test_rows_taken_put_and_stacked_read_the_same():
    model = model_of()
    segs = list(torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(4)).split(8, dim=1))
    memory = run_stream(model, segs[:2])[1]
    assert_row_operations_keep_outputs(model, segs[2:], memory, _logits, atol=0)


def test_a_saved_memory_continues_bit_for_bit_and_a_wrong_one_is_refused():
    model = model_of(dtype=torch.float32)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    _, memory = segments_of(model, ids[:, :16], 8)
    want = model(ids[:, 16:], memory=memory.clone()).logits
    back = memory_from_state_dict(memory.state_dict(), model_config=model.config)
    torch.testing.assert_close(model(ids[:, 16:], memory=back).logits, want, atol=0, rtol=0)
    KINDS["memsizer"].check_state(memory.state_dict(), model.config)
    bad = dict(memory.state_dict(), tokens=memory.tokens[:1])
    with pytest.raises(ValueError, match="`tokens` has shape"):
        memory_from_state_dict(bad)
    with pytest.raises(ValueError, match="blocks, slots, width"):
        model_of(n_layer=1, dtype=torch.float32)(ids[:, 16:], memory=back)


def test_padding_at_a_streams_end_is_neither_stored_nor_counted():
    """A row whose stream ends inside a segment (right padding, as the loop pads) keeps exactly what
    reading its real tokens alone leaves: S and t."""
    model = model_of()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    _, memory = segments_of(model, ids[:, :8], 8)
    padded = model(ids[:, 8:], memory=memory, attention_mask=mask[:, 8:]).memory
    _, alone = segments_of(model, ids[1:, :11], 11)
    assert padded.tokens.tolist() == [16, 11]
    torch.testing.assert_close(padded.sums[1], alone.sums[0], atol=1e-12, rtol=0)


def test_no_gradient_flows_into_the_memory_and_a_bf16_model_keeps_an_fp32_memory():
    model = model_of(dtype=torch.float32).train()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(7))
    out = model(ids[:, :8], labels=ids[:, :8])
    assert not any(t.requires_grad for t in (out.memory.sums, out.memory.tokens))
    out = model(ids[:, 8:], labels=ids[:, 8:], memory=out.memory)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    low = model.to(torch.bfloat16)
    memory = segments_of(low, ids, 8)[1]
    assert memory.sums.dtype == torch.float32 and torch.isfinite(memory.sums).all()
    memory_from_state_dict(memory.state_dict(), model_config=low.config)


def test_the_state_does_not_grow_with_the_stream():
    model = model_of(dtype=torch.float32)
    memory = model.empty_memory(2)
    shapes = (tuple(memory.sums.shape), tuple(memory.tokens.shape))
    for seed in range(3):
        memory = model(torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed)),
                       memory=memory).memory
    assert (tuple(memory.sums.shape), tuple(memory.tokens.shape)) == shapes == ((2, 2, 8, 32), (2,))
    assert model.memory_kind.row_bytes(8) == {"sums": 2 * 8 * 32 * 4, "tokens": 8}


def test_the_carry_preset_builds_the_memsizer_kind():
    from transformers import GPT2Config

    model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40), "memsizer_carry", memsizer_slots=4)
    assert model.memory_kind.name == "memsizer" and model.memory_kind.carries_state
    memory = model.empty_memory(2)
    assert isinstance(memory, MemSizerMemory) and memory.sums.shape == (2, 1, 4, 16) and memory.batch_size == 2
