"""Files without code (issue 19): trees round-trip as safetensors + JSON; pickles are refused unread."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from memoria_ds.memory import MemoriaConfig, MemoryState, memorize, remind
from memoria_ds.safe_io import PickleRefused, check_pickles, convert, is_pickle, load_tree, main, save_tree
from memoria_ds.train.checkpoints import rng_state


class _Marker:
    """Unpickling this creates a file: proof that a loader ran code from the data."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))  # any callable: `open` creates the marker file


def plant(path, marker):
    """A pickle at `path` (torch.save's format) whose loading would create `marker`."""
    torch.save({"memory": [_Marker(marker)], "step": 3}, path)


def test_a_nested_state_round_trips_exactly(tmp_path):
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, search_depth=1)
    state = MemoryState.empty(cfg, 2, 3)
    for _ in range(3):
        r = remind(state, torch.randn(2, 2, 3), cfg)
        memorize(state, r, torch.rand(r.reminded_slots.shape), cfg)
    random.seed(5)
    np.random.seed(6)
    tree = {"memory": [None, {"kind": "memoria", "format": 1, "state": state.state_dict()}],
            "rng": rng_state(), "stream_ids": [3, 1], "lr": float("nan"), "flag": True, "name": "x",
            "by_int": {0: {"step": torch.tensor(4.0), "betas": (0.9, 0.999)}, 7: []}, "$odd": 1,
            "bf16": torch.arange(4, dtype=torch.bfloat16), "view": torch.arange(10)[2:5]}
    tree["tied"] = tree["view"]  # the same tensor twice (tied weights): stored twice, no sharing error
    save_tree(tree, tmp_path / "s.safetensors")
    assert not is_pickle(tmp_path / "s.safetensors")
    back = load_tree(tmp_path / "s.safetensors")
    assert back["memory"][0] is None and back["stream_ids"] == [3, 1] and back["flag"] is True
    assert back["lr"] != back["lr"] and back["$odd"] == 1 and back["by_int"][7] == []
    assert back["by_int"][0]["betas"] == (0.9, 0.999) and torch.equal(back["by_int"][0]["step"], torch.tensor(4.0))
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["view"], torch.tensor([2, 3, 4]))
    for key, value in state.state_dict().items():
        got = back["memory"][1]["state"][key]
        assert torch.equal(got, value) if torch.is_tensor(value) else got == value, key
    # RNG states restore the same streams
    py, npy, th = back["rng"]["python"], back["rng"]["numpy"], back["rng"]["torch"]
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(th)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.setstate(tree["rng"]["python"])
    np.random.set_state(tree["rng"]["numpy"])
    torch.set_rng_state(tree["rng"]["torch"])
    assert first == (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_what_cannot_be_stored_without_pickle_is_refused(tmp_path):
    with pytest.raises(TypeError, match="cannot store a _Marker without pickle"):
        save_tree({"x": _Marker(tmp_path / "m")}, tmp_path / "s.safetensors")


def test_a_pickle_is_refused_unread_and_converted_only_on_request(tmp_path):
    marker = tmp_path / "ran"
    plant(tmp_path / "rank_00000.pt", marker)
    bare = tmp_path / "bare.pkl"
    bare.write_bytes(pickle.dumps(_Marker(marker)))
    for path in (tmp_path / "rank_00000.pt", bare):
        assert is_pickle(path)
        with pytest.raises(PickleRefused, match=r"is a pickle .* not read.*python -m memoria_ds.safe_io convert"):
            load_tree(path)
    # a pickle renamed to look like ours is refused the same way
    (tmp_path / "rank_00000.pt").rename(tmp_path / "fake.safetensors")
    with pytest.raises(PickleRefused):
        load_tree(tmp_path / "fake.safetensors")
    # DeepSpeed-style files: scanned, not loaded
    with pytest.raises(PickleRefused, match=r"would import io.open when loaded, which DeepSpeed never writes"):
        check_pickles([tmp_path / "fake.safetensors"], frozenset(), "DeepSpeed")
    assert not marker.exists()
    (tmp_path / "junk.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # empty, no metadata
    with pytest.raises(ValueError, match="not a memoria_ds state"):
        load_tree(tmp_path / "junk.safetensors")


def test_convert_rewrites_a_trusted_legacy_checkpoint_and_its_manifest(tmp_path, capsys):
    ckpt = tmp_path / "step_00000004"
    (ckpt / "engine").mkdir(parents=True)
    torch.save({"stream_ids": [0], "step": 4, "rng": {"numpy": np.random.get_state()}}, ckpt / "rank_00000.pt")
    torch.save({"module": {"w": torch.ones(2)}}, ckpt / "engine" / "engine.pt")
    files = {"rank_00000.pt": (ckpt / "rank_00000.pt").stat().st_size,
             "engine/engine.pt": (ckpt / "engine" / "engine.pt").stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files, "sha256": {k: "0" for k in files}}))
    main(["convert", str(tmp_path)])
    assert "2 file(s) converted" in capsys.readouterr().out
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["engine/engine.safetensors", "rank_00000.safetensors"]
    assert manifest["files"]["rank_00000.safetensors"] == (ckpt / "rank_00000.safetensors").stat().st_size
    assert len(manifest["sha256"]["rank_00000.safetensors"]) == 64
    assert not (ckpt / "rank_00000.pt").exists()
    assert load_tree(ckpt / "rank_00000.safetensors")["stream_ids"] == [0]
    assert torch.equal(load_tree(ckpt / "engine" / "engine.safetensors")["module"]["w"], torch.ones(2))
    assert convert(tmp_path) == ([], [])  # nothing left to convert


