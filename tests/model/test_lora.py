"""peft LoRA on the backbone's Conv1D layers; the Memoria modules stay fully trainable."""

import pytest
import torch
from model_helpers import run_stream, segments
from peft.tuners.lora import LoraLayer

from memoria_ds.model import MemoriaGPT2LMHeadModel, apply_lora

# peft asks the model for `is_gradient_checkpointing`, which transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def _is_memory(name: str) -> bool:
    return ".abstractor." in name or ".memory_blocks." in name


def test_only_adapters_and_memory_modules_are_trainable(make_model):
    model = apply_lora(make_model("memoria"), r=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if "lora_" in n or _is_memory(n)}
    assert any(_is_memory(n) for n in trainable) and any("lora_" in n for n in trainable)
    lora_layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(lora_layers) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    assert all(m.fan_in_fan_out for m in lora_layers)


def test_lora_starts_as_the_plain_model(make_model):
    plain = make_model("memoria", memory_init="random")
    wrapped = make_model("memoria", memory_init="random")
    wrapped.load_state_dict(plain.state_dict())
    wrapped = apply_lora(wrapped)
    segs = segments(count=3)
    with torch.no_grad():
        a, _ = run_stream(plain, segs)
        b, _ = run_stream(wrapped, segs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_changes_exactly_the_trainable_parameters(make_model, checkpointing):
    base = make_model("memoria")
    if checkpointing:
        base.activation_checkpointing_enable()
    model = apply_lora(base, r=4)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    segs = segments(count=3)
    for _ in range(2):  # LoRA's B and the memory's output projection start at 0: two steps move everything
        memory = None
        for x in segs:
            out = model(x, labels=x, memory=memory)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            memory = out.memory
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert changed == trainable


def test_merged_export_round_trips(make_model, tmp_path):
    """Export: merge the adapters into the backbone, save, reload: same logits, no peft needed."""
    model = apply_lora(make_model("memoria", memory_init="random"), r=4)
    with torch.no_grad():  # move the adapters away from their no-op start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    segs = segments(count=3)
    with torch.no_grad():
        expected, _ = run_stream(model, segs)
    merged = model.merge_and_unload()
    assert isinstance(merged, MemoriaGPT2LMHeadModel)
    merged.save_pretrained(tmp_path)
    loaded = MemoriaGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        got, _ = run_stream(loaded, segs)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
