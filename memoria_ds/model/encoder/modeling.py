"""Memoria BERT / RoBERTa for sequence classification, segment by segment, around the unmodified HF backbone.

Paper section 4.3 and Appendix F.2; the authors' `MemoriaBertEncoder.forward` (cosmoquester/memoria,
experiment/longseq_formers/model/memoria_bert/modeling_memoria_bert.py). One forward is one segment of
every row's document and one memory step:

    memory = prepare(memory, reset)                    # fresh rows where `reset`
    h = embeddings(segment)
    h = layer_i(h) for i = 0 .. l                      # HF's own layers, whole (l = memory_layer_index)
    WM = abstractor(h, real tokens)                    # N_wm engrams of the *current* segment (no leakage:
                                                       #   an encoder sees the whole segment anyway)
    retrieval = remind(state, WM)                      # the engine: writes WM, reminds M_rem (fp32)
    h = layer_i(h) with the memory attention over [WM, M_rem] for i = l+1 .. L-1   (layer.py)
    memorize(state, retrieval, contribution)           # lifespans from the M_rem attention weights
    logits = head(h)                                   # BERT: pooled [CLS]; RoBERTa: its head on <s>

The memory (`EncoderMemory`, the engine's fp32 state per row) is updated in place and returned as
`out.memory`; nothing recurrent lives on a module. The WM keeps its gradient (the abstractor and the
layers below l learn from the layers above, as in the authors' code); the engine stores detached copies.

Notation: B rows, L tokens in the segment, D width, N = N_wm, R reminded slots, K labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, BertModel, RobertaModel
from transformers import initialization as init
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertPreTrainedModel
from transformers.models.roberta.modeling_roberta import RobertaClassificationHead, RobertaPreTrainedModel
from transformers.utils import ModelOutput

from ...memory import MemoriaConfig, MemoryEngine, MemoryStats
from ..abstractor import Abstractor
from ..memory_attention import MemoryInputs, OutputProjection, contribution, engram_key_values
from ..recurrent.none import NoMemory
from ..recurrent.read_copy import read_copy
from .config import MemoriaBertConfig, MemoriaRobertaConfig
from .layer import EncoderMemoryLayer
from .memory import EncoderMemory

AUTHORS_QUERY_STD = 0.02  # the authors' `Abstractor` draws its queries N(0, 0.02)


@dataclass
class MemoriaSequenceClassifierOutput(ModelOutput):
    """Output of a Memoria encoder's forward (one segment).

    Attributes:
        loss: the segment's classification loss if labels were given (HF's: cross-entropy over the rows
            whose label is not -100; MSE for one label; BCE for float multi-label targets).
        logits: (B, K) this segment's class scores.
        memory: the memory after this segment (the object passed in, updated in place; a new one if None).
        memory_stats: the engine's `MemoryStats` of this step.
    """

    loss: Tensor | None = None
    logits: Tensor | None = None
    memory: EncoderMemory | None = None
    memory_stats: MemoryStats | None = None


class MemoriaEncoderModel:
    """What the BERT and RoBERTa classifiers share: the memory modules, their init and the forward.

    A subclass builds its backbone (`base_model_prefix` names it: `bert`, `roberta`) and its
    classification head, calls `_add_memory_modules()` and `post_init()`, and says how the head reads
    the last hidden states (`_classify`). The new modules are `abstractor.*` and
    `memory_layers.{i}.memory_attention.*` (one per layer i above `memory_layer_index`).
    """

    _keys_to_ignore_on_load_missing = [r"memory_layers\.", r"abstractor\."]
    _supports_flash_attn = False  # the memory attention runs eager or SDPA; only those are tested
    _supports_flex_attn = False

    def _add_memory_modules(self) -> None:
        cfg = self.config
        self.memory_layers = nn.ModuleDict({str(i): EncoderMemoryLayer(cfg, i) for i in cfg.memory_layers})
        if not cfg.use_memory:  # the backbone's classifier alone (preset `backbone`)
            self.abstractor = None
            return
        self.abstractor = Abstractor(dim=cfg.hidden_size, num_queries=cfg.memoria_config.num_wm,
                                     ffn_dim=cfg.intermediate_size, activation=cfg.hidden_act, style=cfg.abstractor_style)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The backbone's init (BERT's: N(0, initializer_range), biases 0, layer norms 1 and 0) for
        everything, which is how the authors' code initialises its memory modules too; then:
        the memory attention's output projection at zero under `memory_init="noop"` (its output is then
        exactly 0 and the model is exactly its backbone); the abstractor's queries N(0, 1) in the
        `transformer` style (so the first engrams differ, as Memoria GPT-2's) or N(0, 0.02) in the
        `authors` style (their `Abstractor`'s own draw)."""
        super()._init_weights(module)
        if isinstance(module, Abstractor):
            std = 1.0 if self.config.abstractor_style == "transformer" else AUTHORS_QUERY_STD
            init.normal_(module.queries, mean=0.0, std=std)
        elif isinstance(module, OutputProjection) and self.config.memory_init == "noop":
            init.zeros_(module.weight)
            init.zeros_(module.bias)

    def memory_modules(self) -> list[nn.Module]:
        """The modules the memory adds (abstractor, memory attentions); all trainable. Empty without a memory."""
        if self.abstractor is None:
            return []
        return [self.abstractor, *(layer.memory_attention for layer in self.memory_layers.values())]

    # ------------------------------------------------------------------ memory
    @property
    def memory_settings(self) -> MemoriaConfig:
        """The engine's typed settings, parsed again only when `config.memoria` changed."""
        cached = self.__dict__.get("_memory_settings")
        if cached is None or cached[0] != self.config.memoria:
            cached = self.__dict__["_memory_settings"] = (dict(self.config.memoria), self.config.memoria_config)
        return cached[1]

    @property
    def memory_engine(self) -> MemoryEngine:
        """The memory step, eager or compiled as `config.memory_compile` says (read at each use)."""
        engine = self.__dict__.get("_memory_engine")
        if engine is None or engine.mode != self.config.memory_compile:
            engine = self.__dict__["_memory_engine"] = MemoryEngine(self.config.memory_compile)
        return engine

    def empty_memory(self, batch_size: int, device: torch.device | str | None = None) -> EncoderMemory | NoMemory:
        """A fresh memory for `batch_size` rows (document streams); without a memory, the batch size alone."""
        if not self.config.use_memory:
            return NoMemory(batch_size)
        device = device if device is not None else self.base_model.embeddings.word_embeddings.weight.device
        return EncoderMemory.empty(self.memory_settings, batch_size, self.config.hidden_size, device=device)

    def prepare_memory(self, memory: EncoderMemory | None, batch_size: int, device: torch.device,
                       reset: Tensor | None) -> EncoderMemory:
        """`memory` checked against this model and batch (a fresh one if None), with the `reset` rows fresh.

        Raises:
            ValueError: a memory of another kind, batch size, device, width or capacity; a bad reset mask.
        """
        if not self.config.use_memory:
            if memory is not None and not (isinstance(memory, NoMemory) and memory.batch_size == batch_size):
                raise ValueError(f"this model has no memory (preset `backbone`): pass memory=None or the "
                                 f"NoMemory of {batch_size} rows a previous call returned, got {memory!r}")
            return memory if memory is not None else NoMemory(batch_size)
        if memory is None:
            memory = self.empty_memory(batch_size, device)
        elif not isinstance(memory, EncoderMemory):
            raise ValueError(f"`memory` must be the EncoderMemory a previous call returned, got a "
                             f"{type(memory).__name__}")
        elif memory.batch_size != batch_size or memory.device != device:
            raise ValueError(f"memory of {memory.batch_size} rows on {memory.device} does not fit a batch of "
                             f"{batch_size} rows on {device}")
        elif memory.state.dim != self.config.hidden_size:
            raise ValueError(f"memory of width {memory.state.dim} does not fit a model of width "
                             f"{self.config.hidden_size}")
        else:
            memory.state.check(self.memory_settings)
        if reset is not None:
            reset = torch.as_tensor(reset, device=device, dtype=torch.bool)
            if reset.shape != (batch_size,):
                raise ValueError(f"`reset` must have shape ({batch_size},), got {tuple(reset.shape)}")
            memory.reset(reset)
        return memory

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        memory: EncoderMemory | None = None,
        reset: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> MemoriaSequenceClassifierOutput:
        """Classify one segment of every row's document; one memory step.

        Args:
            input_ids: (B, L) int64 tokens of this segment.
            attention_mask: (B, L) 1 at real tokens, 0 at padding (right padding, e.g. a document's
                last segment). Padding is attended to by no token, read by no abstractor query and
                counts in no engram's contribution. A row with no real token still takes its memory
                step (its working memory then summarises the padding): give it label -100 and reset it
                before its next document.
            token_type_ids / position_ids: as the backbone takes them (None: its defaults).
            labels: (B,) class indices (-100: the row is ignored), or HF's regression / multi-label
                targets (`config.problem_type`).
            memory: the memory a previous call returned; None = fresh for every row. Updated in place.
            reset: (B,) bool, rows that start a new document (made fresh before this segment).
            inputs_embeds / output_attentions / output_hidden_states: not supported (None or False).
            return_dict: accepted and ignored (a `ModelOutput` is always returned).
            **kwargs: `num_items_in_batch` (as HF's Trainer passes it): the class-index loss is then the sum
                over labelled rows divided by it.

        Returns:
            `MemoriaSequenceClassifierOutput`.

        Raises:
            ValueError: a memory that does not fit, a segment longer than the backbone's positions, or an
                unsupported input.
            TypeError: an unknown argument.
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if kwargs:
            raise TypeError(f"unexpected argument(s) {sorted(kwargs)}")
        if inputs_embeds is not None or output_attentions or output_hidden_states:
            raise ValueError("pass `input_ids`; inputs_embeds / output_attentions / output_hidden_states are not "
                             "supported")
        cfg, backbone = self.config, self.base_model
        B, L = input_ids.shape
        if L > self.positions_per_segment:
            raise ValueError(f"a segment of {L} tokens exceeds the {self.positions_per_segment} positions the "
                             f"backbone embeds (max_position_embeddings={cfg.max_position_embeddings}); use "
                             f"shorter segments")
        device = input_ids.device
        memory = self.prepare_memory(memory, B, device, reset)
        settings = self.memory_settings

        hidden = backbone.embeddings(input_ids=input_ids, token_type_ids=token_type_ids,
                                     position_ids=position_ids)  # (B, L, D)
        mask = create_bidirectional_mask(config=backbone.config, inputs_embeds=hidden, attention_mask=attention_mask)
        real = (attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None
                else torch.ones(B, L, dtype=torch.bool, device=device))  # (B, L)
        layers = backbone.encoder.layer
        if not cfg.use_memory:  # the backbone's classifier alone
            for layer in layers:
                hidden = layer(hidden, mask)
            logits = self._classify(hidden)
            loss = self._loss(logits, labels, num_items_in_batch) if labels is not None else None
            return MemoriaSequenceClassifierOutput(loss=loss, logits=logits, memory=memory, memory_stats=None)
        for layer in layers[: cfg.memory_layer_index + 1]:
            hidden = layer(hidden, mask)  # HF's layer, whole

        wm = self.abstractor(hidden, real)  # (B, N, D), with its gradient
        retrieval = self.memory_engine.remind(memory.state, wm, settings)
        # copies: memorize rewrites the state in place, the backward keeps what was read (read_copy.py)
        reminded = read_copy(retrieval.reminded).to(wm.dtype)  # (B, R, D)
        reminded_mask = read_copy(retrieval.reminded_mask)  # (B, R)
        engrams = torch.cat([wm, reminded], dim=1) if reminded.shape[1] else wm  # (B, N + R, D)
        inputs = MemoryInputs(wm_active=torch.ones(B, dtype=torch.bool, device=device), reminded_mask=reminded_mask,
                              reminded_active=reminded_mask.any(dim=1), query_mask=real,
                              use_sdpa=cfg._attn_implementation == "sdpa", num_wm=wm.shape[1], dtype=engrams.dtype)
        reads = []
        key_values = engram_key_values([self.memory_layers[str(i)].memory_attention for i in cfg.memory_layers],
                                       engrams) or [None] * len(cfg.memory_layers)
        for i, kv in zip(cfg.memory_layers, key_values):
            hidden, read = self.memory_layers[str(i)](hidden, engrams, kv, layer=layers[i], attention_mask=mask,
                                                      memory=inputs)
            reads.append(read)

        if reads and reads[0] is not None:
            weights = contribution(reads, inputs)  # (B, R) fp32: mean over layers, heads and real tokens
        else:
            weights = torch.zeros(retrieval.reminded_slots.shape, device=device)
        stats = self.memory_engine.memorize(memory.state, retrieval, weights, settings)

        logits = self._classify(hidden)  # (B, K)
        loss = self._loss(logits, labels, num_items_in_batch) if labels is not None else None
        return MemoriaSequenceClassifierOutput(loss=loss, logits=logits, memory=memory, memory_stats=stats)

    @property
    def positions_per_segment(self) -> int:
        """The longest segment the backbone's learned positions embed (RoBERTa's start after `pad_token_id`)."""
        offset = self.config.pad_token_id + 1 if self.base_model_prefix == "roberta" else 0
        return self.config.max_position_embeddings - offset

    def _loss(self, logits: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
        """HF's sequence-classification loss; for class indices, the mean over rows whose label is not
        -100 (0 when there is none, where HF's mean would be NaN: a segment of finished documents), or
        the sum over them divided by `num_items_in_batch` when given."""
        cfg = self.config
        if cfg.problem_type is None and cfg.num_labels > 1 and labels.dtype in (torch.long, torch.int):
            cfg.problem_type = "single_label_classification"  # HF's rule (ForSequenceClassificationLoss)
        if cfg.problem_type != "single_label_classification":
            return ForSequenceClassificationLoss(labels, logits, cfg)
        labels = labels.to(logits.device).view(-1)  # (B,)
        summed = nn.functional.cross_entropy(logits.view(-1, cfg.num_labels), labels, ignore_index=-100,
                                             reduction="sum")
        if num_items_in_batch is not None:
            return summed / torch.as_tensor(num_items_in_batch, device=summed.device)
        return summed / (labels != -100).sum().clamp(min=1)

    def _classify(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError


class MemoriaBertForSequenceClassification(MemoriaEncoderModel, BertPreTrainedModel):
    """Memoria BERT: an HF `BertModel` (with its pooler) and BERT's classification head
    (dropout, linear on the pooled [CLS]), weight names as `BertForSequenceClassification`'s.

    Args:
        config: a `MemoriaBertConfig`.
    """

    config_class = MemoriaBertConfig
    config: MemoriaBertConfig
    base_model_prefix = "bert"

    def __init__(self, config: MemoriaBertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=True)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._add_memory_modules()
        self.post_init()

    def _classify(self, hidden: Tensor) -> Tensor:
        return self.classifier(self.dropout(self.bert.pooler(hidden)))  # pooled [CLS] -> (B, K)


class MemoriaRobertaForSequenceClassification(MemoriaEncoderModel, RobertaPreTrainedModel):
    """Memoria RoBERTa: an HF `RobertaModel` (no pooler) and RoBERTa's classification head on <s>,
    weight names as `RobertaForSequenceClassification`'s.

    Args:
        config: a `MemoriaRobertaConfig`.
    """

    config_class = MemoriaRobertaConfig
    config: MemoriaRobertaConfig
    base_model_prefix = "roberta"

    def __init__(self, config: MemoriaRobertaConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.roberta = RobertaModel(config, add_pooling_layer=False)
        self.classifier = RobertaClassificationHead(config)
        self._add_memory_modules()
        self.post_init()

    def _classify(self, hidden: Tensor) -> Tensor:
        return self.classifier(hidden)  # reads <s> -> (B, K)


MODEL_FOR_CONFIG = {MemoriaBertConfig: MemoriaBertForSequenceClassification,
                    MemoriaRobertaConfig: MemoriaRobertaForSequenceClassification}
for _config_class, _model_class in MODEL_FOR_CONFIG.items():
    AutoModelForSequenceClassification.register(_config_class, _model_class, exist_ok=True)

__all__ = ["MemoriaBertForSequenceClassification", "MemoriaRobertaForSequenceClassification", "MemoriaEncoderModel",
           "MemoriaSequenceClassifierOutput", "MODEL_FOR_CONFIG"]
