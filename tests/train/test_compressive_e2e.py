"""The Compressive Transformer through the real `deepspeed` launcher on 2 CPU ranks (gloo):
a killed run resumes bit-identically, and its checkpoint holds every stream's memory and
compressed memory; a world-size change (2 -> 1) continues the same optimisation."""

from __future__ import annotations

import torch

from memoria_ds.safe_io import load_tree
from memoria_ds.train.faults import EXIT_CODE

from .launch_util import check, kill_and_resume, metrics, run_training

SETTINGS = ("model.preset=compressive",
            "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
            "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_settings: {compression_rate: 2}}")


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


def test_a_world_size_change_continues_the_same_optimisation(tmp_path):
    """2 ranks for 2 steps, then 1 rank (micro 2 x accum 2): step 3 matches the uninterrupted
    2-rank run to reduction-order rounding (the memory rows re-sharded by stream)."""
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    check(run_training(whole, *SETTINGS, "optim.max_steps=3", "checkpoint.every=1", "eval.at_end=false", ranks=2))
    proc = run_training(moved, *SETTINGS, "optim.max_steps=3", "checkpoint.every=2", "eval.at_end=false", ranks=2,
                        fault="kill_after_step:2")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(moved, *SETTINGS, "optim.max_steps=3", "checkpoint.every=1", "eval.at_end=false",
                       "optim.grad_accum=2", "checkpoint.resume=auto", ranks=1))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(moved)}
    assert a[1] == b[1] and a[2] == b[2]
    assert abs(a[3] - b[3]) < 1e-4 * abs(a[3]), f"step 3 after 2 -> 1: {b[3]} vs uninterrupted {a[3]}"
