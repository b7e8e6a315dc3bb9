"""A Memory Mosaic through launch/pretrain.py: the real `deepspeed` launcher and DeepSpeed on CPU.

Exact resume after a kill, the evaluation protocols, the export loading through the Auto
classes in a fresh process (no memoria_ds import first), launch/evaluate.py scoring the export
as training did, ZeRO-3 construction and export, and the settings refused before any work.
"""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys

import torch

from memoria_ds.eval.result import read_results
from memoria_ds.train.checkpoints import find_latest
from memoria_ds.train.faults import EXIT_CODE

from .launch_util import PRETRAIN, ROOT, check, losses_by_step, metrics, run_training
from .test_evaluate_e2e import evaluate

TINY_MOSAIC = [
    "model.backbone=gpt2", "model.preset=memory_mosaic",
    "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, pmem_count: 2}",
    "data.corpus=bundled", "data.segment_length=16",
    "optim.micro_batch_size=2", "optim.grad_accum=1", "optim.max_steps=6", "optim.lr=1e-3", "optim.precision=fp32",
    "checkpoint.every=3", "checkpoint.export=false", "log.every=1", "log.tensorboard=false", "log.progress=false",
    "eval.max_steps=3", "eval.protocols=[full, paper, memoryless]", f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}",
]


def train(run_dir, *overrides, **kw):
    return run_training(run_dir, *TINY_MOSAIC, *overrides, tiny=False, script=PRETRAIN, **kw)


def test_memory_mosaic_trains_resumes_evaluates_and_exports(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(train(whole, "checkpoint.export=true"))
    proc = train(killed, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    assert find_latest(killed / "checkpoints")[0].step == 3
    check(train(killed, "checkpoint.resume=auto"))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert [r["step"] for r in metrics(killed)] == [1, 2, 3, 4, 5, 6]
    assert a[1] > a[6]  # it learns
    for step in (4, 5, 6):  # after the resume from step 3: bit for bit
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"

    # the protocols ran; nothing crosses segments, so `memoryless` scores what `full` does
    trained = {r.protocol["name"]: r for r in map(read_results, sorted((whole / "eval").glob("step_*.json")))
               for r in r}
    assert set(trained) == {"full", "paper", "memoryless"}
    assert abs(trained["memoryless"].nll - trained["full"].nll) < 1e-6
    assert trained["paper"].scored_tokens < trained["full"].scored_tokens

    # the export: a fresh process loads it through the Auto classes with trust_remote_code
    export = whole / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "memory_mosaic" and config["pmem_count"] == 2
    code = ("import json, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(export)!r}, trust_remote_code=True).eval(); "
            "ids = torch.arange(12).view(1, 12) * 7; "
            "print(type(m).__name__, json.dumps(m(input_ids=ids).logits[0, :, :5].tolist()))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    name, logits = loaded.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "MemoryMosaicLMHeadModel"
    # ... and they are the trained weights: the logits of the export loaded here equal them
    from memoria_ds.model import MemoryMosaicLMHeadModel

    here = MemoryMosaicLMHeadModel.from_pretrained(export).eval()
    with torch.no_grad():
        mine = here(torch.arange(12).view(1, 12) * 7).logits[0, :, :5]
    torch.testing.assert_close(torch.tensor(json.loads(logits)), mine, atol=1e-6, rtol=0)

    # launch/evaluate.py scores the export as training scored it
    check(evaluate(str(whole), "eval.protocols=[full]", "eval.max_steps=3"))
    (scored,) = read_results(whole / "eval" / "validation_full.json")
    assert scored.scored_tokens == trained["full"].scored_tokens and abs(scored.nll - trained["full"].nll) < 1e-5


@pytest.mark.slow
def test_memory_mosaic_under_zero3_exports_the_trained_weights(tmp_path):
    run = tmp_path / "z3"
    check(train(run, f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.max_steps=2",
                "checkpoint.every=2", "checkpoint.export=true", "eval.protocols=[full]"))
    assert (run / "export" / "model.safetensors").is_file()
    losses = losses_by_step(run)
    assert set(losses) == {1, 2} and all(v == v for v in losses.values())


@pytest.mark.slow
def test_mosaic_settings_are_checked_before_any_work(tmp_path):
    proc = run_training(tmp_path / "a", "model.settings={pmem_size: 8}", script=PRETRAIN)  # the memoria preset
    assert proc.returncode == 2 and "configure a Memory Mosaic" in proc.stderr + proc.stdout
    proc = run_training(tmp_path / "b", *TINY_MOSAIC, "model.from_scratch=false", tiny=False)  # finetune.py
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "model.from_scratch=true" in out, out[-2000:]


CARRY = [s.replace("model.preset=memory_mosaic", "model.preset=memory_mosaic_carry") for s in TINY_MOSAIC]
NO_DROPOUT = "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, pmem_count: 2, " \
             "embd_pdrop: 0.0, attn_pdrop: 0.0, resid_pdrop: 0.0}"


@pytest.mark.slow
def test_carried_mosaic_memory_resumes_exactly_and_shows_a_memory_gain(tmp_path):
    from memoria_ds.safe_io import load_tree

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *CARRY, tiny=False, script=PRETRAIN))
    proc = run_training(killed, *CARRY, tiny=False, script=PRETRAIN, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *CARRY, "checkpoint.resume=auto", tiny=False, script=PRETRAIN))
    a, b = losses_by_step(whole), losses_by_step(killed)
    for step in (4, 5, 6):
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    shard_a = load_tree(whole / "checkpoints" / "step_00000006" / "rank_00000.safetensors")["memory"]
    shard_b = load_tree(killed / "checkpoints" / "step_00000006" / "rank_00000.safetensors")["memory"]
    assert shard_a[0]["kind"] == "mosaic" and shard_a[0]["mask"].any()
    for key, value in shard_a[0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, shard_b[0][key]), key
    # the memory is read: carried (`full`) and reset before every segment (`memoryless`) differ
    gain = json.loads((whole / "summary.json").read_text())["memory_gain"]
    assert gain is not None and gain["nats_per_token"] != 0.0


