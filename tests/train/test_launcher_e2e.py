"""End to end with the real `deepspeed` launcher and real DeepSpeed on CPU (gloo).

Each job trains a tiny Memoria GPT-2 on the bundled book for a few steps. What is checked:
the files a run leaves, exact resume after a kill, the atomic-save guarantee, the NaN
policies, clear errors for bad configuration and bad checkpoints.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from memoria_ds.train.checkpoints import find_latest, validate
from memoria_ds.train.faults import EXIT_CODE

from memoria_ds.safe_io import load_tree

from .launch_util import ROOT, check, losses_by_step, metrics, run_training


def _shard_tensors(path):
    shard = load_tree(path)
    out = {}
    for slot, sd in enumerate(shard["memory"]):
        for key, value in (sd or {}).items():
            if isinstance(value, dict):
                for k2, v2 in value.items():
                    if isinstance(v2, torch.Tensor):
                        out[f"{slot}.{key}.{k2}"] = v2
            elif isinstance(value, torch.Tensor):
                out[f"{slot}.{key}"] = value
    return out


def test_single_rank_run_leaves_a_complete_run_directory(tmp_path):
    run = tmp_path / "run"
    proc = check(run_training(run, "checkpoint.export=true", "eval.protocols=[full, paper]", "eval.trace=true"))
    for name in ("config.yaml", "ds_config.json", "metrics.jsonl", "summary.json"):
        assert (run / name).is_file(), name
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 and ds["zero_optimization"]["stage"] == 2
    train = metrics(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 and r["tok/s"] > 0 for r in train)
    assert "memory/ltm" in train[-1] and train[-1]["memory/stm"] > 0, "memory statistics are logged"
    evals = {r["kind"] for r in metrics(run, "eval_full") + metrics(run, "eval_paper")}
    assert evals == {"eval_full", "eval_paper"}
    # keep_last=2: checkpoints at steps 3 and 6, both complete
    assert [validate(p).step for p in sorted((run / "checkpoints").glob("step_*"))] == [3, 6]
    # the final evaluation's memory trace and state, for launch/analyze.py
    trace = (run / "eval" / "trace_paper.jsonl").read_text().splitlines()
    assert len(trace) == 3 and "memory/stm" in json.loads(trace[-1])
    assert (run / "eval" / "memory_full.safetensors").is_file() and (run / "eval" / "memory_paper.safetensors").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert {e["protocol"]["name"] for e in summary["eval"]} == {"full", "paper"}
    assert "done: 6 steps" in proc.stdout and "eval [paper] validation: ppl" in proc.stdout

    # the export loads with the Auto classes and holds the trained (fp32 consolidated) weights
    from transformers import AutoModelForCausalLM

    import memoria_ds.model  # noqa: F401  (registers the model type)
    from memoria_ds.train.export import consolidated_state_dict

    assert (run / "export" / "model.safetensors").is_file()
    assert not [p for p in (run / "export").rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    model = AutoModelForCausalLM.from_pretrained(run / "export")
    # the export (from the live fp32 masters) equals DeepSpeed's consolidation of the final checkpoint
    saved = consolidated_state_dict(run / "checkpoints" / "step_00000006", "deepspeed")
    live = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(live[name], tensor), name
    ids = torch.randint(0, 50257, (1, 16))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_kill_then_resume_equals_uninterrupted(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole))
    proc = run_training(killed, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    assert find_latest(killed / "checkpoints")[0].step == 3
    check(run_training(killed, "checkpoint.resume=auto"))
    a, b = losses_by_step(whole), losses_by_step(killed)
    assert set(b) == {1, 2, 3, 4, 5, 6}
    steps = [r["step"] for r in metrics(killed)]
    assert steps == [1, 2, 3, 4, 5, 6], "step 4 (logged, then killed before its checkpoint) is recorded once"
    for step in (4, 5, 6):  # steps run after the resume from step 3
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    # the memory at the end is bit-identical too
    ta = _shard_tensors(whole / "checkpoints" / "step_00000006" / "rank_00000.safetensors")
    tb = _shard_tensors(killed / "checkpoints" / "step_00000006" / "rank_00000.safetensors")
    assert ta.keys() == tb.keys() and len(ta) > 0
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.mark.slow
def test_a_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_training(run, fault="kill_during_save:6")
    assert proc.returncode == EXIT_CODE
    root = run / "checkpoints"
    assert (root / ".staging-step_00000006").is_dir(), "the half-written checkpoint is left in staging"
    assert not (root / "step_00000006").exists()
    info, _ = find_latest(root)
    assert info.step == 3, "the last good checkpoint is still the one picked"
    proc = check(run_training(run, "checkpoint.resume=auto"))
    assert validate(root / "step_00000006").step == 6
    assert not list(root.glob(".staging-*")), "stale staging folders are cleaned up"
    assert "resume" in proc.stdout + proc.stderr


def _weights(run, step: int, engine: str = "deepspeed") -> dict:
    from memoria_ds.train.export import consolidated_state_dict

    return consolidated_state_dict(run / "checkpoints" / f"step_{step:08d}", engine)


@pytest.mark.parametrize("ds,precision,engine", [
    ("cpu.json", "fp32", "deepspeed"), pytest.param("cpu.json", "bf16", "deepspeed", marks=pytest.mark.slow),
    ("cpu_zero3.json", "bf16", "deepspeed"),
    pytest.param("cpu.json", "fp32", "torch", marks=pytest.mark.slow), ("cpu.json", "bf16", "torch"),  # torch bf16: autocast
])
def test_nan_skip_policy_skips_exactly_that_step(tmp_path, ds, precision, engine):
    """A NaN loss at step 2: that update is not applied (the weights saved at steps 1 and 2 are
    equal), training goes on at step 3, and no NaN reaches the log. DeepSpeed runs in bf16 too,
    with the key its bf16 optimizer reads (`bf16.check_grad_overflow`)."""
    run = tmp_path / "run"
    check(run_training(run, "optim.nan_policy=skip", "checkpoint.every=1", "checkpoint.keep_last=3",
                       "optim.max_steps=3", f"optim.precision={precision}", f"deepspeed={ROOT / 'ds_configs' / ds}",
                       f"engine={engine}", fault="nan_loss:2", launcher="deepspeed" if engine == "deepspeed" else "python"))
    train = {r["step"]: r for r in metrics(run)}
    assert (train[2]["skipped_micro_batches"], train[2]["skipped_steps"]) == (1, 1)
    assert (train[3]["skipped_micro_batches"], train[3]["skipped_steps"]) == (0, 0)
    assert train[2]["loss"] is None and train[2]["ppl"] is None, "nothing was scored in step 2"
    assert "grad_norm" not in train[2], "a skipped step has no gradient norm (not the previous step's)"
    assert all(math.isfinite(train[s]["grad_norm"]) for s in (1, 3)), train
    assert all(isinstance(train[s]["loss"], float) and math.isfinite(train[s]["loss"]) for s in (1, 3)), train
    w1, w2, w3 = (_weights(run, s, engine) for s in (1, 2, 3))
    assert w1.keys() == w2.keys() and len(w1) > 0
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "step 2's update was skipped"
    assert any(not torch.equal(w2[k], w3[k]) for k in w2), "step 3 trained again"
    if engine == "deepspeed":
        written = json.loads((run / "ds_config.json").read_text())
        assert written["bf16"] == ({"enabled": True, "check_grad_overflow": True} if precision == "bf16"
                                   else {"enabled": False})


def test_nan_stop_policy_stops_before_the_next_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_training(run, "optim.nan_policy=stop", "checkpoint.every=1", "optim.max_steps=3",
                        "optim.precision=bf16", "log.every=10", fault="nan_loss:2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "non-finite loss at step 2 (micro-batch 0, rank 0)" in proc.stderr
    assert "nan_policy=stop" in proc.stderr
    assert find_latest(run / "checkpoints")[0].step == 1, "the last good checkpoint stays"


@pytest.mark.slow
def test_resume_refuses_an_incompatible_or_corrupt_checkpoint(tmp_path):
    run = tmp_path / "run"
    check(run_training(run))
    proc = run_training(run, "model.preset=xl")
    assert proc.returncode == 2 and "different `model` configuration" in proc.stderr

    # corrupt the newest shard: `auto` falls back to the previous checkpoint and says so ...
    shard = run / "checkpoints" / "step_00000006" / "rank_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    proc = check(run_training(run, "checkpoint.resume=auto"))
    assert "does not match its checksum" in proc.stdout + proc.stderr
    assert "step_00000003" in proc.stdout + proc.stderr
    # ... while naming it explicitly is an error
    shard.write_bytes(shard.read_bytes()[:-10] + b"9876543210")
    proc = run_training(run, f"checkpoint.resume={run / 'checkpoints' / 'step_00000006'}")
    assert proc.returncode == 2 and "does not match its checksum" in proc.stderr
    # no usable checkpoint at all: `auto` refuses instead of restarting over them
    for step in (6, 3):
        shard = run / "checkpoints" / f"step_{step:08d}" / "rank_00000.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    lines = len((run / "metrics.jsonl").read_text().splitlines())
    proc = run_training(run, "checkpoint.resume=auto", launcher="python")
    assert proc.returncode == 2 and "holds checkpoints but none is usable" in proc.stderr, proc.stderr[-2000:]
    assert "step_00000006" in proc.stderr and "step_00000003" in proc.stderr and "move" in proc.stderr
    assert {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == before
    assert len((run / "metrics.jsonl").read_text().splitlines()) == lines, "nothing was trained"


def test_configuration_mistakes_stop_before_training(tmp_path):
    proc = run_training(tmp_path / "a", "optim.lrr=1", launcher="python")
    assert proc.returncode == 2 and "unknown setting(s) ['optim.lrr']" in proc.stderr
    bad_ds = tmp_path / "bad.json"
    bad_ds.write_text(json.dumps({"train_batch_size": 3, "zero_optimization": {"stage": 2}}))
    proc = run_training(tmp_path / "b", f"deepspeed={bad_ds}")
    assert proc.returncode == 2
    assert "train_batch_size (3) != micro_batch (2) * grad_accum (1) * world_size (1) = 2" in proc.stderr
    proc = run_training(tmp_path / "c", "data.corpus=files", f"data.files={{train: [{tmp_path / 'missing.txt'}]}}",
                        "eval.at_end=false")
    assert proc.returncode == 2 and f"data.files.train: '{tmp_path / 'missing.txt'}' matches no file" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "c").exists()
    # a fresh start over a run directory with checkpoints is refused rather than overwriting them
    # (that run: a memory delay longer than the run is capped at half of it, with one line)
    proc = check(run_training(tmp_path / "d", "optim.max_steps=3", "optim.memory_delay_steps=1000000"))
    note = "note: optim.memory_delay_steps (1000000) capped at 1, at most half of this run's 3 optimizer updates"
    assert proc.stdout.count(note) == 1, proc.stdout[-3000:]
    proc = run_training(tmp_path / "d", "checkpoint.resume=null")
    assert proc.returncode == 2 and "already has checkpoints" in proc.stderr


def test_plain_python_with_and_without_deepspeed(tmp_path):
    for engine in ("torch", "deepspeed"):
        run = tmp_path / engine
        check(run_training(run, f"engine={engine}", "optim.max_steps=3", launcher="python"))
        assert [r["step"] for r in metrics(run)] == [1, 2, 3]
        assert validate(run / "checkpoints" / "step_00000003").step == 3


def test_a_finished_run_rerun_changes_nothing(tmp_path):
    """Resuming a run that already reached its last step trains, evaluates and records nothing
    again: the summary stays valid JSON with the real final loss, the eval is not duplicated."""
    run = tmp_path / "run"
    check(run_training(run))
    summary = (run / "summary.json").read_text()
    records = (run / "metrics.jsonl").read_text()
    proc = check(run_training(run, "checkpoint.resume=auto"))
    assert "already reached step 6" in proc.stdout, proc.stdout[-2000:]
    assert (run / "summary.json").read_text() == summary and math.isfinite(json.loads(summary)["final_train_loss"])
    assert (run / "metrics.jsonl").read_text() == records
    # asking for fewer steps than the checkpoint holds is a mistake, said as one: exit 2, nothing rewritten
    config = (run / "config.yaml").read_text()
    proc = run_training(run, "checkpoint.resume=auto", "optim.max_steps=4", launcher="python")
    assert proc.returncode == 2 and "is at step 6, past this run's last step 4" in proc.stderr, proc.stderr[-2000:]
    assert "set optim.max_steps above 6" in proc.stderr and "Traceback" not in proc.stderr
    assert (run / "config.yaml").read_text() == config and (run / "metrics.jsonl").read_text() == records


@pytest.mark.slow
def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_a_rerun(tmp_path):
    """Issue 47 item 5: a run that checkpointed its last step and stopped before its final
    evaluation (killed here; a failed evaluation or export alike) is not "done": the rerun trains
    nothing, evaluates the final checkpoint and writes the summary; a third run then has nothing to do."""
    run = tmp_path / "run"
    proc = run_training(run, "eval.protocols=[full,memoryless]", fault="kill_after_step:6")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    assert find_latest(run / "checkpoints")[0].step == 6 and not (run / "summary.json").exists()
    train_records = metrics(run)
    proc = check(run_training(run, "eval.protocols=[full,memoryless]"))
    assert "has no summary.json" in proc.stdout and "evaluation, summary" in proc.stdout, proc.stdout[-2000:]
    assert metrics(run) == train_records  # nothing trained again
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_train_loss"] == train_records[-1]["loss"]
    assert [r["protocol"]["name"] for r in summary["eval"]] == ["full", "memoryless"]
    assert [r["step"] for r in metrics(run, "eval_full")] == [6] and summary["memory_gain"] is not None
    proc = check(run_training(run, "eval.protocols=[full,memoryless]"))
    assert "nothing to do" in proc.stdout and json.loads((run / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_a_rollback_sets_the_abandoned_checkpoints_aside(tmp_path):
    """Resuming from an older checkpoint starts a new timeline: the newer checkpoints of the old
    one are moved to checkpoints/abandoned/ (said in the log), so pruning keeps the checkpoint
    resumed from and a crash followed by `--resume auto` continues the new timeline."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    check(run_training(run, "checkpoint.every=1", "checkpoint.keep_last=3"))
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005", "step_00000006"]
    old6 = (ckpts / "step_00000006" / "rank_00000.safetensors").read_bytes()
    proc = run_training(run, "checkpoint.every=1", "checkpoint.keep_last=3",
                        f"checkpoint.resume={ckpts / 'step_00000004'}", fault="kill_after_step:5")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    assert "step_00000005, step_00000006 of the abandoned timeline were set aside" in proc.stdout, proc.stdout[-3000:]
    abandoned = list((ckpts / "abandoned").glob("*/after_step_00000004"))
    assert len(abandoned) == 1
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["step_00000005", "step_00000006"]
    assert (abandoned[0] / "step_00000006" / "rank_00000.safetensors").read_bytes() == old6  # moved, untouched
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert find_latest(ckpts)[0].step == 5  # the new timeline's, not the abandoned step 6
    proc = check(run_training(run, "checkpoint.every=1", "checkpoint.keep_last=3", "checkpoint.resume=auto"))
    assert '"step": 5' in proc.stdout and "set aside" not in proc.stdout
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005", "step_00000006"]
    assert (abandoned[0] / "step_00000006" / "rank_00000.safetensors").read_bytes() == old6  # still set aside


