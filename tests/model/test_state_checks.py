"""Every kind checks its saved state (issue 47 item 3): a memory read back from a file must be of
the model's kind, every field of the dtype the kind writes and of a shape that fits the model,
every value one the kind can hold; else one ValueError naming the field, before the memory is
rebuilt (never a TypeError, a shape error or an invalid multinomial in the first forward). What
the kinds really carry (fresh, after segments, after a reset, stacked) passes."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from memoria_ds.model import KINDS, build_model, load_snapshot, memory_from_state_dict, read, save_snapshot
from memoria_ds.model.recurrent.saved_state import SavedState
from memoria_ds.safe_io import load_tree, save_tree

PRESETS = {  # preset -> memory_type
    "transformer": "none", "xl": "xl", "memoria": "memoria", "compressive": "compressive", "infinity": "infinity",
    "memorizing_no_cache": "memorizing", "memory_mosaic_carry": "mosaic", "memformer": "memformer",
    "memsizer_carry": "memsizer",
}
SEGMENT = 8


def _model(preset: str, **settings):
    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                          eos_token_id=0)
    if preset == "memoria":
        settings.setdefault("memoria", dict(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4,
                                            search_depth=1))
    if preset == "memorizing_no_cache":
        settings.setdefault("memory_settings", {"size": 12, "topk": 4})  # 3 segments of 8 fill it
    if preset == "memformer":
        settings.setdefault("memory_settings", {"num_slots": 4})
    return build_model(backbone, preset, segment_length=SEGMENT, memory_init="random", **settings).eval()


def _memory(model, segments=3, reset_at=1):
    """The memory after `segments` segments of 2 rows, row 0 reset at segment `reset_at`."""
    memory = None
    with torch.no_grad():
        for i in range(segments):
            ids = torch.randint(0, 97, (2, SEGMENT), generator=torch.Generator().manual_seed(i))
            reset = torch.tensor([i == reset_at, False])
            memory = model(ids, memory=memory, reset=reset if memory is not None else None).memory
    return memory


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


@pytest.fixture(scope="module", params=sorted(PRESETS))
def saved(request):
    """(preset, model, the state_dict of what the model carries after three segments)."""
    model = _model(request.param)
    return request.param, model, _clone(_memory(model).state_dict())


# --------------------------------------------------------------------------- no false alarm
def test_what_every_kind_carries_passes_against_its_model(saved):
    preset, model, sd = saved
    config = model.config
    KINDS[config.memory_type].check_state(_clone(sd), config)
    back = memory_from_state_dict(_clone(sd), model_config=config)
    assert back.batch_size == 2
    # fresh, reset, stacked and selected rows too
    fresh = model.empty_memory(3, "cpu")
    assert memory_from_state_dict(fresh.state_dict(), model_config=config).batch_size == 3
    fresh.reset()
    memory_from_state_dict(fresh.state_dict(), model_config=config)
    stacked = type(back).cat([back, back.take_rows([1])])
    assert memory_from_state_dict(stacked.state_dict(), model_config=config).batch_size == 3
    # and the memory rebuilt continues as the one saved, bit for bit
    ids = torch.randint(0, 97, (2, SEGMENT), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # seeded: the infinity-former's sticky memories draw their samples
        torch.manual_seed(1)
        want = model(ids, memory=memory_from_state_dict(_clone(sd))).logits
        torch.manual_seed(1)
        got = model(ids, memory=memory_from_state_dict(_clone(sd), model_config=config)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["xl", "compressive", "memorizing_no_cache", "infinity", "memformer",
                                    "memory_mosaic_carry", "memsizer_carry"])
def test_long_runs_and_bf16_models_pass(preset):
    """Many segments (every cap reached, counters growing), and a bf16 model's memory (caches in
    bf16; memformer's slots normalised in bf16, so only about unit length)."""
    model = _model(preset)
    memory_from_state_dict(_memory(model, segments=9, reset_at=4).state_dict(), model_config=model.config)
    model = model.to(torch.bfloat16)
    memory = _memory(model, segments=5)
    if preset in ("xl", "compressive", "memory_mosaic_carry"):
        assert memory.keys.dtype == torch.bfloat16
    if preset == "memsizer_carry":  # a sum over the whole stream: fp32 whatever the model's dtype
        assert memory.sums.dtype == torch.float32
    memory_from_state_dict(memory.state_dict(), model_config=model.config)


