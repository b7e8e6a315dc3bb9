"""Real DeepSpeed ZeRO-3 on CPU: the model's per-module calls let ZeRO-3 gather every weight.

Runs in a subprocess (its own process group and DeepSpeed config), one rank, gloo.
"""

import json
import os
import subprocess
import sys
import textwrap

# one CPU rank (gloo), a tiny backbone and a ZeRO-3 config: what both scripts start from
PRELUDE = textwrap.dedent(
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
    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
          "zero_allow_untested_optimizer": True}
    init_distributed()  # the toolkit's own start: gloo, without DeepSpeed's shm op (no compile, no file lock)
    """
)

SCRIPT = PRELUDE + textwrap.dedent(
    """
    memoria = dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, initial_lifespan=3.0, alpha=2.0)
    keep = HfDeepSpeedConfig(ds)  # HF partitions while building and initialises gathered
    model = build_model(backbone, "memoria", memoria=memoria)
    partitioned = model.transformer.wte.weight.numel() == 0
    model.activation_checkpointing_enable()
    kv = [b.memory_attention.kv_proj for b in model.memory_blocks]
    calls = []  # a block's own key/value projection called: the engrams were not projected for all blocks at once
    for m in kv:
        m.register_forward_hook(lambda *a: calls.append(1))
    with deepspeed.zero.GatheredParameters([m.weight for m in kv]):
        kv_start = [m.weight.detach().clone() for m in kv]
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    segs = torch.randint(0, 257, (3, 48), generator=torch.Generator().manual_seed(0)).split(12, dim=1)
    with torch.no_grad():  # the model called outside the engine, before its first forward
        model(segs[0], labels=segs[0])
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
    with deepspeed.zero.GatheredParameters([proj, *(m.weight for m in kv)]):
        moved = proj.abs().max().item()
        kv_moved = min((m.weight - w).abs().max().item() for m, w in zip(kv, kv_start))
    print(json.dumps(dict(partitioned=partitioned, losses=losses, steps=memory.state.step.tolist(), moved=moved,
                          kv_moved=kv_moved, calls=len(calls))))
    """
)


def _run(script, text: str) -> dict:
    """Run `text` as a script on one CPU rank; the JSON of its last line."""
    script.write_text(text)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_memoria_trains_under_zero3(tmp_path):
    """The blocks' key/value projections run as one matmul (no block calls its own), in the engine's forward and
    outside it: DeepSpeed gathers a partitioned weight read outside its module's call (its discovery of
    external parameters) for the forward and the backward, and they train."""
    result = _run(tmp_path / "zero3.py", SCRIPT)
    assert result["partitioned"]  # ZeRO-3 really partitioned the weights
    assert result["steps"] == [3, 3, 3]
    assert all(x == x and x < 10 for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert result["moved"] > 0  # the no-op output projection was gathered, trained and is non-zero now
    assert result["kv_moved"] > 0  # every block's key/value projection was trained
    assert result["calls"] == 0


PKM_SCRIPT = PRELUDE + textwrap.dedent(
    """
    from memoria_ds.train.engine import param_groups
    keep = HfDeepSpeedConfig(ds)  # HF partitions while building and initialises gathered
    model = build_model(backbone, "xl", pkm_layers=[1], pkm=dict(n_keys=8, heads=2, knn=4, k_dim=16))
    pkm = model.memory_blocks[1].pkm
    partitioned = pkm.values.weight.numel() == 0 and model.transformer.h[1].mlp is None
    with deepspeed.zero.GatheredParameters(list(pkm.parameters())):
        start = {n: p.detach().clone() for n, p in pkm.named_parameters()}
    groups = param_groups(model, 0.0, 3e-3, pkm_value_lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=groups)
    x = torch.randint(0, 257, (3, 48), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(4):
        memory = None
        for seg in x.split(12, dim=1):
            out = engine(seg, labels=seg, memory=memory)
            engine.backward(out.loss)
            engine.step()
            memory = out.memory
        losses.append(out.loss.item())
    with deepspeed.zero.GatheredParameters(list(pkm.parameters())):
        moved = {n: (p - start[n]).abs().max().item() for n, p in pkm.named_parameters()}
        init = dict(keys=start["keys"].abs().max().item(), values=start["values.weight"].std().item())
    print(json.dumps(dict(partitioned=partitioned, losses=losses, moved=moved, init=init,
                          lrs=[g["lr"] for g in engine.optimizer.param_groups],
                          tracked=int(pkm.query_norm.num_batches_tracked))))
    """
)


def test_pkm_layers_train_under_zero3(tmp_path):
    """A PKM layer's weights are gathered by its modules' calls, initialised as XLM's (gathered by HF),
    all trained, the values in their own group; its batch norm's statistics move once per forward."""
    result = _run(tmp_path / "zero3_pkm.py", PKM_SCRIPT)
    assert result["partitioned"]
    assert result["init"]["keys"] <= 8**-0.5 and abs(result["init"]["values"] - 64**-0.5) < 0.02
    assert all(x == x and x < 10 for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert all(v > 0 for v in result["moved"].values()), result["moved"]
    assert result["lrs"][-1] == 1e-2 and all(lr == 3e-3 for lr in result["lrs"][:-1])
    assert result["tracked"] == 16  # 4 passes of 4 segments


MEMSIZER_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import math
    keep = HfDeepSpeedConfig(ds)  # HF partitions while building and initialises gathered
    model = build_model(backbone, "memsizer_carry", memsizer_slots=8)
    proj = model.memsizer.h[1].attn.c_attn.weight
    partitioned = proj.numel() == 0
    with deepspeed.zero.GatheredParameters([proj]):  # the stated init, made gathered: Phi's part by its own fans
        q = proj[:, : 4 * 8]
        init = dict(q_max=q.abs().max().item(), q_bound=32**-0.5 * math.sqrt(6 / (64 + 32)))
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
    print(json.dumps(dict(partitioned=partitioned, init=init, losses=losses, tokens=memory.tokens.tolist())))
    """
)


def test_memsizer_builds_initialises_and_trains_under_zero3(tmp_path):
    """ZeRO-3 partitions a MemSizer while HF builds it, its fused projection is initialised part by part
    gathered, and it trains with activation checkpointing, its memory carried through the segments."""
    result = _run(tmp_path / "zero3_memsizer.py", MEMSIZER_SCRIPT)
    assert result["partitioned"]
    assert 0.9 * result["init"]["q_bound"] < result["init"]["q_max"] <= result["init"]["q_bound"]
    assert all(x == x and x < 10 for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert result["tokens"] == [48] * 3


ENCODER_SCRIPT = PRELUDE + textwrap.dedent(
    """
    from transformers import BertConfig
    from memoria_ds.model.encoder import build_encoder_model

    memoria = dict(num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=6, initial_lifespan=3.0, alpha=2.0)
    bert = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    keep = HfDeepSpeedConfig(ds)  # HF partitions while building and initialises gathered
    model = build_encoder_model(bert, memoria=memoria, memory_layer_index=1, num_labels=3)
    partitioned = model.bert.embeddings.word_embeddings.weight.numel() == 0
    proj = model.memory_layers["3"].memory_attention.out_proj.weight
    with deepspeed.zero.GatheredParameters([proj]):
        zero_at_start = proj.abs().max().item() == 0.0  # the stated no-op init, applied gathered
    model.activation_checkpointing_enable()
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    segs = torch.randint(2, 50, (3, 32), generator=torch.Generator().manual_seed(0)).split(8, dim=1)
    labels = torch.tensor([0, 1, 2])
    losses = []
    for epoch in range(3):
        memory = None
        for x in segs:  # one optimiser step per segment, the memory carried
            out = engine(x, labels=labels, memory=memory)
            engine.backward(out.loss)
            engine.step()
            memory = out.memory
        losses.append(out.loss.item())
    with deepspeed.zero.GatheredParameters([proj]):
        moved = proj.abs().max().item()
    print(json.dumps(dict(partitioned=partitioned, zero_at_start=zero_at_start, losses=losses,
                          steps=memory.state.step.tolist(), moved=moved)))
    """
)


def test_memoria_encoder_builds_and_trains_under_zero3(tmp_path):
    result = _run(tmp_path / "encoder_zero3.py", ENCODER_SCRIPT)
    assert result["partitioned"] and result["zero_at_start"]
    assert result["steps"] == [4, 4, 4]
    assert all(x == x for x in result["losses"]) and result["losses"][-1] < result["losses"][0]
    assert result["moved"] > 0  # the no-op output projection was gathered, trained and is non-zero now