@pytest.mark.slow
@pytest.mark.parametrize("ds", ["cpu.json", "cpu_zero3.json"])
def test_a_changed_learning_rate_is_applied_on_resume(tmp_path, ds):
    """Resuming with another `optim.lr` (the NaN-stop advice) changes the peak of the restored
    schedule from the next step on, and says so; it is not overwritten by the saved value."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cfg = f"deepspeed={ROOT / 'ds_configs' / ds}"
    check(run_training(whole, cfg))
    proc = run_training(resumed, cfg, fault="kill_after_step:4")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    proc = check(run_training(resumed, cfg, "optim.lr=2e-3", "checkpoint.resume=auto"))
    assert "optim.lr changed since the checkpoint (0.001 -> 0.002): applied from step 4" in proc.stdout, proc.stdout
    a = {r["step"]: r["lr"] for r in metrics(whole)}
    b = {r["step"]: r["lr"] for r in metrics(resumed)}
    assert all(b[s] == a[s] for s in (1, 2, 3)) and all(abs(b[s] - 2 * a[s]) < 1e-12 for s in (4, 5, 6)), (a, b)
    losses_a, losses_b = losses_by_step(whole), losses_by_step(resumed)
    assert losses_b[4] == losses_a[4] and losses_b[5] != losses_a[5]  # step 4 read the weights of step 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["optim_states", "model_states"])
def test_a_corrupt_engine_file_is_skipped_like_a_corrupt_shard(tmp_path, kind):
    """64 bytes flipped in the middle of DeepSpeed's engine state (same size): `auto` skips that
    checkpoint with the file named and resumes from the previous one, instead of loading
    altered weights or failing in the unpickler."""
    run = tmp_path / "run"
    check(run_training(run))
    target = next((run / "checkpoints" / "step_00000006" / "engine").rglob(f"*{kind}.pt"))
    data = bytearray(target.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    target.write_bytes(bytes(data))
    proc = check(run_training(run, "optim.max_steps=7", "checkpoint.resume=auto"))
    out = proc.stdout + proc.stderr
    assert "does not match its checksum" in out and target.name in out, out[-3000:]
    assert '"step": 3' in proc.stdout


@pytest.mark.slow
def test_a_full_disk_during_a_save_says_where_and_cleans_up(tmp_path):
    """A save that fails like a full disk stops the run (exit 1) with one line naming the
    checkpoint, the path and the reason, removes its partial files, and keeps the earlier
    checkpoint, from which the run resumes."""
    run = tmp_path / "run"
    proc = run_training(run, fault="disk_full_during_save:6")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "could not write checkpoint step_00000006" in lines[0], proc.stderr[-3000:]
    assert "No space left on device" in lines[0] and "step_00000003" in lines[0] and "Traceback" not in proc.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000003"], "no staging folder is left behind"
    check(run_training(run, "checkpoint.resume=auto"))
    assert find_latest(ckpts)[0].step == 6


@pytest.mark.slow
def test_the_memory_modules_own_groups_run_and_resume_only_with_their_groups(tmp_path):
    """Real DeepSpeed: optim.memory_lr_scale trains and resumes with other memory settings that
    keep the memory modules' own optimizer groups (here a delay); a resume that would fold them
    back into the backbone's groups is refused before any work."""
    run = tmp_path / "run"
    check(run_training(run, "optim.memory_lr_scale=0.1", "eval.at_end=false", "optim.max_steps=4",
                       "checkpoint.every=2"))
    proc = run_training(run, "optim.max_steps=6", "eval.at_end=false", "checkpoint.resume=auto")
    assert proc.returncode == 2 and "optim.memory_lr_scale=0.1" in proc.stderr, proc.stderr[-3000:]
    assert "resume with a memory_lr_scale other than 1 or a memory_delay_steps above 0" in proc.stderr
    check(run_training(run, "optim.memory_delay_steps=5", "optim.max_steps=6", "eval.at_end=false",
                       "checkpoint.resume=auto"))
    assert max(losses_by_step(run)) == 6


