"""The Compressive Transformer, the infinity-former and Memformer under real DeepSpeed ZeRO-3 (CPU, one rank,
gloo, activation checkpointing), in bf16, and with LoRA on the backbone: their own weights
(`memory_net`) are gathered, trained and kept trainable."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from model_helpers import run_stream, segments

from memoria_ds.model import apply_lora

SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, torch
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from transformers import GPT2Config
    from transformers.integrations import HfDeepSpeedConfig
    from memoria_ds.model import build_model
    from memoria_ds.train.distributed import init_distributed

    preset = sys.argv[1]
    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=257, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
          "zero_allow_untested_optimizer": True}
    init_distributed()
    keep = HfDeepSpeedConfig(ds)
    model = build_model(backbone, preset, segment_length=12)
    net = model.memory_net
    weight = {"infinity": lambda: net.key[0].weight, "memformer": lambda: net.read_out[0].weight}.get(
        preset, lambda: net.keys[0].linear.weight)()
    partitioned = weight.numel() == 0
    model.activation_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    with deepspeed.zero.GatheredParameters([weight]):
        before = weight.detach().clone()
    segs = torch.randint(0, 257, (3, 48), generator=torch.Generator().manual_seed(0)).split(12, dim=1)
    losses = []
    for epoch in range(2):
        memory = None
        for x in segs:
            out = engine(x, labels=x, memory=memory)
            engine.backward(out.loss)
            engine.step()
            memory = out.memory.detach_()  # one segment per step (memformer's slots keep their graph)
        losses.append(out.loss.item())
    with deepspeed.zero.GatheredParameters([weight]):
        moved = (weight.detach() - before).abs().max().item()
    print(json.dumps(dict(partitioned=partitioned, losses=losses, moved=moved)))
    """
)


@pytest.mark.parametrize("preset", ["compressive", "infinity", "memformer"])
def test_trains_under_zero3_with_activation_checkpointing(tmp_path, preset):
    script = tmp_path / "zero3.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), preset], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["partitioned"], "ZeRO-3 partitioned the kind's weights while building"
    assert all(loss == loss for loss in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert result["moved"] > 0, "the kind's own weights were gathered and trained"


@pytest.mark.parametrize("preset", ["compressive", "infinity", "memformer"])
def test_bf16_runs_and_keeps_its_state(make_model, preset):
    model = make_model(preset, segment_length=12).to(torch.bfloat16).train()
    memory = None
    for x in segments(count=3):
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        memory = out.memory.detach_()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.memory_net.parameters()
               if p.requires_grad and p.grad is not None)
    if preset == "infinity":
        assert memory.coefficients.dtype == torch.float32 and memory.has_coefficients.all()
    elif preset == "memformer":
        assert memory.slots.dtype == torch.float32 and not memory.fresh.any()
    else:
        assert memory.compressed_keys.dtype == torch.bfloat16 and memory.compressed_mask.any()


@pytest.mark.parametrize("preset", ["compressive", "infinity", "memformer"])
def test_lora_keeps_the_kinds_weights_trainable(make_model, preset):
    model = make_model(preset, segment_length=12)
    peft = apply_lora(model, r=2)
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert any("memory_net" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("transformer.h.0.mlp.c_fc.base_layer" in n for n in trainable)
    peft.train()
    _, memory = run_stream(peft, segments(count=2))
    out = peft(segments(count=3)[2], labels=segments(count=3)[2], memory=memory)
    out.loss.backward()
    grads = [p.grad for n, p in peft.named_parameters() if "memory_net" in n and p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
