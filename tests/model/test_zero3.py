"""Real DeepSpeed ZeRO-3 on CPU: the model's per-module calls let ZeRO-3 gather every weight.

Runs in a subprocess (its own process group and DeepSpeed config), one rank, gloo.
"""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, socket, torch
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from transformers import GPT2Config
    from transformers.integrations import HfDeepSpeedConfig
    from memoria_ds.model import build_model
    from memoria_ds.train.distributed import init_distributed

    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=257, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    memoria = dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, initial_lifespan=3.0, alpha=2.0)
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
          "zero_allow_untested_optimizer": True}
    init_distributed()  # the toolkit's own start: gloo, without DeepSpeed's shm op (no compile, no file lock)
    keep = HfDeepSpeedConfig(ds)  # HF partitions while building and initialises gathered
    model = build_model(backbone, "memoria", memoria=memoria)
    partitioned = model.transformer.wte.weight.numel() == 0
    model.activation_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    segs = torch.randint(0, 257, (3, 48), generator=torch.Generator().manual_seed(0)).split(12, dim=1)
    losses = []
    for epoch in range(3):
        memory = None
        for x in segs:
            out = engine(x, labels=x, memory=memory)
            engine.backward(out.loss)
            engine.step()
            memory = out.memory
        losses.append(out.loss.item())
    proj = model.memory_blocks[1].memory_attention.out_proj.weight
    with deepspeed.zero.GatheredParameters([proj]):
        moved = proj.abs().max().item()
    print(json.dumps(dict(partitioned=partitioned, losses=losses, steps=memory.state.step.tolist(), moved=moved)))
    """
)


def test_memoria_trains_under_zero3(tmp_path):
    script = tmp_path / "zero3.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["partitioned"]  # ZeRO-3 really partitioned the weights
    assert result["steps"] == [3, 3, 3]
    assert all(x == x and x < 10 for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert result["moved"] > 0  # the no-op output projection was gathered, trained and is non-zero now
