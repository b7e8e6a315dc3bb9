"""MemoriaGPT2Config: a GPT-2 config plus the memory that is bolted onto it.

The config *is* a `GPT2Config` (every backbone field, unchanged) with the memory settings
added, so the unmodified HF `GPT2Model` is built from it directly and a GPT-2 checkpoint
(hub name or local directory) loads into the Memoria model by name.

Memory types (SPEC section 2; paper Tables 1, 2, 4, 7):

    none         the plain backbone (the paper's "Transformer")
    xl           Transformer-XL-style recurrence over cached keys/values
    memoria      Memoria: abstractor -> remind -> memory cross-attention -> memorize
    compressive  the Compressive Transformer (Rae et al. 2020): xl plus a compressed memory
    infinity     the infinity-former (Martins et al. 2022): a continuous long-term memory attention
    memorizing   the Memorizing Transformer (Wu et al. 2022): one block also attends to a kNN memory of its past keys/values
    memformer    Memformer (Wu et al. 2020): k memory slots read by every block, written by slot attention

A kind's own settings are one dict, `memory_settings`, parsed by the kind's settings class
(`KIND_SETTINGS`, registered by the kind; docs/baselines.md).

Every setting is checked by its rule (`SETTING_RULES`, `memoria_ds.setting_rules`: its type, no
bool for an integer, finite numbers, its range or choices), and a bad one is a `SettingError`
naming its key (`memory_settings.num_slots`, `memoria.num_wm`, `engram_loss`).
`check_model_settings` checks a preset and its settings before anything is built (the run
configuration calls it when it loads); what depends on the backbone's shape is checked when
the config is built (`validate_architecture`).

Product-Key Memory layers (`pkm_layers`, sized by `pkm`; `model/pkm.py`) are an option any
kind may carry: they replace (or follow) the MLP of the chosen blocks and carry nothing
across segments.

`PRESETS` names the configurations that the paper compares, so every comparison runs
through the same model class, launcher and evaluation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import GPT2Config

from ..memory import COMPILE_MODES, MemoriaConfig
from ..setting_rules import Rule, SettingError
from .composition import check_composition, is_composite, memory_kinds, part_settings
from .pkm import PKMSettings

# mosaic: Memory Mosaics only (model/mosaic/); memsizer: MemSizers only (model/memsizer/)
MEMORY_TYPES = ("none", "xl", "memoria", "compressive", "infinity", "memorizing", "mosaic", "memformer", "memsizer")
# kinds that cache keys/values at the positions they were computed at (`xl_positions` applies)
CACHED_KV_TYPES = ("xl", "compressive")
ATTENTION_MODES = ("sequential", "parallel")
MEMORY_READS = ("cross_attention", "self_attention")
INIT_MODES = ("noop", "random")
ABSTRACTOR_STYLES = ("transformer", "authors")
XL_POSITIONS = ("shared", "alternate")

# The comparisons of the paper, by name. Values are overrides of `MemoriaGPT2Config`
# fields; a `memoria` dict is merged into the Memoria settings (not replacing them).
PRESETS: dict[str, dict[str, Any]] = {
    "transformer": {"memory_type": "none"},
    # alternating position banks: the cached segment never shares positions with the current
    # one (docs/model.md, "Transformer-XL baseline"; measured in benchmarks/real_text.py)
    "xl": {"memory_type": "xl", "xl_positions": "alternate"},
    # Table 7 ablations: working memory only, + short-term memory, + long-term memory (full)
    "memoria_wm": {"memory_type": "memoria", "memoria": {"use_stm": False, "use_ltm": False}},
    "memoria_wm_stm": {"memory_type": "memoria", "memoria": {"use_ltm": False}},
    "memoria": {"memory_type": "memoria"},
    # The authors' width: the memory attention's q/k/v as wide as the model (their code, and
    # what the paper's numbers were measured with; the reproduction launchers use it).
    "memoria_full_width": {"memory_type": "memoria", "memory_inner_dim_ratio": 1.0},
    # One layer norm and one query for both uses, one output projection (docs/model.md).
    "memoria_fast": {"memory_type": "memoria", "memory_attention_mode": "parallel"},
    # The gated option beyond the paper (docs/memoria_options.md): the engrams as self-attention slots
    # behind a learned gate starting nearly shut, the abstractor also trained to reconstruct the segment
    "memoria_gated": {"memory_type": "memoria", "memory_read": "self_attention", "engram_loss": 1.0,
                      "engram_bias": -4.0},
    # The paper's Compressive Transformer baseline: half the memory uncompressed, half
    # compressed at rate 4 by a 1D convolution (docs/baselines.md)
    "compressive": {"memory_type": "compressive", "xl_positions": "alternate"},
    # The paper's infinity-former baseline, initialised as the authors' code does (random
    # long-term attention; `memory_init="noop"` starts it at exactly the backbone)
    "infinity": {"memory_type": "infinity", "memory_init": "random"},
    # Memorizing Transformer (Wu et al. 2022) as google-research/meliad runs it: a Transformer-XL
    # cache in every block and a kNN memory read by one block near the top, its gate starting at an
    # even mix (docs/field_memories.md gives the source of each default and the departures)
    "memorizing": {"memory_type": "xl+memorizing", "xl_positions": "alternate",
                   "memory_settings": {"memorizing": {"gate_bias": 0.0}}},
    # ... the paper's "no XL cache" variant, its gate starting nearly shut (`memory_init`)
    "memorizing_no_cache": {"memory_type": "memorizing"},
    # Memformer (Wu et al. 2020): k memory slots per stream, read by every block and written by
    # slot attention with biased memory normalisation (docs/field_memories.md: the defaults' sources)
    "memformer": {"memory_type": "memformer"},
    # The Memory Mosaic of Zhang et al. (2024) of the backbone's shape: its own model class
    # (model/mosaic/, built by build.py), carrying nothing across segments.
    "memory_mosaic": {"memory_type": "none"},
    # ... with its contextual memory carried across segments (recurrent/mosaic.py)
    "memory_mosaic_carry": {"memory_type": "mosaic"},
    # MemSizer (Zhang & Cai 2022) of the backbone's shape: its own model class (model/memsizer/, built
    # by build.py), every segment read from an empty key-value memory (the reference's training)
    "memsizer": {"memory_type": "none"},
    # ... with each layer's key-value memory and the stream's length carried across segments (recurrent/memsizer.py)
    "memsizer_carry": {"memory_type": "memsizer"},
}

# The memory settings only some kinds read (`MemoriaGPT2Config` fields); given to a model of
# another kind they change nothing, and a run says so (`idle_settings`). Fields every kind may
# read (`memory_type`, `segment_length`, `memory_init`, the PKM layers' `pkm_layers` and `pkm`) and a
# kind's own `memory_settings` (validated by that kind) are not listed.
SETTINGS_OF_KIND: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "xl": frozenset({"xl_memory_length", "xl_positions"}),
    "mosaic": frozenset({"mosaic_memory_length"}),
    "memoria": frozenset({"memoria", "memory_layers", "memory_heads", "memory_inner_dim", "memory_inner_dim_ratio",
                          "memory_attention_mode", "abstractor_style", "memory_compile", "memory_read",
                          "engram_loss", "engram_bias"}),
    "compressive": frozenset({"xl_positions"}),
    "infinity": frozenset(),
    "memorizing": frozenset(),
    "memformer": frozenset(),
    "memsizer": frozenset(),
}


def idle_settings(memory_type: str, keys: Any) -> list[str]:
    """Those of `keys` that are settings of other memory kinds only: `memory_type` ignores them."""
    mine = frozenset().union(*(SETTINGS_OF_KIND.get(k, frozenset()) for k in memory_kinds(memory_type)))
    others = frozenset().union(*SETTINGS_OF_KIND.values())
    return sorted(k for k in keys if k in others and k not in mine)


# Default width of the memory attention's q/k/v, as a fraction of n_embd. The authors' code
# uses the full width, which costs 1.38x (gpt2) to 1.48x (gpt2-large) the backbone's FLOPs;
# an eighth costs 1.07x there, and kept 81% of the full width's gain from memory in the
# quality probe of docs/benchmarks.md ("Memory attention width").
DEFAULT_MEMORY_WIDTH_RATIO = 0.125

# What each setting may hold (`check_memory_values`): the memory's, the Memory Mosaic's
# (mosaic/config.py), the MemSizer's (memsizer/config.py) and the backbone's sizes and rates
# (GPT2Config: huggingface_hub's strict dataclass checks their types only). A kind's
# `memory_settings` and the `memoria` dict are checked by their own classes.
SETTING_RULES: dict[str, Rule] = {
    # "memory_type": a kind of MEMORY_TYPES, or kinds joined by "+" (`composition.check_composition`)
    "memory_layers": Rule(list, least=0, what="a list of block indices", optional=True, none="every block"),
    "memory_heads": Rule(int, least=1, optional=True, none="`n_head`"),
    "memory_inner_dim": Rule(int, least=1, optional=True, none="from `memory_inner_dim_ratio`"),
    "memory_inner_dim_ratio": Rule(float, above=0, most=4, optional=True, none="`n_embd`"),
    "memory_attention_mode": Rule(str, choices=ATTENTION_MODES),
    "memory_read": Rule(str, choices=MEMORY_READS),
    "engram_loss": Rule(float, least=0, what="a finite weight", note="0: off"),
    "engram_bias": Rule(float, optional=True, none="no bias"),
    "memory_init": Rule(str, choices=INIT_MODES),
    "abstractor_style": Rule(str, choices=ABSTRACTOR_STYLES),
    "xl_memory_length": Rule(int, least=1, optional=True, none="one segment"),
    "xl_positions": Rule(str, choices=XL_POSITIONS),
    "segment_length": Rule(int, least=1, optional=True, none="not fixed"),
    "memory_compile": Rule(str, choices=COMPILE_MODES, optional=True),
    "pmem_size": Rule(int, least=1, optional=True, none="n_inner - n_embd / 2"),
    "pmem_count": Rule(int, least=1),
    "bias": Rule(bool),
    "mosaic_memory_length": Rule(int, least=1, optional=True, none="one segment"),
    "memsizer_slots": Rule(int, least=1),
    "q_init_scale": Rule(float, above=0),
    "kv_init_scale": Rule(float, above=0),
    "pkm_layers": Rule(list, least=0, what="a list of block indices", optional=True, none="no PKM layer"),
    **{name: Rule(int, least=1) for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")},
    "n_inner": Rule(int, least=1, optional=True, none="4 * n_embd"),
    **{name: Rule(float, least=0, below=1) for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop",
                                                        "summary_first_dropout")},
    "layer_norm_epsilon": Rule(float, above=0),
    "initializer_range": Rule(float, least=0),
}


def check_memory_values(values: Mapping[str, Any]) -> None:
    """The settings in `values` (`MemoriaGPT2Config` fields) that need no backbone: each by its
    rule (`SETTING_RULES`), then those that depend on each other.

    Raises:
        SettingError: naming the setting, what it holds and what it may hold.
    """
    for name, value in values.items():
        rule = SETTING_RULES.get(name)
        if rule is not None:
            rule.check(name, value)
    read = values.get("memory_read", "cross_attention")
    if "memory_type" in values:
        check_composition(values["memory_type"], read if isinstance(read, str) else "cross_attention")
    if read == "self_attention" and values.get("memory_layers") is not None:
        raise SettingError("memory_layers", f"({values['memory_layers']}) is for `memory_read='cross_attention'`: "
                           f"`memory_read='self_attention'` reads the engrams in every block's self-attention; "
                           f"leave `memory_layers` unset")
    if values.get("engram_bias") is not None and read != "self_attention":
        raise SettingError("engram_bias", "biases the engram slots of `memory_read='self_attention'`; set that, or "
                           "leave `engram_bias` unset")
    resolve_pkm(values.get("pkm_layers"), values.get("pkm"))


def resolve_pkm(pkm_layers: list[int] | None, pkm: Any) -> dict[str, Any] | None:
    """The `pkm` setting with every size resolved (`pkm.PKMSettings`), or None when there is no PKM layer.

    Raises:
        SettingError: `pkm` given without `pkm_layers`, or a bad size (keyed `pkm.<name>`).
    """
    if not pkm_layers:
        if pkm:
            raise SettingError("pkm", f"({pkm!r}) sizes the PKM layers of `pkm_layers`, which names none; set "
                               f"`pkm_layers` (e.g. [1]) or remove `pkm`")
        return None
    return PKMSettings.from_dict(dict(pkm) if isinstance(pkm, Mapping) else {} if pkm is None else pkm).to_dict()


def _resolved_memoria(memoria: Any) -> dict[str, Any]:
    """The `memoria` setting (a mapping of `MemoriaConfig` fields, or None) with every field resolved."""
    if memoria is not None and not isinstance(memoria, Mapping):
        raise SettingError("memoria", f"({memoria!r}) must be a mapping of Memoria settings "
                           f"(memoria_ds.memory.MemoriaConfig), e.g. {{num_wm: 16}}")
    try:
        return MemoriaConfig.from_dict(dict(memoria or {})).to_dict()
    except SettingError as e:
        raise e.within("memoria") from None


# Keys of a backbone config that describe a checkpoint, not the architecture.
_NOT_ARCHITECTURE = {
    "model_type",
    "architectures",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "dtype",
    "torch_dtype",
}


@strict
class MemoriaGPT2Config(GPT2Config):
    """GPT-2 backbone settings plus the memory's.

    Every `GPT2Config` field keeps its meaning. Added fields:

    Args:
        memory_type: one of `MEMORY_TYPES` (`"none"`, `"xl"`, `"memoria"`, `"compressive"`, `"infinity"`),
            or kinds that compose joined by "+" (`"xl+memoria"`: `composition.py`).
        memory_settings: the settings of a kind that has its own (`compressive`, ...), as a
            dict of its settings class's fields (missing ones take its defaults). Stored
            fully resolved; None for a kind without settings. A composite's: each part's
            under its name (`{"memorizing": {...}}`).
        memoria: Memoria settings as a dict of `memoria_ds.memory.MemoriaConfig` fields
            (missing ones take the paper's WikiText-103 defaults). Stored fully resolved.
        memory_layers: blocks (0-based) that get a memory cross-attention; `None` = every
            block, as the authors' code does.
        memory_heads: heads of the memory cross-attention; `None` = `n_head`.
        memory_inner_dim: width of its q/k/v (a multiple of `memory_heads`); overrides
            `memory_inner_dim_ratio` when set.
        memory_inner_dim_ratio: the width as a fraction of `n_embd`, rounded to a multiple of
            `memory_heads`. Default 1/8 (`DEFAULT_MEMORY_WIDTH_RATIO`); 1.0 is the authors'
            width (preset `memoria_full_width`). `None` = `n_embd` (how configs saved
            before the default changed say full width).
        memory_attention_mode: `"sequential"` (the authors' block: self-attention -> WM
            cross-attention -> reminded-engram cross-attention -> MLP, each with its own
            pre-layer-norm and residual) or `"parallel"` (one layer norm and one query for
            both uses; their outputs are summed before one output projection).
        memory_read: how the blocks read Memoria's engrams. `"cross_attention"` (the paper's
            model: a memory cross-attention after each block's self-attention, configured by
            the four settings above) or `"self_attention"` (an option beyond the paper: the
            working memory and reminded engrams are key/value slots of every block's own
            self-attention, projected by that block's `ln_1` and `c_attn` as Transformer-XL's
            cache is, competing with the segment's tokens in one softmax; no new weights, and
            not a no-op at initialisation: docs/model.md, "Options beyond the paper").
        engram_loss: weight of an auxiliary loss (an option beyond the paper; 0 = off, the
            paper's model) that trains the abstractor to keep the passage: every token of the
            previous segment, attending (parameter-free dot-product attention) over the working
            memory, should read what it reads attending over the whole previous segment (the
            Compressive Transformer's attention-reconstruction loss, with the segment's final
            hidden states as queries, keys and values; the target carries no gradient).
        engram_bias: with `memory_read="self_attention"`, a learned per-head, per-block bias
            added to the attention logits of the engram slots, starting at this value (an
            option beyond the paper; None = no bias). A negative start (e.g. -4) makes the
            blocks start close to their backbone, the engrams taking little attention until the
            bias is learned up: a gate on the memory read.
        memory_init: `"noop"` (output projections of the memory attention start at zero:
            the model starts exactly as the backbone) or `"random"` (the paper's random
            initialisation of every new weight).
        abstractor_style: `"transformer"` (scaled dot-product attention, FFN with the
            backbone's activation) or `"authors"` (no 1/sqrt(d) scaling, FFN of two linear
            layers with no activation: what the authors' code does).
        xl_memory_length: keys/values per layer kept by `xl`; `None` = the previous
            segment's length.
        xl_positions: how `xl` (and every kind in `CACHED_KV_TYPES`) places a segment among GPT-2's absolute positions.
            `"shared"`: every segment at 0..L-1, so a cached key and a current key of the
            same place in their segments carry the same position (what configs saved
            without this field mean). `"alternate"`: segments since a reset alternate
            between two banks, 0..L-1 and S..S+L-1 with S = n_positions // 2, so the
            cached previous segment always sits in the other bank (the `xl` preset's
            choice; segments must fit in S).
        segment_length: the segment length the model is trained with; `generate()` feeds
            a long prompt in segments of this length unless told otherwise.
        memory_compile: None (the memory engine runs eagerly) or a `torch.compile` mode
            (`memoria_ds.memory.COMPILE_MODES`: "default", or "reduce-overhead" for CUDA
            graphs on a GPU): the engine's remind and memorize each run as one compiled
            graph, the same computation (`memoria_ds.memory.MemoryEngine`).
        pkm_layers: blocks (0-based) that get a Product-Key Memory layer (`model/pkm.py`;
            Lample et al. 2019), with any memory kind; None (or empty) = none. It replaces the
            block's MLP (the block's `mlp` weights are then absent) or follows it, as `pkm`'s
            `placement` says.
        pkm: the PKM layers' sizes as a dict of `pkm.PKMSettings` fields (missing ones take the
            paper's: 512 x 512 keys, 4 heads, knn 32, k_dim 256, query batch norm, replacing the
            MLP). Stored fully resolved; None when `pkm_layers` names no block.
    """

    model_type = "memoria_gpt2"

    memory_type: str = "memoria"
    memoria: dict[str, Any] | None = None
    memory_settings: dict[str, Any] | None = None
    memory_layers: list[int] | None = None
    memory_heads: int | None = None
    memory_inner_dim: int | None = None
    memory_inner_dim_ratio: float | None = DEFAULT_MEMORY_WIDTH_RATIO
    memory_attention_mode: str = "sequential"
    memory_read: str = "cross_attention"
    engram_loss: float = 0.0
    engram_bias: float | None = None
    memory_init: str = "noop"
    abstractor_style: str = "transformer"
    xl_memory_length: int | None = None
    xl_positions: str = "shared"
    segment_length: int | None = None
    memory_compile: str | None = None
    pkm_layers: list[int] | None = None
    pkm: dict[str, Any] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        # resolve the Memoria settings once (capacity included), so config.json is explicit
        self.memoria = _resolved_memoria(self.memoria)
        self.memory_settings = resolve_memory_settings(self.memory_type, self.memory_settings)
        if self.pkm_layers is None or isinstance(self.pkm_layers, list):  # another type: validation says so
            self.pkm = resolve_pkm(self.pkm_layers, self.pkm)
        super().__post_init__(**kwargs)

    # ------------------------------------------------------------------ validation
    def validate_architecture(self) -> None:
        """Part of the `@strict` validation: every setting by its rule (`check_memory_values`), then
        what depends on the backbone's shape; each mistake a `SettingError` naming the setting."""
        super().validate_architecture()
        check_memory_values({name: getattr(self, name) for name in (*SETTING_RULES, "memory_type") if hasattr(self, name)})
        for kind in self.memory_kinds:
            settings_class = KIND_SETTINGS.get(kind)
            if settings_class is not None and hasattr(settings_class, "check_model"):  # e.g. a block index in range
                own = part_settings(self.memory_type, self.memory_settings, kind)
                settings = settings_class.from_dict(dict(own or {}))
                try:
                    settings.check_model(self)
                except SettingError as e:
                    raise e.within(f"memory_settings.{kind}" if is_composite(self.memory_type)
                                   else "memory_settings") from None
        if self.pkm_layers:
            bad = [i for i in self.pkm_layers if not 0 <= i < self.n_layer]
            if bad or len(set(self.pkm_layers)) != len(self.pkm_layers):
                raise SettingError("pkm_layers", f"({self.pkm_layers}) must be distinct block indices in "
                                   f"[0, {self.n_layer}) (the model has {self.n_layer} blocks)")
        if self.memory_layers is not None:
            bad = [i for i in self.memory_layers if not 0 <= i < self.n_layer]
            if bad or len(set(self.memory_layers)) != len(self.memory_layers):
                raise SettingError("memory_layers", f"({self.memory_layers}) must be distinct block indices in "
                                   f"[0, {self.n_layer}); use None for every block")
        heads = self.resolved_memory_heads
        inner = self.resolved_memory_inner_dim
        if inner < heads or inner % heads:
            raise SettingError("memory_inner_dim", f"({inner}): the memory attention width must be a positive "
                               f"multiple of `memory_heads` ({heads})")
        if self.segment_length is not None and not 1 <= self.segment_length <= self.positions_per_segment:
            banks = " (half of n_positions: `xl_positions='alternate'` uses two banks)" if self.position_banks > 1 else ""
            raise SettingError("segment_length", f"({self.segment_length}) must be in [1, {self.positions_per_segment}]"
                               f"{banks}: GPT-2's learned positions (n_positions={self.n_positions}) stop there")

    # ------------------------------------------------------------------ derived values
    @property
    def pkm_settings(self) -> PKMSettings | None:
        """The PKM layers' sizes (None: no PKM layer)."""
        return PKMSettings.from_dict(dict(self.pkm)) if self.pkm_layers and self.pkm is not None else None

    @property
    def pkm_replaced_mlps(self) -> list[int]:
        """Blocks whose MLP a PKM layer replaces (their `mlp` weights are absent)."""
        settings = self.pkm_settings
        return sorted(self.pkm_layers) if settings is not None and settings.placement == "replace" else []

    @property
    def memory_kinds(self) -> tuple[str, ...]:
        """The kinds this model carries, in order: one, or a composite's (`"xl+memoria"`: xl, memoria)."""
        return memory_kinds(self.memory_type)

    @property
    def memoria_config(self) -> MemoriaConfig:
        """The Memoria settings as the memory engine's typed config."""
        return MemoriaConfig.from_dict(self.memoria)

    @property
    def position_banks(self) -> int:
        """How many banks of positions segments alternate between (2 for `xl` with alternating positions)."""
        return position_banks(self.memory_type, self.xl_positions)

    @property
    def positions_per_segment(self) -> int:
        """S: a segment (with its decoded tokens) must fit in S positions; bank b starts at b * S."""
        return self.n_positions // self.position_banks

    @property
    def resolved_memory_layers(self) -> list[int]:
        """Blocks with a memory cross-attention (empty unless `memory_type == "memoria"` and
        `memory_read == "cross_attention"`)."""
        if "memoria" not in self.memory_kinds or self.memory_read != "cross_attention":
            return []
        return sorted(self.memory_layers) if self.memory_layers is not None else list(range(self.n_layer))

    @property
    def resolved_memory_heads(self) -> int:
        return self.memory_heads if self.memory_heads is not None else self.n_head

    @property
    def resolved_memory_inner_dim(self) -> int:
        if self.memory_inner_dim is not None:
            return self.memory_inner_dim
        if self.memory_inner_dim_ratio is not None:
            heads = self.resolved_memory_heads
            return max(heads, int(round(self.n_embd * self.memory_inner_dim_ratio / heads)) * heads)
        return self.n_embd

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_backbone(
        cls, backbone: GPT2Config | str | os.PathLike, preset: str | None = None, **settings: Any
    ) -> MemoriaGPT2Config:
        """A Memoria config around a GPT-2 backbone config.

        Args:
            backbone: a `GPT2Config`, or a hub name (`"gpt2"`, `"gpt2-large"`, ...) or local
                directory whose config.json is a GPT-2 config.
            preset: a name from `PRESETS` (e.g. `"xl"`, `"memoria_wm_stm"`), applied first.
            **settings: any `MemoriaGPT2Config` field (memory or backbone), applied last; a
                `memoria` dict is merged into the preset's Memoria settings.

        Raises:
            ValueError: an unknown preset, or settings that do not validate.
        """
        if not isinstance(backbone, GPT2Config):
            backbone = GPT2Config.from_pretrained(backbone)
        values = {k: v for k, v in backbone.to_dict().items() if k not in _NOT_ARCHITECTURE}
        values = {k: v for k, v in values.items() if k not in _memory_fields()}
        values.update(resolve_preset(preset, **settings))
        attn = getattr(backbone, "_attn_implementation", None)
        if attn is not None and "attn_implementation" not in values:
            values["attn_implementation"] = attn
        return cls(**values)


