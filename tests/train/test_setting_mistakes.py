"""Issue 47 item 4 and 5a: every memory setting is checked like the rest of the configuration.

Fuzzed through what the CLI runs before any data work (`parse.load(RunConfig)`, then setup's
`preflight.check_run`): for every field of every kind's `memory_settings`, every Memoria option
and backbone size (`SETTING_RULES`), every `memoria` setting and every kNN-LM setting, wrong
values of each sort (a bool for an integer, a fraction, nan, inf, a string, a list, out of
range, an unknown name) are one `ConfigError` line naming the dotted key; the values the rules
allow, every preset and the repository's configs pass. Then the estimate that refuses a bptt
span that cannot fit, and the kNN-LM index checked against the keys' width and the datastore.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import GPT2Config

from memoria_ds.memory import MemoriaConfig
from memoria_ds.eval.knn_lm import KNNLMSettings, check_index, training_entries
from memoria_ds.model.config import KIND_SETTINGS, PRESETS, SETTING_RULES
from memoria_ds.model.families import family_of_field
from memoria_ds.train.activation_memory import span_bytes
from memoria_ds.setting_rules import Rule, rules_of
from memoria_ds.train.config import RunConfig
from memoria_ds.train.distributed import DistInfo
from memoria_ds.train.parse import ConfigError, load
from memoria_ds.train.preflight import check_run, check_span_fits, model_config

ROOT = Path(__file__).resolve().parents[2]
# a 2-block, 32-wide model from scratch (no hub), as the launcher tests train
TINY = ["model.backbone=gpt2", "model.from_scratch=true",
        "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64}", "data.segment_length=16",
        "optim.micro_batch_size=2", "optim.precision=fp32"]
CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def refusal(*overrides: str) -> str:
    """The one-line ConfigError the run's checks before any data work give (fails if they accept)."""
    with pytest.raises(ConfigError) as e:
        check_run(load(RunConfig, None, [*TINY, *overrides]), CPU, "fp32")
    message = str(e.value)
    assert "\n" not in message, message
    return message


def accepted(*overrides: str) -> RunConfig:
    cfg = load(RunConfig, None, [*TINY, *overrides])
    check_run(cfg, CPU, "fp32")
    return cfg


