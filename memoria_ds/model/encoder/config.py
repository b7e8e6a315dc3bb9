"""MemoriaBertConfig / MemoriaRobertaConfig: a BERT or RoBERTa config plus Memoria's settings.

Each config *is* the backbone's config (`BertConfig`, `RobertaConfig`: every field unchanged) with
the memory's fields added (`EncoderMemoryFields`), so the unmodified HF `BertModel` / `RobertaModel`
is built from it directly and a BERT or RoBERTa checkpoint loads by name. The model types are the
authors' (`memoria_bert`, `memoria_roberta`: cosmoquester/memoria, experiment/longseq_formers/model/).

Defaults and where they come from (the authors' `MemoriaBertConfig`, and the paper's Appendix B.3,
which states the same values):

    memoria.num_wm             64   memoria_num_memories (the abstractor's queries)
    memoria.num_stm_reminded   64   memoria_num_reminded_stm
    memoria.num_ltm_reminded   64   memoria_num_reminded_ltm   (64 + 64 + 64 = the paper's "192 memories")
    memoria.stm_capacity      128   memoria_stm_capacity
    memoria.initial_lifespan   12   memoria_initial_lifespan
    memoria.alpha               8   memoria_lifespan_extend_scale
    memoria.search_depth       10   memoria_ltm_search_depth
    memory_layer_index          9   memory_layer_index (of 12 layers: "the output of the 10th layer is
                                    used as memory, and it is referenced in the remaining 2 layers");
                                    None resolves to `num_hidden_layers - 3`, the same place in a backbone
                                    of another depth (at least 0)

The memory attention (`memory_residual`, `memory_init`) and the abstractor (`abstractor_style`)
each have the authors' form and a no-op form; docs/encoders.md says what each computes and why the
default is what it is. Preset `memoria_authors` is the authors' model throughout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, BertConfig, PretrainedConfig, RobertaConfig

from ...memory import COMPILE_MODES, MemoriaConfig
from ...setting_rules import Rule, SettingError

# The authors' encoder settings (their MemoriaBertConfig / MemoriaRobertaConfig defaults).
ENCODER_MEMORIA: dict[str, Any] = {"num_wm": 64, "num_stm_reminded": 64, "num_ltm_reminded": 64,
                                   "stm_capacity": 128, "initial_lifespan": 12.0, "alpha": 8.0,
                                   "search_depth": 10}
MEMORY_RESIDUALS = ("add", "post_norm")
INIT_MODES = ("noop", "random")
ABSTRACTOR_STYLES = ("transformer", "authors")

# Named configurations of the memory (field overrides; a `memoria` dict is merged into the settings).
ENCODER_PRESETS: dict[str, dict[str, Any]] = {
    # the default: starts as exactly the backbone's classifier (docs/encoders.md, "Initialisation")
    "memoria": {},
    # the authors' model: their memory attention (BertAttention: post-LayerNorm residual), their
    # abstractor (no 1/sqrt(D), no activation) and their random initialisation
    "memoria_authors": {"memory_residual": "post_norm", "memory_init": "random", "abstractor_style": "authors"},
    # the backbone alone (no abstractor, no memory attention, nothing carried): the classifier the
    # memory is measured against, reading one segment (truncated) or every segment (`eval.aggregate`)
    "backbone": {"use_memory": False},
    # Table 7's ablations, on the encoder: working memory only; + short-term memory
    "memoria_wm": {"memoria": {"use_stm": False, "use_ltm": False}},
    "memoria_wm_stm": {"memoria": {"use_ltm": False}},
}

SETTING_RULES: dict[str, Rule] = {
    "memory_layer_index": Rule(int, least=0, what="a layer index", optional=True, none="num_hidden_layers - 3"),
    "memory_residual": Rule(str, choices=MEMORY_RESIDUALS),
    "memory_init": Rule(str, choices=INIT_MODES),
    "abstractor_style": Rule(str, choices=ABSTRACTOR_STYLES),
    "memory_compile": Rule(str, choices=COMPILE_MODES, optional=True),
    "use_memory": Rule(bool),
}


@dataclass(repr=False, eq=False, init=False)
class EncoderMemoryFields:
    """The memory's fields, shared by the BERT and RoBERTa configs.

    Args:
        memoria: Memoria settings as a dict of `memoria_ds.memory.MemoriaConfig` fields; missing
            ones take the authors' encoder values (`ENCODER_MEMORIA`). Stored fully resolved.
        memory_layer_index: l, the layer whose output the abstractor reads (0-based); the layers
            above it read the working memory and the reminded engrams. None = `num_hidden_layers - 3`
            (9 of 12, the authors'). At most `num_hidden_layers - 2`: some layer must read.
        memory_residual: how the memory attention's output joins a layer's stream. `"add"`:
            `h + out(attention)`, whose output projection can start at zero (the default). `"post_norm"`:
            `LayerNorm(h + out(attention))`, the authors' (their memory attention is an HF
            `BertAttention`, whose output sublayer normalises after the residual).
        memory_init: `"noop"` (the memory attention's output projection starts at zero: the model
            starts as exactly its backbone; needs `memory_residual="add"`) or `"random"` (every new
            weight as the authors' code draws it: N(0, initializer_range), biases 0, layer norms 1 and 0).
        abstractor_style: `"transformer"` (scaled attention, an FFN with the backbone's activation;
            queries N(0, 1)) or `"authors"` (unscaled, two linear layers with no activation between;
            queries N(0, 0.02), as their `Abstractor` draws them).
        memory_compile: None (the memory engine runs eagerly) or a `torch.compile` mode for it.
        use_memory: False builds the backbone's classifier alone (preset `backbone`): no abstractor, no
            memory attention, no memory step; its memory (`NoMemory`) keeps only the batch size. The
            baseline the memory is measured against, with the same loop, data and checkpoints.
    """

    memoria: dict[str, Any] | None = None
    memory_layer_index: int | None = None
    memory_residual: str = "add"
    memory_init: str = "noop"
    abstractor_style: str = "transformer"
    memory_compile: str | None = None
    use_memory: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        self.memoria = resolved_memoria(self.memoria)
        if self.memory_layer_index is None and isinstance(self.num_hidden_layers, int):
            self.memory_layer_index = max(0, self.num_hidden_layers - 3)
        super().__post_init__(**kwargs)

    def validate_architecture(self) -> None:
        """Part of the `@strict` validation: every memory setting by its rule, then against the backbone's depth."""
        super().validate_architecture()
        for name, rule in SETTING_RULES.items():
            rule.check(name, getattr(self, name))
        last = self.num_hidden_layers - 2
        if self.use_memory and self.memory_layer_index > last:
            raise SettingError("memory_layer_index", f"({self.memory_layer_index}) must be at most "
                               f"num_hidden_layers - 2 ({last}): the layers above it read the memory, so one "
                               f"must be left (the authors' 9 of 12 leaves two)")
        if self.memory_init == "noop" and self.memory_residual != "add":
            raise SettingError("memory_init", f"('noop') needs memory_residual='add': a memory attention that "
                               f"normalises after its residual ({self.memory_residual!r}) changes the stream "
                               f"whatever its output; use memory_init='random' (the authors')")

    @property
    def memoria_config(self) -> MemoriaConfig:
        """The Memoria settings as the memory engine's typed config."""
        return MemoriaConfig.from_dict(self.memoria)

    @property
    def memory_layers(self) -> list[int]:
        """The layers that read the memory: every layer above `memory_layer_index` (none without a memory)."""
        return list(range(self.memory_layer_index + 1, self.num_hidden_layers)) if self.use_memory else []


@strict
class MemoriaBertConfig(EncoderMemoryFields, BertConfig):
    """A `BertConfig` with Memoria's settings (`EncoderMemoryFields`)."""

    model_type = "memoria_bert"


@strict
class MemoriaRobertaConfig(EncoderMemoryFields, RobertaConfig):
    """A `RobertaConfig` with Memoria's settings (`EncoderMemoryFields`)."""

    model_type = "memoria_roberta"


# backbone model type -> the config that adds the memory to it
CONFIG_FOR_BACKBONE: dict[str, type[PretrainedConfig]] = {"bert": MemoriaBertConfig, "roberta": MemoriaRobertaConfig}

# keys of a backbone config that describe a checkpoint, not the architecture
_NOT_ARCHITECTURE = {"model_type", "architectures", "transformers_version", "_name_or_path", "auto_map", "dtype",
                     "torch_dtype"}


def resolved_memoria(memoria: Any) -> dict[str, Any]:
    """The `memoria` setting merged over the authors' encoder values, every field resolved (capacity included).

    Raises:
        SettingError: not a mapping, or a bad Memoria setting (keyed `memoria.<name>`).
    """
    if memoria is not None and not isinstance(memoria, Mapping):
        raise SettingError("memoria", f"({memoria!r}) must be a mapping of Memoria settings "
                           f"(memoria_ds.memory.MemoriaConfig), e.g. {{num_wm: 16}}")
    try:
        return MemoriaConfig.from_dict({**ENCODER_MEMORIA, **dict(memoria or {})}).to_dict()
    except SettingError as e:
        raise e.within("memoria") from None


def resolve_encoder_preset(preset: str | None, **settings: Any) -> dict[str, Any]:
    """Field overrides of a preset (`ENCODER_PRESETS`) and the explicit settings, the `memoria` dicts merged.

    Raises:
        ValueError: an unknown preset.
    """
    if preset is not None and preset not in ENCODER_PRESETS:
        raise ValueError(f"unknown encoder preset {preset!r}; known: {sorted(ENCODER_PRESETS)}")
    values = dict(ENCODER_PRESETS[preset]) if preset is not None else {}
    memoria = {**values.pop("memoria", {}), **dict(settings.pop("memoria", None) or {})}
    values.update(settings)
    if memoria:
        values["memoria"] = memoria
    return values


def encoder_config(backbone: PretrainedConfig | str | os.PathLike, preset: str | None = None,
                   **settings: Any) -> EncoderMemoryFields:
    """The Memoria config around a BERT or RoBERTa backbone config (or a saved Memoria encoder's).

    Args:
        backbone: a `BertConfig` / `RobertaConfig` (or a Memoria one), or a hub name or local
            directory holding one.
        preset: a name of `ENCODER_PRESETS`, applied first.
        **settings: any field of the Memoria config (memory or backbone, e.g. `num_labels=2`), applied last.

    Raises:
        ValueError: a backbone that is neither BERT nor RoBERTa, an unknown preset.
        SettingError: a setting that does not validate.
    """
    if not isinstance(backbone, PretrainedConfig):
        backbone = AutoConfig.from_pretrained(backbone)
    values = resolve_encoder_preset(preset, **settings)
    if isinstance(backbone, EncoderMemoryFields):  # a saved Memoria encoder: its settings, then these
        saved = {k: v for k, v in backbone.to_dict().items() if k not in _NOT_ARCHITECTURE}
        if "num_labels" in values or "id2label" in values:
            saved = {k: v for k, v in saved.items() if k not in ("id2label", "label2id")}
        memoria = {**saved.get("memoria", {}), **values.pop("memoria", {})}
        return type(backbone)(**{**saved, **values, "memoria": memoria})
    config_class = CONFIG_FOR_BACKBONE.get(backbone.model_type)
    if config_class is None:
        plain = " (Longformer and BigBird are read without memory: preset `backbone`)" \
            if backbone.model_type in ("longformer", "big_bird") else ""
        raise ValueError(f"the backbone is a {backbone.model_type!r} model; Memoria encoders wrap "
                         f"{sorted(CONFIG_FOR_BACKBONE)} (BERT, RoBERTa){plain}")
    base = {k: v for k, v in backbone.to_dict().items() if k not in _NOT_ARCHITECTURE}
    if "num_labels" in values or "id2label" in values:  # the labels given, not the checkpoint's
        base = {k: v for k, v in base.items() if k not in ("id2label", "label2id")}
    attn = getattr(backbone, "_attn_implementation", None)
    if attn is not None and "attn_implementation" not in values:
        values["attn_implementation"] = attn
    return config_class(**{**base, **values})


AutoConfig.register(MemoriaBertConfig.model_type, MemoriaBertConfig, exist_ok=True)
AutoConfig.register(MemoriaRobertaConfig.model_type, MemoriaRobertaConfig, exist_ok=True)

__all__ = ["ENCODER_MEMORIA", "ENCODER_PRESETS", "EncoderMemoryFields", "MemoriaBertConfig", "MemoriaRobertaConfig",
           "CONFIG_FOR_BACKBONE", "encoder_config", "resolve_encoder_preset", "resolved_memoria"]
