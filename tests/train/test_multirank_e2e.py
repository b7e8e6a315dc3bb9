"""Two ranks on CPU (gloo) through `deepspeed --num_gpus 2`: ZeRO-2, ZeRO-3 with LoRA, and
resuming on a different number of ranks (2 -> 1 and 1 -> 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from memoria_ds.safe_io import load_tree
from memoria_ds.train.checkpoints import validate

from .launch_util import ROOT, check, metrics, move_two_ranks_to_one, run_training


def _memory_rows(ckpt_dir, world_size):
    """{stream id: {field: tensor}} of every memory row saved in a checkpoint."""
    rows = {}
    for r in range(world_size):
        shard = load_tree(ckpt_dir / f"rank_{r:05d}.safetensors")
        mb = shard["micro_batch_size"]
        for pos, sid in enumerate(shard["stream_ids"]):
            sd = shard["memory"][pos // mb]
            flat = {}
            for key, value in sd.items():
                if isinstance(value, dict):
                    flat.update({f"{key}.{k}": v[pos % mb] for k, v in value.items()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0})
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    flat[key] = value[pos % mb]
            rows[sid] = flat
    return rows


def test_two_ranks_zero2_then_one_rank_then_two_again(tmp_path):
    run = tmp_path / "run"
    # 2 ranks x 2 streams = 4 streams
    check(run_training(run, "optim.max_steps=2", "checkpoint.every=2", ranks=2))
    saved = _memory_rows(run / "checkpoints" / "step_00000002", 2)
    assert sorted(saved) == [0, 1, 2, 3]
    # the plain torch engine cannot re-shard: refused before any work (exit 2), nothing written
    before = sorted(p for p in run.rglob("*"))
    proc = run_training(run, "engine=torch", "optim.max_steps=3", "optim.grad_accum=2", "checkpoint.resume=auto",
                        launcher="python")
    assert proc.returncode == 2 and "a world-size change needs engine=deepspeed" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and sorted(p for p in run.rglob("*")) == before
    # a resume that would change the number of streams (1 rank x micro 2 x accum 1 = 2, not 4): refused from the
    # manifest, before DeepSpeed's universal conversion or any engine work, naming the rule; nothing written
    proc = run_training(run, "optim.max_steps=3", "checkpoint.resume=auto", ranks=1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "micro_batch_size * grad_accum * ranks" in proc.stderr and "4 token streams" in proc.stderr, proc.stderr
    assert sorted(p for p in run.rglob("*")) == before
    # 1 rank owns all 4 streams (micro 2 x accum 2): weights/optimizer via a universal checkpoint
    proc = check(run_training(run, "optim.max_steps=3", "checkpoint.every=1", "optim.grad_accum=2",
                              "checkpoint.resume=auto", "eval.at_end=false", ranks=1))
    assert "2 -> 1 ranks" in proc.stdout + proc.stderr
    assert (run / "checkpoints" / "step_00000002" / "engine_universal").is_dir()
    assert (run / "checkpoints" / "step_00000002" / "latest_universal").read_text() == "engine_universal"
    one = validate(run / "checkpoints" / "step_00000003")
    assert one.world_size == 1
    # and back to 2 ranks
    proc = check(run_training(run, "optim.max_steps=4", "checkpoint.every=1", "checkpoint.resume=auto",
                              "eval.at_end=false", ranks=2))
    assert "1 -> 2 ranks" in proc.stdout + proc.stderr
    steps = [r["step"] for r in metrics(run)]
    assert steps == [1, 2, 3, 4], steps
    assert all(r["loss"] == r["loss"] for r in metrics(run))


NO_DROPOUT = ("model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
              "embd_pdrop: 0.0, attn_pdrop: 0.0, memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, "
              "stm_capacity: 16, search_depth: 2}}")


@pytest.mark.slow
def test_a_world_size_change_continues_the_same_optimisation(tmp_path):
    """2 ranks for 2 steps, then 1 rank: step 3 matches an uninterrupted 2-rank run (fp32,
    no dropout) to reduction-order rounding, so weights, Adam moments, the schedule, the
    memory rows and the stream positions all carried over."""
    move_two_ranks_to_one(tmp_path, NO_DROPOUT)


def test_resharding_keeps_every_stream_memory(tmp_path):
    """The memory rows of each stream after a 2 -> 1 resume are the ones saved for it."""
    from memoria_ds.model import build_model
    from memoria_ds.train.checkpoints import restore_memories

    model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32), "memoria",
                        memoria=dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4))
    cfg = model.config.memoria_config
    gen = torch.Generator().manual_seed(0)

    def filled(rows):
        memory = None
        for _ in range(5):
            out = model(input_ids=torch.randint(0, 64, (rows, 8), generator=gen), memory=memory)
            memory = out.memory
        return memory

    # two "ranks", each with 2 slots of 1 row: streams 0..3
    shards = [
        {"stream_ids": [0, 1], "micro_batch_size": 1, "memory": [filled(1).state_dict(), filled(1).state_dict()]},
        {"stream_ids": [2, 3], "micro_batch_size": 1, "memory": [filled(1).state_dict(), filled(1).state_dict()]},
    ]
    # one rank, micro 2 x 2 slots, in a different order
    slots = restore_memories(shards, [3, 1, 0, 2], 2, torch.device("cpu"), cfg)
    assert [m.batch_size for m in slots] == [2, 2]
    want = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    for new_slot, pair in enumerate([(3, 1), (0, 2)]):
        for row, sid in enumerate(pair):
            s, slot = want[sid]
            from memoria_ds.model import memory_from_state_dict

            ref = memory_from_state_dict(shards[s]["memory"][slot], config=cfg)
            got = slots[new_slot].take_rows([row])
            assert torch.equal(got.state.counts, ref.state.counts) and torch.equal(got.state.vectors, ref.state.vectors)
            assert torch.equal(got.prev_hidden, ref.prev_hidden)
    with pytest.raises(ValueError, match="in no shard"):
        restore_memories(shards, [0, 9], 1, torch.device("cpu"), cfg)


@pytest.fixture
def tiny_backbone(tmp_path):
    """A pretrained-style GPT-2 directory (random weights), standing in for the hub's."""
    path = tmp_path / "backbone"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)).save_pretrained(path)
    return path


