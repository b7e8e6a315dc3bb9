"""MbPA++'s training side through the real launcher (`episodic.enabled`): every document read is written
to the rank's episodic memory, a replay update follows every `replay_every` documents, and on 2 CPU ranks
a kill and resume gives the uninterrupted run's losses, evaluation, memory and replay count bit for bit
(the memory, the schedule and the draws checkpointed with the step). Settings it cannot serve are refused
before any work."""

from __future__ import annotations

import json

import pytest
import torch

from memoria_ds.episodic import EpisodicMemory
from memoria_ds.train.checkpoints import find_latest, load_shard

from .classify_util import classify_args, run_args
from .launch_util import ROOT, check, killed_and_resumed, run_training

DS = f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}"
# 2 ranks x 2 documents per step: a replay of 4 documents (2 per rank) after every 3rd step (12 documents)
EPISODIC = ["episodic.enabled=true", "episodic.replay_every=6", "episodic.replay_size=4", "data.max_segments=1",
            "optim.bptt_segments=1", "data.segment_length=24", "model.preset=backbone"]


def _run(run, tmp_path, *extra, **kw):
    if not (tmp_path / "docs").exists():
        classify_args(tmp_path, {"train": 32, "validation": 8})
    return run_training(run, *run_args(tmp_path, {"train": 32, "validation": 8}), DS, *EPISODIC,
                        "optim.max_steps=8", "checkpoint.every=4", "optim.micro_batch_size=1",
                        "optim.grad_accum=2", *extra, tiny=False, **kw)


def _shard(run, rank):
    """Rank `rank`'s episodic state in the run's newest checkpoint."""
    return load_shard(find_latest(run / "checkpoints")[0], rank)["episodic"]