# --------------------------------------------------------------------------- crafted states
def _set(name, value):
    def change(sd):
        sd[name] = value(sd) if callable(value) else value
    return change


def _narrow(*names, dim=-1, size=1):
    """Every field of `names` cut to `size` along `dim`: consistent with each other, not with the model."""
    def change(sd):
        for name in names:
            sd[name] = sd[name].narrow(dim, 0, size).clone()
    return change


def _grow(names, dim, size):
    """Every field of `names` padded to `size` along `dim` (more slots than the model ever keeps)."""
    def change(sd):
        for name in names:
            t = sd[name]
            shape = list(t.shape)
            shape[dim] = size - t.shape[dim]
            sd[name] = torch.cat([t.new_zeros(shape), t], dim=dim)
    return change


def _fill(name, value, index=(0,)):
    def change(sd):
        sd[name][index] = value
    return change


# (change, the message's words, needs the model: passes a check without the model's config)
CRAFTED = {
    "none": [
        (_set("batch_size", -1), r"`batch_size` is -1", False),
        (_set("batch_size", "2"), r"`batch_size` is '2'", False),
    ],
    "xl": [
        (_narrow("keys", "values", size=8), r"`keys` has shape \(2, 2, 2, 8, 8\), expected .*hd=16.*for this model",
         True),
        (_narrow("keys", "values", dim=1, size=1), r"`keys` has shape .*Y=2.* for this model", True),
        (_set("values", lambda sd: sd["values"].double()), r"`values` has dtype torch.float64, expected torch.float32",
         False),
        (_set("mask", lambda sd: sd["mask"].float()), r"`mask` has dtype torch.float32, expected torch.bool", False),
        (_set("segments", lambda sd: torch.full((2,), -5)), r"`segments` holds a negative count", False),
        (_set("segments", lambda sd: torch.full((2,), 3e38)), r"`segments` has dtype torch.float32", False),
        (_grow(("keys", "values"), 3, 100), r"`mask` has shape \(2, 8\), expected \(B=2, M=100\)", False),
        (_set("mask", lambda sd: sd["mask"][:, :3]), r"`mask` has shape \(2, 3\), expected \(B=2, M=8\)", False),
        (lambda sd: (_grow(("keys", "values"), 3, 80)(sd), _grow(("mask",), 1, 80)(sd)),
         r"`mask` has M=80, more than this model ever holds \(64", True),
    ],
    "compressive": [
        (_set("segments", lambda sd: torch.full((2,), -5)), r"`segments` holds a negative count", False),
        (_narrow("keys", "values", "compressed_keys", "compressed_values", size=4),
         r"`keys` has shape .*hd=16\) for this model", True),
        (_set("compressed_mask", lambda sd: sd["compressed_mask"].to(torch.uint8)),
         r"`compressed_mask` has dtype torch.uint8, expected torch.bool", False),
        (_set("compressed_values", lambda sd: sd["compressed_values"][:, :, :, :1]), r"`compressed_values` has shape",
         False),
        (lambda sd: (_grow(("compressed_keys", "compressed_values"), 3, 6)(sd), _grow(("compressed_mask",), 1, 6)(sd)),
         r"`compressed_mask` has C=6, more than this model ever holds \(4: compressive `compressed_length`\)", True),
    ],
    "memorizing": [
        (_narrow("keys", "values", size=8), r"`keys` has shape \(2, 2, 12, 8\), expected \(B=2, H=2, M=12, hd=16\) "
                                              r"for this model", True),
        (_fill("keys", 3e38), r"`keys` holds a key longer than 1", False),
        (_set("mask", lambda sd: sd["mask"].float()), r"`mask` has dtype torch.float32, expected torch.bool", False),
        (_set("values", lambda sd: sd["values"].half()), r"`values` has dtype torch.float16, expected torch.float32",
         False),
        (lambda sd: (_grow(("keys", "values"), 2, 20)(sd), _grow(("mask",), 1, 20)(sd)),
         r"`mask` has M=20, more than this model ever holds \(12: memorizing `size`\)", True),
    ],
    "memformer": [
        (_narrow("slots", size=16), r"`slots` has shape \(2, 4, 16\), expected \(B=2, k=4, D=32\) for this model",
         True),
        (_narrow("slots", dim=1, size=3), r"`slots` has shape \(2, 3, 32\), expected \(B=2, k=4, D=32\) for this model",
         True),
        (_fill("slots", 3e38), r"`slots` holds a slot longer than 1", False),
        (_set("fresh", lambda sd: sd["fresh"].float()), r"`fresh` has dtype torch.float32, expected torch.bool", False),
        (_set("slots", lambda sd: sd["slots"].double()), r"`slots` has dtype torch.float64", False),
    ],
    "infinity": [
        (_fill("mass", -0.5, (0, 0, 0)), r"`mass` holds negative masses", False),
        (_set("mass", lambda sd: sd["mass"] * 3), r"`mass` does not sum to 1", False),
        (_set("has_coefficients", lambda sd: sd["has_coefficients"].float()), r"`has_coefficients` has dtype", False),
        (_set("hidden_mask", lambda sd: sd["hidden_mask"].long()), r"`hidden_mask` has dtype torch.int64", False),
        (_narrow("hidden", "coefficients", size=16), r"`hidden` has shape .*D=32\) for this model", True),
        (_narrow("coefficients", dim=2, size=4), r"`coefficients` has shape .*N=8.* for this model", True),
        (_set("mass", lambda sd: sd["mass"][:, :, :64] * 2), r"`mass` has shape .*K=128", False),
    ],
    "mosaic": [
        (_narrow("keys", "values", "last_key", "last_raw", "kbar", size=8),
         r"`keys` has shape .*hd=16\) for this model", True),
        (_set("mask", lambda sd: sd["mask"].float()), r"`mask` has dtype torch.float32, expected torch.bool", False),
        (_set("has_last", lambda sd: sd["has_last"].long()), r"`has_last` has dtype torch.int64", False),
        (_set("kbar", lambda sd: sd["kbar"][:, :, :1]), r"`kbar` has shape .*expected \(B=2, Y=2, 2, H=2, hd=16\)",
         False),
        (_set("last_key", lambda sd: sd["last_key"].double()), r"`last_key` has dtype torch.float64", False),
    ],
    "memsizer": [
        (_narrow("sums", size=16), r"`sums` has shape \(2, 2, 32, 16\), expected \(B=2, Y=2, K=32, D=32\) for this "
                                   r"model", True),
        (_narrow("sums", dim=2, size=4), r"`sums` has shape .*K=32.* for this model", True),
        (_set("sums", lambda sd: sd["sums"].half()), r"`sums` has dtype torch.float16, expected torch.float32 or "
                                                     r"torch.float64", False),
        (_set("tokens", lambda sd: sd["tokens"].float()), r"`tokens` has dtype torch.float32, expected torch.int64",
         False),
        (_set("tokens", lambda sd: torch.full((2,), -3)), r"`tokens` holds a negative count", False),
        (_set("tokens", lambda sd: torch.zeros(2, dtype=torch.long)), r"`sums` holds values in a row that has read "
                                                                      r"no token", False),
        (_set("tokens", lambda sd: sd["tokens"][:1]), r"`tokens` has shape \(1,\), expected \(B=2\)", False),
    ],
    "memoria": [
        (lambda sd: (_narrow("prev_hidden", size=16)(sd), _narrow("vectors", size=16)(sd["state"])),
         r"`prev_hidden` has shape \(2, 8, 16\), expected \(B=2, P=8, D=32\) for this model", True),
        (_set("prev_mask", lambda sd: sd["prev_mask"].float()), r"`prev_mask` has dtype torch.float32, expected "
                                                                 r"torch.bool", False),
        (lambda sd: sd["state"].update(kind=sd["state"]["kind"].fill_(7)), r"`state`: .*`kind` holds values "
                                                                            r"outside 0..3", False),
        (lambda sd: _narrow("vectors", size=16)(sd["state"]), r"`state` holds 2 rows of width 16; `prev_hidden` 2 of "
                                                              r"width 32", False),
        (lambda sd: sd["state"].update(counts=sd["state"]["counts"].int()), r"`state`: .*`counts` has dtype "
                                                                              r"torch.int32, expected torch.int16",
         True),
    ],
}