def yaml_value(value) -> str:
    """`value` as a command line writes it (`.nan`, `true`, `[1, 2]`)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def bad_values(rule: Rule) -> list:
    """Values of every sort that `rule` refuses."""
    if rule.choices is not None:
        return ["bogus", 1, True, [rule.choices[0]]]
    if rule.type is bool:
        return [1, 0, "yes", 1.0]
    if rule.type is str:
        return [1, ["x"]]
    if rule.type is list:
        return [[True], [1.5], 3, ["x"], {"a": 1}] + ([[-1]] if rule.least is not None else [])
    out = [True, False, "x", [1], {"a": 1}, math.nan, math.inf, -math.inf]
    if rule.type is int:
        out.append(1.5)
    if rule.least is not None:
        out.append(rule.least - 1)
    if rule.above is not None:
        out.append(rule.above)
    if rule.below is not None:
        out.append(rule.below)
    if rule.most is not None:
        out.append(rule.most + 1)
    return out + ([] if rule.optional else [None])


def good_values(rule: Rule) -> list:
    """The edges of what `rule` allows."""
    if rule.choices is not None:
        return list(rule.choices) + ([None] if rule.optional else [])
    if rule.type is bool:
        return [True, False]
    out = [v for v in (rule.least, rule.most) if v is not None]
    out += [None] if rule.optional else []
    return out


def _preset_of(memory_type: str) -> str:
    return next(name for name, values in PRESETS.items() if values.get("memory_type") == memory_type)


def _cases():
    """(overrides, dotted key) of every setting with every sort of wrong value."""
    for memory_type, settings_class in sorted(KIND_SETTINGS.items()):
        preset = f"model.preset={_preset_of(memory_type)}"
        for name, rule in rules_of(settings_class).items():
            key = f"model.settings.memory_settings.{name}"
            for value in bad_values(rule):
                yield pytest.param([preset, f"{key}={yaml_value(value)}"], key, id=f"{memory_type}.{name}={value!r}")
        key = "model.settings.memory_settings.bogus"
        yield pytest.param([preset, f"{key}=1"], key, id=f"{memory_type}.unknown")
        yield pytest.param([preset, "model.settings.memory_settings=[1, 2]"], "model.settings.memory_settings",
                           id=f"{memory_type}.list")
    for name, rule in SETTING_RULES.items():
        family = family_of_field(name)  # a Memory Mosaic's or a MemSizer's own setting: with its preset
        preset = f"model.preset={sorted(family.presets)[0] if family is not None else 'memoria'}"
        key = f"model.settings.{name}"
        for value in bad_values(rule):
            yield pytest.param([preset, f"{key}={yaml_value(value)}"], key, id=f"{name}={value!r}")
    for name, rule in rules_of(MemoriaConfig).items():
        key = f"model.settings.memoria.{name}"
        values = bad_values(Rule(rule.type, choices=rule.choices, optional=rule.optional))
        values += {"num_wm": [0], "stm_capacity": [0], "num_stm_reminded": [-1], "num_ltm_reminded": [-1],
                   "search_depth": [-1], "initial_lifespan": [0, -1.0], "alpha": [-0.5], "capacity": [5]}.get(name, [])
        for value in values:
            yield pytest.param([f"{key}={yaml_value(value)}"], key, id=f"memoria.{name}={value!r}")
    yield pytest.param(["model.settings.memoria.bogus=1"], "model.settings.memoria.bogus", id="memoria.unknown")
    yield pytest.param(["model.settings.memoria=[1]"], "model.settings.memoria", id="memoria.list")
    for name, rule in rules_of(KNNLMSettings).items():
        if name == "index":
            continue  # a string: below
        key = f"eval.knn_lm.{name}"
        for value in bad_values(rule):
            if value is None and name == "key":
                continue
            yield pytest.param([f"{key}={yaml_value(value)}"], key, id=f"knn_lm.{name}={value!r}")


# What issue 47 item 4 listed, each a traceback, a silent acceptance or a wrong block before.
ISSUE_CASES = [
    (["model.preset=memformer", "model.settings.memory_settings.num_slots=0"],
     "model.settings.memory_settings.num_slots"),
    (["model.preset=memformer", "model.settings.memory_settings.slots=4"], "model.settings.memory_settings.slots"),
    (["model.preset=memformer", "model.settings.memory_settings.temperature=.nan"],
     "model.settings.memory_settings.temperature"),
    (["model.preset=memorizing_no_cache", "model.settings.memory_settings.topk=0"],
     "model.settings.memory_settings.topk"),
    (["model.preset=memorizing_no_cache", "model.settings.memory_settings.layer=9"],
     "model.settings.memory_settings.layer"),
    (["model.preset=memorizing_no_cache", "model.settings.memory_settings.layer=true"],
     "model.settings.memory_settings.layer"),
    # the `memorizing` preset is a composite (xl+memorizing): its part's settings go under the part's name
    (["model.preset=memorizing", "model.settings.memory_settings.memorizing.topk=0"],
     "model.settings.memory_settings.memorizing.topk"),
    (["model.preset=memorizing", "model.settings.memory_settings.topk=4"], "model.settings.memory_settings.topk"),
    (["model.preset=compressive", "model.settings.memory_settings.compression_rate=0"],
     "model.settings.memory_settings.compression_rate"),
    (["model.preset=compressive", "model.settings.memory_settings=[1,2]"], "model.settings.memory_settings"),
    (["model.preset=compressive", "model.settings.memory_settings.reconstruction_weight=.inf"],
     "model.settings.memory_settings.reconstruction_weight"),
    (["model.preset=infinity", "model.settings.memory_settings.kl_weight=.inf"],
     "model.settings.memory_settings.kl_weight"),
    (["model.preset=infinity", "model.settings.memory_settings.mu_0=.nan"], "model.settings.memory_settings.mu_0"),
    (["model.settings.memory_read=sideways"], "model.settings.memory_read"),
    (["model.settings.engram_loss=-1"], "model.settings.engram_loss"),
    (["model.settings.memory_read=self_attention", "model.settings.engram_bias=.inf"], "model.settings.engram_bias"),
    (["eval.knn_lm.temperature=.inf"], "eval.knn_lm.temperature"),
    (["eval.knn_lm.lmbda=1.0"], "eval.knn_lm.lmbda"),
    # what only the backbone's shape decides (checked in setup, before the data)
    (["model.settings.memory_layers=[0, 2]"], "model.settings.memory_layers"),
    (["model.settings.memory_inner_dim=3"], "model.settings.memory_inner_dim"),
]


@pytest.mark.parametrize("overrides, key", ISSUE_CASES)
def test_the_issues_mistakes_name_their_key(overrides, key):
    message = refusal(*overrides)
    assert message.startswith(f"`{key}`"), message
    value = yaml.safe_load(overrides[-1].split("=", 1)[1])
    assert repr(value) in message or "unknown" in message, message  # the value said back


@pytest.mark.parametrize("overrides, key", list(_cases()))
def test_every_wrong_value_of_every_setting_is_one_line_naming_its_key(overrides, key):
    message = refusal(*overrides)
    assert f"`{key}`" in message, message


def test_unknown_names_are_refused_naming_the_known_ones():
    for memory_type, settings_class in KIND_SETTINGS.items():
        message = refusal(f"model.preset={_preset_of(memory_type)}", "model.settings.memory_settings.bogus=1")
        assert f"unknown {memory_type} setting" in message
        assert all(name in message for name in rules_of(settings_class)), message
    assert "(so are ['zz'])" in refusal("model.settings.memoria={bogus: 1, zz: 2}")


def test_the_values_the_rules_allow_pass():
    for memory_type, settings_class in sorted(KIND_SETTINGS.items()):
        for name, rule in rules_of(settings_class).items():
            for value in good_values(rule):
                if memory_type == "memorizing" and name == "layer" and value is not None:
                    value = 1  # the last block of 2
                accepted(f"model.preset={_preset_of(memory_type)}", f"model.settings.memory_settings.{name}="
                         f"{yaml_value(value)}")
    for extra in (["model.settings.memory_read=self_attention", "model.settings.engram_bias=-4.0",
                   "model.settings.engram_loss=0.5"], ["model.settings.memory_layers=[0, 1]"],
                  ["model.settings.memory_inner_dim_ratio=4"],
                  ["eval.knn_lm.lmbda=0.0", "eval.knn_lm.temperature=1e-3"],
                  ["model.preset=memorizing_no_cache", "model.settings.memory_settings.layer=null"],
                  ["model.preset=memorizing", "model.settings.memory_settings.memorizing.layer=1"]):
        accepted(*extra)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_passes(preset):
    cfg = accepted(f"model.preset={preset}", "optim.bptt_segments=2")
    assert model_config(cfg).n_layer == 2


CONFIGS = [*ROOT.glob("launch/configs/*.yaml"), *ROOT.glob("launch/repro/configs/*.yaml")]


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in CONFIGS))
def test_the_repositorys_configs_pass(path, tmp_path):
    if load(RunConfig, ROOT / path).model.task == "classification":  # an encoder: settings checked as parsed
        from transformers import RobertaConfig

        from memoria_ds.train.build import run_model_config

        RobertaConfig().save_pretrained(tmp_path)  # a pretrained RoBERTa: its config from a local copy
        cfg = load(RunConfig, ROOT / path, [f"model.backbone={tmp_path}"])
        assert run_model_config(cfg).model_type == "memoria_roberta" and cfg.data.tokenizer == str(tmp_path)
        return
    overrides = []
    if not load(RunConfig, ROOT / path).model.from_scratch:  # a pretrained GPT-2: its config from a local copy
        GPT2Config().save_pretrained(tmp_path)
        overrides = [f"model.backbone={tmp_path}"]
    check_run(load(RunConfig, ROOT / path, overrides), CPU, "fp32")


# ---------------------------------------------------------------------- a bptt span that cannot fit
def test_the_span_estimate_counts_every_segments_activations():
    cfg = accepted("model.preset=memformer")
    config = model_config(cfg)
    # fp32, per block s*b*h*(34 + 5*a*s/h) * 2 bytes = 16*2*32*(34 + 5*2*16/32) * 2; logits 16*2*50257 * (4 + 4)
    one = 2 * (16 * 2 * 32 * (34 + 5)) * 2 + 16 * 2 * 50257 * 8
    assert span_bytes(config, 2, 16, 1, "fp32") == one == 13_025_536
    assert span_bytes(config, 2, 16, 1000, "fp32") == 1000 * one
    # memory replay keeps a segment's memory (2 rows of 1024 32-wide fp32 slots) and its input
    kept = 2 * (1024 * 32 * 4 + 16 * 32 * 4)
    assert span_bytes(config, 2, 16, 1000, "fp32", recompute=True) == 1000 * kept + one


def test_a_span_that_cannot_fit_is_refused_with_the_estimate():
    cfg = load(RunConfig, None, [*TINY, "model.preset=memformer", "optim.bptt_segments=1000"])
    config = model_config(cfg)
    ten_gib = (10 * 1024**3, "of memory available on this machine")
    with pytest.raises(ConfigError) as e:
        check_span_fits(cfg, config, "fp32", CPU.device, available=ten_gib)
    message = str(e.value)
    assert message.startswith("`optim.bptt_segments` (1000) keeps the activations of 1000 segments"), message
    assert "about 12.1 GiB per rank" in message and "more than the 10.0 GiB of memory available" in message
    assert "at most 824 segments fit" in message and "optim.bptt_recompute=true" in message, message
    check_span_fits(cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"bptt_segments": 824})}), config,
                    "fp32", CPU.device, available=ten_gib)
    # memory replay fits where the plain span does not
    replay = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"bptt_recompute": True})})
    check_span_fits(replay, config, "fp32", CPU.device, available=ten_gib)
    # a span far beyond any machine is refused by the real check, which measures the memory
    message = refusal("model.preset=memformer", "optim.bptt_segments=100000")
    assert "optim.bptt_segments` (100000)" in message and "segments fit" in message, message
    accepted("model.preset=memformer", "optim.bptt_segments=4")


# ---------------------------------------------------------------------- the kNN-LM index
def test_training_entries_of_faiss_indexes():
    assert [training_entries(f, 64) for f in ("Flat", "HNSW32", "IVF4096,Flat", "IVF16,PQ4", "PQ8x4", "IMI2x4,Flat",
                                              "OPQ8,IVF64,PQ8")] == [0, 0, 4096, 256, 16, 16, 256]


def test_the_index_is_checked_against_the_keys_and_the_datastore():
    knn = ["eval.knn_lm.enabled=true", "eval.knn_lm.train_datastore=true"]
    message = refusal(*knn, "eval.knn_lm.index=IVF4096,Flat", "eval.knn_lm.train_max_entries=500")
    assert message.startswith("`eval.knn_lm.index` ('IVF4096,Flat') is trained on the training-text datastore and "
                              "needs at least 4096 entries"), message
    assert "`eval.knn_lm.train_max_entries` caps it at 500" in message
    # the width is the model's (32), not GPT-2's 768
    message = refusal(*knn, "eval.knn_lm.index=IVF16,PQ48")
    assert "for this model's 32-wide keys" in message and "768" not in message, message
    accepted(*knn, "eval.knn_lm.index=IVF8,Flat", "eval.knn_lm.train_max_entries=500")
    accepted(*knn, "eval.knn_lm.index=IVF4096,Flat")  # uncapped: the whole training split
    # before the model is known, a string is refused only if no GPT-2 width builds it
    KNNLMSettings(index="PQ80")  # 1280 (GPT-2 large) / 80
    with pytest.raises(ValueError, match="not a FAISS index_factory string for keys of any GPT-2 width"):
        KNNLMSettings(index="IVF4096,Bogus")
    with pytest.raises(ValueError, match="caps it at 10"):
        check_index("PQ4", 32, 10, "the cap")