class _Call:
    """Pickles as `func(*args)`: how Python 3.11.0-3.11.3 write an enum member is
    `_Call(getattr, (EnumClass, "member"))`."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def test_an_enum_member_pickled_as_getattr_is_accepted_and_nothing_else_is(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from memoria_ds.train.engine import DEEPSPEED_PICKLE_GLOBALS as allowed

    member = _Call(getattr, ZeroStageEnum, "gradients")
    ok = tmp_path / "ok.pt"  # the form Debian 12's Python 3.11.2 writes; getattr memoized and used twice
    torch.save({"zero_stage": member, "again": _Call(getattr, ZeroStageEnum, "weights"), "w": torch.ones(2)}, ok)
    assert "builtins.getattr" in torch.serialization.get_unsafe_globals_in_checkpoint(str(ok))
    check_pickles([ok], allowed, "DeepSpeed")
    loaded = torch.load(ok, weights_only=False)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["again"] is ZeroStageEnum.weights

    forged = {
        "not_a_member": {"a": member, "b": _Call(getattr, ZeroStageEnum, "_missing_")},
        "dunder": _Call(getattr, ZeroStageEnum, "__class__"),
        "not_an_enum": _Call(getattr, LossScaler, "backward"),
        "getattr_as_argument": _Call(LossScaler, getattr),
        "getattr_itself": {"x": getattr},
        "name_not_a_string": _Call(getattr, ZeroStageEnum, 2),
    }
    for name, payload in forged.items():
        path = tmp_path / f"{name}.pt"
        torch.save(payload, path)
        with pytest.raises(PickleRefused, match=r"would import builtins.getattr \(not as an enum member lookup\)"):
            check_pickles([path], allowed, "DeepSpeed")
    # an enum that DeepSpeed does not write is refused for its import, before any getattr question
    torch.save(_Call(getattr, torch.serialization.LoadEndianness, "NATIVE"), tmp_path / "other_enum.pt")
    with pytest.raises(PickleRefused, match="LoadEndianness"):
        check_pickles([tmp_path / "other_enum.pt"], allowed, "DeepSpeed")
