"""Product-Key Memory layers through the real launcher on 2 CPU ranks (gloo): a kill and resume gives the
uninterrupted run's losses and evaluation bit for bit, under ZeRO-2 and ZeRO-1 (the query batch norms' running statistics are the
ranks' mean after every update, so the checkpoint, rank 0's module, is every rank's); bf16 under ZeRO-3
with LoRA on a pretrained backbone trains the PKM layer and exports it through the Auto classes."""

from __future__ import annotations

import json

import pytest
import torch

from memoria_ds.train.faults import EXIT_CODE

from .launch_util import ROOT, check, losses_by_step, metrics, run_training

PKM = "pkm_layers: [1], pkm: {n_keys: 8, heads: 2, knn: 4, k_dim: 16}"
XL_PKM = ("model.preset=xl",
          "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, embd_pdrop: 0.0, "
          f"attn_pdrop: 0.0, {PKM}}}", "eval.max_steps=4")


@pytest.mark.parametrize("zero", ["cpu.json", pytest.param("zero1.json", marks=pytest.mark.slow)], ids=["zero2", "zero1"])
def test_two_rank_kill_and_resume_equals_uninterrupted(tmp_path, zero):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run = (*XL_PKM, f"deepspeed={ROOT / 'ds_configs' / zero}")
    check(run_training(whole, *run, ranks=2))
    stage = json.loads((whole / "ds_config.json").read_text())["zero_optimization"]["stage"]
    assert stage == (2 if zero == "cpu.json" else 1)
    proc = run_training(killed, *run, ranks=2, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *run, "checkpoint.resume=auto", ranks=2))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert set(a) == set(b) == {1, 2, 3, 4, 5, 6}
    for step in (4, 5, 6):  # run after the resume from step 3
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    # the evaluation normalises the queries by the running statistics: each rank's shard by the same ones
    ea, eb = metrics(whole, "eval_full")[-1], metrics(killed, "eval_full")[-1]
    assert ea["ppl"] == eb["ppl"] and ea["ppl"] == ea["ppl"], (ea, eb)


@pytest.mark.slow
def test_bf16_zero3_lora_trains_the_pkm_layer_and_exports_it(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    import memoria_ds.model  # noqa: F401  (registers the Auto classes)

    backbone = tmp_path / "backbone"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)).save_pretrained(backbone)
    run = tmp_path / "run"
    check(run_training(
        run, "model.preset=xl", f"model.backbone={backbone}", "model.from_scratch=false",
        f"model.settings={{{PKM[:-1]}, placement: after}}}}", "lora.enabled=true", "lora.r=4", "optim.precision=bf16",
        f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.max_steps=3", "checkpoint.export=true",
        "checkpoint.merge_lora=true", "eval.at_end=false", ranks=2,
    ))
    losses = [r["loss"] for r in metrics(run)]
    assert len(losses) == 3 and all(x == x for x in losses)
    model = AutoModelForCausalLM.from_pretrained(run / "export")
    pkm = model.memory_blocks[1].pkm
    norm = pkm.query_norm
    assert int(norm.num_batches_tracked) == 3, "one update of the running statistics per step"
    assert not torch.equal(norm.running_mean, torch.zeros_like(norm.running_mean))
    assert model.config.pkm_layers == [1] and model.transformer.h[1].mlp is not None  # after the MLP: kept
    assert all(torch.isfinite(p).all() for p in pkm.parameters())