@pytest.mark.slow
def test_carried_mosaic_memory_moves_with_its_streams_from_two_ranks_to_one(tmp_path):
    """2 ranks for 2 steps, then 1 rank: step 3 matches an uninterrupted 2-rank run (the memory
    rows travelled with their streams)."""
    common = [*CARRY, NO_DROPOUT, "optim.max_steps=3", "eval.at_end=false"]
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    check(run_training(whole, *common, "checkpoint.every=1", tiny=False, script=PRETRAIN, ranks=2))
    killed = run_training(moved, *common, "checkpoint.every=2", tiny=False, script=PRETRAIN, ranks=2,
                          fault="kill_after_step:2")
    assert killed.returncode == EXIT_CODE, killed.stderr[-3000:]
    check(run_training(moved, *common, "checkpoint.every=1", "optim.grad_accum=2", "checkpoint.resume=auto",
                       tiny=False, script=PRETRAIN, ranks=1))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(moved)}
    assert a[1] == b[1] and a[2] == b[2]
    assert abs(a[3] - b[3]) < 1e-4 * abs(a[3]), f"step 3 after 2 -> 1: {b[3]} vs uninterrupted {a[3]}"


@pytest.mark.slow
def test_carried_mosaic_in_bf16_under_zero3_resumes_exactly(tmp_path):
    """bf16 under ZeRO-3 on 2 ranks: the loss is finite, the carried contextual memory (a cache of the
    blocks' keys, values and leaky averages, kept in the model's dtype as `xl`'s cache is: docs/model.md,
    "Dtypes") is checkpointed per stream in bf16 and finite, and a run killed after step 3 and resumed
    from its step-2 checkpoint continues bit for bit."""
    from memoria_ds.safe_io import load_tree

    common = [*CARRY, NO_DROPOUT, "optim.precision=bf16", f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}",
              "optim.max_steps=4", "checkpoint.every=2", "eval.at_end=false"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *common, tiny=False, script=PRETRAIN, ranks=2))
    proc = run_training(killed, *common, tiny=False, script=PRETRAIN, ranks=2, fault="kill_after_step:3")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *common, "checkpoint.resume=auto", tiny=False, script=PRETRAIN, ranks=2))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert all(v == v for v in a.values())
    for step in (3, 4):
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    for rank in (0, 1):
        shard = load_tree(whole / "checkpoints" / "step_00000004" / f"rank_{rank:05d}.safetensors")["memory"]
        floats = [v for state in shard for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert floats and all(v.dtype == torch.bfloat16 and bool(torch.isfinite(v).all()) for v in floats)
