"""Build what a run needs from its RunConfig: the model (with LoRA), the corpora, the precision."""

from __future__ import annotations

import errno
from typing import Any

import torch
from datasets.exceptions import DatasetGenerationError
from torch import nn
from transformers import AutoConfig, BertConfig, GPT2Config, PretrainedConfig, RobertaConfig

from ..data import TokenCorpus, input_length_for, local_documents, prepare_corpus, sorting_dataset
from ..data.labelled import load_labelled_documents
from ..model import MemoriaGPT2Config, apply_lora, build_model
from ..model.build import build_config
from ..model.encoder import apply_encoder_lora, build_encoder_model, encoder_config
from ..model.encoder.plain import is_plain_classifier, plain_classifier_config
from ..model.families import family_of_config, family_of_preset
from . import distributed as dist_utils
from . import faults
from .config import DataSection, LoraSection, ModelSection, RunConfig
from .parse import ConfigError


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> bf16 on a GPU that supports it, else fp32."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def load_corpora(data: DataSection, splits: tuple[str, ...], rank: int,
                 label_names: list[str] | None = None) -> dict[str, TokenCorpus]:
    """Tokenized splits. Rank 0 prepares (and caches) them first; the others then read the cache.
    `label_names`: a trained classifier's classes, to map labelled documents by (`data.corpus: documents`)."""
    kwargs: dict[str, Any] = dict(data.loader)
    if data.path is not None:
        kwargs["path"] = data.path

    def prepare() -> dict[str, TokenCorpus]:
        if faults.active("disk_full_in_data_prep", 0):
            raise OSError(errno.ENOSPC, "No space left on device (fault injection)")
        if data.corpus == "sorting":  # generated examples (datasets.Dataset per split)
            s = data.sorting_settings
            sizes = {"num_train": s["num_train"] if "train" in splits else 0,
                     "num_validation": s["num_validation"] if "validation" in splits else 0,
                     "num_test": s["num_test"] if "test" in splits else 0}
            length = input_length_for(s["num_segments"], data.segment_length)
            return dict(sorting_dataset(length, seed=s["seed"], num_proc=data.num_proc, **sizes))
        if data.corpus == "documents":  # labelled documents (model.task: classification)
            try:
                return load_labelled_documents(files=data.files or None, path=data.path, tokenizer=data.tokenizer,
                                               splits=splits, text_field=data.text_field,
                                               label_field=data.label_field, num_proc=data.num_proc,
                                               label_names=label_names)
            except ValueError as e:  # a missing split, column or unreadable labels: the data's fault
                raise ConfigError(f"data.corpus=documents: {e}") from None
        if data.corpus == "files":
            try:
                docs = local_documents(data.files, text_field=data.text_field)
            except DatasetGenerationError as e:  # a malformed row: say which error, not `datasets`' wrapper
                cause = e.__cause__ or e.__context__ or e
                raise ConfigError(f"data.files could not be read ({type(cause).__name__}: {_first_line(str(cause))}); "
                                  f"fix or replace the file") from e
            return prepare_corpus(docs, data.tokenizer, name="files", splits=splits, num_proc=data.num_proc,
                                  append_eos=data.append_eos)
        return prepare_corpus(data.corpus, data.tokenizer, splits=splits, num_proc=data.num_proc,
                              append_eos=data.append_eos, **kwargs)

    failure: Exception | None = None
    if rank == 0:
        try:
            out = prepare()
        except Exception as e:  # told to the others (none waits at a barrier for a rank that is gone), then raised
            failure = e
    told = dist_utils.broadcast_object(
        None if failure is None else (isinstance(failure, ConfigError), type(failure).__name__, str(failure)))
    if failure is not None:
        raise failure
    if told is not None:
        bad_input, kind, message = told
        if bad_input:  # the same one line (and exit status 2) on every rank
            raise ConfigError(message)
        raise DataPreparationFailed(f"rank 0 could not prepare the data ({kind}: {_first_line(message)}); "
                                    f"its error says why")
    if rank != 0:
        out = prepare()
    return out


class DataPreparationFailed(RuntimeError):
    """Rank 0 failed to prepare the corpora; raised on the other ranks instead of waiting."""


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


# The published GPT-2 shapes (n_embd, n_layer, n_head): a from-scratch run needs only these,
# so it never asks the hub.
GPT2_SHAPES = {"gpt2": (768, 12, 12), "gpt2-medium": (1024, 24, 16), "gpt2-large": (1280, 36, 20),
               "gpt2-xl": (1600, 48, 25)}


def from_scratch_backbone(model: ModelSection, vocab_size: int | None) -> GPT2Config:
    """The backbone config for a from-scratch run: the named architecture (a GPT-2 size, or a
    local directory's config) with the corpus vocabulary."""
    name = model.backbone.split("/")[-1]
    if name in GPT2_SHAPES:
        n_embd, n_layer, n_head = GPT2_SHAPES[name]
        base = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    else:
        base = AutoConfig.from_pretrained(model.backbone)
    values = {k: v for k, v in base.to_dict().items() if k in GPT2Config().to_dict()}
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    return GPT2Config(**values)


