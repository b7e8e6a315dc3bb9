"""The `memorizing` preset (the kNN memory beside an XL cache, `xl+memorizing`) through the real launcher
on 2 CPU ranks (gloo): a kill and resume gives the uninterrupted run's losses and memory (both parts)
bit for bit; ZeRO-3 with LoRA on a pretrained backbone trains the kNN gate with the adapters."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.safe_io import load_tree
from memoria_ds.train.faults import EXIT_CODE

from .launch_util import ROOT, check, losses_by_step, metrics, run_training

# 2 layers (the kNN block is the top one), a memory of 24 pairs: 16-token segments push the oldest out
MEMORIZING = ("model.preset=memorizing",
              "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
              "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_settings: {memorizing: {size: 24, topk: 4}}}")


def _memory(ckpt, rank):
    """Every tensor of the rank's memory, by slot, part and field (`0.memorizing.keys`)."""
    shard = load_tree(ckpt / f"rank_{rank:05d}.safetensors")

    def flat(prefix, tree):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from flat(f"{prefix}{k}.", v)
            elif isinstance(v, torch.Tensor):
                yield f"{prefix}{k}", v

    return {key: v for slot, sd in enumerate(shard["memory"]) for key, v in flat(f"{slot}.", sd["parts"])}


def test_two_rank_kill_and_resume_equals_uninterrupted(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *MEMORIZING, ranks=2))
    proc = run_training(killed, *MEMORIZING, ranks=2, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *MEMORIZING, "checkpoint.resume=auto", ranks=2))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert set(a) == set(b) == {1, 2, 3, 4, 5, 6}
    for step in (4, 5, 6):  # run after the resume from step 3
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    for rank in (0, 1):
        ma = _memory(whole / "checkpoints" / "step_00000006", rank)
        mb = _memory(killed / "checkpoints" / "step_00000006", rank)
        assert ma.keys() == mb.keys() and any(k.endswith("memorizing.keys") for k in ma)
        assert any(k.startswith("0.xl.") for k in ma)
        for key in ma:
            assert torch.equal(ma[key], mb[key]), (rank, key)
        full = [v for k, v in ma.items() if k.endswith("memorizing.mask")]
        assert all(m.shape[1] == 24 and bool(m.all()) for m in full), "the memory filled to its cap"
    evals = metrics(whole, "eval_full")
    assert evals and evals[-1]["ppl"] == evals[-1]["ppl"]


@pytest.mark.slow
def test_zero3_lora_trains_the_knn_gate(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    backbone = tmp_path / "backbone"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)).save_pretrained(backbone)
    run = tmp_path / "run"
    check(run_training(
        run, "model.preset=memorizing", f"model.backbone={backbone}", "model.from_scratch=false",
        "model.settings={memory_settings: {memorizing: {size: 24, topk: 4}}}", "lora.enabled=true", "lora.r=4",
        f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.max_steps=3", "checkpoint.export=true",
        "checkpoint.merge_lora=true", "eval.at_end=false", ranks=2,
    ))
    import memoria_ds.model  # noqa: F401
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "export")
    gate = model.memory_net.gate_bias
    assert not torch.equal(gate, torch.zeros_like(gate)), "the gate (a memory module, starting at 0) was trained"
    losses = [r["loss"] for r in metrics(run)]
    assert len(losses) == 3 and all(x == x for x in losses)
