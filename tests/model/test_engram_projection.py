"""The engrams' keys and values of every block's memory attention in one projection
(`memory_attention.engram_key_values`) compute what each block's own projection computes.

The reference is the same model with LoRA (peft) on every block's `kv_proj`: its adapters start at
zero, so it is the same function, and a wrapped projection is projected by its own module, block by
block (the path every model took before the fused projection).
"""

import pytest
import torch
from model_helpers import losses_and_grads, segments
from peft import LoraConfig, get_peft_model

from memoria_ds.model.memory_attention import engram_key_values

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def _train_segments(model, segs):
    """Training segments with the memory carried: losses, last logits, gradients by the base model's names."""
    model.train()
    losses, grads, out = losses_and_grads(model, segs)
    names = {n: n.replace("base_model.model.", "").replace("base_layer.", "") for n in grads}
    return losses, out.logits.detach(), {names[n]: g for n, g in grads.items()}


def _pair(make_model, preset, **settings):
    """(fused, per-block) models with the same weights, the memory's modules drawn large enough to matter."""
    fused = make_model(preset, memory_init="random", **settings)
    with torch.no_grad():
        for module in fused.memory_modules():
            for p in module.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)
    own = make_model(preset, memory_init="random", **settings)
    own.load_state_dict(fused.state_dict())
    own = get_peft_model(own, LoraConfig(r=2, target_modules=["kv_proj"]))
    own.requires_grad_(True)  # peft froze the rest: every weight trains, as in the fused model
    return fused, own


@pytest.mark.parametrize("preset", ["memoria", "memoria_fast", "xl+memoria", "memoria_wm"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_projection_for_every_block_equals_each_block_s_own(make_model, preset, checkpointing):
    fused, own = _pair(make_model, preset)
    if checkpointing:
        fused.activation_checkpointing_enable()
        own.get_base_model().activation_checkpointing_enable()
    calls = {"fused": 0, "own": 0}
    for name, model in (("fused", fused), ("own", own)):
        for block in model.memory_blocks if name == "fused" else own.get_base_model().memory_blocks:
            block.memory_attention.kv_proj.register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    segs = segments(batch=3, count=3)
    a_loss, a_logits, a_grads = _train_segments(fused, segs)
    b_loss, b_logits, b_grads = _train_segments(own, segs)
    assert calls["fused"] == 0 and calls["own"] > 0  # each path took its own way
    torch.testing.assert_close(a_loss, b_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(a_logits, b_logits, rtol=0, atol=2e-5)
    assert set(a_grads) <= set(b_grads)
    for name, grad in a_grads.items():
        torch.testing.assert_close(grad, b_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any("kv_proj" in n for n in a_grads)  # the fused projection's weights get their gradients


def test_the_projection_splits_as_each_block_would():
    """By hand: block i's keys and values are its own Linear's output, split in two and into heads."""
    from memoria_ds.model.memory_attention import MemoryAttention

    torch.manual_seed(0)
    attentions = [MemoryAttention(8, 2, 6, "sequential", 1e-5, 0.0, 0.0) for _ in range(3)]
    engrams = torch.randn(2, 5, 8)
    fused = engram_key_values(attentions, engrams)
    assert len(fused) == 3
    for attention, kv in zip(attentions, fused):
        assert kv.shape == (2, 2, 2, 5, 3)  # (k/v, B, H, T, hd)
        k, v = attention.kv_proj(engrams).split(6, dim=-1)
        torch.testing.assert_close(kv[0], k.view(2, 5, 2, 3).transpose(1, 2), rtol=0, atol=1e-6)
        torch.testing.assert_close(kv[1], v.view(2, 5, 2, 3).transpose(1, 2), rtol=0, atol=1e-6)
    assert engram_key_values([], engrams) is None
