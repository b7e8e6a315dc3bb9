"""bf16 (and fp16 on GPU) backbones keep an fp32 memory state; outputs stay finite."""

import pytest
import torch
from model_helpers import run_stream, segments


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast"])
def test_bf16_backbone_fp32_memory(make_model, preset):
    model = make_model(preset, memory_init="random").to(torch.bfloat16).train()
    memory = None
    for x in segments(count=4):
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
        assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
        assert torch.isfinite(out.loss)
    state = memory.state
    assert state.vectors.dtype == state.sq_norms.dtype == state.lifespan.dtype == torch.float32
    assert memory.prev_hidden.dtype == torch.float32
    assert torch.isfinite(state.vectors).all() and int(out.memory_stats.reminded_stm.min()) > 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast"])
def test_bf16_autocast_keeps_the_memory_step_in_fp32(make_model, preset):
    """engine=torch trains in bf16 under autocast. The memory step must not follow it: its
    scores in bf16 were read as float32 bits (a crash, or a wrong ranking), and its state is fp32."""
    model = make_model(preset, memory_init="random").train()
    memory = None
    for x in segments(count=4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
        assert torch.isfinite(out.loss)
    assert memory.state.vectors.dtype == torch.float32 and int(out.memory_stats.reminded_stm.min()) > 0
    # the same remind under autocast and without it: the same engrams, bit for bit
    kind, state, settings = model.memory_kind, memory.state, model.memory_kind.settings
    wm = torch.randn(state.batch_size, settings.num_wm, state.dim, generator=torch.Generator().manual_seed(0))
    plain = kind.engine.remind(state.clone(), wm, settings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = kind.engine.remind(state.clone(), wm, settings)
    assert torch.equal(plain.reminded_slots, cast.reminded_slots) and torch.equal(plain.reminded, cast.reminded)


def test_bf16_memory_carries_over_to_fp32_model(make_model):
    """The memory is dtype-free: a bf16 run's memory continues in an fp32 copy of the model."""
    model = make_model("memoria", memory_init="random")
    half = make_model("memoria", memory_init="random")
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    segs = segments(count=3)
    with torch.no_grad():
        _, memory = run_stream(half, segs[:2])
        out = model(segs[2], memory=memory)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_xl_bf16(make_model):
    model = make_model("xl").to(torch.bfloat16)
    with torch.no_grad():
        outs, memory = run_stream(model, segments(count=3))
    assert memory.keys.dtype == torch.bfloat16 and all(torch.isfinite(o.logits).all() for o in outs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_gpu(make_model, dtype):
    model = make_model("memoria", memory_init="random").to("cuda", dtype).train()
    memory = None
    for x in segments(count=4):
        x = x.cuda()
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory
        assert torch.isfinite(out.logits).all()
    assert memory.state.vectors.dtype == torch.float32 and memory.state.vectors.is_cuda