def test_writes_replays_and_an_exact_resume_on_two_ranks(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    a, b = killed_and_resumed(lambda run, *extra, **kw: _run(run, tmp_path, *extra, **kw), whole, killed,
                              kill_after=6, ranks=2)
    assert set(a) == set(b) == set(range(1, 9))
    for step in (5, 6, 7, 8):  # after the resume from step 4, with the replay after step 6
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    ea = json.loads((whole / "summary.json").read_text())["eval"]
    eb = json.loads((killed / "summary.json").read_text())["eval"]
    assert [(x["accuracy"], x["nll"]) for x in ea] == [(y["accuracy"], y["nll"]) for y in eb]

    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    # 4 documents a step over both ranks; replays due after 6, 12, 18, 24, 30 documents: steps 2, 3, 5, 6, 8
    assert [train[s]["episodic/replays"] for s in range(1, 9)] == [0, 1, 2, 2, 3, 4, 4, 5]
    assert [train[s]["episodic/size"] for s in range(1, 9)] == [2 * s for s in range(1, 9)]  # rank 0's, all written
    for run in (whole, killed):  # what each rank holds at the end: its 16 documents, in reading order
        for rank in (0, 1):
            state = _shard(run, rank)
            memory = EpisodicMemory.from_state_dict(state["memory"])
            assert len(memory) == 16 and state["replays"] == 5 and state["schedule"]["seen"] == 32
    for rank in (0, 1):
        x, y = _shard(whole, rank), _shard(killed, rank)
        assert all(torch.equal(x["memory"][k], y["memory"][k]) for k in x["memory"] if torch.is_tensor(x["memory"][k]))
        assert torch.equal(x["generator"], y["generator"])


def test_the_keys_are_the_models_encoder_before_training(tmp_path):
    """The stored keys are the first-token states of the classifier's encoder as built (not as trained):
    a run with the learning rate 100 times higher stores the same keys."""
    slow, fast = tmp_path / "slow", tmp_path / "fast"
    check(_run(slow, tmp_path, "optim.max_steps=4", ranks=1))
    check(_run(fast, tmp_path, "optim.max_steps=4", "optim.lr=0.1", ranks=1))
    k1, k2 = (EpisodicMemory.from_state_dict(_shard(r, 0)["memory"]).keys for r in (slow, fast))
    assert k1.shape == (8, 32) and torch.equal(k1, k2)


@pytest.mark.parametrize("extra, message", [
    (["data.max_segments=4"], "stores each document as one example"),
    pytest.param(["episodic.replay_size=3"], "must split evenly over the 2 ranks", marks=pytest.mark.slow),
    pytest.param(["episodic.write_prob=0"], "must be in (0, 1]", marks=pytest.mark.slow),
])
def test_settings_it_cannot_serve_are_one_line_and_exit_2(tmp_path, extra, message):
    proc = _run(tmp_path / "run", tmp_path, *extra, ranks=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


@pytest.mark.slow
def test_the_adapted_reading_adapts_to_every_ranks_memory(tmp_path):
    """`eval.protocols=[full, adapted]` on 2 ranks: the adapted reading searches the whole memory (both
    ranks' 16 documents); with no adaptation step it is the plain reading exactly, with steps it is not
    the same model any more (its NLL moves)."""
    base, adapted = tmp_path / "none", tmp_path / "steps"
    common = ["eval.protocols=[full, adapted]", "optim.max_steps=8", "episodic.neighbours=4"]
    check(_run(base, tmp_path, *common, "episodic.adapt_steps=0", ranks=2))
    check(_run(adapted, tmp_path, *common, "episodic.adapt_steps=5", "episodic.adapt_lr=0.5", "checkpoint.export=true",
               ranks=2))
    for run, moved in ((base, False), (adapted, True)):
        full, bare = json.loads((run / "summary.json").read_text())["eval"]
        assert bare["protocol"]["name"] == "adapted" and bare["scored_tokens"] == full["scored_tokens"] == 8
        settings = bare["protocol"]["local_adaptation"]
        assert settings["memory_size"] == 32 and settings["neighbours"] == 4
        assert (bare["nll"] != full["nll"]) == moved
        if not moved:
            assert (bare["accuracy"], bare["nll"]) == (full["accuracy"], full["nll"])
    assert list((adapted / "eval").glob("step_*_classification_adapted.json"))

    # the evaluate command, in one process: both ranks' memories from the checkpoint, the key network rebuilt
    from .test_evaluate_e2e import evaluate

    proc = evaluate(str(adapted), "--out", str(tmp_path / "scored"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "32 documents of every rank" in proc.stdout
    own = {r["protocol"]["name"]: r for r in json.loads((adapted / "summary.json").read_text())["eval"]}
    for name in ("full", "adapted"):
        again = json.loads((tmp_path / "scored" / f"validation_classification_{name}.json").read_text())
        assert again["accuracy"] == own[name]["accuracy"]
        assert again["nll"] == pytest.approx(own[name]["nll"], rel=1e-5), name
    proc = evaluate(str(adapted / "export"), "--config", str(adapted / "config.yaml"))  # no run: no memory
    assert proc.returncode == 2 and "give the directory of a run trained with `episodic.enabled" in proc.stderr
    config = adapted / "config.yaml"  # a run whose key network can no longer be rebuilt: refused, exit 2
    config.write_text(config.read_text().replace("seed: 1234", "seed: 99"))
    proc = evaluate(str(adapted), "--out", str(tmp_path / "never"))
    assert proc.returncode == 2 and "does not give the keys its memory holds" in proc.stderr, proc.stderr[-2000:]


def test_in_order_reads_the_documents_as_given(tmp_path):
    """`data.in_order`: a lifelong run's documents are read in the files' order (the tasks one after
    another), not shuffled; it is refused for a text corpus."""
    from memoria_ds.data.labelled import load_labelled_documents
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.distributed import DistInfo
    from memoria_ds.train.parse import ConfigError, load
    from memoria_ds.train.setup import _streams

    classify_args(tmp_path, {"train": 16, "validation": 8})
    docs = load_labelled_documents(files={"train": [str(tmp_path / "docs" / "train.jsonl")]},
                                   tokenizer=str(tmp_path / "tokenizer"))["train"]
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    for in_order in (True, False):
        cfg = load(RunConfig, None, [*run_args(tmp_path), f"data.in_order={in_order}", "data.max_segments=1"])
        streams = _streams(cfg, info, docs, 4)
        labels = [int(x) for step in range(4) for x in streams.batch_at(0, step).labels]
        assert (labels == docs.dataset["label"]) == in_order
    with pytest.raises(ConfigError, match="orders labelled documents"):
        load(RunConfig, None, ["data.in_order=true"])


def test_a_lifelong_run_reads_its_tasks_in_turn_and_scores_each(tmp_path):
    """Tasks of `lifelong_tasks` in order (`data.in_order`): the episodic memory holds each document's task,
    in reading order; the evaluation gives every task's accuracy (summing to the whole), after each task
    (`eval.after_each_task`, also mid-batch) and at the end. With `replay_every=0` the memory is written and
    never replayed (the "local adaptation alone" baseline)."""
    from memoria_ds.data.lifelong_tasks import write_lifelong_tasks, write_task_tokenizer

    files = write_lifelong_tasks(tmp_path / "tasks", tasks=2, classes=2, counts={"train": 8, "test": 4}, words=10)
    tok = write_task_tokenizer(tmp_path / "tok", tasks=2, classes=2)
    split_files = "{" + ", ".join(f"{k}: [{', '.join(v)}]" for k, v in files.items()) + "}"
    run = tmp_path / "run"
    args = [a for a in run_args(tmp_path) if not a.startswith(("data.files", "data.tokenizer", "data.segment_length",
                                                                "data.max_segments", "model.preset"))]
    # batches of 3: task 0's 8th document is read in step 3 (documents 7-9), the 16th document never (drop_last)
    check(run_training(run, *args, DS, f"data.files={split_files}", f"data.tokenizer={tok}", "data.in_order=true",
                       "data.segment_length=24", "data.max_segments=1", "optim.bptt_segments=1", "model.preset=backbone",
                       "episodic.enabled=true", "episodic.replay_every=0", "episodic.replay_size=2",
                       "episodic.adapt_steps=2", "eval.split=test", "eval.protocols=[full]",
                       "eval.after_each_task=[full, adapted]", "optim.epochs=1", "optim.micro_batch_size=3",
                       tiny=False, ranks=1))
    state = _shard(run, 0)
    memory = EpisodicMemory.from_state_dict(state["memory"])
    assert memory.task_ids.tolist() == [0] * 8 + [1] * 7  # task 0's documents, then task 1's
    assert state["replays"] == 0 and state["schedule"]["seen"] == 15
    result = json.loads((run / "summary.json").read_text())["eval"][0]
    per_task = result["protocol"]["per_task"]
    assert [(t["task"], t["documents"]) for t in per_task] == [(0, 4), (1, 4)]
    assert sum(t["correct"] for t in per_task) == round(result["accuracy"] * 8)
    readings = sorted(p.name for p in (run / "eval").glob("step_*_classification_*.json"))
    assert readings == ["step_00000003_classification_adapted.json", "step_00000003_classification_full.json",
                        "step_00000005_classification_full.json"]
    adapted = json.loads((run / "eval" / readings[0]).read_text())["protocol"]
    assert adapted["local_adaptation"]["memory_size"] == 9 and len(adapted["per_task"]) == 2  # written by step 3

@pytest.mark.parametrize("extra, message", [
    (["eval.after_each_task=[full]"], "the tasks must come in turn"),
    (["data.in_order=true", "eval.after_each_task=[adapted]"], "set `episodic.enabled=true`"),
    (["data.in_order=true", "eval.after_each_task=[paper]"], "a classifier is evaluated `full`"),
    (["data.in_order=true", "eval.after_each_task=[fresh]"], "unknown eval protocol"),
])
def test_readings_after_each_task_it_cannot_serve_are_refused(tmp_path, extra, message):
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    classify_args(tmp_path, {"train": 4, "validation": 2})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", ".")):
        load(RunConfig, None, [*run_args(tmp_path), "data.max_segments=1", *extra])
    with pytest.raises(ConfigError, match="reads a lifelong run's tasks"):  # a language model has no tasks
        load(RunConfig, None, ["eval.after_each_task=[full]"])


@pytest.mark.slow
def test_gpt2_as_the_classifier_under_zero2_in_bf16(tmp_path):
    """MbPA++ on the toolkit's GPT-2 classifier (HF's, read at each document's last token): ZeRO-2, bf16, 2 ranks;
    the memory keyed by the last real token's state of the untrained copy, replayed, and adapted to."""
    classify_args(tmp_path, {"train": 32, "validation": 8})
    args = [a for a in run_args(tmp_path, {"train": 32, "validation": 8})
            if not a.startswith(("model.backbone", "model.settings", "model.preset", "data.segment_length",
                                 "data.max_segments"))]
    run = tmp_path / "run"
    check(run_training(run, *args, f"deepspeed={ROOT / 'ds_configs' / 'zero2.json'}", "model.backbone=gpt2",
                       "model.from_scratch=true", "model.preset=backbone",
                       "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 32}", "data.segment_length=24",
                       "data.max_segments=1", "optim.bptt_segments=1", "optim.precision=bf16",
                       "episodic.enabled=true", "episodic.replay_every=8", "episodic.replay_size=4",
                       "episodic.adapt_steps=2", "eval.protocols=[full, adapted]", "optim.max_steps=6",
                       "optim.micro_batch_size=2", "checkpoint.export=true", tiny=False, ranks=2))
    for rank in (0, 1):
        state = _shard(run, rank)
        assert len(EpisodicMemory.from_state_dict(state["memory"])) == 12 and state["replays"] == 3
    results = {r["protocol"]["name"]: r for r in json.loads((run / "summary.json").read_text())["eval"]}
    assert results["adapted"]["protocol"]["local_adaptation"]["memory_size"] == 24
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2
