"""Config, presets and ablations: the paper's comparisons are one config switch apart."""

import json

import pytest
import torch
from model_helpers import SMALL_MEMORIA, segments
from transformers import GPT2Config

from memoria_ds.memory import MemoriaConfig
from memoria_ds.model import PRESETS, MemoriaGPT2Config


def test_resolved_memoria_settings_are_explicit(backbone_config):
    cfg = MemoriaGPT2Config.from_backbone(backbone_config, "memoria", memoria={"num_wm": 16})
    assert cfg.memoria["num_wm"] == 16
    assert cfg.memoria["capacity"] == MemoriaConfig(num_wm=16).capacity  # resolved, written to config.json
    assert cfg.memoria_config == MemoriaConfig(num_wm=16)
    # every backbone field is kept
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (2, 64, 4, 257)


def test_round_trip_through_dict(backbone_config):
    cfg = MemoriaGPT2Config.from_backbone(backbone_config, "xl", xl_memory_length=7, segment_length=12)
    again = MemoriaGPT2Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert again.memory_type == "xl" and again.xl_memory_length == 7


@pytest.mark.parametrize(
    "preset,memory_type,use_stm,use_ltm",
    [
        ("transformer", "none", True, True),
        ("xl", "xl", True, True),
        ("memoria_wm", "memoria", False, False),
        ("memoria_wm_stm", "memoria", True, False),
        ("memoria", "memoria", True, True),
    ],
)
def test_presets(backbone_config, preset, memory_type, use_stm, use_ltm):
    cfg = MemoriaGPT2Config.from_backbone(backbone_config, preset)
    assert cfg.memory_type == memory_type
    assert (cfg.memoria_config.use_stm, cfg.memoria_config.use_ltm) == (use_stm, use_ltm)


def test_preset_memoria_settings_merge_with_explicit_ones(backbone_config):
    cfg = MemoriaGPT2Config.from_backbone(backbone_config, "memoria_wm_stm", memoria={"num_wm": 2})
    assert cfg.memoria["num_wm"] == 2 and cfg.memoria["use_ltm"] is False


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"memory_type": "bogus"}, "memory_type"),
        ({"memory_layers": [0, 5]}, "memory_layers"),
        ({"memory_layers": [1, 1]}, "memory_layers"),
        ({"memory_inner_dim": 30}, "multiple of"),
        ({"memory_attention_mode": "both"}, "memory_attention_mode"),
        ({"memory_init": "zeros"}, "memory_init"),
        ({"xl_memory_length": 0}, "xl_memory_length"),
        ({"segment_length": 1000}, "n_positions"),
        ({"memoria": {"num_stm_reminded": 9, "stm_capacity": 8}}, "stm_capacity"),
        ({"memoria": {"nonsense": 1}}, "unknown Memoria setting"),
    ],
)
def test_invalid_settings_say_what_is_wrong(backbone_config, settings, message):
    with pytest.raises(Exception, match=message):
        MemoriaGPT2Config.from_backbone(backbone_config, **settings)


def test_unknown_preset_lists_the_known_ones(backbone_config):
    with pytest.raises(ValueError, match="known"):
        MemoriaGPT2Config.from_backbone(backbone_config, "memoria_large")
    assert {"transformer", "xl", "memoria_wm", "memoria_wm_stm", "memoria"} <= set(PRESETS)


