"""peft LoRA on a Memoria encoder: adapters on the backbone's layers only, the memory modules and the head
trainable, the wrapped model starts as the unwrapped one, trains exactly what is trainable, and merges back."""

from __future__ import annotations

import pytest
import torch
from encoder_helpers import document_segments, randomize, tiny_encoder

from memoria_ds.model.encoder import apply_encoder_lora, build_encoder_model


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_adapters_sit_on_the_backbone_only(family):
    model = tiny_encoder(family)
    peft_model = apply_encoder_lora(model, r=4)
    adapted = {name.split(".lora_")[0] for name, _ in peft_model.named_parameters() if ".lora_" in name}
    prefix = f"base_model.model.{family}.encoder.layer."
    assert adapted and all(name.startswith(prefix) for name in adapted)
    kinds = {name[len(prefix):].split(".", 1)[1] for name in adapted}
    assert kinds == {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                     "intermediate.dense", "output.dense"}
    assert len(adapted) == 6 * model.config.num_hidden_layers
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    memory_and_head = {n for n in trainable if ".lora_" not in n}
    assert memory_and_head == {n for n, _ in peft_model.named_parameters()
                               if n.startswith(("base_model.model.abstractor.", "base_model.model.memory_layers.",
                                                "base_model.model.classifier."))}


def test_the_wrapped_model_starts_as_the_model_and_trains_what_is_trainable():
    model = tiny_encoder("roberta", "memoria_authors")
    randomize(model)
    segs = document_segments("roberta", count=3)
    with torch.no_grad():
        memory, want = None, []
        for ids in segs:
            out = model(ids, memory=memory)
            memory, _ = out.memory, want.append(out.logits)
    peft_model = apply_encoder_lora(model, r=4).train()
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    memory = None
    for ids, logits in zip(segs, want):
        with torch.no_grad():
            out = peft_model(ids, memory=memory)  # the memory goes through peft's forward
        torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
        memory = out.memory
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    labels = torch.tensor([0, 2])
    losses = []
    for _ in range(4):
        memory, total = None, 0.0
        for ids in segs:
            out = peft_model(ids, labels=labels, memory=memory)
            memory, total = out.memory, total + out.loss / len(segs)  # the per-segment losses averaged
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    assert losses[-1] < losses[0]
    for name, p in peft_model.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        if p.requires_grad and ("lora_B" in name or "memory_layers" in name or "classifier" in name):
            assert moved, f"{name} did not train"
        if not p.requires_grad:
            assert not moved, f"frozen {name} changed"


@pytest.mark.slow
def test_the_merged_model_saves_and_reloads(tmp_path):
    model = tiny_encoder("bert")
    peft_model = apply_encoder_lora(model, r=4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    ids = document_segments("bert", count=1)[0]
    with torch.no_grad():
        want = peft_model(ids).logits
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path)
    loaded = build_encoder_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-6)
