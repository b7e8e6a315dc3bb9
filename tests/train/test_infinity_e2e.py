"""The infinity-former through the real `deepspeed` launcher on 2 CPU ranks (gloo): a killed
run resumes bit-identically (sticky memories draw from the saved random state), and its
checkpoint holds every stream's continuous memory."""

from __future__ import annotations

import torch

from memoria_ds.safe_io import load_tree
from memoria_ds.train.faults import EXIT_CODE

from .launch_util import check, metrics, run_training

SETTINGS = ("model.preset=infinity",
            "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
            "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_settings: {num_basis: 8}}")


def test_two_ranks_resume_bit_identically(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *SETTINGS, "optim.max_steps=4", "checkpoint.every=2", "eval.at_end=false", ranks=2))
    proc = run_training(killed, *SETTINGS, "optim.max_steps=4", "checkpoint.every=2", "eval.at_end=false", ranks=2,
                        fault="kill_after_step:3")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *SETTINGS, "optim.max_steps=4", "checkpoint.every=2", "eval.at_end=false",
                       "checkpoint.resume=auto", ranks=2))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(killed)}
    assert a[3] == b[3] and a[4] == b[4], (a, b)
    for rank in (0, 1):
        memory = load_tree(whole / "checkpoints" / "step_00000004" / f"rank_{rank:05d}.safetensors")["memory"][0]
        assert memory["kind"] == "infinity"
        assert memory["coefficients"].shape == (2, 2, 8, 32) and bool(memory["has_coefficients"].all())
        assert memory["hidden"].shape == (2, 2, 16, 32) and bool(memory["hidden_mask"].all())
        assert torch.isfinite(memory["coefficients"]).all() and memory["coefficients"].abs().sum() > 0