# The backbone fields that fix the shapes of pretrained weights.
SHAPE_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")


def check_pretrained_settings(model: ModelSection) -> None:
    """Shape settings (`n_layer`, `n_embd`, ...) describe a from-scratch model: refuse them
    for a pretrained backbone whose weights have other shapes, before any data work.

    Raises:
        ConfigError: the conflicting settings, the backbone's values, and what to do.
    """
    if model.from_scratch:
        return
    family = family_of_preset(model.preset)
    if family is not None and family_of_config(AutoConfig.from_pretrained(model.backbone)) is not family:
        raise ConfigError(f"model.preset={model.preset} builds a {family.name}, which has no weights in the GPT-2 "
                          f"backbone {model.backbone!r}: set model.from_scratch=true (the backbone then gives only "
                          f"its shape), or give a directory saved from a {family.name}")
    asked = {k: model.settings[k] for k in SHAPE_FIELDS if k in model.settings}
    if not asked:
        return
    saved = AutoConfig.from_pretrained(model.backbone)
    conflicts = {k: v for k, v in asked.items() if getattr(saved, k, None) != v}
    if conflicts:
        have = ", ".join(f"{k}={getattr(saved, k, None)}" for k in conflicts)
        raise ConfigError(
            f"model.settings {', '.join(f'{k}={v}' for k, v in conflicts.items())} conflict with the pretrained "
            f"backbone {model.backbone!r} ({have}): shape settings apply only with model.from_scratch=true. "
            f"Remove them to fine-tune it (e.g. --config launch/configs/finetune_gpt2.yaml), or train from scratch"
        )


def build_run_model(cfg: RunConfig, vocab_size: int | None, label_names: list[str] | None = None) -> nn.Module:
    """The model of `cfg` (Memoria GPT-2 or a baseline, or a Memoria encoder classifier), LoRA-wrapped if asked.

    Args:
        vocab_size: the corpus vocabulary; a from-scratch model gets it unless `settings`
            says otherwise; a pretrained backbone must cover it.
        label_names: a classifier's classes (`model.task: classification`), index -> name.
    """
    m = cfg.model
    if m.task == "classification":
        return build_run_encoder(cfg, vocab_size, label_names or [])
    backbone, settings = _model_source(cfg, vocab_size)
    if m.from_scratch:
        model = build_model(backbone, m.preset, attn_implementation=m.attn_implementation, **settings)
    else:
        # fp32 whatever dtype the checkpoint was saved in: the engine owns the precision (DeepSpeed
        # keeps fp32 masters and casts; ZeRO-3 needs one dtype across the backbone and the new
        # modules, which are built in fp32)
        model = build_model(backbone, m.preset, dtype=torch.float32, attn_implementation=m.attn_implementation,
                            **settings)
    if vocab_size is not None and model.config.vocab_size < vocab_size:
        raise ValueError(
            f"the corpus has token ids up to {vocab_size - 1} but the model's vocabulary has {model.config.vocab_size} "
            f"entries; use the backbone's tokenizer (data.tokenizer) or a from-scratch model"
        )
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return apply_lora_section(model, cfg.lora)


def build_run_encoder(cfg: RunConfig, vocab_size: int | None, label_names: list[str]) -> nn.Module:
    """A Memoria BERT / RoBERTa classifier of `label_names`' classes (fp32: the engine owns the precision),
    LoRA on its backbone if asked (`lora.target_modules` at its GPT-2 default: every linear layer of the
    backbone's transformer layers)."""
    m = cfg.model
    settings = dict(m.settings)
    if label_names:
        if settings.get("num_labels", len(label_names)) != len(label_names):
            raise ConfigError(f"`model.settings.num_labels` ({settings['num_labels']}) but the documents have "
                              f"{len(label_names)} classes ({label_names[:8]}); remove num_labels")
        settings.pop("num_labels", None)
        settings["id2label"] = dict(enumerate(label_names))
        settings["label2id"] = {name: i for i, name in enumerate(label_names)}
    if m.from_scratch:
        model = build_encoder_model(_encoder_source(m, vocab_size), m.preset,
                                    attn_implementation=m.attn_implementation, **settings)
    else:
        _check_zero3_head(m.backbone, len(label_names))
        model = build_encoder_model(m.backbone, m.preset, dtype=torch.float32,
                                    attn_implementation=m.attn_implementation, **settings)
    if vocab_size is not None and model.config.vocab_size < vocab_size:
        raise ValueError(f"the documents have token ids up to {vocab_size - 1} but the model's vocabulary has "
                         f"{model.config.vocab_size} entries; use the backbone's tokenizer (data.tokenizer)")
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not cfg.lora.enabled:
        return model
    lora = cfg.lora
    gpt2_default = lora.target_modules == LoraSection().target_modules
    targets = {} if gpt2_default else {"target_modules": lora.target_modules}
    return adapters_in_model_dtype(apply_encoder_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                                      **targets))


