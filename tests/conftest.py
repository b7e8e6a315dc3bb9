"""Shared fixtures: deterministic seeding, a tiny GPT-2 config built locally, GPU marker."""

from __future__ import annotations

import os
import random

import pytest
import torch

# DeepSpeed picks its CPU accelerator by itself with a warning; say it outright where no GPU is.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tiny models: one thread is faster and steadier than two (on a shared 2-core machine a
# tiny evaluation took 9.9 s with 2 threads, 0.27 s with 1). Jobs the tests launch set
# OMP_NUM_THREADS=1 themselves.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same RNG state, and torch uses few threads (CI has 2 cores)."""
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # numpy is a dependency, but the seed is not worth a failure
        pass


_LINEAR = torch.nn.functional.linear


@pytest.fixture(autouse=True, scope="module")
def _torch_linear_restored():
    """`torch.nn.functional.linear` as torch has it, after every test file. A ZeRO-3 engine made in a
    test's own process replaces it for the rest of that process (DeepSpeed's memory-efficient
    linear, `partition_parameters._enable_mem_efficient_linear`: "This will persist unless manually
    reset"), and every later `nn.Linear` there dispatched `mm` + `add_` instead of `addmm`: on a
    pytest-xdist worker that ran tests/train/test_ds_configs_init.py first, the recorded operation
    counts rose (2026-11-29). Within a file it is left as DeepSpeed set it (a module's engine may
    span its tests)."""
    yield
    torch.nn.functional.linear = _LINEAR


@pytest.fixture
def tiny_gpt2_config():
    """A 2-layer, 64-wide GPT-2 config built locally (never downloaded)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=257, n_positions=256, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
