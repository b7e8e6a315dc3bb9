"""The model a checkpoint holds, built in memory: a run without an export can still be scored.

    model = checkpoint_model(Path("runs/x/checkpoints/step_00000138"))

The checkpoint's manifest holds its run's configuration. The model is built from it on CPU as
the export builds it (`build_run_model`: a LoRA run's frozen backbone comes from the backbone),
and the checkpoint's fp32 weights are loaded into it: DeepSpeed's consolidation of the ZeRO
files, or the plain engine's safetensors (`consolidated_state_dict`; at the final step these
equal the export's weights). A LoRA run's adapters are merged. Nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .build import build_run_model
from .checkpoints import CheckpointError, CheckpointInfo, validate
from .config import RunConfig
from .export import consolidated_state_dict
from .parse import ConfigError
from .parse import validate as validate_config


def checkpoint_config(path: Path, verify: bool = True) -> tuple[CheckpointInfo, RunConfig]:
    """The checkpoint folder `path`, checked (`validate`), and the run configuration its manifest holds.

    Args:
        verify: also check every file against the manifest's checksums (`validate`'s `verify_contents`).

    Raises:
        CheckpointError: an incomplete or damaged checkpoint, or a manifest without the run's configuration.
    """
    info = validate(path, verify_contents=verify)
    try:
        return info, validate_config(RunConfig, info.manifest.get("meta", {})["config"])
    except (KeyError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path}: its manifest holds no usable run configuration ({e})") from None


def checkpoint_model(path: Path, verify: bool = True) -> nn.Module:
    """The trained model of the checkpoint folder `path`, in fp32 on CPU, in eval mode.

    Args:
        verify: check every file against the manifest's checksums, and DeepSpeed's pickles
            for what they import, first (`validate`); False when the caller just did.

    Raises:
        CheckpointError: an incomplete or damaged checkpoint, a manifest without the run's
            configuration, or weights that do not fit the model that configuration builds.
    """
    info, cfg = checkpoint_config(path, verify)
    state = consolidated_state_dict(info.path, info.manifest.get("meta", {}).get("engine", cfg.engine))
    # a from-scratch model's vocabulary came from the corpus: the saved embedding has its size
    vocab = next((t.shape[0] for name, t in state.items() if name.endswith(("wte.weight", "word_embeddings.weight"))),
                 None)
    labels = info.manifest.get("meta", {}).get("label_names")  # a classifier's classes
    model = build_run_model(cfg, vocab, labels).to("cpu")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(state))
    unknown = sorted(set(state) - set(model.state_dict()))
    if missing or unknown:
        raise CheckpointError(f"checkpoint {path}: its weights do not fit the model its configuration builds "
                              f"(missing {missing[:3]}, unknown {unknown[:3]})")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise CheckpointError(f"checkpoint {path}: its weights do not fit the model its configuration builds "
                              f"({str(e).strip().splitlines()[-1]})") from None
    if cfg.lora.enabled:
        model = model.merge_and_unload()
    return model.eval()
