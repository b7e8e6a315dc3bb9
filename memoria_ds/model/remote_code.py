"""An exported Memoria GPT-2 (or a model of a family trained from scratch: a Memory Mosaic, a
MemSizer) that loads with `trust_remote_code=True`, no import needed first.

The export carries two one-line modules that import the installed memoria_ds, and its
config's `auto_map` names them, so

    AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)

works in a fresh process (memoria_ds must be installed: the files carry no model code of
their own). Without `trust_remote_code`, `import memoria_ds.model` first (it registers the
model type with the Auto classes). The model card says which.

The modules are named after the model type (`configuration_memoria_gpt2.py`,
`modeling_memoria_gpt2.py`; `..._memory_mosaic.py`; `..._memsizer.py`) and import the
config and model classes from where they are defined.
"""

from __future__ import annotations

from pathlib import Path


def remote_files(config) -> tuple[dict[str, str], dict[str, str]]:
    """(file name -> its one line, `auto_map`) of a model of this config: a `MemoriaGPT2Config` (or a
    family's subclass) for `AutoModelForCausalLM`, a Memoria encoder's for `AutoModelForSequenceClassification`."""
    from .encoder.config import EncoderMemoryFields
    from .encoder.modeling import MODEL_FOR_CONFIG
    from .families import family_of_config
    from .modeling import MemoriaGPT2LMHeadModel

    config_class = type(config)
    if isinstance(config, EncoderMemoryFields):
        model_class, auto = MODEL_FOR_CONFIG[config_class], "AutoModelForSequenceClassification"
    else:
        family = family_of_config(config)
        model_class = family.model_class if family is not None else MemoriaGPT2LMHeadModel
        auto = "AutoModelForCausalLM"
    name = config_class.model_type
    files = {f"configuration_{name}.py": _import_line(config_class), f"modeling_{name}.py": _import_line(model_class)}
    auto_map = {"AutoConfig": f"configuration_{name}.{config_class.__name__}", auto: f"modeling_{name}.{model_class.__name__}"}
    return files, auto_map


def _import_line(cls: type) -> str:
    return f"from {cls.__module__} import {cls.__name__}  # noqa: F401\n"


def add_remote_code(model, out_dir: str | Path) -> bool:
    """Set `auto_map` on a Memoria GPT-2's (or a Memory Mosaic's, a MemSizer's) config (call before
    `save_pretrained`) and write the two modules into `out_dir`; a Memoria encoder's (BERT, RoBERTa:
    `AutoModelForSequenceClassification`) the same way. Returns False (and does nothing) for
    another model type."""
    from .config import MemoriaGPT2Config
    from .encoder.config import EncoderMemoryFields

    if not isinstance(model.config, (MemoriaGPT2Config, EncoderMemoryFields)):
        return False
    files, auto_map = remote_files(model.config)
    model.config.auto_map = dict(auto_map)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return True
