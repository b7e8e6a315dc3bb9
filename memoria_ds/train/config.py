"""RunConfig: everything a training run needs, typed, from YAML/JSON plus dotted overrides.

    python launch/finetune.py --config configs/x.yaml optim.lr=3e-5 model.preset=xl

Sections: `model`, `lora`, `data`, `optim`, `checkpoint`, `log`, `eval`, plus the run's
directory, seed, engine and DeepSpeed JSON. Each section is a pydantic model: typed and
strict (no silent coercion: `2.5` is not an integer, `1` is not `true`), unknown keys refused
at every level, cross-field checks in an `after` validator; parse.py reads files and
overrides and turns pydantic's errors into one line. The resolved configuration is written
to `<run_dir>/config.yaml` at the start of every run.
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..data.corpora import CORPORA
from ..data.reset import ResetPolicy
from ..data.sorting import NUM_SYMBOLS
from ..eval.protocols import FORGET, PROTOCOL_NAMES

ADAPTED = "adapted"  # a classifier's reading with MbPA++'s local adaptation (`episodic.*`)
from ..memory import COMPILE_MODES
from ..model.composition import memory_kinds
from ..model.config import check_model_settings, position_banks, resolve_preset
from ..model.families import FAMILIES, family_of_preset
from ..setting_rules import SettingError

# `model.backbone` of a from-scratch classifier (task: classification); GPT-2's only as preset `backbone`
ENCODER_BACKBONES = ("bert", "roberta", "gpt2")

Precision = Literal["auto", "fp32", "bf16", "fp16"]


def _number(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads `3e-5` (no dot) as a string; users write it that way."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


Number = Annotated[float, BeforeValidator(_number)]  # a float; an int widens to it


class Section(BaseModel):
    """A configuration section: strict types, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


@functools.cache
def _model_fields() -> frozenset[str]:
    """Every key `model.settings` may hold: the fields of MemoriaGPT2Config (GPT-2's included),
    and those of each family trained from scratch (`model/families.py`: subclasses, their own fields added)."""
    fields = frozenset().union(*(family.config_class().to_dict() for family in FAMILIES))
    return fields - {"_name_or_path", "architectures", "transformers_version", "model_type"}


