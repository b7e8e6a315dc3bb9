"""A composite memory (`model.preset=xl+memoria`: Transformer-XL's cache beside Memoria's engrams) through
the real `deepspeed` launcher on 2 CPU ranks (gloo): a killed run resumes bit-identically with both parts of
every stream's memory in its checkpoint, and a world-size change (2 -> 1) re-shards them by stream."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.safe_io import load_tree

from .launch_util import check, kill_and_resume, move_two_ranks_to_one, run_training

SETTINGS = ("model.preset=xl+memoria",
            "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
            "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_init: random, "
            "memoria: {num_wm: 4, num_stm_reminded: 2, num_ltm_reminded: 2, stm_capacity: 8}}")


def test_two_ranks_resume_bit_identically_with_both_parts_in_the_checkpoint(tmp_path):
    whole, _ = kill_and_resume(tmp_path, *SETTINGS)
    for rank in (0, 1):
        shard = load_tree(whole / "checkpoints" / "step_00000004" / f"rank_{rank:05d}.safetensors")
        memory = shard["memory"][0]
        assert memory["kind"] == "xl+memoria" and sorted(memory["parts"]) == ["memoria", "xl"]
        assert bool(memory["parts"]["xl"]["mask"].all())  # the cache holds the last segment
        assert (memory["parts"]["memoria"]["state"]["kind"] > 0).any()  # engrams alive


@pytest.mark.slow
def test_a_world_size_change_continues_the_same_optimisation(tmp_path):
    move_two_ranks_to_one(tmp_path, *SETTINGS)


@pytest.mark.slow
def test_the_run_reports_what_each_part_is_worth(tmp_path):
    import json

    run = tmp_path / "run"
    proc = run_training(run, *SETTINGS, "optim.max_steps=2", "eval.at_end=true",
                        "eval.protocols=[full,memoryless,memoryless_xl,memoryless_memoria]", ranks=2)
    check(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["memory_gain"] is not None
    parts = summary["memory_gain_parts"]
    assert sorted(parts) == ["memoria", "xl"] and all(p["part"] == k for k, p in parts.items())
    full = next(r for r in summary["eval"] if r["protocol"]["name"] == "full")
    for part, gain in parts.items():
        bare = next(r for r in summary["eval"] if r["protocol"]["name"] == f"memoryless_{part}")
        assert bare["scored_tokens"] == full["scored_tokens"]
        assert abs(gain["nats_per_token"] - (bare["nll"] - full["nll"])) < 1e-9
    assert "gain of the memory's xl" in proc.stdout + proc.stderr
