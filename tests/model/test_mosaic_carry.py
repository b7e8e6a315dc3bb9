"""The `mosaic` memory kind: a Memory Mosaic's contextual memory carried across segments.

The defining check: with room for every pair, a stream read segment by segment gives the
logits of the same stream read at once (float64). Then resets, a short memory, saving and
moving rows, and that nothing flows back into the memory.
"""

from __future__ import annotations

import pytest
import torch

from memoria_ds.model import build_model, memory_from_state_dict
from memoria_ds.model.mosaic import MemoryMosaicConfig, MemoryMosaicLMHeadModel
from memoria_ds.model.recurrent import MosaicMemory

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def model_of(memory_type: str = "mosaic", length: int | None = None, **kw) -> MemoryMosaicLMHeadModel:
    values = dict(vocab_size=41, n_positions=64, n_layer=2, n_head=4, n_embd=32, embd_pdrop=0.0, attn_pdrop=0.0,
                  resid_pdrop=0.0, bos_token_id=0, eos_token_id=0, pmem_count=2, memory_type=memory_type,
                  mosaic_memory_length=length)
    config = MemoryMosaicConfig(**{**values, **kw})
    torch.manual_seed(0)
    model = MemoryMosaicLMHeadModel(config).double().eval()
    with torch.no_grad():  # away from the init, so that every carried quantity matters
        for name, p in model.named_parameters():
            if name.endswith((".leak", ".scale", ".mix")):
                p.add_(torch.rand_like(p) * 0.1)
    return model


def segments(model, ids: torch.Tensor, L: int, memory=None, reset=None):
    out = []
    for s in range(0, ids.shape[1], L):
        o = model(ids[:, s : s + L], memory=memory, reset=reset if s == 0 else None)
        memory = o.memory
        out.append(o.logits)
    return torch.cat(out, 1), memory


@pytest.mark.parametrize("L", [1, 5, 8])
def test_reading_in_segments_equals_reading_at_once(L):
    model = model_of(length=100)
    ids = torch.randint(0, 41, (3, 24), generator=torch.Generator().manual_seed(1))
    whole = model(ids).logits  # one segment: what the paper's model computes
    carried, memory = segments(model, ids, L)
    torch.testing.assert_close(carried, whole, atol=1e-10, rtol=0)
    assert isinstance(memory, MosaicMemory) and memory.mask.sum(1).tolist() == [23] * 3  # 23 complete pairs
    # the paper's model (same weights, nothing carried) equals it on the first segment only
    plain = model_of("none")
    alone = torch.cat([plain(ids[:, s : s + L]).logits for s in range(0, 24, L)], 1)
    torch.testing.assert_close(alone[:, :L], whole[:, :L], atol=1e-10, rtol=0)
    if L > 1:
        assert (alone[:, L:] - whole[:, L:]).abs().amax() > 1e-3


def test_a_short_memory_forgets_the_oldest_pairs_but_not_the_leaky_averages():
    ids = torch.randint(0, 41, (2, 24), generator=torch.Generator().manual_seed(2))
    long, _ = segments(model_of(length=100), ids, 8)
    short, memory = segments(model_of(), ids, 8)  # default: one segment's pairs (8)
    assert memory.length == 8 and memory.mask.all()
    torch.testing.assert_close(short[:, :16], long[:, :16], atol=1e-10, rtol=0)  # nothing forgotten yet
    assert (short[:, 16:] - long[:, 16:]).abs().amax() > 1e-6


def test_a_reset_row_reads_as_a_fresh_stream():
    model = model_of(length=100)
    a = torch.randint(0, 41, (2, 16), generator=torch.Generator().manual_seed(3))
    _, memory = segments(model, a, 8)
    b = torch.randint(0, 41, (2, 8), generator=torch.Generator().manual_seed(4))
    out = model(b, memory=memory.clone(), reset=torch.tensor([True, False])).logits
    fresh = model(b[:1]).logits
    torch.testing.assert_close(out[:1], fresh, atol=1e-10, rtol=0)
    assert (model(b[1:]).logits - out[1:]).abs().amax() > 1e-6  # the other row kept its past
    memory.reset()
    assert not memory.mask.any() and not memory.has_last.any() and not memory.kbar.any()


def test_saved_moved_and_stacked_rows_read_the_same():
    model = model_of(length=100)
    ids = torch.randint(0, 41, (3, 16), generator=torch.Generator().manual_seed(5))
    _, memory = segments(model, ids, 8)
    nxt = torch.randint(0, 41, (3, 8), generator=torch.Generator().manual_seed(6))
    want = model(nxt, memory=memory.clone()).logits
    back = memory_from_state_dict(memory.state_dict())
    torch.testing.assert_close(model(nxt, memory=back).logits, want, atol=0, rtol=0)
    parts = [memory.take_rows([2]), memory.take_rows([0, 1])]
    stacked = MosaicMemory.cat(parts).take_rows([1, 2, 0])
    torch.testing.assert_close(model(nxt, memory=stacked).logits, want, atol=0, rtol=0)
    bad = memory.state_dict()
    bad["kbar"] = bad["kbar"][:, :1]
    with pytest.raises(ValueError, match="`kbar` has shape"):
        memory_from_state_dict(bad)
    with pytest.raises(ValueError, match="blocks, heads"):
        model_of(length=100, n_layer=1)(nxt, memory=memory)


def test_no_gradient_flows_into_the_memory_and_training_runs():
    model = model_of()
    model.train()
    ids = torch.randint(0, 41, (2, 16), generator=torch.Generator().manual_seed(7))
    out = model(ids[:, :8], labels=ids[:, :8])
    assert not any(t.requires_grad for t in out.memory.state_dict().values() if isinstance(t, torch.Tensor))
    out = model(ids[:, 8:], labels=ids[:, 8:], memory=out.memory)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_carry_preset_builds_the_mosaic_kind():
    from transformers import GPT2Config

    model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40), "memory_mosaic_carry",
                        mosaic_memory_length=32)
    assert model.memory_kind.name == "mosaic" and model.config.mosaic_memory_length == 32
    memory = model.empty_memory(2)
    assert isinstance(memory, MosaicMemory) and memory.batch_size == 2 and memory.length == 0