def _encoder_source(m: ModelSection, vocab_size: int | None) -> PretrainedConfig | str:
    """What a classifier is built from: a from-scratch `bert` / `roberta` / `gpt2` config with the documents'
    vocabulary (unless `settings` names one; its other sizes come from `settings`), else the checkpoint."""
    if not m.from_scratch:
        return m.backbone
    shape = {"bert": BertConfig, "gpt2": GPT2Config}.get(m.backbone, RobertaConfig)
    return shape(**({"vocab_size": vocab_size} if vocab_size is not None and "vocab_size" not in m.settings else {}))


def _check_zero3_head(backbone: str, classes: int) -> None:
    """Under ZeRO-3, HF's loader cannot draw a new head over a checkpoint's head of another size (it
    refuses the shapes); say what to do instead of its error."""
    from .engine import building_under_zero3

    saved = AutoConfig.from_pretrained(backbone)
    head = any(a.endswith("ForSequenceClassification") for a in (saved.architectures or []))
    if building_under_zero3() and head and classes and saved.num_labels != classes:
        raise ConfigError(f"model.backbone {backbone!r} is a classifier of {saved.num_labels} classes and the "
                          f"documents have {classes}: under ZeRO-3 its head cannot be replaced while loading. Use ZeRO-1/2 "
                          f"(ds_configs/zero2.json), or save its encoder alone (model.bert / model.roberta "
                          f".save_pretrained) and start from that")


def run_model_config(cfg: RunConfig, vocab_size: int | None = None) -> MemoriaGPT2Config:
    """The config of the model `build_run_model` builds for `cfg`, without building it or reading any
    weights (a from-scratch model's vocabulary, which the corpus gives, is the backbone's unless
    `vocab_size` says): what a checkpoint's memories are checked against. A classifier's is its
    Memoria encoder's config (`model.task: classification`)."""
    m = cfg.model
    if m.task == "classification":
        source = _encoder_source(m, vocab_size)
        saved = source if isinstance(source, PretrainedConfig) else AutoConfig.from_pretrained(source)
        if m.preset == "backbone" and is_plain_classifier(saved):
            return plain_classifier_config(saved, **m.settings)  # Longformer, BigBird, GPT-2: HF's own config
        return encoder_config(source, m.preset, **m.settings)
    backbone, settings = _model_source(cfg, vocab_size)
    return build_config(backbone, cfg.model.preset, **settings)


def _model_source(cfg: RunConfig, vocab_size: int | None) -> tuple[GPT2Config | str, dict[str, Any]]:
    """The backbone `build_model` starts from (a from-scratch model's `GPT2Config` with the shape
    settings applied, else the hub name or directory) and the settings left for the model."""
    m = cfg.model
    settings = dict(m.settings)
    settings.setdefault("segment_length", cfg.data.segment_length)
    if not m.from_scratch:
        return m.backbone, settings
    backbone = from_scratch_backbone(m, settings.pop("vocab_size", vocab_size))
    arch = {k: settings.pop(k) for k in list(settings) if k in GPT2Config().to_dict() and k != "vocab_size"}
    return GPT2Config(**{**backbone.to_dict(), **arch}), settings


def apply_lora_section(model: nn.Module, lora: LoraSection) -> nn.Module:
    """LoRA on the backbone, the adapters in the dtype of every other parameter.

    peft makes adapters fp32 whatever the base layers are. Under ZeRO-3 in bf16 the backbone
    and the memory modules are built in bf16 (straight into partitions), and ZeRO-3 flattens
    all trainable parameters into one buffer of one dtype; DeepSpeed keeps fp32 master
    copies of them all, so the adapters lose nothing by following.
    """
    if not lora.enabled:
        return model
    model = apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
    return adapters_in_model_dtype(model)


def adapters_in_model_dtype(model: nn.Module) -> nn.Module:
    """The LoRA adapters in the dtype of every other parameter (see `apply_lora_section`)."""
    dtypes = {p.dtype for n, p in model.named_parameters() if ".lora_" not in n}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
                module.to(dtype)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The MemoriaGPT2LMHeadModel inside a PeftModel (or the model itself)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def run_label_names(cfg: RunConfig, model: nn.Module) -> list[str] | None:
    """A classifier's classes as the trained model names them (index order), else None."""
    if cfg.model.task != "classification":
        return None
    id2label = unwrap(model).config.id2label
    return [id2label[i] for i in range(len(id2label))]


def model_config(model: nn.Module) -> MemoriaGPT2Config:
    return unwrap(model).config
