"""Export a run's newest checkpoint as a Hugging Face directory that `from_pretrained` loads.

Weights come from the checkpoint, consolidated to fp32 on rank 0 (DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint` for ZeRO 1-3: under bf16 these are the fp32
master weights, not the bf16 copies). A fresh model is built on CPU from the run's
configuration (so frozen backbone weights left out of a LoRA checkpoint come from the
backbone), the trained weights are loaded into it, and:

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

from . import distributed as dist_utils
from .build import build_run_model, unwrap
from .checkpoint import ENGINE_TAG, find_latest

if TYPE_CHECKING:
    from .loop import Trainer


def consolidated_state_dict(ckpt_dir: Path, engine_kind: str) -> dict[str, torch.Tensor]:
    """fp32 weights of every saved parameter, keyed like the trained module's state dict."""
    if engine_kind == "torch":
        return torch.load(ckpt_dir / ENGINE_TAG / "engine.pt", map_location="cpu", weights_only=False)["module"]
    tag_dir = ckpt_dir / ENGINE_TAG
    if any(tag_dir.glob("*zero_pp_rank_*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=ENGINE_TAG)
    else:  # ZeRO stage 0: the module weights are stored whole
        blob = torch.load(next(tag_dir.glob("mp_rank_*_model_states.pt")), map_location="cpu", weights_only=False)
        state = blob["module"]
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


def verify_against_live(trainer: Trainer, state: dict[str, torch.Tensor] | None) -> int:
    """Check that every trained tensor in `state` (rank 0's) equals the live parameter.

    The live parameter is gathered (ZeRO-3) on every rank; rank 0 compares it with the
    saved fp32 weight cast to the live dtype (bf16 training keeps fp32 masters). Every
    rank calls this. Raises RuntimeError on an empty or different tensor.

    Returns:
        The number of tensors checked.
    """
    stage = getattr(trainer.engine, "zero_stage", None)
    problems, checked = [], 0
    for name, param in trainer.model.named_parameters():
        if not param.requires_grad:
            continue
        with _gathered(param, stage):
            if trainer.info.is_main:
                live = param.detach().cpu()
                saved = state.get(name)
                if saved is None or saved.numel() == 0 or saved.shape != live.shape:
                    problems.append(f"{name}: saved {None if saved is None else tuple(saved.shape)}, "
                                    f"live {tuple(live.shape)}")
                elif not torch.equal(saved.to(live.dtype), live):
                    problems.append(f"{name}: values differ from the live parameter")
                checked += 1
    if problems:
        raise RuntimeError("the checkpoint's trained weights do not match the live model:\n  " + "\n  ".join(problems[:10]))
    return checked


def export_hf(trainer: Trainer, ckpt_root: Path) -> Path | None:
    """Write `<run_dir>/export` from the newest checkpoint (rank 0; every rank calls).

    Before writing, the checkpoint's trained weights are checked against the live
    parameters (gathered under ZeRO-3): what is exported is what was trained.
    """
    out_dir = Path(trainer.cfg.run_dir) / "export"
    state = None
    if trainer.info.is_main:
        info, _ = find_latest(ckpt_root)
        if info is None:
            raise RuntimeError(f"nothing to export: no complete checkpoint in {ckpt_root}")
        state = consolidated_state_dict(info.path, trainer.cfg.engine)
    checked = verify_against_live(trainer, state)
    if trainer.info.is_main:
        trainer.log(f"export: {checked} trained tensors in {info.path.name} equal the live parameters")
        vocab = trainer.vocab_size
        fresh = build_run_model(trainer.cfg, vocab).to("cpu")
        trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(state))
        if missing:
            raise RuntimeError(f"checkpoint {info.path} lacks trained parameters {missing[:5]} (and {len(missing) - 5} more)"
                               if len(missing) > 5 else f"checkpoint {info.path} lacks trained parameters {missing}")
        fresh.load_state_dict(state, strict=False)
        if trainer.cfg.lora.enabled:
            if trainer.cfg.checkpoint.merge_lora:
                model = fresh.merge_and_unload()
            else:
                fresh.save_pretrained(str(out_dir / "adapter"))
                model = unwrap(build_run_model_plain(trainer, vocab))
                model.load_state_dict(_strip_lora(state), strict=False)
        else:
            model = fresh
        model.save_pretrained(str(out_dir))
        _save_tokenizer(trainer, out_dir)
        trainer.log(f"exported {info.path.name} to {out_dir}")
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
