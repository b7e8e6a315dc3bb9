"""Export a run's trained weights as a Hugging Face directory that `from_pretrained` loads.

The weights come from the engine in this process, right after the final checkpoint, not
from files: under DeepSpeed the optimizer's fp32 master weights, assembled per parameter
with DeepSpeed's `safe_get_full_fp32_param` (ZeRO 1-3; under bf16 these are the masters,
not the bf16 copies); with the plain engine the parameters themselves. Nothing is
unpickled (issue 19). A fresh model is built on CPU from the run's configuration (so frozen
backbone weights left out of a LoRA run come from the backbone), the trained weights are
loaded into it, and (safetensors only: transformers 5 writes nothing else, the peft adapter
is saved with `safe_serialization=True`):

- without LoRA: `save_pretrained(<run_dir>/export)`;
- with LoRA and `merge_lora` (default): the adapters are merged into the backbone, and the
  result is a plain Memoria GPT-2 directory;
- with LoRA and `merge_lora: false`: `<run_dir>/export` holds the backbone plus the trained
  Memoria modules, and `<run_dir>/export/adapter` the peft adapter
  (`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d), d + "/adapter")`).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model.remote_code import add_remote_code
from ..safe_io import load_tree
from . import distributed as dist_utils
from .build import build_run_model, unwrap
from .checkpoint import ENGINE_TAG
from .engine import ENGINE_FILE
from .model_card import model_card

if TYPE_CHECKING:
    from .loop import Trainer


def consolidated_state_dict(ckpt_dir: Path, engine_kind: str) -> dict[str, torch.Tensor]:
    """fp32 weights of every saved parameter of a checkpoint, keyed like the module's state dict.

    A tool for checking checkpoints (the tests use it), not the export's path. The plain
    engine's state is read as data (safetensors); DeepSpeed's consolidation
    (`get_fp32_state_dict_from_zero_checkpoint`) unpickles DeepSpeed's own files: use it
    only on checkpoints you trust (docs/training.md, "Files that run code when loaded").
    """
    if engine_kind == "torch":
        return load_tree(ckpt_dir / ENGINE_TAG / ENGINE_FILE)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=ENGINE_TAG)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _strip_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped state dict as the plain model's (adapters dropped, base layers renamed)."""
    out = {}
    for k, v in state.items():
        if ".lora_" in k:
            continue
        k = k.replace("base_model.model.", "", 1) if k.startswith("base_model.model.") else k
        out[re.sub(r"\.base_layer\.", ".", k)] = v
    return out


def _gathered(param, zero_stage: int | None):
    """The full parameter on every rank for the duration (ZeRO-3 partitions it)."""
    if zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
    return contextlib.nullcontext()


def trained_weights(trainer: Trainer) -> tuple[dict[str, torch.Tensor], int]:
    """fp32 copies of every trainable parameter, on rank 0 (every rank calls: under ZeRO the
    assembly is collective), checked against the live parameter.

    Under DeepSpeed each weight is the optimizer's fp32 master (`safe_get_full_fp32_param`);
    rank 0 checks that it equals the live parameter (gathered under ZeRO-3) once cast to the
    live dtype: what is exported is what the model computes with. With the plain engine the
    parameter is the weight.

    Returns:
        ({name: fp32 tensor} on rank 0, else {}), and the number of tensors checked.

    Raises:
        RuntimeError: a master that is empty, of another shape, or different from the parameter.
    """
    stage = getattr(trainer.engine, "zero_stage", None)
    deepspeed_run = trainer.cfg.engine == "deepspeed"
    if deepspeed_run:
        from deepspeed.utils import safe_get_full_fp32_param
    out, problems = {}, []
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:
            continue
        master = safe_get_full_fp32_param(param) if deepspeed_run else None
        with _gathered(param, stage):
            if trainer.info.is_main:
                live = param.detach().cpu()
                weight = live.float().clone() if master is None else master.detach().float().cpu().clone()
                if weight.numel() == 0 or weight.shape != live.shape:
                    problems.append(f"{name}: master {tuple(weight.shape)}, live {tuple(live.shape)}")
                elif not torch.equal(weight.to(live.dtype), live):
                    problems.append(f"{name}: the fp32 master differs from the live parameter")
                out[name] = weight
    if problems:
        raise RuntimeError("the trained weights do not match the live model:\n  " + "\n  ".join(problems[:10]))
    return out, len(out)


def export_hf(trainer: Trainer, step: int, results: list | None = None) -> Path | None:
    """Write `<run_dir>/export` from the engine's weights at `step` (rank 0; every rank calls),
    with a model card (README.md) giving the final evaluation `results`."""
    out_dir = Path(trainer.cfg.run_dir) / "export"
    state, checked = trained_weights(trainer)
    if trainer.info.is_main:
        trainer.log(f"export: {checked} trained tensors (fp32{' masters' if trainer.cfg.engine == 'deepspeed' else ''}) "
                    f"equal the live parameters at step {step}")
        vocab = trainer.vocab_size
        fresh = build_run_model(trainer.cfg, vocab).to("cpu")
        trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(state))
        if missing:
            raise RuntimeError(f"the engine lacks trained parameters {missing[:5]} (and {len(missing) - 5} more)"
                               if len(missing) > 5 else f"the engine lacks trained parameters {missing}")
        fresh.load_state_dict(state, strict=False)
        if trainer.cfg.lora.enabled:
            if trainer.cfg.checkpoint.merge_lora:
                model = fresh.merge_and_unload()
            else:
                fresh.save_pretrained(str(out_dir / "adapter"), safe_serialization=True)
                model = unwrap(build_run_model_plain(trainer, vocab))
                model.load_state_dict(_strip_lora(state), strict=False)
        else:
            model = fresh
        remote = add_remote_code(model, out_dir)  # loads with trust_remote_code=True, no import first
        model.save_pretrained(str(out_dir))  # transformers 5 writes safetensors only
        _save_tokenizer(trainer, out_dir)
        lora = trainer.cfg.checkpoint.merge_lora if trainer.cfg.lora.enabled else None
        (out_dir / "README.md").write_text(model_card(trainer.cfg, step, list(results or []), model.config, lora,
                                                      remote_code=remote))
        trainer.log(f"exported step {step} to {out_dir} (safetensors)")
    dist_utils.barrier()
    return out_dir


def build_run_model_plain(trainer: Trainer, vocab):
    """The run's model without LoRA (the base for a non-merged adapter export)."""
    from dataclasses import replace

    cfg = replace(trainer.cfg, lora=replace(trainer.cfg.lora, enabled=False))
    return build_run_model(cfg, vocab).to("cpu")


def _save_tokenizer(trainer: Trainer, out_dir: Path) -> None:
    data = trainer.cfg.data
    if data.corpus in ("enwik8", "sorting"):
        return  # a character / symbol vocabulary, recorded in the corpus metadata
    from ..data import load_tokenizer

    try:
        load_tokenizer(data.tokenizer or "gpt2").save_pretrained(str(out_dir))
    except (OSError, ValueError) as e:  # the weights are what matters; say so and go on
        trainer.log(f"export: tokenizer not saved ({e})")
