"""The sorting task through the training loop: the memory carries an example's segments to
its answer in training exactly as in evaluation.

The answer of a sorting example sits in its last segment(s); the others hold no target.
Their loss used to be 0/0 = NaN, which the loop took for a diverged micro-batch: it reset
that micro-batch's memory at every segment, so the memory models trained without memory
and were evaluated with it (`xl` scored below chance). Now those segments run forward
only (writing the memory), and training sees what evaluation sees: with the weights held
still (a learning rate of 1e-12) and no dropout, the mean training loss over one epoch
equals the evaluation NLL on the same examples.
"""

from __future__ import annotations

import json

import pytest

from memoria_ds.train.config import RunConfig
from memoria_ds.train.distributed import init_distributed
from memoria_ds.train.loop import train as train_run
from memoria_ds.train.setup import setup
from memoria_ds.train.parse import load

SETTINGS = ("{n_layer: 2, n_embd: 32, n_head: 2, n_positions: 32, resid_pdrop: 0.0, embd_pdrop: 0.0, "
            "attn_pdrop: 0.0, memory_init: random, memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, "
            "stm_capacity: 16, search_depth: 2}}")


@pytest.mark.parametrize("preset", ["xl", "memoria", "transformer"])
def test_training_sees_the_memory_that_evaluation_sees(tmp_path, preset):
    cfg = load(RunConfig, None, [
        "engine=torch", f"model.preset={preset}", "model.from_scratch=true", f"model.settings={SETTINGS}",
        "data.corpus=sorting", "data.segment_length=16",
        "data.sorting={num_segments: 4, num_train: 32, num_validation: 8, num_test: 0}",
        "optim.micro_batch_size=8", "optim.epochs=1", "optim.lr=1e-12", "optim.warmup_ratio=0",
        "eval.split=train", "eval.protocols=[full, memoryless]", "log.every=1000", "log.progress=false", "log.tensorboard=false",
        "checkpoint.every=0", "checkpoint.export=false", f"run_dir={tmp_path / 'run'}",
    ])
    ctx, state = setup(cfg, init_distributed())
    streams = state.streams
    assert streams.scored_segments == {2, 3}, "SEP and the 20 answer symbols end a 64-token example"
    assert (ctx.total_steps, ctx.update_steps) == (16, 8), "4 batches x 4 segments; updates on 2 of 4"
    summary = train_run(ctx, state)
    ctx.lock.release()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["skipped_micro_batches"] == 0 and train[-1]["skipped_steps"] == 0
    result, bare = summary["eval"]  # the memory carried; reset before every segment (`memoryless`)
    assert result["scored_tokens"] == bare["scored_tokens"] == 32 * 20
    assert (result["protocol"]["memoryless"], bare["protocol"]["memoryless"]) == (False, True)
    gain = summary["memory_gain"]
    assert (gain["accuracy_with"], gain["accuracy_without"]) == (result["accuracy"], bare["accuracy"])
    assert gain["nats_per_token"] == bare["nll"] - result["nll"]
    (logged,) = [r for r in records if r["kind"] == "eval_memory_gain"]
    assert logged["accuracy_points"] == pytest.approx(100 * (result["accuracy"] - bare["accuracy"]))
    if preset == "transformer":
        assert gain["nats_per_token"] == 0.0, "a model without memory gains nothing"
    else:
        assert gain["nats_per_token"] != 0.0, "the memory carried through the example changes the answers' NLL"
    assert summary["final_train_loss"] == pytest.approx(result["nll"], abs=2e-5), (
        f"training saw another model than evaluation: train {summary['final_train_loss']} vs eval {result['nll']}")
