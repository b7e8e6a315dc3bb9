"""Fixtures for the model tests: tiny GPT-2 backbones built locally, small Memoria settings."""

from __future__ import annotations

import pytest
from model_helpers import SMALL_MEMORIA

from memoria_ds.model import build_model


@pytest.fixture
def backbone_config(tiny_gpt2_config):
    """The shared tiny GPT-2 config, with special tokens inside its 257-token vocabulary."""
    tiny_gpt2_config.bos_token_id = 0
    tiny_gpt2_config.eos_token_id = 0
    return tiny_gpt2_config


@pytest.fixture
def make_model(backbone_config):
    """`make_model(preset, **settings)`: a tiny model in eval mode with small Memoria settings."""

    def make(preset: str = "memoria", **settings):
        memoria = dict(SMALL_MEMORIA)
        memoria.update(settings.pop("memoria", {}))
        model = build_model(backbone_config, preset, memoria=memoria, **settings)
        return model.eval()

    return make
