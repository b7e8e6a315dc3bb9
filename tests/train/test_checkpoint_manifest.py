"""A checkpoint's manifest is read as untrusted input: every field `save_checkpoint` writes is
type-checked, and a file name that points outside the checkpoint is refused unread."""

from __future__ import annotations

import json
import os

import pytest
import torch

from memoria_ds.safe_io import file_sha256, save_tree
from memoria_ds.train.checkpoints import CheckpointError, find_latest, make_shard
from memoria_ds.train.checkpoints.store import validate


def _checkpoint(root, step):
    """A complete one-shard checkpoint, as `save_checkpoint` lays it out."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    shard = make_shard([0], [None], {"position": torch.arange(4)}, step, micro_batch_size=1)
    save_tree(dict(shard, format=1, rank=0, world_size=1), path / "rank_00000.safetensors")
    rel = "rank_00000.safetensors"
    manifest = {"format": 1, "step": step, "world_size": 1, "files": {rel: (path / rel).stat().st_size},
                "sha256": {rel: file_sha256(path / rel)}, "meta": {"config": {}, "fingerprint": {}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path, manifest


@pytest.mark.parametrize("change,says", [
    (lambda m: m.update(step="7"), "`step` is '7', not an integer >= 0"),
    (lambda m: m.update(step=True), "`step` is True, not an integer >= 0"),
    (lambda m: m.update(world_size=0), "`world_size` is 0, not an integer >= 1"),
    (lambda m: m.update(world_size=None), "`world_size` is None"),
    (lambda m: m.update(files=["rank_00000.safetensors"]), "`files` and `sha256` must be objects"),
    (lambda m: m["files"].update({"rank_00000.safetensors": "894840"}), "the size of rank_00000.safetensors is '894840'"),
    (lambda m: m["files"].update({"../../outside": 3}), "the file name '../../outside' points outside the checkpoint"),
    (lambda m: m["sha256"].update({"/etc/hostname": "0" * 64}), "the file name '/etc/hostname' points outside"),
    (lambda m: m["sha256"].update({"rank_00000.safetensors": 5}), "the checksum of rank_00000.safetensors is 5"),
    (lambda m: m.update(meta=[]), "`meta` and its `config` and `fingerprint` must be objects"),
    (lambda m: m["meta"].update(config="x"), "`meta` and its `config` and `fingerprint` must be objects"),
])
def test_a_manifest_with_fields_of_the_wrong_shape_is_refused(tmp_path, change, says):
    path, manifest = _checkpoint(tmp_path / "checkpoints", 3)
    assert validate(path).step == 3  # whole: accepted
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json is corrupt") as e:
        validate(path)
    assert says in str(e.value)


def test_a_file_linked_from_outside_is_refused_and_auto_falls_back(tmp_path):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 3)
    newer, manifest = _checkpoint(root, 6)
    secret = tmp_path / "secret"
    secret.write_text("not the checkpoint's")
    os.symlink(secret, newer / "extra")
    manifest["files"]["extra"] = secret.stat().st_size
    (newer / "manifest.json").write_text(json.dumps(manifest))
    info, skipped = find_latest(root)
    assert info is not None and info.step == 3
    assert len(skipped) == 1 and "'extra' points outside the checkpoint" in skipped[0]
    for text in ("[1, 2]", "\udcff"):
        (newer / "manifest.json").write_bytes(text.encode("utf-8", "surrogateescape"))
        with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
            validate(newer)
