"""A Memoria BERT classifying labelled documents through the real launcher (`model.task:
classification`, `data.corpus: documents`): on 2 CPU ranks a kill and resume gives the
uninterrupted run's losses and final evaluation bit for bit (the memory of every document row
checkpointed with the step); the summary holds accuracy and macro-F1 with and without the memory;
the export loads through `AutoModelForSequenceClassification` and scores as the run did; bad
classification settings are refused before any work."""

from __future__ import annotations

import json

import pytest
import torch

from memoria_ds.train.faults import EXIT_CODE

from .classify_util import classify_args, run_args
from memoria_ds.eval.result import read_results

from .launch_util import ROOT, check, killed_and_resumed, losses_by_step, run_training
from .test_evaluate_e2e import evaluate

DS = f"deepspeed={ROOT / 'ds_configs' / 'cpu.json'}"


def _run(run, tmp_path, *extra, **kw):
    """A run of the task `classify_args` writes under tmp_path (once: the same files for every run)."""
    if not (tmp_path / "docs").exists():
        classify_args(tmp_path)
    return run_training(run, *run_args(tmp_path), DS, "optim.max_steps=8", "checkpoint.every=4",
                        *extra, tiny=False, **kw)


def test_two_rank_kill_and_resume_equals_uninterrupted(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    a, b = killed_and_resumed(lambda run, *extra, **kw: _run(run, tmp_path, *extra, **kw), whole, killed,
                              kill_after=6, ranks=2)
    assert set(a) == set(b) == set(range(1, 9))
    for step in (5, 6, 7, 8):  # trained after the resume from step 4 (steps 1-2: document 1, 3-4: ...)
        assert a[step] == b[step], f"step {step}: uninterrupted {a[step]!r} vs resumed {b[step]!r}"
    ea = json.loads((whole / "summary.json").read_text())["eval"]
    eb = json.loads((killed / "summary.json").read_text())["eval"]
    assert [r["protocol"]["name"] for r in ea] == ["full", "memoryless"]
    for x, y in zip(ea, eb):
        assert (x["accuracy"], x["macro_f1"], x["nll"]) == (y["accuracy"], y["macro_f1"], y["nll"])
        assert x["scored_tokens"] == 8 and x["data"]["label_names"] == ["alpha", "beta", "gamma"]


def test_the_export_loads_as_a_sequence_classifier_and_scores_as_the_run(tmp_path):
    from transformers import AutoModelForSequenceClassification

    import memoria_ds.model.encoder  # noqa: F401  (registers the Auto classes)
    from memoria_ds.data.labelled import load_labelled_documents
    from memoria_ds.eval.classification import evaluate_classification

    run = tmp_path / "run"
    check(_run(run, tmp_path, "checkpoint.export=true", "optim.max_steps=4"))
    model = AutoModelForSequenceClassification.from_pretrained(run / "export").eval()
    assert model.config.id2label == {0: "alpha", 1: "beta", 2: "gamma"}
    card = (run / "export" / "README.md").read_text()
    assert "AutoModelForSequenceClassification.from_pretrained" in card and "macro-F1" in card
    assert "BERT classifier" in card and "AutoModelForCausalLM" not in card
    docs = load_labelled_documents(files={"validation": [str(tmp_path / "docs" / "validation.jsonl")]},
                                   tokenizer=str(run / "export"), splits=("validation",))["validation"]
    ours = evaluate_classification(model, docs, segment_length=12, max_segments=4, batch_size=2, split="validation",
                                   device="cpu")
    (full, bare) = json.loads((run / "summary.json").read_text())["eval"]
    assert ours.correct == full["correct"] and ours.macro_f1 == full["macro_f1"]
    assert ours.nll == pytest.approx(full["nll"], rel=1e-5)
    # the evaluate command, on the export and on the newest checkpoint (the export moved aside), on 2 ranks
    for ranks in (1, 2):
        out = tmp_path / f"scored{ranks}"
        proc = evaluate(str(run), "--out", str(out), ranks=ranks)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # (2 ranks read as many streams: a setting other than the run's, named in a suffix of the files)
        files = sorted(out.glob("validation_classification_*.json"))
        assert len(files) == 2, files
        got = {r.protocol["name"]: r for f in files for r in read_results(f)}
        assert (got["full"].correct, got["memoryless"].correct) == (full["correct"], bare["correct"])
        assert got["full"].macro_f1 == full["macro_f1"] and "macro-F1" in proc.stdout
        if ranks == 1:
            (run / "export").rename(run / "export.aside")


def test_a_bad_document_column_is_one_line_and_exit_2(tmp_path):
    """Found when the documents are read (the settings themselves: tests/train/test_run_config.py)."""
    run = tmp_path / "run"
    proc = _run(run, tmp_path, "data.label_field=topic")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "has no column 'topic'" in proc.stderr, proc.stderr[-3000:]
    assert not (run / "checkpoints").exists()


@pytest.mark.slow
def test_bf16_zero3_with_lora_on_a_pretrained_encoder_trains_and_exports(tmp_path):
    """A saved (pretrained) tiny BERT encoder, LoRA on its backbone, bf16 under ZeRO-3 on 2 ranks: the run
    trains (finite losses), checkpoints, and its merged export loads as a sequence classifier."""
    from transformers import AutoModelForSequenceClassification, BertConfig, BertModel

    import memoria_ds.model.encoder  # noqa: F401  (registers the Auto classes)

    classify_args(tmp_path)
    backbone = tmp_path / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=68, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32)).save_pretrained(backbone)
    args = [a for a in run_args(tmp_path) if not a.startswith(("model.backbone", "model.from_scratch", "model.settings"))]
    run = tmp_path / "run"
    check(run_training(run, *args, f"model.backbone={backbone}", "model.from_scratch=false",
                       "model.settings={memory_layer_index: 0, memoria: {num_wm: 4, num_stm_reminded: 4, "
                       "num_ltm_reminded: 4, stm_capacity: 16, search_depth: 2}}",
                       f"deepspeed={ROOT / 'ds_configs' / 'cpu_zero3.json'}", "optim.precision=bf16", "lora.enabled=true",
                       "lora.r=4", "optim.max_steps=4", "checkpoint.every=4", "checkpoint.export=true",
                       "checkpoint.merge_lora=true", ranks=2, tiny=False))
    losses = losses_by_step(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v for v in losses.values())
    model = AutoModelForSequenceClassification.from_pretrained(run / "export")
    assert model.config.id2label == {0: "alpha", 1: "beta", 2: "gamma"} and not hasattr(model, "peft_config")


