"""The infinity-former through the real `deepspeed` launcher on 2 CPU ranks (gloo): a killed
run resumes bit-identically (sticky memories draw from the saved random state), and its
checkpoint holds every stream's continuous memory."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.safe_io import load_tree

from .launch_util import kill_and_resume

SETTINGS = ("model.preset=infinity",
            "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
            "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_settings: {num_basis: 8}}")


@pytest.mark.slow
def test_two_ranks_resume_bit_identically(tmp_path):
    whole, _ = kill_and_resume(tmp_path, *SETTINGS)
    for rank in (0, 1):
        memory = load_tree(whole / "checkpoints" / "step_00000004" / f"rank_{rank:05d}.safetensors")["memory"][0]
        assert memory["kind"] == "infinity"
        assert memory["coefficients"].shape == (2, 2, 8, 32) and bool(memory["has_coefficients"].all())
        assert memory["hidden"].shape == (2, 2, 16, 32) and bool(memory["hidden_mask"].all())
        assert torch.isfinite(memory["coefficients"]).all() and memory["coefficients"].abs().sum() > 0