class ModelSection(Section):
    """Which model to build.

    Args:
        task: `lm` (default: a causal language model, GPT-2 or a from-scratch family) or
            `classification` (a Memoria BERT / RoBERTa classifying labelled documents segment
            by segment, `data.corpus: documents`; docs/encoders.md).
        backbone: a GPT-2 hub name (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`) or a
            local directory. Fine-tuning loads its weights; `from_scratch` uses only its
            config (override sizes in `settings`, e.g. `n_layer`). With `task: classification`,
            a BERT or RoBERTa hub name or directory; from scratch, `bert` or `roberta`.
        from_scratch: build a randomly initialised model from the backbone's config.
        preset: a comparison of the paper (`memoria_ds.model.config.PRESETS`): `memoria`,
            `memoria_wm`, `memoria_wm_stm`, `xl`, `transformer`, `memoria_full_width`,
            `memoria_fast`.
        settings: any other `MemoriaGPT2Config` field (`memoria: {...}` for the memory,
            `memory_layers`, `xl_memory_length`, backbone sizes for from-scratch runs).
        gradient_checkpointing: recompute backbone blocks in backward.
        attn_implementation: `sdpa` (default) or `eager`.
        compile: None (eager), or a `torch.compile` mode (`default`, `reduce-overhead`:
            CUDA graphs on a GPU, `max-autotune`, `max-autotune-no-cudagraphs`): the whole
            forward (backbone, memory attention, abstractor and memory engine) and its
            backward run as compiled graphs (one each: the model has static shapes and no
            host synchronisation). The same computation up to floating-point summation
            order; a first step that compiles for a minute or more. ZeRO-1/2 and
            `engine=torch`; not with ZeRO-3 or activation checkpointing.
    """

    task: Literal["lm", "classification"] = "lm"
    backbone: str = "gpt2"
    from_scratch: bool = False
    preset: str = "memoria"
    settings: dict = Field(default_factory=dict)
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    compile: str | None = None

    @model_validator(mode="after")
    def check(self):
        if self.compile is not None:
            if self.compile not in COMPILE_MODES:
                raise ValueError(f"`model.compile` must be null (eager) or one of {list(COMPILE_MODES)}, "
                                 f"got {self.compile!r}")
            if self.gradient_checkpointing:
                raise ValueError("`model.compile` and `model.gradient_checkpointing` together are not supported; "
                                 "set one of them")
            if self.settings.get("memory_compile") is not None:
                raise ValueError("`model.compile` already compiles the memory engine with the rest of the model; "
                                 "remove `model.settings.memory_compile`")
        if self.task == "classification":
            return self._check_encoder()
        # the preset and the memory settings fail here, before any data or model work
        unknown = sorted(set(self.settings) - _model_fields())
        if unknown:
            hints = {k: difflib.get_close_matches(k, _model_fields(), n=1) for k in unknown}
            said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise ValueError(f"unknown `model.settings` key(s) {said}; they are MemoriaGPT2Config fields "
                             f"(memoria_ds/model/config.py) or GPT2Config fields")
        for family in FAMILIES:
            own = sorted(family.fields & set(self.settings))
            if own and family_of_preset(self.preset) is not family:
                raise ValueError(f"`model.settings` {', '.join(own)} configure a {family.name}; "
                                 f"model.preset={self.preset} does not read them: remove them, or set "
                                 f"model.preset={sorted(family.presets)[0]}")
        # every setting by its rule, the Memoria and the kind's settings by their classes; an unknown
        # preset is a ValueError naming the known ones (what the backbone's shape decides: train/preflight.py)
        try:
            check_model_settings(self.preset, self.settings)
        except SettingError as e:
            raise e.within("model.settings") from None
        if "n_embd" in self.settings and "n_head" in self.settings and self.settings["n_embd"] % self.settings["n_head"]:
            raise ValueError(f"`model.settings.n_head` ({self.settings['n_head']}) must divide `n_embd` "
                             f"({self.settings['n_embd']})")
        return self

    def _check_encoder(self):
        """`task: classification`: an encoder preset, and settings of the Memoria encoder's config."""
        from transformers import BertConfig

        from ..model.encoder.config import ENCODER_PRESETS, MemoriaBertConfig, MemoriaRobertaConfig, encoder_config

        if self.preset not in ENCODER_PRESETS:
            raise ValueError(f"unknown `model.preset` {self.preset!r} for `model.task: classification`; the encoder "
                             f"presets are {sorted(ENCODER_PRESETS)}")
        if self.from_scratch and self.backbone not in ENCODER_BACKBONES:
            raise ValueError(f"`model.backbone` {self.backbone!r} with `model.from_scratch`: give {ENCODER_BACKBONES} "
                             f"(its sizes in `model.settings`), or a BERT / RoBERTa checkpoint without from_scratch")
        if self.from_scratch and self.backbone == "gpt2":
            return self._check_gpt2_classifier()
        known = set(MemoriaBertConfig().to_dict()) | set(MemoriaRobertaConfig().to_dict()) | {"memoria", "num_labels"}
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise ValueError(f"unknown `model.settings` key(s) {unknown} for a Memoria encoder; they are fields of "
                             f"MemoriaBertConfig / MemoriaRobertaConfig (memoria_ds/model/encoder/config.py)")
        try:
            encoder_config(BertConfig(), self.preset, **self.settings)
        except SettingError as e:
            raise e.within("model.settings") from None
        if self.compile is not None:
            raise ValueError("`model.compile` is not supported with `model.task: classification` yet; leave it unset")
        return self

    def _check_gpt2_classifier(self):
        """A from-scratch GPT-2 classifier: HF's, without a memory (preset `backbone`), of GPT2Config's sizes."""
        from transformers import GPT2Config

        if self.preset != "backbone":
            raise ValueError(f"a GPT-2 classifier is HF's GPT2ForSequenceClassification without a memory: set "
                             f"`model.preset=backbone` (got {self.preset!r})")
        config = GPT2Config()
        unknown = sorted(k for k in self.settings if k != "num_labels" and not hasattr(config, k))
        if unknown:
            raise ValueError(f"unknown `model.settings` key(s) {unknown} for a GPT-2 classifier; they are GPT2Config "
                             f"fields (n_layer, n_embd, n_head, n_positions, ...)")
        return self


