"""Files are never lost, never misread, never trusted blindly: every file the project writes
reads back as what it is, `convert` touches only legacy pickles and runs nothing, and any
damaged or crafted content of a tree, a shard or a snapshot is one ValueError, never a
crash from inside or a poisoned memory accepted."""

from __future__ import annotations

import json
import os
import pickle
import random
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from memoria_ds.memory import MemoriaConfig, MemoryState, memorize, remind
from memoria_ds.memory.state import LTM
from memoria_ds.model import memory_from_state_dict
from memoria_ds.safe_io import (FORMAT, MAX_DEPTH, ConvertRefused, PickleRefused, TreeError, check_tree, convert_file,
                                is_pickle, load_tree, main, same_tree, save_tree, sniff)
from memoria_ds.train.checkpoints import CheckpointError, find_latest, make_shard
from memoria_ds.train.checkpoints.shards import check_shard
from memoria_ds.safe_io import file_sha256

CFG = MemoriaConfig(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, search_depth=1)


def _engine_state(rows=2, dim=3, steps=6, seed=0):
    torch.manual_seed(seed)
    state = MemoryState.empty(CFG, rows, dim)
    for _ in range(steps):
        r = remind(state, torch.randn(rows, CFG.num_wm, dim), CFG)
        memorize(state, r, torch.rand(r.reminded_slots.shape), CFG)
    return state


def _memoria_memory(rows=2, dim=3):
    return {"kind": "memoria", "format": 1, "prev_hidden": torch.randn(rows, 4, dim),
            "prev_mask": torch.ones(rows, 4, dtype=torch.bool), "state": _engine_state(rows, dim).state_dict()}


