"""The Compressive Transformer through the real `deepspeed` launcher on 2 CPU ranks (gloo):
a killed run resumes bit-identically, and its checkpoint holds every stream's memory and
compressed memory; a world-size change (2 -> 1) continues the same optimisation."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.safe_io import load_tree

from .launch_util import kill_and_resume, move_two_ranks_to_one

SETTINGS = ("model.preset=compressive",
            "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
            "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_settings: {compression_rate: 2}}")


@pytest.mark.slow
def test_two_ranks_resume_bit_identically(tmp_path):
    whole, _ = kill_and_resume(tmp_path, *SETTINGS)
    # the checkpoint holds each rank's streams: memory and compressed memory, with tokens in both
    for rank in (0, 1):
        shard = load_tree(whole / "checkpoints" / "step_00000004" / f"rank_{rank:05d}.safetensors")
        memory = shard["memory"][0]
        assert memory["kind"] == "compressive"
        assert memory["mask"].shape == (2, 8) and bool(memory["mask"].all())  # M = 16 // 2
        assert memory["compressed_mask"].shape == (2, 8) and bool(memory["compressed_mask"].all())
        assert torch.isfinite(memory["compressed_keys"]).all() and memory["compressed_keys"].abs().sum() > 0


@pytest.mark.slow
def test_a_world_size_change_continues_the_same_optimisation(tmp_path):
    """2 ranks for 2 steps, then 1 rank (micro 2 x accum 2): step 3 matches the uninterrupted
    2-rank run to reduction-order rounding (the memory rows re-sharded by stream)."""
    move_two_ranks_to_one(tmp_path, *SETTINGS)