def position_banks(memory_type: str, xl_positions: str) -> int:
    """Banks of positions a model's segments alternate between: a segment may use n_positions // banks."""
    cached = any(kind in CACHED_KV_TYPES for kind in memory_kinds(memory_type))
    return 2 if cached and xl_positions == "alternate" else 1


# memory_type -> the settings class of a kind that has settings; filled by each kind's class
# (`recurrent.base.MemoryKind.__init_subclass__`), so that this module does not import the kinds
KIND_SETTINGS: dict[str, Any] = {}


def resolve_memory_settings(memory_type: str, settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """A kind's `memory_settings`, every field resolved by the kind's settings class (None: it has none).

    Raises:
        SettingError: settings for a kind that takes none, or a bad setting (keyed `memory_settings.<name>`).
    """
    if not isinstance(memory_type, str) or any(k not in MEMORY_TYPES for k in memory_kinds(memory_type)):
        return settings  # validate_architecture says so
    if is_composite(memory_type):
        return _resolve_composite_settings(memory_type, settings)
    settings_class = KIND_SETTINGS.get(memory_type)
    if settings_class is None:
        if settings:
            raise SettingError("memory_settings", f"({settings!r}): memory type {memory_type!r} takes no "
                               f"`memory_settings`; remove them")
        return None
    return settings_class.from_dict(settings if settings is not None else {}).to_dict()


def _resolve_composite_settings(memory_type: str, settings: Any) -> dict[str, Any] | None:
    """A composite's `memory_settings`: a mapping from each part that has settings to its own, resolved."""
    if settings is not None and not isinstance(settings, Mapping):
        raise SettingError("memory_settings", f"({settings!r}) must map the parts of {memory_type!r} to their "
                           f"settings, e.g. {{memorizing: {{size: 4096}}}}")
    kinds = memory_kinds(memory_type)
    unknown = sorted(str(k) for k in (settings or {}) if k not in kinds or k not in KIND_SETTINGS)
    if unknown:
        owners = [k for k in kinds if k in KIND_SETTINGS and unknown[0] in KIND_SETTINGS[k].__dataclass_fields__]
        hint = f" (a part's setting goes under its name: memory_settings.{owners[0]}.{unknown[0]})" if owners else ""
        raise SettingError(f"memory_settings.{unknown[0]}", f"is unknown: not a part of {memory_type!r} that takes "
                           f"settings; those that do: {[k for k in kinds if k in KIND_SETTINGS]}{hint}")
    out = {}
    for kind in kinds:
        if kind in KIND_SETTINGS:
            try:
                out[kind] = resolve_memory_settings(kind, dict((settings or {}).get(kind) or {}))
            except SettingError as e:  # `memory_settings.size` as the part's holder names it
                raise SettingError(e.key.replace("memory_settings", f"memory_settings.{kind}", 1), e.problem) from None
    return out or None


def composite_preset(preset: str) -> dict[str, Any]:
    """The fields of a preset name joined by "+" (`"xl+memoria"`): each part's preset merged, the
    memory types joined (a kind named by two parts once: `"xl+memorizing"`, whose `memorizing` is
    itself `xl+memorizing`), each part's `memory_settings` under its kind; two parts that set one
    field to different values are refused."""
    values: dict[str, Any] = {}
    kinds: list[str] = []
    from_composite: set[str] = set()
    settings: dict[str, Any] = {}
    for part in preset.split("+"):
        if part not in PRESETS:
            raise ValueError(f"unknown preset {part!r} in {preset!r}; known: {sorted(PRESETS)}")
        fields = dict(PRESETS[part])
        part_type = fields.pop("memory_type")
        # a kind that a composite part and another part both bring, once (`xl+memorizing`); a kind that
        # two single parts bring, twice (refused by `check_composition` as repeated)
        kinds += [k for k in memory_kinds(part_type)
                  if k not in kinds or not (is_composite(part_type) or k in from_composite)]
        from_composite |= set(memory_kinds(part_type)) if is_composite(part_type) else set()
        own = fields.pop("memory_settings", None) or {}
        for kind, kind_settings in (own.items() if is_composite(part_type) else [(part_type, own)]):
            if kind_settings and settings.setdefault(kind, kind_settings) != kind_settings:
                raise ValueError(f"presets of {preset!r} disagree on `memory_settings.{kind}`")
        for key, value in fields.items():
            if key in values and values[key] != value:
                raise ValueError(f"presets of {preset!r} disagree on `{key}` ({values[key]!r}, {value!r})")
            values[key] = value
    memory_type = "+".join(kinds)
    if settings:
        values["memory_settings"] = settings if is_composite(memory_type) else settings[memory_type]
    return {"memory_type": memory_type, **values}


def resolve_preset(preset: str | None, **settings: Any) -> dict[str, Any]:
    """Field overrides for a preset name (or names joined by "+": `composite_preset`) plus explicit settings
    (the `memoria` dicts merged)."""
    if preset is not None and preset not in PRESETS and "+" not in preset:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}, or several joined by '+' "
                         f"(e.g. 'xl+memoria')")
    values = (dict(PRESETS[preset]) if preset in PRESETS else composite_preset(preset)) if preset is not None else {}
    composite = is_composite(str(settings.get("memory_type", values.get("memory_type", ""))))
    merged = {}
    for key in ("memoria", "memory_settings"):
        merged[key] = dict(values.pop(key, None) or {})
        given = settings.pop(key, None)
        if given is not None and not isinstance(given, Mapping):
            raise SettingError(key, f"({given!r}) must be a mapping of settings (name: value)")
        for name, value in (given or {}).items():  # a composite's parts merged part by part
            both = key == "memory_settings" and composite and isinstance(value, Mapping)
            merged[key][name] = {**merged[key].get(name, {}), **value} if both else value
    values.update(settings)
    values.update({key: value for key, value in merged.items() if value})
    return values


