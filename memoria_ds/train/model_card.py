"""The model card (README.md) written into an export: what the model is, how it was trained
and evaluated, and the numbers of that run, as the Hugging Face hub shows them."""

from __future__ import annotations

import json
from typing import Any

import yaml

from ..eval.gain import memory_gain
from ..model.remote_code import remote_files


_NAMES = {"gpt2": "GPT-2", "bert": "BERT", "roberta": "RoBERTa", "memory_mosaic": "Memory Mosaic",
          "memsizer": "MemSizer"}


def model_card(cfg: Any, step: int, results: list[Any], model_config: Any, lora_merged: bool | None,
               remote_code: bool = False) -> str:
    """Markdown with a YAML header (`library_name`, `tags`, `datasets`, `base_model`).

    Args:
        cfg: the run's `RunConfig`. step: the step exported.
        results: the final evaluation's `EvalResult`s (may be empty).
        model_config: the exported model's config (`MemoriaGPT2Config` or a backbone config).
        lora_merged: None without LoRA; True if merged into the backbone, False if the
            adapter is beside it in `adapter/`.
        remote_code: the export carries `auto_map` modules (`model/remote_code.py`).
    """
    m, d = cfg.model, cfg.data
    classifier = m.task == "classification"
    memory = "memoria" if classifier else getattr(model_config, "memory_type", "none")
    family = getattr(model_config, "model_type", "gpt2").replace("memoria_", "")  # gpt2, bert, roberta
    auto = "AutoModelForSequenceClassification" if classifier else "AutoModelForCausalLM"
    tags = ["memoria_ds", family, "memoria"] + ([m.preset] if m.preset != "memoria" else [])
    if classifier:
        tags.append("text-classification")
    header: dict[str, Any] = {"library_name": "transformers", "tags": tags}
    if not m.from_scratch:
        header["base_model"] = m.backbone
    corpus = {"wikitext103": "Salesforce/wikitext", "pg19": "deepmind/pg19", "enwik8": "LTCB/enwik8"}.get(d.corpus)
    if corpus:
        header["datasets"] = [corpus]
    lines = ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "",
             f"# {m.preset} {_NAMES.get(family, family)}{' classifier' if classifier else ''} "
             f"({'trained from scratch' if m.from_scratch else f'fine-tuned from `{m.backbone}`'})", ""]
    lines += [("Trained with memoria_ds (Memoria: Park & Bak, ICML 2024): an encoder that classifies a long "
               "document segment by segment, its segments sharing a working, short-term and long-term memory of "
               "engrams; the prediction is read at the document's last segment.") if classifier else
              "Trained with memoria_ds (Memoria: Park & Bak, ICML 2024): a GPT-2 whose "
              "segments share a working, short-term and long-term memory of engrams." if memory == "memoria" else
              f"Trained with memoria_ds as a baseline (memory type `{memory}`).", ""]
    module = "memoria_ds.model.encoder" if classifier else "memoria_ds.model"
    lines += ["## Load", "", "```python", f"import {module}  # registers the model type with the Auto classes",
              f"from transformers import {auto}", "", f'model = {auto}.from_pretrained("DIR")']
    if lora_merged is False:
        lines += ["from peft import PeftModel", 'model = PeftModel.from_pretrained(model, "DIR/adapter")']
    lines += ["```", ""]
    if remote_code:
        first, second = sorted(remote_files(model_config)[0])
        lines += [f"Or, without the import: `{auto}.from_pretrained(\"DIR\", trust_remote_code=True)`. "
                  f"That runs the two one-line modules in this directory (`{first}`, "
                  f"`{second}`), which import the installed `memoria_ds` (pip install memoria_ds); "
                  "they carry no model code. The weights are safetensors and the settings JSON: loading them runs "
                  "nothing.", ""]
    else:
        lines += ["Nothing in this directory is executable: weights are safetensors, settings JSON.", ""]
    memoria = getattr(model_config, "memoria", None)
    layers = getattr(model_config, "n_layer", getattr(model_config, "num_hidden_layers", "?"))
    width = getattr(model_config, "n_embd", getattr(model_config, "hidden_size", "?"))
    lines += ["## Model", "", f"- backbone: `{m.backbone}` ({'random init' if m.from_scratch else 'pretrained'}), "
              f"{layers} layers, width {width}",
              f"- preset: `{m.preset}`; memory type `{memory}`"]
    if memoria:
        lines.append(f"- memory settings: `{json.dumps(memoria, sort_keys=True)}`")
    if lora_merged is not None:
        lines.append(f"- LoRA r={cfg.lora.r}: {'merged into the backbone' if lora_merged else 'adapter in adapter/'}")
    lines += ["", "## Training", "",
              f"- data: `{d.corpus}`{f' ({d.path})' if d.path else ''}, segments of {d.segment_length} tokens, "
              f"memory reset `{d.reset}`",
              f"- {step} optimiser steps, lr {cfg.optim.lr:g}, {cfg.optim.micro_batch_size * cfg.optim.grad_accum} "
              f"streams per rank, precision `{cfg.optim.precision}`, seed {cfg.seed}", ""]
    lines += ["## Evaluation", ""]
    if not results:
        lines += ["Not evaluated at the end of training (`eval.at_end=false`); "
                  "`python launch/evaluate.py DIR` scores it.", ""]
    else:
        lines += [f"| split | protocol | metric | scored {'documents' if classifier else 'tokens'} |",
                  "|---|---|---|---|"]
        for r in results:
            metric = (f"accuracy {r.accuracy:.4f}, macro-F1 {r.macro_f1:.4f}" if r.macro_f1 is not None else
                      f"accuracy {r.accuracy:.4f}" if r.accuracy is not None else
                      f"bpc {r.bpc:.4f}" if r.bpc is not None else f"ppl {r.ppl:.3f}")
            lines.append(f"| {r.split} | `{r.protocol.get('name', '?')}` | {metric} | {r.scored_tokens} |")
        lines += ["", ("`full`: each document read segment by segment with its memory, classified at its last "
                       "segment; `memoryless`: the same with the memory reset before every segment (the last segment "
                       "alone decides; memoria_ds docs/encoders.md).") if classifier else
                  ("`paper`: one stream, memory carried through the split, each segment's first token "
                   "unscored (the authors' protocol); `full`: every token scored; `memoryless`: `full` with the "
                   "memory reset before every segment (memoria_ds docs/data.md)."), ""]
        gain = memory_gain(results)
        if gain is not None:
            lines += [f"What the memory is worth to this model: {gain.describe()}.", ""]
    return "\n".join(lines)