@pytest.mark.slow
def test_the_backbone_alone_trains_resumes_and_reads_every_segment(tmp_path):
    """Preset `backbone` (no memory) through the same loop, one optimiser step per batch of documents
    (`optim.bptt_segments` = `data.max_segments`: the authors' stepping), killed and resumed;
    `eval.aggregate=mean` scores the mean of each document's segment logits (the segment-mean baseline):
    the memoryless reading is the same reading, so the memory gain is exactly 0."""
    classify_args(tmp_path)
    args = [a for a in run_args(tmp_path) if not a.startswith(("model.preset", "model.settings"))]
    common = [*args, "model.preset=backbone", "model.settings={num_hidden_layers: 2, hidden_size: 32, "
              "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 32}", "eval.aggregate=mean", DS,
              "optim.max_steps=8", "checkpoint.every=4", "optim.bptt_segments=4"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    check(run_training(whole, *common, tiny=False))
    proc = run_training(killed, *common, tiny=False, fault="kill_after_step:6")
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    check(run_training(killed, *common, "checkpoint.resume=auto", tiny=False))
    assert losses_by_step(whole) == losses_by_step(killed) and sorted(losses_by_step(whole)) == list(range(1, 9))
    full, bare = json.loads((whole / "summary.json").read_text())["eval"]
    assert full["protocol"]["aggregate"] == "mean" and full["scored_tokens"] == 8
    assert (full["correct"], full["nll"]) == (bare["correct"], bare["nll"])
    assert json.loads((killed / "summary.json").read_text())["eval"][0]["correct"] == full["correct"]
