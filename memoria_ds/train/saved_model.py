"""Checking a `save_pretrained` directory before anything loads or uploads it.

    check_saved_model(Path("runs/x/export"))   # ConfigError naming what is wrong, or None

Used by `launch/evaluate.py` (before any data work) and `launch/push.py` (before any
network): a truncated or overwritten weight file, a broken config.json or a sharded
model with a shard missing stops with one line instead of a loader's traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from .parse import ConfigError


def check_saved_model(directory: Path) -> None:
    """A save_pretrained directory that cannot load stops here, before any data work: its
    config.json must be a JSON object, and it must hold weights whose every safetensors file
    opens whole (header and data; a truncated or overwritten file is named)."""
    from safetensors import SafetensorError, safe_open

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{directory / 'config.json'} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{directory / 'config.json'} is not a JSON object")
    weights = sorted(directory.glob("*.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = {directory / f for f in json.loads(index.read_text())["weight_map"].values()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} cannot be read ({e!r})") from None
        missing = sorted(str(f.name) for f in named if not f.is_file())
        if missing:
            raise ConfigError(f"{directory} is missing the weight file(s) {missing} that {index.name} names")
    pickled = ("pytorch_model.bin", "pytorch_model.bin.index.json")
    if not weights and not any((directory / n).is_file() for n in pickled):
        raise ConfigError(f"{directory} holds no weights (no *.safetensors, no pytorch_model.bin)")
    for f in weights:
        try:
            with safe_open(f, framework="pt") as opened:
                opened.keys()
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{f} is not a complete safetensors file ({e}); export the model again") from None


__all__ = ["check_saved_model"]
