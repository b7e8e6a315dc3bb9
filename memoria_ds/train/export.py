"""Export a run's trained weights as a Hugging Face directory that `from_pretrained` loads.

The weights come from the engine in this process, right after the final checkpoint, not
from files: under DeepSpeed the optimizer's fp32 master weights, assembled per parameter
with DeepSpeed's `safe_get_full_fp32_param` (ZeRO 1-3; under bf16 these are the masters,
not the bf16 copies); with the plain engine the parameters themselves. Nothing is
unpickled (issue 19). A fresh model is built on CPU from the run's configuration (so frozen
backbone weights left out of a LoRA run come from the backbone), the trained weights and the
live model's persistent buffers (a PKM layer's running statistics) are loaded into it, and (safetensors only: transformers 5 writes nothing else, the peft adapter
is saved with `safe_serialization=True`):

- without LoRA: `save_pretrained(<run_dir>/export)`;
- with LoRA and `merge_lora` (default): the adapters are merged into the backbone, and the
  result is a plain Memoria GPT-2 directory;
- with LoRA and `merge_lora: false`: `<run_dir>/export` holds the backbone plus the trained
  Memoria modules, and `<run_dir>/export/adapter` the peft adapter
  (`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d), d + "/adapter")`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..model.remote_code import add_remote_code
from ..safe_io import load_tree
from . import distributed as dist_utils
from .build import build_run_model, run_label_names, unwrap
from .checkpoints import ENGINE_TAG
from .engine import ENGINE_FILE, fp32_master, gathered, zero_fp32_state_dict
from .config import RunConfig
from .model_card import model_card


def consolidated_state_dict(ckpt_dir: Path, engine_kind: str) -> dict[str, torch.Tensor]:
    """fp32 weights of every saved parameter of a checkpoint, keyed like the module's state dict.

    A tool for checking checkpoints (the tests use it), not the export's path. The plain
    engine's state is read as data (safetensors); DeepSpeed's consolidation
    (`get_fp32_state_dict_from_zero_checkpoint`) unpickles DeepSpeed's own files: use it
    only on checkpoints you trust (docs/training.md, "Files that run code when loaded").
    """
    if engine_kind == "torch":
        return load_tree(ckpt_dir / ENGINE_TAG / ENGINE_FILE)["module"]
    return zero_fp32_state_dict(ckpt_dir, ENGINE_TAG)


def _strip_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped state dict as the plain model's (adapters dropped, base layers renamed)."""
    out = {}
    for k, v in state.items():
        if ".lora_" in k:
            continue
        k = k.replace("base_model.model.", "", 1) if k.startswith("base_model.model.") else k
        out[re.sub(r"\.base_layer\.", ".", k)] = v
    return out


def trained_weights(cfg: RunConfig, engine, model: nn.Module, is_main: bool) -> tuple[dict[str, torch.Tensor], int]:
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
    stage = getattr(engine, "zero_stage", None)
    deepspeed_run = cfg.engine == "deepspeed"
    out, problems = {}, []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        master = fp32_master(param) if deepspeed_run else None
        with gathered(param, stage):
            if is_main:
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


def trained_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the model's persistent buffers, named as in its state dict: state the run
    moved that is not a parameter (a PKM layer's batch-norm running statistics). Buffers are not
    partitioned by ZeRO: this rank's copy (rank 0's in the export, as DeepSpeed's checkpoint keeps)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer.detach().cpu().clone()
    return out


def export_hf(
    cfg: RunConfig, engine, model: nn.Module, *, vocab_size: int, is_main: bool, log: Callable[[str], None],
    step: int, results: list | None = None,
) -> Path | None:
    """Write `<run_dir>/export` from the engine's weights at `step` (rank 0; every rank calls),
    with a model card (README.md) giving the final evaluation `results`.

    Args:
        cfg: the run's configuration. engine: the DeepSpeed or plain engine holding the weights.
        model: the module the engine trains (LoRA-wrapped for a LoRA run). vocab_size: the
        model's vocabulary. is_main: this process is rank 0. log: rank 0's log line writer.
    """
    out_dir = Path(cfg.run_dir) / "export"
    state, checked = trained_weights(cfg, engine, model, is_main)
    if is_main:
        log(f"export: {checked} trained tensors (fp32{' masters' if cfg.engine == 'deepspeed' else ''}) "
            f"equal the live parameters at step {step}")
        vocab = vocab_size
        fresh = build_run_model(cfg, vocab, run_label_names(cfg, model)).to("cpu")
        trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(state))
        if missing:
            raise RuntimeError(f"the engine lacks trained parameters {missing[:5]} (and {len(missing) - 5} more)"
                               if len(missing) > 5 else f"the engine lacks trained parameters {missing}")
        state.update(trained_buffers(model))  # what the run moved besides its weights
        fresh.load_state_dict(state, strict=False)
        if cfg.lora.enabled:
            if cfg.checkpoint.merge_lora:
                exported = fresh.merge_and_unload()
            else:
                fresh.save_pretrained(str(out_dir / "adapter"), safe_serialization=True)
                exported = unwrap(build_run_model_plain(cfg, vocab, run_label_names(cfg, model)))
                exported.load_state_dict(_strip_lora(state), strict=False)
        else:
            exported = fresh
        remote = add_remote_code(exported, out_dir)  # loads with trust_remote_code=True, no import first
        exported.save_pretrained(str(out_dir))  # transformers 5 writes safetensors only
        _save_tokenizer(cfg, out_dir, log)
        lora = cfg.checkpoint.merge_lora if cfg.lora.enabled else None
        (out_dir / "README.md").write_text(model_card(cfg, step, list(results or []), exported.config, lora,
                                                      remote_code=remote))
        log(f"exported step {step} to {out_dir} (safetensors)")
    dist_utils.barrier()
    return out_dir


def build_run_model_plain(cfg: RunConfig, vocab: int, labels: list[str] | None = None) -> nn.Module:
    """The run's model without LoRA (the base for a non-merged adapter export)."""
    plain = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"enabled": False})})
    return build_run_model(plain, vocab, labels).to("cpu")



def _save_tokenizer(cfg: RunConfig, out_dir: Path, log: Callable[[str], None]) -> None:
    data = cfg.data
    if data.corpus in ("enwik8", "sorting"):
        return  # a character / symbol vocabulary, recorded in the corpus metadata
    from ..data import load_tokenizer

    try:
        load_tokenizer(data.tokenizer or "gpt2").save_pretrained(str(out_dir))
    except (OSError, ValueError) as e:  # the weights are what matters; say so and go on
        log(f"export: tokenizer not saved ({e})")