def _random_tree(rng: random.Random, depth=0):
    pick = rng.randrange(9 if depth < 4 else 5)
    if pick == 0:
        return torch.randn(rng.randrange(0, 5), dtype=rng.choice([torch.float32, torch.bfloat16, torch.float64]))
    if pick == 1:
        return np.arange(rng.randrange(4), dtype=rng.choice([np.uint32, np.int64, np.float32]))
    if pick == 2:
        return rng.choice([None, True, False, rng.randrange(-10**12, 10**12), rng.random(), float("inf")])
    if pick == 3:
        return "".join(rng.choice("ab$é\"\\{}") for _ in range(rng.randrange(12)))
    if pick == 4:
        return rng.random() * 1e300
    if pick == 5:
        return [_random_tree(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 6:
        return tuple(_random_tree(rng, depth + 1) for _ in range(rng.randrange(4)))
    if pick == 7:
        return {f"k{i}": _random_tree(rng, depth + 1) for i in range(rng.randrange(4))}
    return {rng.choice([3, "$x", (1, "a"), None]): _random_tree(rng, depth + 1) for _ in range(rng.randrange(3))}


# --------------------------------------------------------------------------- format by structure
def test_every_header_length_reads_back_as_safetensors(tmp_path):
    """Header lengths are multiples of 8, so 1 file in 32 starts with 0x80, the byte a pickle
    starts with: every residue of the header length is written and read back as what it is."""
    first_bytes = set()
    path = tmp_path / "s.safetensors"
    for n in range(260):
        tree = {"description": "d" * n, "x": torch.arange(3)}
        save_tree(tree, path)
        first_bytes.add(path.read_bytes()[0])
        assert sniff(path) == "safetensors" and not is_pickle(path), n
        assert same_tree(load_tree(path), tree), n
    assert 0x80 in first_bytes and len(first_bytes) == 32  # every header length mod 256 was seen


def test_random_trees_round_trip_exactly(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "t.safetensors"
    for i in range(300):
        tree = {"root": _random_tree(rng), "pad": "p" * rng.randrange(64)}
        save_tree(tree, path)
        assert sniff(path) == "safetensors", i
        assert same_tree(load_tree(path), tree), i


def test_pickles_and_other_files_are_told_apart_from_safetensors(tmp_path):
    zipped, bare, legacy = tmp_path / "a.pt", tmp_path / "b.pkl", tmp_path / "c.pt"
    torch.save({"x": torch.ones(2)}, zipped)
    bare.write_bytes(pickle.dumps({"x": 1}, protocol=4))
    torch.save({"x": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert [sniff(p) for p in (zipped, bare, legacy)] == ["zip", "pickle", "pickle"]
    for blob in (b"", b"\x80", b"\x80\x00\x00\x00\x00\x00\x00\x00{}", b"\x08\x00\x00\x00\x00\x00\x00\x00[1,2]   ",
                 struct.pack("<Q", 10**9) + b"{}", b"hello world, this is text"):
        (tmp_path / "x").write_bytes(blob)
        assert sniff(tmp_path / "x") == "unknown", blob
        with pytest.raises(ValueError, match="not a memoria_ds state file"):
            load_tree(tmp_path / "x")


# --------------------------------------------------------------------------- crafted trees
def _crafted(path, structure, tensors=None, raw=None):
    metadata = {"format": FORMAT, "memoria_ds.tree": raw if raw is not None else json.dumps(structure)}
    save_file(tensors if tensors is not None else {"t0": torch.ones(2)}, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("structure,says", [
    ({"a": {"$tensor": "t999"}}, "a reference to tensor 't999', which the file does not hold"),
    ({"a": {"$tensor": 3}}, "a tensor reference 3 that is not a name"),
    ({"a": {"$items": [[{"k": 1}, 2]]}}, "a mapping key of type dict"),
    ({"a": {"$items": [[[{"k": 1}], 2]]}}, "a mapping key of type tuple"),
    ({"a": {"$items": [[1]]}}, "not a [key, value] pair"),
    ({"a": {"$items": {"k": 1}}}, "a $items entry that is a dict, not a list"),
    ({"a": {"$tuple": "ab"}}, "a $tuple entry that is a str"),
    ({"a": {"$eval": "os.system('x')"}}, "which no tree holds"),
    ({"a": {"$tensor": "t0", "other": 1}}, "which no tree holds"),
    ({"a": {"$ndarray": "t1"}}, "an array 't1' of dtype torch.bfloat16"),
])
def test_a_crafted_tree_is_one_tree_error(tmp_path, structure, says):
    path = _crafted(tmp_path / "c.safetensors", structure,
                    tensors={"t0": torch.ones(2), "t1": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(TreeError, match="is damaged or crafted") as e:
        load_tree(path)
    assert says in str(e.value)
    if "t1" not in str(structure):  # check_tree reads no tensor data: the array's dtype is load_tree's to see
        with pytest.raises(TreeError):
            check_tree(path)


def test_deep_nesting_and_broken_json_are_refused_not_recursion_errors(tmp_path):
    for depth in (MAX_DEPTH + 5, 200_000):
        path = _crafted(tmp_path / f"deep{depth}.safetensors", None, raw="[" * depth + "]" * depth)
        with pytest.raises(ValueError, match="nested") as e:
            load_tree(path)
        assert not isinstance(e.value, RecursionError)
    with pytest.raises(ValueError, match="nested deeper than"):  # the writer refuses what the reader would
        tree: list = []
        for _ in range(MAX_DEPTH + 2):
            tree = [tree]
        save_tree(tree, tmp_path / "w.safetensors")
    path = _crafted(tmp_path / "broken.safetensors", None, raw='{"a": [1, 2')
    with pytest.raises(ValueError, match="not a readable memoria_ds state file"):
        load_tree(path)


def test_flipped_bytes_in_a_real_shard_are_value_errors_or_harmless(tmp_path):
    """Fuzz: any byte of a shard changed; reading it gives the tree, or a ValueError, nothing else."""
    path = tmp_path / "rank_00000.safetensors"
    save_tree(dict(make_shard([0, 1], [memory_from_state_dict(_memoria_memory())], {"step": 3}, 3, 2),
                   format=1, rank=0, world_size=1), path)
    blob = path.read_bytes()
    rng = random.Random(1)
    for _ in range(400):
        mutated = bytearray(blob)
        for _ in range(rng.randrange(1, 4)):
            where = rng.randrange(len(blob)) if rng.random() < 0.5 else rng.randrange(min(len(blob), 600))
            mutated[where] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        try:
            check_shard(load_tree(path), 0)
        except ValueError:
            pass


# --------------------------------------------------------------------------- memories and shards
def test_states_the_engine_makes_pass_the_value_checks():
    """No false alarm: every state along random engine runs (resets too) is accepted."""
    for seed in range(5):
        state = _engine_state(rows=3, dim=4, steps=0, seed=seed)
        for step in range(40):
            r = remind(state, torch.randn(3, CFG.num_wm, 4) * (10 ** (step % 3)), CFG)
            memorize(state, r, torch.rand(r.reminded_slots.shape), CFG)
            if step % 7 == 3:
                state.reset(torch.tensor([True, False, step % 2 == 0]))
            MemoryState.from_state_dict(state.state_dict(), config=CFG)


@pytest.mark.parametrize("poison,says", [
    (lambda s: s["vectors"].fill_(float("nan")), "non-finite values in `state.vectors`"),
    (lambda s: s["lifespan"].__setitem__((0, 0), float("inf")), "non-finite values in `state.lifespan`"),
    (lambda s: s["kind"].__setitem__((0, 0), 99), "`kind` holds values outside 0..3"),
    (lambda s: s["kind"].__setitem__((0, 0), -1), "`kind` holds values outside 0..3"),
    (lambda s: (s["kind"].__setitem__((0, 0), LTM), s["uid"].__setitem__((0, 0), -1)), "a live engram has no uid"),
    (lambda s: (s["kind"].__setitem__((0, 0), LTM), s["lifespan"].__setitem__((0, 0), -2.0)),
     "no positive lifespan"),
    (lambda s: s["counts"].__setitem__((0, 0, 0), -5), "negative"),
    (lambda s: s["step"].__setitem__(0, -1), "negative"),
    (lambda s: s.__setitem__("kind", s["kind"].to(torch.int64)), "dtype torch.int64"),
    (lambda s: s.__setitem__("uid", s["uid"][:, :2]), "shape"),
    (lambda s: s.__setitem__("vectors", torch.zeros(3)), "expected (B, C, D)"),
    (lambda s: s.__setitem__("counts", "many"), "`counts` is str"),
    (lambda s: s.pop("uid"), "missing field(s) ['uid']"),
])
def test_a_poisoned_memoria_memory_is_refused(poison, says):
    sd = _memoria_memory()
    poison(sd["state"])
    with pytest.raises(ValueError) as e:
        memory_from_state_dict(sd)
    assert says in str(e.value)


@pytest.mark.parametrize("change,says", [
    (lambda m: m.update(state="a string"), "a memory state must be a mapping"),
    (lambda m: m.pop("prev_hidden"), "`prev_hidden` is missing"),
    (lambda m: m.update(prev_hidden=[1, 2]), "`prev_hidden` is a list, expected a tensor"),
    (lambda m: m.update(kind=["memoria"]), "unknown memory kind"),
    (lambda m: m.update(kind="lstm"), "unknown memory kind 'lstm'"),
    (lambda m: m["prev_hidden"].fill_(float("-inf")), "non-finite values in `prev_hidden`"),
])
def test_a_malformed_memory_of_any_field_is_one_value_error(change, says):
    sd = _memoria_memory()
    change(sd)
    with pytest.raises(ValueError) as e:
        memory_from_state_dict(sd)
    assert says in str(e.value)
    with pytest.raises(ValueError, match="a saved memory must be a mapping"):
        memory_from_state_dict([sd])


def test_xl_memory_values_are_checked_too():
    sd = {"kind": "xl", "format": 1, "keys": torch.zeros(2, 1, 2, 3, 4), "values": torch.zeros(2, 1, 2, 3, 4),
          "mask": torch.ones(2, 3, dtype=torch.bool), "segments": torch.zeros(2, dtype=torch.int64)}
    assert memory_from_state_dict(sd).batch_size == 2
    sd["values"][1, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite values in `values`"):
        memory_from_state_dict(sd)


def _shard(**change):
    shard = dict(make_shard([4, 5], [memory_from_state_dict(_memoria_memory())], {"step": 3}, 3, 2),
                 format=1, rank=0, world_size=1)
    shard.update(change)
    return shard


@pytest.mark.parametrize("change,says", [
    ({"micro_batch_size": 0}, "micro_batch_size is 0"),
    ({"stream_ids": [4, 4]}, "stream_ids are not distinct"),
    ({"stream_ids": "45"}, "stream_ids are not distinct"),
    ({"rank": 1}, "it says it is rank 1's"),
    ({"step": -3}, "step is -3"),
    ({"streams": None}, "no data stream state"),
    ({"memory": []}, "0 memories for 1 micro-batch slots"),
    ({"memory": {"0": None}}, "no memories"),
    ({"rng": {"python": (3, (1, 2), None), "numpy": None, "torch": None}}, "RNG state cannot be restored"),
    ({"rng": "seed"}, "RNG state cannot be restored"),
])
def test_a_malformed_shard_is_refused(change, says):
    check_shard(_shard(), 0)
    with pytest.raises(ValueError) as e:
        check_shard(_shard(**change), 0)
    assert says in str(e.value)
    bad = _shard()
    bad["memory"][0]["state"]["kind"][0, 0] = 99
    with pytest.raises(ValueError, match="memory of slot 0.*outside 0..3"):
        check_shard(bad, 0)


def _checkpoint(root, step, shard):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    save_tree(dict(shard, step=step), path / "rank_00000.safetensors")
    rel = "rank_00000.safetensors"
    manifest = {"format": 1, "step": step, "world_size": 1, "files": {rel: (path / rel).stat().st_size},
                "sha256": {rel: file_sha256(path / rel)}, "meta": {"config": {}, "fingerprint": {}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_auto_resume_falls_back_past_a_crafted_shard_whose_checksum_matches(tmp_path):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, _shard())
    poisoned = _shard()
    poisoned["memory"][0]["state"]["vectors"].fill_(float("nan"))
    _checkpoint(root, 4, poisoned)
    newest = _checkpoint(root, 6, _shard())
    # a reference to a tensor the file does not hold, with the manifest's checksum updated to match
    meta = {"format": FORMAT, "memoria_ds.tree": json.dumps({"memory": [{"$tensor": "t999"}], "rank": 0})}
    save_file({"t0": torch.ones(1)}, str(newest / "rank_00000.safetensors"), metadata=meta)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["rank_00000.safetensors"] = (newest / "rank_00000.safetensors").stat().st_size
    manifest["sha256"]["rank_00000.safetensors"] = file_sha256(newest / "rank_00000.safetensors")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    info, skipped = find_latest(root)
    assert info is not None and info.step == 2
    assert "tensor 't999', which the file does not hold" in skipped[0]
    assert "non-finite values in `state.vectors`" in skipped[1]


# --------------------------------------------------------------------------- convert
class _System:
    """Unpickling this runs a shell command: the payload of a crafted legacy file."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_convert_runs_no_code_and_loses_no_file(tmp_path, capsys):
    marker = tmp_path / "ran"
    payload = tmp_path / "step_00000002" / "rank_00000.pt"
    payload.parent.mkdir()
    torch.save({"memory": [_System(f"touch {marker}")], "step": 2}, payload)
    before = payload.read_bytes()
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tmp_path)])
    assert e.value.code == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert "would import" in err and "system" in err and "not converted" in err
    assert payload.read_bytes() == before and not payload.with_suffix(".safetensors").exists()
    # a bare (non-zip) pickle with the same payload: torch's restricted unpickler refuses it
    torch.save({"memory": [_System(f"touch {marker}")]}, payload, _use_new_zipfile_serialization=False)
    with pytest.raises(ConvertRefused, match="cannot be loaded as data only"):
        convert_file(payload)
    assert not marker.exists() and payload.exists()


def test_convert_leaves_safetensors_and_deepspeed_files_alone(tmp_path, capsys):
    """The refusal's advice followed on a file that is not a pickle: nothing is touched."""
    for n in range(115, 123):  # header lengths whose first byte is 0x80
        shard = tmp_path / f"rank_{n:05d}.safetensors"
        save_tree({"description": "d" * n}, shard)
        before = shard.read_bytes()
        main(["convert", str(shard)])
        assert "already safetensors" in capsys.readouterr().out
        assert shard.read_bytes() == before
    deepspeed = tmp_path / "engine" / "mp_rank_00_model_states.pt"
    deepspeed.parent.mkdir()
    torch.save({"module": {"w": torch.ones(1)}}, deepspeed)
    with pytest.raises(SystemExit) as e:
        main(["convert", str(deepspeed)])
    assert e.value.code == 2 and "not a legacy memoria_ds pickle" in capsys.readouterr().err
    assert deepspeed.exists() and not deepspeed.with_suffix(".safetensors").exists()


def test_an_interrupted_conversion_is_finished_and_a_foreign_file_is_not_overwritten(tmp_path):
    old = tmp_path / "rank_00000.pt"
    tree = {"stream_ids": [0], "rng": {"numpy": np.random.get_state()}}
    torch.save(tree, old)
    new = old.with_suffix(".safetensors")
    save_tree(torch.load(old, weights_only=False), new)  # killed after writing the copy, before removing the pickle
    assert convert_file(old) == new and not old.exists()
    assert same_tree(load_tree(new), tree)
    torch.save(tree, old)
    save_tree({"something": "else"}, new)
    with pytest.raises(ConvertRefused, match="exists and holds something else"):
        convert_file(old)
    assert old.exists() and load_tree(new) == {"something": "else"}
    with pytest.raises(PickleRefused):
        load_tree(old)


def test_the_analysis_reader_refuses_a_crafted_trace_state(tmp_path):
    from memoria_ds.analysis.memory_data import load_memory
    from memoria_ds.eval.trace import TRACE_STATE_KIND

    good = {"kind": TRACE_STATE_KIND, "memoria": CFG.to_dict(), "state": _engine_state().state_dict(), "step": 6}
    save_tree(good, tmp_path / "m.safetensors")
    assert load_memory(tmp_path / "m.safetensors").state.batch_size == 2
    for change, says in [(lambda t: t.pop("memoria"), "KeyError"), (lambda t: t.update(state=[1]), "mapping"),
                         (lambda t: t["state"]["kind"].fill_(7), "outside 0..3")]:
        tree = {**good, "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in good["state"].items()}}
        change(tree)
        save_tree(tree, tmp_path / "c.safetensors")
        with pytest.raises(ValueError, match=says):
            load_memory(tmp_path / "c.safetensors")


@pytest.mark.parametrize("preset", ["xl", "memoria", "compressive", "infinity", "memorizing", "memory_mosaic_carry",
                                    "memformer", "memsizer_carry"])
def test_every_kinds_saved_memory_loads_and_a_poisoned_one_is_refused(preset):
    """No false alarm on what a kind really carries, and a NaN in any of its float fields refused."""
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    settings = {"memoria": dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4,
                                search_depth=1)} if preset == "memoria" else {}
    model = build_model(backbone, preset, segment_length=8, **settings).eval()
    memory = None
    with torch.no_grad():
        for seed in range(3):
            memory = model(torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(seed)),
                           memory=memory).memory
    sd = memory.state_dict()
    assert memory_from_state_dict(sd).batch_size == 2

    def floats(tree, path=()):
        if torch.is_tensor(tree):
            return [path] if tree.is_floating_point() and tree.numel() else []
        items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
        return [p for k, v in items for p in floats(v, path + (k,))]

    paths = floats(sd)
    assert paths
    for path in paths:
        poisoned = memory.clone().state_dict()
        target = poisoned
        for key in path:
            target = target[key]
        target.view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            memory_from_state_dict(poisoned)
