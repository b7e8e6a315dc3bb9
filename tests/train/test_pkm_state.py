"""A PKM layer's batch-norm running statistics are state a run moves without being parameters: the
plain engine's LoRA checkpoint and the Hugging Face export keep them."""

from __future__ import annotations

import torch

from memoria_ds.model import apply_lora, build_model
from memoria_ds.safe_io import load_tree
from memoria_ds.train.config import OptimSection
from memoria_ds.train.engine import ENGINE_FILE, TorchEngine
from memoria_ds.train.export import trained_buffers

PKM = {"n_keys": 8, "heads": 2, "knn": 4, "k_dim": 16}
STATS = ("running_mean", "running_var", "num_batches_tracked")


def _trained(tiny_gpt2_config, lora: bool):
    torch.manual_seed(0)
    model = build_model(tiny_gpt2_config, "xl", pkm_layers=[1], pkm=PKM)
    model = apply_lora(model) if lora else model
    engine = TorchEngine(model, torch.device("cpu"), OptimSection(lr=1e-3, warmup_ratio=0.0), total_steps=4,
                         precision="fp32")
    x = torch.randint(0, 257, (2, 8))
    for _ in range(2):
        engine.backward(model(x, labels=x).loss)
        engine.step()
    return model, engine


def test_a_lora_checkpoint_of_the_plain_engine_keeps_the_running_statistics(tiny_gpt2_config, tmp_path):
    model, engine = _trained(tiny_gpt2_config, lora=True)
    engine.save(tmp_path, "engine", exclude_frozen=True)
    saved = load_tree(tmp_path / "engine" / ENGINE_FILE)["module"]
    prefix = "base_model.model.memory_blocks.1.pkm.query_norm."
    for name in STATS:
        torch.testing.assert_close(saved[prefix + name], model.get_buffer(prefix + name), rtol=0, atol=0)
    assert int(saved[prefix + "num_batches_tracked"]) == 2
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert frozen and not frozen & set(saved)  # the backbone's weights (the tied lm_head too) stay out
    assert "base_model.model.lm_head.weight" not in saved


def test_the_export_takes_the_live_running_statistics(tiny_gpt2_config):
    model, _ = _trained(tiny_gpt2_config, lora=False)
    buffers = trained_buffers(model)
    assert sorted(buffers) == [f"memory_blocks.1.pkm.query_norm.{n}" for n in sorted(STATS)]
    fresh = build_model(tiny_gpt2_config, "xl", pkm_layers=[1], pkm=PKM)
    fresh.load_state_dict(buffers, strict=False)
    for name in buffers:
        torch.testing.assert_close(fresh.get_buffer(name), model.get_buffer(name), rtol=0, atol=0)
    assert int(buffers["memory_blocks.1.pkm.query_norm.num_batches_tracked"]) == 2
    assert buffers["memory_blocks.1.pkm.query_norm.running_mean"].abs().sum() > 0
