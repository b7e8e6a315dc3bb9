"""An exported Memoria encoder that loads with `trust_remote_code=True`, no import needed first.

The route of the causal models (`model/remote_code.py`): the export carries two one-line modules
that import the installed memoria_ds, and its config's `auto_map` names them, so

    AutoModelForSequenceClassification.from_pretrained(export_dir, trust_remote_code=True)

works in a fresh process (memoria_ds must be installed: the files carry no model code of their
own). Without `trust_remote_code`, `import memoria_ds.model.encoder` first (it registers the model
types with the Auto classes).
"""

from __future__ import annotations

from pathlib import Path

from .config import EncoderMemoryFields
from .modeling import MODEL_FOR_CONFIG


def remote_files(config: EncoderMemoryFields) -> tuple[dict[str, str], dict[str, str]]:
    """(file name -> its one line, `auto_map`) of a Memoria encoder with this config."""
    config_class, model_class = type(config), MODEL_FOR_CONFIG[type(config)]
    name = config_class.model_type
    files = {f"configuration_{name}.py": _import_line(config_class), f"modeling_{name}.py": _import_line(model_class)}
    auto_map = {"AutoConfig": f"configuration_{name}.{config_class.__name__}",
                "AutoModelForSequenceClassification": f"modeling_{name}.{model_class.__name__}"}
    return files, auto_map


def _import_line(cls: type) -> str:
    return f"from {cls.__module__} import {cls.__name__}  # noqa: F401\n"


def add_encoder_remote_code(model, out_dir: str | Path) -> bool:
    """Set `auto_map` on a Memoria encoder's config (call before `save_pretrained`) and write the two
    modules into `out_dir`. Returns False (and does nothing) for another model."""
    if not isinstance(model.config, EncoderMemoryFields):
        return False
    files, auto_map = remote_files(model.config)
    model.config.auto_map = dict(auto_map)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return True


__all__ = ["add_encoder_remote_code", "remote_files"]
