"""Back-propagation through several segments (`optim.bptt_segments`) and its memory replay variant
(`optim.bptt_recompute`): the recomputed segments give the plain BPTT's gradients; through the real
launcher, a span of 2 segments per step consumes 2 segments of every stream, resumes bit for bit on
2 ranks and across a world-size change, trains Memformer's writer (which 1 segment per step never
reaches), and the recompute trains as the plain span does, also under ZeRO-3 in bf16 on 2 ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from memoria_ds.model import build_model
from memoria_ds.safe_io import load_tree
from memoria_ds.train.loop import _forward

from .launch_util import ROOT, check, kill_and_resume, metrics, run_training

MEMFORMER = ("model.preset=memformer",
             "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, "
             "embd_pdrop: 0.0, attn_pdrop: 0.0, memory_init: random, memory_settings: {num_slots: 6}}")


@pytest.mark.parametrize("span", [2, 3])
def test_memory_replay_gives_the_plain_bptt_gradients(tiny_gpt2_config, span):
    torch.manual_seed(0)
    model = build_model(tiny_gpt2_config, "memformer", memory_settings={"num_slots": 4}, memory_init="random").train()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 257, (2, 10), generator=gen) for _ in range(span)]
    reset = torch.zeros(2, dtype=torch.bool)

    def gradients(recompute):
        model.zero_grad()
        memory, losses = None, []
        for k, x in enumerate(xs):
            out = _forward(model, SimpleNamespace(input_ids=x, attention_mask=None), memory,
                           reset | torch.tensor([False, k == span - 1]), x, recompute)
            memory = out.memory
            losses.append(out.loss)
        torch.stack(losses).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, replayed = gradients(False), gradients(True)
    assert plain.keys() == replayed.keys()
    assert float(plain["memory_net.write_query.weight"].abs().sum()) > 0  # the writer is reached
    for name in plain:
        torch.testing.assert_close(replayed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def _shard(run, step, rank):
    return load_tree(run / "checkpoints" / f"step_{step:08d}" / f"rank_{rank:05d}.safetensors")


@pytest.mark.slow
def test_two_segments_per_step_resume_bit_for_bit_on_two_ranks(tmp_path):
    whole, killed = kill_and_resume(tmp_path, *MEMFORMER, "optim.bptt_segments=2", ranks=2)
    for rank in (0, 1):
        a, b = _shard(whole, 4, rank), _shard(killed, 4, rank)
        assert a["streams"]["step"] == b["streams"]["step"] == 8, "4 steps of 2 segments"
        for slot, (ma, mb) in enumerate(zip(a["memory"], b["memory"])):
            assert ma["kind"] == "memformer"
            assert torch.equal(ma["slots"], mb["slots"]), (rank, slot)


def _writer(run):
    from transformers import AutoModelForCausalLM

    import memoria_ds.model  # noqa: F401

    net = AutoModelForCausalLM.from_pretrained(run / "export").memory_net
    return net.write_query.weight.detach(), net.read_out[0].weight.detach()


def test_only_a_span_of_segments_trains_the_writer(tmp_path):
    common = (*MEMFORMER, "engine=torch", "checkpoint.export=true", "eval.at_end=false", "checkpoint.every=0")
    runs = {}
    for name, extra in {"k1_1": ("optim.max_steps=1",), "k1_2": ("optim.max_steps=2",),
                        "k2_2": ("optim.max_steps=2", "optim.bptt_segments=2")}.items():
        proc = check(run_training(tmp_path / name, *common, *extra, launcher="python"))
        assert ("its write gets no gradient in this run" in proc.stdout) == name.startswith("k1"), proc.stdout[-2000:]
        runs[name] = _writer(tmp_path / name)
    (w1, r1), (w2, r2), (w22, _) = runs["k1_1"], runs["k1_2"], runs["k2_2"]
    assert not torch.equal(r1, r2), "the reader learns with one segment per step"
    assert torch.equal(w1, w2), "one segment per step: no loss reaches the write"
    assert not torch.equal(w22, w2), "two segments per step: the second's loss trains the writer"


@pytest.mark.slow
def test_memory_replay_trains_as_the_plain_span(tmp_path):
    common = (*MEMFORMER, "optim.bptt_segments=2", "optim.max_steps=3", "eval.at_end=false", "checkpoint.every=0")
    check(run_training(tmp_path / "plain", *common))
    check(run_training(tmp_path / "replay", *common, "optim.bptt_recompute=true"))
    a = [r["loss"] for r in metrics(tmp_path / "plain")]
    b = [r["loss"] for r in metrics(tmp_path / "replay")]
    assert len(a) == len(b) == 3 and a[0] == b[0]
    assert b == pytest.approx(a, rel=1e-5)


@pytest.mark.slow
def test_a_world_size_change_continues_the_same_span_training(tmp_path):
    """2 ranks for 2 steps of 2 segments, then 1 rank (micro 2 x accum 2): the slots re-shard by
    stream and step 3 matches the uninterrupted 2-rank run to reduction-order rounding."""
    from memoria_ds.train.faults import EXIT_CODE

    common = (*MEMFORMER, "optim.bptt_segments=2", "optim.max_steps=3", "eval.at_end=false")
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    check(run_training(whole, *common, "checkpoint.every=1", ranks=2))
    proc = run_training(moved, *common, "checkpoint.every=2", ranks=2, fault="kill_after_step:2")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(moved, *common, "checkpoint.every=1", "optim.grad_accum=2", "checkpoint.resume=auto", ranks=1))
    a = {r["step"]: r["loss"] for r in metrics(whole)}
    b = {r["step"]: r["loss"] for r in metrics(moved)}
    assert a[1] == b[1] and a[2] == b[2]
    assert abs(a[3] - b[3]) < 1e-4 * abs(a[3]), f"step 3 after 2 -> 1: {b[3]} vs uninterrupted {a[3]}"
    assert _shard(moved, 3, 0)["streams"]["step"] == 6


@pytest.mark.slow
def test_a_non_finite_loss_in_a_span_skips_that_step_only(tmp_path):
    """`nan_policy=skip` with 2 segments per step: the span's backward is NaN, the engine skips that
    update, the slots of its rows start fresh, and the next step trains again."""
    run = tmp_path / "run"
    check(run_training(run, *MEMFORMER, "optim.bptt_segments=2", "optim.nan_policy=skip", "optim.max_steps=3",
                       "engine=torch", "eval.at_end=false", "checkpoint.every=0", fault="nan_loss:2",
                       launcher="python"))
    train = {r["step"]: r for r in metrics(run)}
    assert (train[2]["skipped_micro_batches"], train[2]["skipped_steps"]) == (1, 1)
    assert (train[3]["skipped_micro_batches"], train[3]["skipped_steps"]) == (0, 0)
    assert "grad_norm" not in train[2] and train[3]["grad_norm"] == train[3]["grad_norm"]
    assert train[3]["loss"] == train[3]["loss"]


def test_a_replayed_span_trains_the_writer_under_zero3_in_bf16(tmp_path):
    """ZeRO-3 partitions the writer's weights, bf16 runs the span, and the replay recomputes each segment
    under the engine's gathered parameters: the writer (reached only through the span) still trains, and
    the slots checkpointed per stream are fp32 and finite."""
    common = (*MEMFORMER, "optim.bptt_segments=2", "optim.bptt_recompute=true", "optim.precision=bf16",
              f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "checkpoint.export=true",
              "checkpoint.every=2", "eval.at_end=false")
    check(run_training(tmp_path / "one", *common, "optim.max_steps=1", ranks=2))
    check(run_training(tmp_path / "two", *common, "optim.max_steps=2", ranks=2))
    (w1, r1), (w2, r2) = _writer(tmp_path / "one"), _writer(tmp_path / "two")
    assert not torch.equal(w1, w2), "the second step's span trains the writer under ZeRO-3"
    assert not torch.equal(r1, r2)
    losses = [r["loss"] for r in metrics(tmp_path / "two")]
    assert len(losses) == 2 and all(x == x for x in losses)
    for rank in (0, 1):
        shard = _shard(tmp_path / "two", 2, rank)
        assert shard["streams"]["step"] == 4, "2 steps of 2 segments"
        for state in shard["memory"]:
            assert state["slots"].dtype == torch.float32 and bool(torch.isfinite(state["slots"]).all())
