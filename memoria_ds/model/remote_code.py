"""An exported Memoria GPT-2 that loads with `trust_remote_code=True`, no import needed first.

The export carries two one-line modules that import the installed memoria_ds, and its
config's `auto_map` names them, so

    AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)

works in a fresh process (memoria_ds must be installed: the files carry no model code of
their own). Without `trust_remote_code`, `import memoria_ds.model` first (it registers the
model type with the Auto classes). The model card says which.
"""

from __future__ import annotations

from pathlib import Path

FILES = {
    "configuration_memoria_gpt2.py": "from memoria_ds.model.config import MemoriaGPT2Config  # noqa: F401\n",
    "modeling_memoria_gpt2.py": "from memoria_ds.model.modeling import MemoriaGPT2LMHeadModel  # noqa: F401\n",
}
AUTO_MAP = {
    "AutoConfig": "configuration_memoria_gpt2.MemoriaGPT2Config",
    "AutoModelForCausalLM": "modeling_memoria_gpt2.MemoriaGPT2LMHeadModel",
}

# the same for a Memory Mosaic (model/mosaic/)
MOSAIC_FILES = {
    "configuration_memory_mosaic.py": "from memoria_ds.model.mosaic.config import MemoryMosaicConfig  # noqa: F401\n",
    "modeling_memory_mosaic.py": "from memoria_ds.model.mosaic.modeling import MemoryMosaicLMHeadModel  # noqa: F401\n",
}
MOSAIC_AUTO_MAP = {
    "AutoConfig": "configuration_memory_mosaic.MemoryMosaicConfig",
    "AutoModelForCausalLM": "modeling_memory_mosaic.MemoryMosaicLMHeadModel",
}


def add_remote_code(model, out_dir: str | Path) -> bool:
    """Set `auto_map` on a Memoria GPT-2's (or Memory Mosaic's) config (call before
    `save_pretrained`) and write the two modules into `out_dir`. Returns False (and does
    nothing) for another model type."""
    from .config import MemoriaGPT2Config
    from .mosaic.config import MemoryMosaicConfig

    if not isinstance(model.config, MemoriaGPT2Config):
        return False
    mosaic = isinstance(model.config, MemoryMosaicConfig)
    files, auto_map = (MOSAIC_FILES, MOSAIC_AUTO_MAP) if mosaic else (FILES, AUTO_MAP)
    model.config.auto_map = dict(auto_map)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return True