def test_zero3_lora_two_ranks_exports_complete_weights(tmp_path, tiny_backbone):
    run = tmp_path / "run"
    proc = check(run_training(
        run, f"model.backbone={tiny_backbone}", "model.from_scratch=false", "lora.enabled=true", "lora.r=4",
        f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.max_steps=3", "checkpoint.export=true",
        "checkpoint.merge_lora=false", "eval.at_end=false", ranks=2,
    ))
    out = proc.stdout + proc.stderr
    assert "trained tensors (fp32 masters) equal the live parameters at step 3" in out
    # safetensors only, the adapter too: nothing in the export is a pickle
    assert not [p for p in (run / "export").rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert (run / "export" / "adapter" / "adapter_model.safetensors").is_file()
    # the adapter and the Memoria modules are complete (non-empty) and load back
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import memoria_ds.model  # noqa: F401

    base = AutoModelForCausalLM.from_pretrained(run / "export")
    model = PeftModel.from_pretrained(base, run / "export" / "adapter")
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.numel() > 0 for p in lora.values())
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n), "the adapters were trained"
    memory_params = [p for m in base.memory_modules() for p in m.parameters()]
    assert memory_params and all(p.numel() > 0 for p in memory_params)
    ids = torch.randint(0, 50257, (1, 16))
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.slow
def test_zero3_lora_gradient_checkpointing_two_ranks(tmp_path, tiny_backbone):
    """ZeRO-3 + LoRA + gradient checkpointing on 2 ranks (deepspeed 0.16.9 - 0.19.2 fail with
    `CheckpointError: saved [32] vs recomputed [0]`): trains, and recomputing the blocks in
    backward gives the losses of the run that keeps its activations."""
    common = [f"model.backbone={tiny_backbone}", "model.from_scratch=false", "lora.enabled=true", "lora.r=4",
              f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.max_steps=3", "eval.at_end=false"]
    check(run_training(tmp_path / "gc", *common, "model.gradient_checkpointing=true", ranks=2))
    check(run_training(tmp_path / "plain", *common, ranks=2))
    gc, plain = metrics(tmp_path / "gc"), metrics(tmp_path / "plain")
    assert [r["step"] for r in gc] == [1, 2, 3]
    for a, b in zip(gc, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
    assert gc[-1]["loss"] != gc[0]["loss"], "the adapters trained"