class LoraSection(Section):
    """peft LoRA on the backbone's Conv1D projections; the Memoria modules stay fully trained."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: Number = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["c_attn", "c_proj", "c_fc"])

    @model_validator(mode="after")
    def check(self):
        if self.r < 1:
            raise ValueError(f"`lora.r` ({self.r}) must be at least 1")
        if self.alpha <= 0:
            raise ValueError(f"`lora.alpha` ({self.alpha}) must be above 0 (the adapter's scale is alpha / r)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`lora.dropout` ({self.dropout}) must be in [0, 1)")
        return self


def _check_reset(key: str, spec: str) -> None:
    """A reset policy that parses, or a ValueError naming `key` and the valid forms."""
    try:
        ResetPolicy.parse(spec)
    except ValueError as e:
        raise ValueError(f"`{key}`: {e}") from None


class DataSection(Section):
    """The corpus, its streams and the memory reset policy.

    Args:
        corpus: `bundled` (the shipped public-domain book), `wikitext103`, `pg19`,
            `enwik8`, `files` (local text/jsonl/parquet files in `files`), `sorting`
            (the paper's sorting task, generated; see `sorting`), or `documents`
            (labelled documents to classify, `model.task: classification`: local files in
            `files`, or a hub dataset / `save_to_disk` folder in `path`; columns
            `text_field` and `label_field`).
        path: a local copy of the corpus (hub layout, `save_to_disk` folder, raw files);
            None loads from the hub.
        files: data files for `corpus: files`, as `{split: [paths]}`.
        text_field: the document column of local files.
        tokenizer: a tokenizer name or path; None: the GPT-2 tokenizer (or, for enwik8,
            its 204-symbol character vocabulary; for a classifier of a pretrained backbone, the
            backbone's own, resolved into the run's config).
        append_eos: put the tokenizer's end-of-text token after every document (None:
            yes when the tokenizer has one). The authors' runs used no separator: `false`.
        segment_length: tokens per segment (150 in the paper; 512 for enwik8).
        tail: `drop` (full segments only, as the paper) or `pad`.
        shuffle_documents: a new seeded document order every epoch.
        reset: memory reset policy for training: `never`, `document_start`, `every:N`, or
            `document_start+every:N` (the paper resets all memory every 500 steps).
        loader: extra keyword arguments for the corpus loader (e.g. `num_train_books`).
        num_proc: tokenisation processes.
        label_field: the label column of labelled documents (`corpus: documents`): class
            indices, or names (mapped to indices in sorted order, or by the dataset's ClassLabel).
        max_segments: segments a labelled document may fill (`corpus: documents`); the rest of
            a longer one is dropped and the run says how many were.
        in_order: read labelled documents (`corpus: documents`) in the order of their files and rows, every
            epoch, instead of a new seeded order each epoch: a lifelong run's tasks one after another
            (docs/episodic.md). The last batch that does not fill is dropped either way.
        sorting: the sorting task (`corpus: sorting`): `num_segments` per example (4, 8,
            16, 32 in Table 4), `num_train` (80,000), `num_validation`, `num_test`,
            `seed`. Each example fills exactly `num_segments` segments; memory is reset at
            every example's first segment whatever `reset` says.
    """

    corpus: str = "bundled"
    path: str | None = None
    files: dict = Field(default_factory=dict)
    text_field: str = "text"
    tokenizer: str | None = None
    append_eos: bool | None = None
    segment_length: int = 150
    tail: Literal["drop", "pad"] = "drop"
    shuffle_documents: bool = False
    in_order: bool = False
    reset: str = "every:500"
    loader: dict = Field(default_factory=dict)
    num_proc: int | None = None
    label_field: str = "label"
    max_segments: int = 8
    sorting: dict = Field(default_factory=lambda: {"num_segments": 4, "num_train": 80_000, "num_validation": 1_000,
                                                     "num_test": 1_000, "seed": 0})

    @model_validator(mode="after")
    def check(self):
        corpora = sorted(CORPORA) + ["documents", "files", "sorting"]
        if self.corpus not in corpora:
            raise ValueError(
                f"unknown `data.corpus` {self.corpus!r}; choose from {corpora}. For your own files use "
                "data.corpus=files with data.files='{train: [a.txt], validation: [b.txt]}'; for a local copy "
                "of a named corpus, data.path=DIR"
            )
        known = {"num_segments", "num_train", "num_validation", "num_test", "seed"}
        if set(self.sorting) - known:
            raise ValueError(f"unknown `data.sorting` setting(s) {sorted(set(self.sorting) - known)}; known: {sorted(known)}")
        if self.segment_length < 2:
            raise ValueError(f"`data.segment_length` ({self.segment_length}) must be at least 2")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"`data.num_proc` ({self.num_proc}) must be at least 1, or null (one process)")
        _check_reset("data.reset", self.reset)
        if self.max_segments < 1:
            raise ValueError(f"`data.max_segments` ({self.max_segments}) must be at least 1")
        if self.corpus == "documents" and not (self.files or self.path):
            raise ValueError("`data.corpus: documents` needs `data.files` ({train: [a.jsonl], validation: [b.jsonl]}) "
                             "or `data.path` (a hub dataset name or a save_to_disk folder)")
        if self.in_order and self.corpus != "documents":
            raise ValueError("`data.in_order` orders labelled documents (`data.corpus: documents`); a text corpus is "
                             "read in order already (`data.shuffle_documents` shuffles its documents)")
        if self.corpus == "files" and not self.files:
            raise ValueError("`data.corpus: files` needs `data.files`, e.g. {train: [a.txt], validation: [b.txt]}")
        if self.corpus == "sorting":
            settings = self.sorting_settings
            for key, least in (("num_segments", 1), ("num_train", 1), ("num_validation", 0), ("num_test", 0),
                               ("seed", 0)):
                value = settings[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < least:
                    raise ValueError(f"`data.sorting.{key}` ({value!r}) must be an integer >= {least}")
            if settings["num_segments"] * self.segment_length <= NUM_SYMBOLS:
                raise ValueError(f"`data.sorting.num_segments` ({settings['num_segments']}) segments of "
                                 f"{self.segment_length} cannot hold the {NUM_SYMBOLS}-symbol answer and any input")
        return self

    @property
    def reset_policy(self) -> ResetPolicy:
        policy = ResetPolicy.parse(self.reset)
        if self.corpus == "documents":  # every document starts with an empty memory, and only there
            return ResetPolicy(at_document_start=True, every_n_steps=None)
        if self.corpus == "sorting":  # every example starts with an empty memory
            policy = ResetPolicy(at_document_start=True, every_n_steps=policy.every_n_steps)
        return policy

    @property
    def sorting_settings(self) -> dict:
        return {"num_segments": 4, "num_train": 80_000, "num_validation": 1_000, "num_test": 1_000, "seed": 0,
                **self.sorting}


class OptimSection(Section):
    """Optimiser, schedule, batch and precision.

    Streams: every data-parallel rank owns `micro_batch_size * grad_accum` token streams;
    micro-batch j of a step feeds rows [j * micro, (j + 1) * micro) of them, so
    `train_batch_size = micro_batch_size * grad_accum * world_size` is also the number of
    streams (B_global), each with its own memory row.

    Args:
        lr: peak learning rate (paper: 5e-5 fine-tuning, 2e-4 from scratch).
        weight_decay: AdamW weight decay on matrices (0 = Adam, as the paper).
        warmup_ratio: linear warm-up over this fraction of the steps, then the `schedule`.
        schedule: after the warm-up, `linear` (decay to 0 at the last step: the paper's language
            models) or `constant` (the peak rate to the end: the authors' classification runs, whose
            Lightning module sets no scheduler without a warm-up rate).
        grad_clip: gradient norm clipping (paper: 1.0); 0 disables it.
        memory_lr_scale: the learning rate of the modules Memoria adds (abstractor, memory
            attentions) as a multiple of `lr` (paper: 1, one rate). Below 1 steadies a
            from-scratch run at a high `lr`, where the memory path can otherwise swamp the
            residual stream (docs/training.md, "The memory's learning rate").
        memory_delay_steps: optimizer updates during which the modules Memoria adds do not
            learn (learning rate 0; the memory still runs, and starts as a no-op with the
            default init); then their own warm-up and decay run over the remaining updates
            (paper: 0). Keeps the memory path from growing while the backbone learns the
            text's first statistics (docs/training.md, "The memory's learning rate"). Capped
            at half the run's updates (rounded down; the run prints one line when it is), so
            a short run of a preset with a long delay still trains its memory.
        pkm_value_lr: the learning rate of the Product-Key Memory layers' value tables
            (`model.settings.pkm_layers`), in an optimiser group of their own: constant (no
            warm-up or decay; 0 during `memory_delay_steps`), no weight decay, the run's Adam
            betas and eps. XLM's default, and the paper's advice: Adam at a constant 1e-3
            (docs/field_memories.md, "Product-Key Memory"). None: the values train with the other
            memory parameters. Updates are dense (ZeRO has no sparse gradients). No effect on a
            model without PKM layers.
        micro_batch_size: streams per rank per micro-batch.
        grad_accum: micro-batches per optimiser step.
        epochs: passes over the training split (ignored when `max_steps` is set).
        max_steps: optimiser steps to run (overrides `epochs`).
        precision: `auto` (bf16 on GPUs that support it, else fp32), `fp32`, `bf16`, `fp16` (GPU only).
        nan_policy: on a non-finite loss, `skip` (the micro-batch is left out of the step on
            every rank, the affected memory rows are reset, and training goes on) or `stop`
            (stop with an error; the last good checkpoint is kept).
        bptt_segments: K, consecutive segments of every stream that one optimiser step spans
            (back-propagation through time). Per micro-batch the K segments run in order
            carrying the memory with its graph, the mean of their losses is back-propagated
            once, and the memory is detached at the end of the span; so a kind that keeps the
            graph of its state (`memformer`) trains its write from later segments' losses.
            1 (default): one segment per step, as before. `max_steps` counts optimiser steps;
            `epochs` gives `epochs * segments per epoch // K` of them. Not for the sorting
            task (its input segments have no targets). A classifier (`model.task:
            classification`), whose memory carries no gradient, steps once on the mean loss of
            K segments: with K = `data.max_segments`, once per batch of documents, as the
            authors' loop does (docs/encoders.md says why it matters).
        bptt_recompute: memory replay back-propagation (Memformer's MRBP): every segment of a
            span runs under activation checkpointing (non-reentrant), so only the memory
            states between segments are kept and each segment is recomputed in backward;
            the same gradients for less memory and about one more forward per segment.
    """

    lr: Number = 5e-5
    weight_decay: Number = 0.0
    betas: list[Number] = Field(default_factory=lambda: [0.9, 0.999])
    eps: Number = 1e-8
    warmup_ratio: Number = 0.06
    schedule: Literal["linear", "constant"] = "linear"
    grad_clip: Number = 1.0
    memory_lr_scale: Number = 1.0
    memory_delay_steps: int = 0
    pkm_value_lr: Number | None = 1e-3
    micro_batch_size: int = 8
    grad_accum: int = 1
    epochs: int = 3
    max_steps: int | None = None
    precision: Precision = "auto"
    nan_policy: Literal["skip", "stop"] = "skip"
    bptt_segments: int = 1
    bptt_recompute: bool = False

    @model_validator(mode="after")
    def check(self):
        if self.bptt_segments < 1:
            raise ValueError(f"`optim.bptt_segments` ({self.bptt_segments}) must be at least 1 (1 = one segment "
                             f"per optimiser step)")
        for name in ("lr", "weight_decay", "eps", "grad_clip", "warmup_ratio", "memory_lr_scale"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"`optim.{name}` ({getattr(self, name)}) must be a finite number")
        if self.memory_lr_scale <= 0:
            raise ValueError(f"`optim.memory_lr_scale` ({self.memory_lr_scale}) must be > 0 (1 = the paper's single rate)")
        if self.pkm_value_lr is not None and not (math.isfinite(self.pkm_value_lr) and self.pkm_value_lr > 0):
            raise ValueError(f"`optim.pkm_value_lr` ({self.pkm_value_lr}) must be a finite number > 0 (XLM's: 1e-3), "
                             f"or null to train the PKM values with the other memory parameters")
        if self.memory_delay_steps < 0:
            raise ValueError(f"`optim.memory_delay_steps` ({self.memory_delay_steps}) must be >= 0 (0 = no delay, the paper)")
        if self.lr <= 0:
            raise ValueError(f"`optim.lr` ({self.lr}) must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"`optim.warmup_ratio` ({self.warmup_ratio}) must be in [0, 1)")
        if self.micro_batch_size < 1 or self.grad_accum < 1:
            raise ValueError("`optim.micro_batch_size` and `optim.grad_accum` must be at least 1")
        if self.epochs < 1:
            raise ValueError(f"`optim.epochs` ({self.epochs}) must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`optim.max_steps` ({self.max_steps}) must be at least 1, or null")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"`optim.betas` must be two numbers in [0, 1), got {self.betas}")
        if self.grad_clip < 0:
            raise ValueError(f"`optim.grad_clip` ({self.grad_clip}) must be >= 0")
        return self


class EpisodicSection(Section):
    """MbPA++'s episodic memory for a classifier (de Masson d'Autume et al. 2019; `memoria_ds/episodic`).

    Every document the training reads is written (with probability `write_prob`) into this rank's
    episodic memory, keyed by a frozen copy of the classifier's encoder as the run built it (the
    pretrained backbone, before any update: the paper's separate frozen key network). Once per
    `replay_every` documents read over all ranks, one extra optimiser update on `replay_size`
    documents drawn from the memories (each rank `replay_size / ranks` from its own) follows the step:
    sparse experience replay. The memory and the schedule are part of every checkpoint.

    Args:
        enabled: keep the episodic memory and replay from it.
        write_prob: the chance each document is written (the paper: 1; 0.5 and 0.1 cost little).
        replay_every: documents read between replays (the paper: 10,000); 0: no replay, the memory written for
            local adaptation alone (the paper's baseline "local adaptation only").
        replay_size: documents per replay update, over all ranks (the paper: 100).
        neighbours / adapt_steps / adapt_lr / adapt_l2: local adaptation, read by the `adapted` evaluation
            (`eval.protocols`): K nearest documents of the whole memory (every rank's), L plain gradient steps
            at this rate on their loss plus `adapt_l2` times the squared distance to the trained weights
            (the paper: K 32, L 30, lambda 1e-3; the rate 1e-3 is a public port's).
    """

    enabled: bool = False
    write_prob: Number = 1.0
    replay_every: int = 10_000
    replay_size: int = 100
    neighbours: int = 32
    adapt_steps: int = 30
    adapt_lr: Number = 1e-3
    adapt_l2: Number = 1e-3

    @model_validator(mode="after")
    def check(self):
        if not 0 < self.write_prob <= 1:
            raise ValueError(f"`episodic.write_prob` ({self.write_prob}) must be in (0, 1] (the paper: 1)")
        if self.neighbours < 1 or self.adapt_steps < 0 or not (self.adapt_lr > 0 and self.adapt_l2 >= 0):
            raise ValueError("`episodic.neighbours` must be >= 1, `adapt_steps` >= 0, `adapt_lr` > 0 and `adapt_l2` "
                             ">= 0 (the paper: 32, 30, 1e-3, 1e-3)")
        if self.replay_every < 0 or self.replay_size < 1:
            raise ValueError("`episodic.replay_every` must be >= 0 (0: no replay) and `episodic.replay_size` >= 1 "
                             "(the paper: 10000 and 100)")
        return self


class CheckpointSection(Section):
    """When and what to save.

    Args:
        every: save every N optimiser steps (and at the end); 0: only at the end.
        keep_last: complete checkpoints to keep.
        resume: `auto` (the newest complete checkpoint of the run, if any), a checkpoint
            path, or null (start fresh; an existing run directory with checkpoints is then
            refused rather than overwritten).
        export: write a Hugging Face directory (`<run_dir>/export`) at the end.
        merge_lora: export LoRA merged into the backbone (else the adapter is saved beside it).
        max_abs: the largest magnitude a memory activation (engram vector, hidden state,
            cached key or value) may have for a checkpoint to be written.
        max_weight_growth: a weight's magnitude may grow to this many times the largest
            weight the run started from (at least 1) for a checkpoint to be written.
            Beyond either limit, or on a value that is not finite, the state is diverging:
            nothing is written and the run stops, naming the last good checkpoint
            (memoria_ds/train/health.py). `.inf` checks finiteness only.
    """

    every: int = 500
    keep_last: int = 2
    resume: str | None = "auto"
    export: bool = True
    merge_lora: bool = True
    max_abs: Number = 1e6
    max_weight_growth: Number = 100.0

    @model_validator(mode="after")
    def check(self):
        if self.every < 0 or self.keep_last < 1:
            raise ValueError("`checkpoint.every` must be >= 0 and `checkpoint.keep_last` >= 1")
        for key in ("max_abs", "max_weight_growth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"`checkpoint.{key}` ({getattr(self, key)}) must be a positive number "
                                 f"(.inf: finiteness only)")
        return self


class LogSection(Section):
    """Logging: a record every `every` optimiser steps (and at the end) to `metrics.jsonl`;
    the same scalars to TensorBoard and, opt-in, to Weights & Biases; a progress bar.

    Args:
        wandb: also log to Weights & Biases (`pip install wandb`, or memoria_ds[wandb]). A
            resumed run continues the same W&B run (its id is kept in `<run_dir>/wandb_id`).
        wandb_project: the W&B project.
        wandb_mode: `online`, `offline` (no network: sync later with `wandb sync`), or null
            (W&B's own choice: `WANDB_MODE`, a login).
    """

    every: int = 10
    tensorboard: bool = True
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "memoria_ds"
    wandb_mode: Literal["online", "offline"] | None = None

    @model_validator(mode="after")
    def check(self):
        if self.every < 1:
            raise ValueError(f"`log.every` ({self.every}) must be at least 1")
        if self.wandb:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ValueError("`log.wandb=true` needs the wandb package: pip install wandb (or "
                                 "memoria_ds[wandb]), or set log.wandb=false")
        return self


class KNNLMSection(Section):
    """kNN-LM on top of the model at evaluation (`memoria_ds.eval.knn_lm`; docs/field_memories.md).

    Each stream keeps a datastore of (key, next token) of the text it has read since its
    memory's last reset; every scored token's distribution is interpolated with that of its
    k nearest entries. Defaults are Khandelwal et al. (2020)'s WikiText-103 settings.

    Args:
        enabled: score every protocol with kNN-LM (the result also records the model alone).
        k: neighbours per token (paper: 1024). lmbda: weight of p_kNN (paper: 0.25).
        temperature: divides the negative squared L2 distances (paper: 1).
        key: `ffn_input` (the last block's FFN input after its layer norm: the paper's) or
            `final_hidden` (after ln_f).
        max_entries: per-stream datastore cap, oldest out; null: unbounded (paper).
        train_datastore: also search one shared datastore of the training split, read by the
            model with its memory (the paper's datastore is its training text). Every rank
            builds the same one before each evaluation, so it costs a pass over that text.
        train_max_entries: stop reading the training split after this many entries; null: all.
        train_streams: streams the training split is read with (each carries its memory).
        index: how the training-text datastore is searched: `exact`, or a FAISS
            `index_factory` string (`IVF4096,PQ64`: the authors' index; needs faiss-cpu).
        nprobe: inverted lists an `IVF` index probes per query (the paper's: 32).
        index_distances: `exact` (the index's neighbours scored by their exact distances from the
            full-precision keys: the authors' default) or `index` (by the index's estimates).
    """

    enabled: bool = False
    k: int = 1024
    lmbda: Number = 0.25
    temperature: Number = 1.0
    key: Literal["ffn_input", "final_hidden"] = "ffn_input"
    max_entries: int | None = None
    train_datastore: bool = False
    train_max_entries: int | None = None
    train_streams: int = 8
    index: str = "exact"
    nprobe: int = 32
    index_distances: Literal["exact", "index"] = "exact"

    @model_validator(mode="after")
    def check(self):
        try:
            self.settings()  # one place for the checks and their messages (the index against the model: preflight.py)
        except SettingError as e:
            raise e.within("eval.knn_lm") from None
        if self.index != "exact" and not self.train_datastore:
            raise ValueError(f"`eval.knn_lm.index={self.index}` searches the training-text datastore, which is off: "
                             "set eval.knn_lm.train_datastore=true (each stream's own datastore is searched exactly)")
        if self.train_max_entries is not None and self.train_max_entries < 1:
            raise ValueError(f"`eval.knn_lm.train_max_entries` must be >= 1 or null (all), got {self.train_max_entries}")
        if self.train_streams < 1:
            raise ValueError(f"`eval.knn_lm.train_streams` must be >= 1, got {self.train_streams}")
        return self

    def settings(self):
        """The evaluation's `KNNLMSettings`."""
        from ..eval.knn_lm import KNNLMSettings

        return KNNLMSettings(k=self.k, lmbda=self.lmbda, temperature=self.temperature, key=self.key,
                             max_entries=self.max_entries, index=self.index, nprobe=self.nprobe,
                             index_distances=self.index_distances)


class EvalSection(Section):
    """Evaluation during and after training (memoria_ds.eval protocols).

    Args:
        every: evaluate every N optimiser steps; 0: only at the end.
        split: the split to evaluate.
        protocols: any of `full` (every token, `num_streams` streams), `paper` (one stream,
            149 of 150 tokens scored, no resets: the authors' protocol) and `memoryless`
            (`full` with the memory reset before every segment; beside `full`, the run also
            reports the memory gain: what the memory is worth to this model; on the sorting
            task, `memoryless` adds the accuracy with the memory reset before every segment).
        num_streams: streams of the `full` protocol (a multiple of the world size); 0:
            one per rank.
        reset: reset policy of the `full` protocol.
        max_steps: evaluate at most this many segments per protocol (quick checks).
        at_end: evaluate once training is done.
        trace: in the final evaluation, record the memory statistics of every segment
            (`<run_dir>/eval/trace_<protocol>.jsonl`) and save the final memory state
            (`memory_<protocol>.safetensors`), for `launch/analyze.py` (paper Figures 5, 6, 8-9).
        knn_lm: kNN-LM on top of the model in every language-modelling protocol (`KNNLMSection`).
        aggregate: a classifier's prediction for a document (`model.task: classification`): `last`,
            the argmax at its last segment (the authors' `eval_aggregate="last"`), or `mean`, the
            argmax of its segments' logits averaged (the segment-mean reading: with preset
            `backbone`, the baseline that sees every segment without a memory).
    """

    every: int = 0
    split: str = "validation"
    protocols: list[str] = Field(default_factory=lambda: ["full"])
    num_streams: int = 0
    reset: str = "never"
    max_steps: int | None = None
    at_end: bool = True
    trace: bool = False
    knn_lm: KNNLMSection = Field(default_factory=KNNLMSection)
    aggregate: Literal["last", "mean"] = "last"
    after_each_task: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def check(self):
        bad = [p for p in [*self.protocols, *self.after_each_task]
               if p not in PROTOCOL_NAMES and not p.startswith(FORGET) and p != ADAPTED]
        if bad:
            raise ValueError(f"unknown eval protocol(s) {bad}; use any of `full`, `paper`, `memoryless`, or "
                             f"`memoryless_<part>` for a part of a composite memory (`memoryless_xl`), or `{ADAPTED}` "
                             f"(a classifier with `episodic.enabled`: MbPA++'s local adaptation)")
        if len(set(self.protocols)) < len(self.protocols):
            raise ValueError(f"`eval.protocols` {self.protocols} names a protocol twice")
        if not self.protocols and (self.at_end or self.every):
            raise ValueError("`eval.protocols` is empty: name `full`, `paper` and/or `memoryless`, or set "
                             "`eval.at_end=false` (and `eval.every=0`) to train without evaluating")
        _check_reset("eval.reset", self.reset)
        if self.every < 0 or self.num_streams < 0:
            raise ValueError(f"`eval.every` ({self.every}) and `eval.num_streams` ({self.num_streams}) must be >= 0 "
                             f"(0: only at the end / one stream per rank)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`eval.max_steps` ({self.max_steps}) must be at least 1, or null")
        return self


class RunConfig(Section):
    """A whole training run.

    Args:
        run_dir: where the resolved config, metrics, TensorBoard logs, checkpoints and the
            export go.
        seed: seeds every RNG (per rank: seed + rank for dropout streams).
        deterministic: every op on a deterministic kernel (`torch.use_deterministic_algorithms`,
            cuBLAS's fixed workspace), so that a step on a GPU repeats bit for bit and a resumed
            run follows the uninterrupted one exactly; an op without such a kernel stops the run
            with torch's error. Off by default: on a GPU it can cost speed (CPU steps repeat
            anyway). See memoria_ds/train/determinism.py.
        engine: `deepspeed` (default) or `torch` (plain PyTorch, one process).
        deepspeed: the DeepSpeed JSON (ds_configs/); `--deepspeed` on the command line sets it.
    """

    run_dir: str = "runs/default"
    seed: int = 1234
    deterministic: bool = False
    engine: Literal["deepspeed", "torch"] = "deepspeed"
    deepspeed: str = "ds_configs/cpu.json"
    model: ModelSection = Field(default_factory=ModelSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    log: LogSection = Field(default_factory=LogSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    episodic: EpisodicSection = Field(default_factory=EpisodicSection)

    @model_validator(mode="after")
    def check(self):
        if self.episodic.enabled and self.model.task != "classification":
            raise ValueError("`episodic.enabled` (MbPA++) keeps labelled documents: it needs `model.task: "
                             "classification` with `data.corpus: documents`")
        if (self.model.task == "classification") != (self.data.corpus == "documents"):
            raise ValueError("`model.task: classification` reads labelled documents and only them: set both "
                             "`model.task: classification` and `data.corpus: documents`, or neither")
        if self.eval.after_each_task and self.model.task != "classification":
            raise ValueError("`eval.after_each_task` reads a lifelong run's tasks: it needs `model.task: "
                             "classification` with `data.corpus: documents` and `data.in_order=true`")
        if ADAPTED in self.eval.protocols and self.model.task != "classification":
            raise ValueError(f"`eval.protocols` `{ADAPTED}` (MbPA++'s local adaptation) scores a classifier")
        if self.model.task == "classification":
            return self._check_classification()
        if self.eval.aggregate != "last":
            raise ValueError(f"`eval.aggregate` ({self.eval.aggregate!r}) says how a classifier reads a document's "
                             f"segments (`model.task: classification`); a language model scores every token: "
                             f"leave it `last`")
        # a from-scratch model gets GPT-2's 1024 positions unless told otherwise; every segment
        # restarts at position 0 (the memory models included), so a segment must fit
        positions = self.model.settings.get("n_positions", 1024)
        values = resolve_preset(self.model.preset, **self.model.settings)
        banks = position_banks(values.get("memory_type", "memoria"), values.get("xl_positions", "shared")) > 1
        positions //= 2 if banks else 1  # MemoriaGPT2Config.xl_positions
        if self.model.from_scratch and self.data.segment_length > positions:
            kind = values.get("memory_type", "memoria")
            half = (f" (`{kind}` with `xl_positions: alternate` puts the cached segment in the other half of the "
                    f"positions: a segment may use half of them)" if banks else "")
            raise ValueError(f"`data.segment_length` ({self.data.segment_length}) exceeds the model's positions "
                             f"(`model.settings.n_positions` = {self.model.settings.get('n_positions', 1024)}){half}; "
                             f"raise n_positions or shorten segments")
        kinds = memory_kinds(values.get("memory_type", "memoria"))
        parts = [p[len(FORGET):] for p in self.eval.protocols if p.startswith(FORGET)]
        wrong = [p for p in parts if len(kinds) < 2 or p not in kinds]
        if wrong:
            raise ValueError(f"`eval.protocols` names `{FORGET}{wrong[0]}`, which forgets the part {wrong[0]!r} of a "
                             f"composite memory; model.preset={self.model.preset} carries "
                             f"{'+'.join(kinds)!r}" + (f": its parts are {list(kinds)}" if len(kinds) > 1 else
                                                       ", a single kind: use `memoryless`"))
        if self.lora.enabled and self.model.from_scratch:
            raise ValueError("LoRA adapts a pretrained backbone: set `lora.enabled: false` for `model.from_scratch`")
        # every corpus loader names its splits train / validation / test; local files, as data.files does
        splits = sorted(self.data.files) if self.data.corpus == "files" else ["test", "train", "validation"]
        if (self.eval.at_end or self.eval.every) and self.eval.split not in splits:
            raise ValueError(f"`eval.split` {self.eval.split!r} is not a split of `data.corpus: {self.data.corpus}` "
                             f"(it has {splits}); choose one, or set `eval.at_end=false` to train without evaluating")
        if self.data.corpus == "sorting" and self.optim.bptt_segments > 1:
            raise ValueError(f"`optim.bptt_segments` ({self.optim.bptt_segments}) spans segments with a loss each; "
                             f"the sorting task's input segments have no targets: use bptt_segments=1 for it")
        if self.data.corpus == "sorting" and self.eval.knn_lm.enabled:
            raise ValueError("`eval.knn_lm` interpolates a language model's next-token distribution; the sorting "
                             "task is scored by accuracy: set `eval.knn_lm.enabled=false`")
        if (self.data.corpus == "sorting" and (self.eval.at_end or self.eval.every)
                and self.data.sorting_settings[f"num_{self.eval.split}"] < 1):
            raise ValueError(f"`data.sorting.num_{self.eval.split}` is 0: nothing to evaluate on `eval.split: "
                             f"{self.eval.split}`; generate some, or set `eval.at_end=false`")
        return self


    def _check_classification(self):
        """`model.task: classification` on `data.corpus: documents`: what the loop and the evaluation support.
        A pretrained backbone reads its own tokenizer's ids unless `data.tokenizer` names another."""
        if self.data.tokenizer is None and not self.model.from_scratch:
            self.data.tokenizer = self.model.backbone  # written so in the run's config.yaml
        positions = self.model.settings.get("max_position_embeddings", self.model.settings.get("n_positions", 512))
        if self.model.from_scratch and self.data.segment_length > positions - 2:  # RoBERTa's positions start at 2
            raise ValueError(f"`data.segment_length` ({self.data.segment_length}) needs max_position_embeddings of at "
                             f"least {self.data.segment_length + 2}; set `model.settings.max_position_embeddings`")
        if self.episodic.enabled and (self.data.max_segments != 1 or self.optim.bptt_segments != 1):
            raise ValueError(f"`episodic.enabled` stores each document as one example: set `data.max_segments=1` "
                             f"and `optim.bptt_segments=1` (got {self.data.max_segments} and "
                             f"{self.optim.bptt_segments}; launch/classify.py sets 8 for the segmented encoders)")
        if self.optim.bptt_recompute:
            raise ValueError("`optim.bptt_recompute` replays a memory that carries gradients; an encoder's memory "
                             "carries none (each segment learns within itself): set `optim.bptt_recompute=false`")
        if self.eval.knn_lm.enabled:
            raise ValueError("`eval.knn_lm` interpolates a language model; a classifier is scored by accuracy and "
                             "F1: set `eval.knn_lm.enabled=false`")
        wrong = [p for p in self.eval.protocols if p not in ("full", "memoryless", ADAPTED)]
        if self.eval.after_each_task and not self.data.in_order:
            raise ValueError("`eval.after_each_task` reads each task as it ends: the tasks must come in turn "
                             "(`data.in_order=true`, one file or block of documents per task)")
        wrong += [p for p in self.eval.after_each_task if p not in ("full", "memoryless", ADAPTED)]
        if ADAPTED in [*self.eval.protocols, *self.eval.after_each_task] and not self.episodic.enabled:
            raise ValueError(f"`eval.protocols` `{ADAPTED}` adapts to the episodic memory's neighbours: set "
                             f"`episodic.enabled=true`")
        if wrong:
            raise ValueError(f"`eval.protocols` {wrong}: a classifier is evaluated `full` (its memory across a "
                             f"document's segments) and `memoryless` (each segment alone)")
        if self.lora.enabled and self.model.from_scratch:
            raise ValueError("LoRA adapts a pretrained backbone: set `lora.enabled: false` for `model.from_scratch`")
        splits = sorted(self.data.files) if self.data.files else ["test", "train", "validation"]
        if (self.eval.at_end or self.eval.every or self.eval.after_each_task) and self.eval.split not in splits:
            raise ValueError(f"`eval.split` {self.eval.split!r} is not among the documents' splits {splits}; choose "
                             f"one, or set `eval.at_end=false`")
        return self


def describe(cfg: RunConfig) -> dict[str, Any]:
    """A short summary for logs."""
    return {"model": f"{cfg.model.backbone} ({cfg.model.preset}{', scratch' if cfg.model.from_scratch else ''})",
            "data": f"{cfg.data.corpus} L={cfg.data.segment_length}", "run_dir": cfg.run_dir}