def check_model_settings(preset: str | None, settings: Mapping[str, Any]) -> None:
    """Check the settings a model of `preset` with `settings` is built from, as far as no backbone is
    needed (its shape decides the rest, in `validate_architecture`): every setting by its rule, the
    Memoria settings and the kind's `memory_settings` by their classes. Nothing is built.

    Raises:
        SettingError: naming the setting as `settings` does (`engram_loss`, `memory_settings.num_slots`).
        ValueError: an unknown preset.
    """
    values = resolve_preset(preset, **settings)
    check_memory_values(values)
    _resolved_memoria(values.get("memoria"))
    resolve_memory_settings(values.get("memory_type", "memoria"), values.get("memory_settings"))


def _memory_fields() -> set[str]:
    return {
        "memory_type",
        "memoria",
        "memory_settings",
        "memory_layers",
        "memory_heads",
        "memory_inner_dim",
        "memory_inner_dim_ratio",
        "memory_attention_mode",
        "memory_read",
        "engram_loss",
        "engram_bias",
        "memory_init",
        "abstractor_style",
        "xl_memory_length",
        "xl_positions",
        "segment_length",
        "pkm_layers",
        "pkm",
    }


__all__ = ["MemoriaGPT2Config", "PRESETS", "MEMORY_TYPES", "CACHED_KV_TYPES", "KIND_SETTINGS", "SETTINGS_OF_KIND",
           "SETTING_RULES", "idle_settings", "XL_POSITIONS", "resolve_memory_settings", "position_banks",
           "DEFAULT_MEMORY_WIDTH_RATIO", "resolve_preset", "composite_preset", "check_model_settings",
           "check_memory_values", "resolve_pkm"]