def test_memory_attention_width_presets(backbone_config):
    # the tiny backbone is 64 wide with 4 heads: default 1/8 -> 8, the authors' width -> 64
    default = MemoriaGPT2Config.from_backbone(backbone_config, "memoria")
    assert default.memory_attention_mode == "sequential" and default.resolved_memory_inner_dim == 8
    fast = MemoriaGPT2Config.from_backbone(backbone_config, "memoria_fast")
    assert fast.memory_attention_mode == "parallel" and fast.resolved_memory_inner_dim == 8
    full = MemoriaGPT2Config.from_backbone(backbone_config, "memoria_full_width")
    assert full.memory_attention_mode == "sequential" and full.resolved_memory_inner_dim == 64
    # rounded to a multiple of the heads, never below one per head
    assert MemoriaGPT2Config.from_backbone(backbone_config, memory_inner_dim_ratio=0.2).resolved_memory_inner_dim == 12
    assert MemoriaGPT2Config.from_backbone(backbone_config, memory_inner_dim_ratio=0.01).resolved_memory_inner_dim == 4
    assert MemoriaGPT2Config.from_backbone(backbone_config, memory_inner_dim=24).resolved_memory_inner_dim == 24


def test_config_saved_with_the_old_full_width_default_keeps_it(backbone_config, tmp_path):
    """Configs written before the default became 1/8 say `"memory_inner_dim_ratio": null`: full width."""
    cfg = MemoriaGPT2Config.from_backbone(backbone_config, "memoria", memory_inner_dim_ratio=None)
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["memory_inner_dim_ratio"] is None
    assert MemoriaGPT2Config.from_pretrained(tmp_path).resolved_memory_inner_dim == 64


def test_memory_layers_choose_the_blocks(make_model):
    model = make_model("memoria", memory_layers=[1])
    assert [b.memory_attention is not None for b in model.memory_blocks] == [False, True]
    assert all(b.memory_attention is None for b in make_model("xl").memory_blocks)
    assert make_model("xl").abstractor is None


@pytest.mark.parametrize("preset,stm,ltm", [("memoria_wm", 0, 0), ("memoria_wm_stm", 3, 0), ("memoria", 3, 3)])
def test_ablations_remind_the_right_engrams(make_model, preset, stm, ltm):
    """Table 7 switches: reminded slot counts, and what is actually reminded once memory has filled."""
    model = make_model(preset, memory_init="random")
    cfg = model.config.memoria_config
    assert cfg.num_reminded == stm + ltm
    memory, seen_stm, seen_ltm = None, 0, 0
    with torch.no_grad():
        for x in segments(count=10):
            out = model(x, memory=memory)
            memory = out.memory
            seen_stm = max(seen_stm, int(out.memory_stats.reminded_stm.max()))
            seen_ltm = max(seen_ltm, int(out.memory_stats.reminded_ltm.max()))
    assert seen_stm == stm
    assert (seen_ltm > 0) == (ltm > 0) and seen_ltm <= ltm


def test_backbone_from_a_plain_gpt2_config_keeps_its_fields():
    backbone = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=64, activation_function="gelu")
    cfg = MemoriaGPT2Config.from_backbone(backbone, "memoria", memoria=SMALL_MEMORIA)
    assert (cfg.n_layer, cfg.activation_function, cfg.n_positions, cfg.model_type) == (3, "gelu", 64, "memoria_gpt2")


def test_settings_of_another_memory_kind_are_named_as_idle():
    from memoria_ds.model.config import SETTINGS_OF_KIND, idle_settings

    assert idle_settings("xl", ["memory_heads", "memory_attention_mode", "n_layer", "xl_positions"]) == [
        "memory_attention_mode", "memory_heads"]
    assert idle_settings("memoria", ["xl_memory_length", "memoria", "segment_length"]) == ["xl_memory_length"]
    assert idle_settings("none", ["memoria", "xl_positions", "n_embd"]) == ["memoria", "xl_positions"]
    # every memory field of the config is some kind's setting, or shared by all (segment_length, memory_type,
    # the PKM layers any kind may carry)
    from memoria_ds.model.config import _memory_fields

    named = frozenset().union(*SETTINGS_OF_KIND.values())
    assert _memory_fields() - named == {"memory_type", "segment_length", "memory_init", "memory_settings", "pkm_layers",
                                        "pkm"}
    # every kind is listed
    from memoria_ds.model.config import MEMORY_TYPES

    assert set(SETTINGS_OF_KIND) == set(MEMORY_TYPES)