@pytest.mark.parametrize("kind,case", [(kind, i) for kind, cases in CRAFTED.items() for i in range(len(cases))],
                         ids=lambda v: str(v))
def test_a_crafted_state_of_every_kind_is_refused_naming_the_field(kind, case):
    preset = next(p for p, k in PRESETS.items() if k == kind)
    model = _model(preset)
    sd = _clone(_memory(model).state_dict())
    change, says, needs_model = CRAFTED[kind][case]
    change(sd)
    with pytest.raises(ValueError, match=says):
        memory_from_state_dict(_clone(sd), model_config=model.config)
    with pytest.raises(ValueError, match=says):
        KINDS[kind].check_state(_clone(sd), model.config)
    if needs_model:  # consistent in itself: only the model tells
        memory_from_state_dict(_clone(sd))
    else:  # a file can be refused for it without its model (a checkpoint's validation)
        with pytest.raises(ValueError, match=says):
            memory_from_state_dict(_clone(sd))


def test_every_kind_is_covered():
    assert set(CRAFTED) == set(KINDS) == set(PRESETS.values())


def test_a_memory_of_another_kind_is_refused_for_the_model():
    xl = _clone(_memory(_model("xl")).state_dict())
    model = _model("memorizing_no_cache")
    with pytest.raises(ValueError, match="saved memory is of kind 'xl' but this model's memory is 'memorizing'"):
        memory_from_state_dict(xl, model_config=model.config)


