"""A MemSizer through launch/pretrain.py (and finetune.py for LoRA): the real `deepspeed` launcher and
DeepSpeed on CPU.

Its memory carried across segments (`memsizer_carry`): an exact resume after a kill (1 rank under
ZeRO-2 with the export loading through the Auto classes in a fresh process and launch/evaluate.py
scoring it; 2 ranks under ZeRO-1; 2 ranks in bf16 under ZeRO-3), each stream's S and t in the
checkpoint shards, a memory gain between the `full` and `memoryless` protocols, the memory rows
moving with their streams from 2 ranks to 1; LoRA on a saved MemSizer's projections; the settings
refused before any work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from memoria_ds.eval.result import read_results
from memoria_ds.safe_io import load_tree
from memoria_ds.train.faults import EXIT_CODE

from .launch_util import (FINETUNE, PRETRAIN, ROOT, check, losses_by_step, metrics, move_two_ranks_to_one,
                          run_training)
from .test_evaluate_e2e import evaluate

SHAPE = "n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, memsizer_slots: 8"
CARRY = [
    "model.backbone=gpt2", "model.preset=memsizer_carry", f"model.settings={{{SHAPE}}}",
    "data.corpus=bundled", "data.segment_length=16",
    "optim.micro_batch_size=2", "optim.grad_accum=1", "optim.max_steps=6", "optim.lr=1e-3", "optim.precision=fp32",
    "checkpoint.every=3", "checkpoint.export=false", "log.every=1", "log.tensorboard=false", "log.progress=false",
    "eval.max_steps=3", "eval.protocols=[full, memoryless]", f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}",
]
NO_DROPOUT = f"model.settings={{{SHAPE}, embd_pdrop: 0.0, attn_pdrop: 0.0, resid_pdrop: 0.0}}"


def train(run_dir, *overrides, **kw):
    return run_training(run_dir, *CARRY, *overrides, tiny=False, script=PRETRAIN, **kw)


def kill_and_resume(tmp_path, *overrides, ranks: int, steps: int = 6, every: int = 3, kill: int = 4):
    """An uninterrupted run and one killed after step `kill` and resumed from its last checkpoint:
    every step after the resume bit for bit. Returns both runs' directories."""
    common = (*overrides, f"optim.max_steps={steps}", f"checkpoint.every={every}")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(train(whole, *common, ranks=ranks))
    proc = train(killed, *common, ranks=ranks, fault=f"kill_after_step:{kill}")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(train(killed, *common, "checkpoint.resume=auto", ranks=ranks))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert all(v == v for v in a.values()) and sorted(a) == list(range(1, steps + 1))
    for step in range(every * (kill // every) + 1, steps + 1):
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    return whole, killed


def shards(run, step: int, ranks: int) -> list[dict]:
    return [load_tree(run / "checkpoints" / f"step_{step:08d}" / f"rank_{r:05d}.safetensors")["memory"][0]
            for r in range(ranks)]


def test_carried_memsizer_resumes_exactly_evaluates_and_exports(tmp_path):
    whole, killed = kill_and_resume(tmp_path, "checkpoint.export=true", ranks=1)
    a, b = shards(whole, 6, 1)[0], shards(killed, 6, 1)[0]
    assert a["kind"] == "memsizer" and a["sums"].dtype == torch.float32 and a["sums"].abs().sum() > 0
    assert (a["tokens"] > 0).all()
    for key in ("sums", "tokens"):
        assert torch.equal(a[key], b[key]), key
    losses = losses_by_step(whole)
    assert losses[1] > losses[6]  # it learns

    # the memory is read: carried (`full`) and reset before every segment (`memoryless`) differ
    trained = {r.protocol["name"]: r for r in map(read_results, sorted((whole / "eval").glob("step_*.json")))
               for r in r}
    assert set(trained) == {"full", "memoryless"} and trained["full"].nll != trained["memoryless"].nll
    gain = json.loads((whole / "summary.json").read_text())["memory_gain"]
    assert gain is not None and gain["nats_per_token"] != 0.0

    # the export: a fresh process loads it through the Auto classes with trust_remote_code
    export = whole / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "memsizer" and config["memory_type"] == "memsizer" and config["memsizer_slots"] == 8
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_memsizer.MemSizerLMHeadModel"
    code = ("import json, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(export)!r}, trust_remote_code=True).eval(); "
            "ids = torch.arange(12).view(1, 12) * 7; "
            "print(type(m).__name__, json.dumps(m(input_ids=ids).logits[0, :, :5].tolist()))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    name, logits = loaded.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "MemSizerLMHeadModel"
    from memoria_ds.model import MemSizerLMHeadModel

    here = MemSizerLMHeadModel.from_pretrained(export).eval()
    with torch.no_grad():
        mine = here(torch.arange(12).view(1, 12) * 7).logits[0, :, :5]
    torch.testing.assert_close(torch.tensor(json.loads(logits)), mine, atol=1e-6, rtol=0)

    # launch/evaluate.py scores the export as training scored it
    check(evaluate(str(whole), "eval.protocols=[full]", "eval.max_steps=3"))
    (scored,) = read_results(whole / "eval" / "validation_full.json")
    assert scored.scored_tokens == trained["full"].scored_tokens and abs(scored.nll - trained["full"].nll) < 1e-5


@pytest.mark.slow  # CI's budget: two ranks' exact resume is the bf16 ZeRO-3 test's; ZeRO-1 is the config's stage
def test_two_ranks_under_zero1_resume_bit_identically(tmp_path):
    zero1 = tmp_path / "zero1.json"
    config = json.loads((ROOT / "ds_configs" / "cpu.json").read_text())
    config["zero_optimization"]["stage"] = 1
    zero1.write_text(json.dumps(config))
    whole, _ = kill_and_resume(tmp_path, NO_DROPOUT, f"deepspeed={zero1}", "eval.at_end=false", ranks=2, steps=4,
                               every=2, kill=3)
    for memory in shards(whole, 4, 2):
        assert memory["kind"] == "memsizer" and (memory["tokens"] > 0).all()


@pytest.mark.slow
def test_two_ranks_in_bf16_under_zero3_resume_bit_identically_with_an_fp32_memory(tmp_path):
    whole, _ = kill_and_resume(tmp_path, NO_DROPOUT, "optim.precision=bf16", "eval.at_end=false",
                               f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", ranks=2, steps=4, every=2, kill=3)
    for memory in shards(whole, 4, 2):  # a sum over the stream: fp32 in a bf16 run
        assert memory["sums"].dtype == torch.float32 and bool(torch.isfinite(memory["sums"]).all())


@pytest.mark.slow  # CI's budget: the same check (launch_util.move_two_ranks_to_one) runs for every other kind
def test_the_memory_moves_with_its_streams_from_two_ranks_to_one(tmp_path):
    move_two_ranks_to_one(tmp_path, "model.preset=memsizer_carry", NO_DROPOUT)


@pytest.mark.slow
def test_lora_on_a_saved_memsizer(tmp_path):
    """Fine-tuning a saved MemSizer with LoRA (finetune.py, the toolkit's targets c_attn, c_proj, c_fc):
    only the adapters train, and the merged export loads through the Auto classes."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    saved = tmp_path / "saved"
    build_model(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64), "memsizer_carry",
                memsizer_slots=8).save_pretrained(saved)
    run = tmp_path / "lora"
    common = [c for c in CARRY if not c.startswith(("model.backbone", "model.settings"))]
    check(run_training(run, *common, f"model.backbone={saved}", "model.from_scratch=false", "lora.enabled=true",
                       "lora.r=4", "optim.max_steps=3", "checkpoint.every=3", "checkpoint.export=true",
                       "eval.at_end=false", tiny=False, script=FINETUNE))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    exported = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    base = AutoModelForCausalLM.from_pretrained(saved).eval()
    moved = {n for n, p in exported.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    # LoRA merged into exactly the adapted projections of every block; nothing else moved
    assert moved == {f"memsizer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "mlp.c_fc", "mlp.c_proj")}


@pytest.mark.slow
def test_memsizer_settings_are_checked_before_any_work(tmp_path):
    proc = run_training(tmp_path / "a", "model.settings={memsizer_slots: 8}", script=PRETRAIN)  # the memoria preset
    assert proc.returncode == 2 and "configure a MemSizer" in proc.stderr + proc.stdout
    proc = run_training(tmp_path / "b", *CARRY, "model.from_scratch=false", tiny=False)  # finetune.py, GPT-2 weights
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "model.from_scratch=true" in out, out[-2000:]
    proc = run_training(tmp_path / "c", *CARRY, "model.settings={memsizer_slots: 0}", tiny=False, script=PRETRAIN)
    assert proc.returncode == 2 and "memsizer_slots" in proc.stderr + proc.stdout
