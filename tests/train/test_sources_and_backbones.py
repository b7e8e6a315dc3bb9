"""A run that cannot start says so in a few lines before it writes anything: an unreachable
hub, shape settings that contradict a pretrained backbone. And the README's next step after
the quickstart (fine-tune the real GPT-2) works, with a local full-size GPT-2 directory."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import constants
from transformers import GPT2Config, GPT2LMHeadModel

from memoria_ds.train import sources
from memoria_ds.train.config import RunConfig
from memoria_ds.train.parse import ConfigError, load

from .launch_util import ROOT, check, metrics, run_training


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A full-size GPT-2 (124M, random weights) saved like a hub snapshot."""
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(path)
    return path


def test_what_needs_the_hub(tmp_path, monkeypatch, gpt2_dir):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))

    def needs(*overrides):
        return sources.hub_needs(load(RunConfig, None, list(overrides)))

    assert needs("model.from_scratch=true") == [], "GPT-2 shapes are built in"
    assert needs(f"model.backbone={gpt2_dir}") == [], "a local directory"
    assert needs() == ["the backbone 'gpt2' (model.backbone)"]
    assert needs("model.from_scratch=true", "data.corpus=wikitext103") == [
        "the corpus 'wikitext103' (Salesforce/wikitext; data.corpus)"]
    assert needs("model.from_scratch=true", "data.corpus=wikitext103", f"data.path={tmp_path}") == []
    with pytest.raises(ConfigError, match=r"model.backbone='/no/such/dir' is neither a directory nor a Hugging Face"):
        needs("model.backbone=/no/such/dir")


def test_an_unreachable_hub_is_detected_in_milliseconds(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert sources.hub_unreachable().startswith("no connection to 127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert sources.hub_unreachable() == "HF_HUB_OFFLINE is set"
    with pytest.raises(ConfigError, match=r"(?s)cannot be reached \(HF_HUB_OFFLINE is set\).*backbone 'gpt2'.*"
                                          r"model.from_scratch=true.*bash launch/quickstart.sh"):
        sources.check_sources(load(RunConfig, None, []))


def test_the_design_card_command_fails_fast_without_the_hub(tmp_path):
    """`deepspeed launch/finetune.py --deepspeed ds_configs/zero2.json` with no hub."""
    run = tmp_path / "run"
    proc = run_training(run, "--deepspeed", str(ROOT / "ds_configs" / "zero2.json"), tiny=False,
                        env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("[")]  # the launcher's own log
    assert 3 <= len(errors) <= 8, errors
    assert "cannot be reached" in errors[0] and "model.backbone=DIR" in proc.stderr
    assert not run.exists(), "the run directory is created only once the run can start"


def test_shape_settings_do_not_apply_to_a_pretrained_backbone(tmp_path, gpt2_dir):
    run = tmp_path / "run"
    proc = run_training(run, "--config", str(ROOT / "launch" / "configs" / "quickstart.yaml"),
                        "model.from_scratch=false", f"model.backbone={gpt2_dir}", tiny=False, launcher="python")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("model.settings n_positions=256, n_embd=64, n_layer=2, n_head=4 conflict with the pretrained backbone"
            in proc.stderr)
    assert "(n_positions=1024, n_embd=768, n_layer=12, n_head=12)" in proc.stderr
    assert "launch/configs/finetune_gpt2.yaml" in proc.stderr and not run.exists()


@pytest.mark.slow
def test_finetuning_a_full_size_gpt2_from_a_local_directory(tmp_path, gpt2_dir):
    """The README's next step after the quickstart, with a local copy instead of the hub."""
    run = tmp_path / "run"
    check(run_training(run, "--config", str(ROOT / "launch" / "configs" / "finetune_gpt2.yaml"),
                       f"model.backbone={gpt2_dir}", "optim.max_steps=2", "eval.max_steps=1",
                       "eval.protocols=[full]", "checkpoint.export=false", "log.progress=false",
                       "log.tensorboard=false", "log.every=1", tiny=False))
    config = json.loads((run / "checkpoints" / "step_00000002" / "manifest.json").read_text())["meta"]["config"]
    assert config["model"]["backbone"] == str(gpt2_dir) and not config["model"]["from_scratch"]
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_a_backbone_saved_in_bf16_trains_in_one_dtype(tmp_path):
    """The engine owns the precision: a checkpoint saved in bf16 loads in fp32 like the new
    Memoria modules and LoRA adapters (ZeRO-3 flattens them into one buffer of one dtype)."""
    from memoria_ds.train.build import build_run_model

    path = tmp_path / "bf16"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)).to(torch.bfloat16).save_pretrained(path)
    for lora in ("false", "true"):
        cfg = load(RunConfig, None, [f"model.backbone={path}", "model.from_scratch=false", f"lora.enabled={lora}",
                                     "data.segment_length=16"])
        model = build_run_model(cfg, vocab_size=50257)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