def test_the_field_checks_name_sizes_and_bind_them_once():
    s = SavedState({"kind": "xl", "format": 1, "a": torch.zeros(2, 3), "b": torch.zeros(2, 4)}, "xl", {"H": 3})
    s.tensor("a", (torch.float32,), "B H")
    with pytest.raises(ValueError, match=r"saved xl memory: `b` has shape \(2, 4\), expected \(B=2, H=3\) for this "
                                         r"model"):
        s.tensor("b", (torch.float32,), "B H")
    with pytest.raises(ValueError, match=r"`c` is missing"):
        s.tensor("c", (torch.float32,), "B")
    with pytest.raises(ValueError, match="saved memory is of kind 'xl', expected 'memformer'"):
        SavedState({"kind": "xl", "format": 1}, "memformer")
    with pytest.raises(ValueError, match="must be a mapping"):
        SavedState([1], "xl")


# --------------------------------------------------------------------------- snapshots
def _snapshot(tmp_path, preset):
    model = _model(preset)
    book = torch.randint(0, 97, (1, 3 * SEGMENT), generator=torch.Generator().manual_seed(1))
    return model, save_snapshot(tmp_path / "book.safetensors", model, read(model, book, SEGMENT))


def test_a_crafted_snapshot_of_the_right_model_is_refused_when_loaded(tmp_path):
    """The right fingerprint does not make a snapshot's memory one the model can run."""
    model, path = _snapshot(tmp_path, "memorizing_no_cache")
    assert load_snapshot(path, model).memory.batch_size == 1
    tree = load_tree(path)
    narrow = dict(tree, memory=dict(tree["memory"], keys=tree["memory"]["keys"][..., :8].clone(),
                                    values=tree["memory"]["values"][..., :8].clone()))
    save_tree(narrow, tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match=r"narrow.safetensors: saved memorizing memory: `keys` has shape"):
        load_snapshot(tmp_path / "narrow.safetensors", model)
    xl_memory = _memory(_model("xl"), segments=1).take_rows([0]).state_dict()
    save_tree(dict(tree, memory=xl_memory), tmp_path / "other_kind.safetensors")
    with pytest.raises(ValueError, match="saved memory is of kind 'xl' but this model's memory is 'memorizing'"):
        load_snapshot(tmp_path / "other_kind.safetensors", model)
