"""A memory crafted behind a matching checksum (issue 47 item 3), through the real launchers: a
`memorizing` checkpoint whose keys have another head width passes the file checks, so only the
memory's own check against the checkpoint's model can stop it. `--resume auto` falls back to the
intact older checkpoint with a line naming the field, a named `--resume` exits 2 with one line,
and `launch/evaluate.py --memory` of a crafted or other-kind snapshot exits 2 with one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config

from memoria_ds.safe_io import file_sha256, load_tree, save_tree
from memoria_ds.train.checkpoints import CheckpointError, find_latest, make_shard, validate
from memoria_ds.train.checkpoints.shards import check_shard, saved_model_config

from memoria_ds.train.faults import EXIT_CODE

from .launch_util import check, losses_by_step, run_training
from .test_evaluate_e2e import evaluate

# 2 layers of 2 heads of width 16; a kNN memory of 24 pairs at the top block; checkpoints at steps 3, 6 and 9
MEMORIZING = ("model.preset=memorizing_no_cache",
              "model.settings={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, memory_init: random, "
              "memory_settings: {size: 24, topk: 4}}", "optim.max_steps=9", "eval.at_end=false")


def _narrow_head_width(sd: dict, width: int) -> None:
    """The keys and values cut to `width` per head: consistent with each other, not with the model."""
    sd["keys"] = sd["keys"][..., :width].clone()
    sd["values"] = sd["values"][..., :width].clone()


def _rewrite_shard(ckpt, change) -> None:
    """Change rank 0's shard and write the manifest's size and checksum to match (a crafted checkpoint)."""
    rel = "rank_00000.safetensors"
    shard = load_tree(ckpt / rel)
    change(shard)
    save_tree(shard, ckpt / rel)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][rel] = (ckpt / rel).stat().st_size
    manifest["sha256"][rel] = file_sha256(ckpt / rel)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


def test_auto_resume_falls_back_past_a_crafted_memory_and_a_named_one_is_refused(tmp_path):
    run = tmp_path / "run"
    proc = run_training(run, *MEMORIZING, launcher="python", fault="kill_after_step:7")  # steps left to resume
    assert proc.returncode == EXIT_CODE, proc.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_00000006"
    _rewrite_shard(ckpt, lambda shard: _narrow_head_width(shard["memory"][0], 8))
    validate(ckpt, verify_contents=False)  # the files and sizes are right: only the memory's check against the model tells
    with pytest.raises(CheckpointError, match=r"rank 0, memory of slot 0: saved memorizing memory: `keys` has shape "
                                              r"\(2, 2, 24, 8\), expected \(B=2, H=2, M=24, hd=16\) for this model"):
        validate(ckpt)

    proc = run_training(run, *MEMORIZING, f"checkpoint.resume={ckpt}", launcher="python")
    lines = _error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "`keys` has shape" in lines[0], proc.stderr[-3000:]

    proc = check(run_training(run, *MEMORIZING, "checkpoint.resume=auto", launcher="python"))
    out = proc.stdout + proc.stderr
    assert "resume: skipping a newer unusable checkpoint" in out and "`keys` has shape (2, 2, 24, 8)" in out
    assert '"step": 3' in out, out[-3000:]  # resumed from the intact older checkpoint
    assert set(losses_by_step(run)) == set(range(1, 10))
    assert (ckpt / "manifest.json").is_file()  # written again by the resumed run, the crafted one set aside
    validate(ckpt)
    assert list((run / "checkpoints" / "abandoned").rglob("step_00000006"))


def test_a_manifest_without_its_model_is_checked_against_the_running_one(tmp_path):
    """A crafted checkpoint whose manifest drops its run configuration (so `validate` has no model
    to check the memory against) is still refused before any forward: the resume checks every
    memory against the running model; exit 2, one line."""
    run = tmp_path / "run"
    proc = run_training(run, *MEMORIZING, "optim.max_steps=6", launcher="python")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_00000006"
    _rewrite_shard(ckpt, lambda shard: _narrow_head_width(shard["memory"][0], 8))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["meta"]["config"]["model"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    validate(ckpt)  # nothing to check the memory's shapes against here
    proc = run_training(run, *MEMORIZING, "optim.max_steps=9", f"checkpoint.resume={ckpt}", launcher="python")
    lines = _error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "`keys` has shape (2, 2, 24, 8)" in lines[0], proc.stderr[-3000:]


def test_value_checks_need_no_model_and_the_model_check_needs_the_manifest(tmp_path):
    """A memory whose values no kind writes (here memformer slots of 3e38, a float mask) is refused
    by the checkpoint's own validation (`find_latest`), with or without the model; a checkpoint
    whose manifest holds no run configuration gets the value checks only (the resume checks its
    memories against the running model: `test_a_manifest_without_its_model_is_checked_against_the_running_one`)."""
    from memoria_ds.model import memory_from_state_dict

    slots = torch.nn.functional.normalize(torch.randn(2, 4, 8), dim=-1)
    good = {"kind": "memformer", "format": 1, "slots": slots, "fresh": torch.zeros(2, dtype=torch.bool)}
    huge = dict(good, slots=slots * 3e38)
    masked = {"kind": "xl", "format": 1, "keys": torch.zeros(2, 1, 2, 3, 4), "values": torch.zeros(2, 1, 2, 3, 4),
              "mask": torch.ones(2, 3), "segments": torch.zeros(2, dtype=torch.int64)}
    root = tmp_path / "checkpoints"
    for step, sd in ((2, good), (4, huge), (6, masked)):
        shard = dict(make_shard([0, 1], [memory_from_state_dict(sd)] if sd is good else [None], {}, step, 2),
                     format=1, rank=0, world_size=1)
        if sd is not good:
            shard["memory"] = [sd]
        path = root / f"step_{step:08d}"
        path.mkdir(parents=True)
        save_tree(shard, path / "rank_00000.safetensors")
        rel = "rank_00000.safetensors"
        (path / "manifest.json").write_text(json.dumps({
            "format": 1, "step": step, "world_size": 1, "files": {rel: (path / rel).stat().st_size},
            "sha256": {rel: file_sha256(path / rel)}, "meta": {"config": {}, "fingerprint": {}}}))
    info, skipped = find_latest(root)
    assert info is not None and info.step == 2
    assert "`mask` has dtype torch.float32, expected torch.bool" in skipped[0]
    assert "`slots` holds a slot longer than 1" in skipped[1]
    validate(root / "step_00000002")
    with pytest.raises(ValueError, match="no run configuration"):
        saved_model_config({"meta": {}})
    check_shard(load_tree(root / "step_00000002" / "rank_00000.safetensors"), 0)


def test_the_checkpoints_model_is_the_one_the_run_builds():
    """`saved_model_config` builds, from a run configuration alone, the config of the model the run trains."""
    from memoria_ds.train.build import build_run_model
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import to_dict, validate as validate_config

    shape = dict(n_layer=2, n_embd=32, n_head=2, n_positions=64)
    for preset, settings in (("memorizing_no_cache", {"memory_settings": {"size": 24, "topk": 4}}),
                             ("memorizing", {"memory_settings": {"memorizing": {"size": 24, "topk": 4}}}),
                             ("memformer", {"memory_settings": {"num_slots": 8}}), ("memory_mosaic_carry", {}),
                             ("memsizer_carry", {"memsizer_slots": 8}),
                             ("compressive", {"xl_positions": "shared"}), ("infinity", {})):
        cfg = validate_config(RunConfig, {
            "model": {"backbone": "gpt2", "from_scratch": True, "preset": preset, "settings": {**shape, **settings}},
            "data": {"corpus": "bundled", "segment_length": 16}})
        built = build_run_model(cfg, None).config
        config = saved_model_config({"meta": {"config": to_dict(cfg)}})
        assert type(config) is type(built), preset
        for key in ("memory_type", "n_layer", "n_embd", "n_head", "n_positions", "memory_settings", "segment_length",
                    "xl_positions", "xl_memory_length"):
            assert getattr(config, key) == getattr(built, key), (preset, key)


def test_evaluate_refuses_a_crafted_or_other_kind_snapshot_with_one_line(tmp_path):
    from memoria_ds.model import build_model, read, save_snapshot

    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=50257, n_layer=1, n_embd=16, n_head=2, n_positions=64)
    model = build_model(backbone, "memorizing_no_cache", memory_init="random",
                        memory_settings={"size": 24, "topk": 4}).eval()
    model.save_pretrained(tmp_path / "model")
    snap = save_snapshot(tmp_path / "book.safetensors", model,
                         read(model, torch.randint(0, 50257, (1, 48)), segment_length=16))
    tree = load_tree(snap)
    narrow = {**tree, "memory": dict(tree["memory"])}
    _narrow_head_width(narrow["memory"], 4)
    save_tree(narrow, tmp_path / "narrow.safetensors")
    xl = build_model(backbone, "xl").eval()
    other = read(xl, torch.randint(0, 50257, (1, 16)), segment_length=16).state_dict()
    save_tree({**tree, "memory": other}, tmp_path / "other_kind.safetensors")  # right fingerprint, memory of xl

    common = ["data.corpus=bundled", "data.segment_length=16", "eval.protocols=[paper]", "eval.max_steps=2"]
    check(evaluate(str(tmp_path / "model"), "--memory", str(snap), *common, "--out", str(tmp_path / "ok")))
    for path, says in ((tmp_path / "narrow.safetensors", "saved memorizing memory: `keys` has shape (1, 2, 24, 4), "
                                                         "expected (B=1, H=2, M=24, hd=8) for this model"),
                       (tmp_path / "other_kind.safetensors", "saved memory is of kind 'xl' but this model's memory "
                                                             "is 'memorizing'")):
        proc = evaluate(str(tmp_path / "model"), "--memory", str(path), *common, "--out", str(tmp_path / "x"))
        lines = _error_lines(proc)
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