@pytest.mark.slow
def test_a_compiled_model_trains_as_the_eager_one_and_resumes_eagerly(tmp_path):
    """`model.compile`: the whole model (memory engine included) as compiled graphs under the
    real launcher and ZeRO-2; without dropout its losses are the eager run's. Killed, it
    resumes without compiling (the checkpoint is the eager model's). ZeRO-3 (module hooks
    inside the forward) is refused before any work."""
    no_dropout = "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, resid_pdrop: 0.0, " \
                 "embd_pdrop: 0.0, attn_pdrop: 0.0, memoria: {num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, " \
                 "stm_capacity: 16, search_depth: 2}}"
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    check(run_training(eager, no_dropout))
    proc = run_training(compiled, no_dropout, "model.compile=default", fault="kill_after_step:4", timeout=900)
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    assert yaml.safe_load((compiled / "config.yaml").read_text())["model"]["compile"] == "default"
    assert find_latest(compiled / "checkpoints")[0].step == 3
    proc = check(run_training(compiled, no_dropout, "checkpoint.resume=auto"))  # eagerly, from step 3
    a, b = losses_by_step(eager), losses_by_step(compiled)
    assert list(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:  # 1-3 compiled, 4-6 eager after the resume
        assert math.isclose(a[step], b[step], rel_tol=1e-4), (step, a[step], b[step])
    assert "done: 6 steps" in proc.stdout

    zero3 = ROOT / "ds_configs" / "cpu_zero3.json"
    proc = run_training(tmp_path / "z3", "model.compile=default", f"deepspeed={zero3}")
    assert proc.returncode == 2 and "`model.compile` is not supported under ZeRO-3" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "z3").exists()
