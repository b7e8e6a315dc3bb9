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


def add_encoder_remote_code(model, out_dir: str | Path) -> bool:
    """`remote_code.add_remote_code` for a Memoria encoder only: False (and nothing done) for another model."""
    from ..remote_code import add_remote_code

    return isinstance(model.config, EncoderMemoryFields) and add_remote_code(model, out_dir)


__all__ = ["add_encoder_remote_code"]
