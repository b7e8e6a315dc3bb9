"""Several memory kinds in one model (`memory_type="xl+memoria"`, issue 54 item 1): each part reads where it
reads and writes its own state, and the whole keeps every guarantee a single kind has."""

from __future__ import annotations

import io

import pytest
import torch
from model_helpers import (
    VOCAB, assert_a_reset_row_starts_a_fresh_stream, assert_only_later_tokens_change,
    assert_row_operations_keep_outputs, changed_token, run_stream, segments,
)

from memoria_ds.model import build_model
from memoria_ds.model.config import check_model_settings
from memoria_ds.model.recurrent import memory_from_state_dict
from memoria_ds.setting_rules import SettingError

COMPOSITES = ["xl+memoria", "xl+memorizing", "xl+infinity", "xl+memformer", "xl+memoria_gated"]


def _logits(model, segs, memory=None):
    with torch.no_grad():
        torch.manual_seed(0)  # the infinity-former's sticky samples
        outs, _ = run_stream(model, segs, memory=memory)
    return [o.logits for o in outs]


def _twin(make_model, preset, source, **settings):
    """A model of `preset` holding `source`'s weights (the parts' modules included)."""
    model = make_model(preset, segment_length=12, **settings)
    missing, _ = model.load_state_dict(source.state_dict(), strict=False)  # a part's modules are unexpected
    return model, missing


@pytest.mark.parametrize("preset,settings,match", [
    ("xl+compressive", {}, "both read through the blocks' cached slots"),
    ("xl+xl", {}, "repeats 'xl'"),
    ("transformer+xl", {}, "joins `none`"),
    ("xl+memory_mosaic_carry", {}, "joins `mosaic`, which only its own model family runs"),
    ("memsizer_carry+xl", {}, "joins `memsizer`, which only its own model family runs"),
    ("infinity+memformer", {}, "trainable modules"),
    ("memoria+memorizing", {}, "trainable modules"),
    ("xl+memorizing", {"memory_settings": {"memorizing": {"size": 0}}}, "memory_settings.memorizing.size"),
    ("xl+memorizing", {"memory_settings": {"xl": {}}}, "memory_settings.xl"),
])
def test_kinds_that_read_through_one_place_or_bad_settings_are_refused(preset, settings, match):
    with pytest.raises(SettingError, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_model_settings(preset, settings)
    with pytest.raises(ValueError, match="unknown preset 'bogus'"):
        check_model_settings("xl+bogus", {})


def test_a_composite_is_named_and_set_by_its_parts(make_model):
    model = make_model("xl+memorizing", memory_settings={"memorizing": {"size": 64, "topk": 4}})
    cfg = model.config
    assert cfg.memory_type == "xl+memorizing" and cfg.memory_kinds == ("xl", "memorizing")
    assert cfg.position_banks == 2  # the xl preset's alternating banks
    assert cfg.memory_settings["memorizing"]["size"] == 64
    assert model.memory_kind.parts["memorizing"].settings.topk == 4
    assert model.memory_kind.cached_slots(12) == 12  # xl's one segment; the kNN memory is not a cached slot


@pytest.mark.parametrize("memoria", ["memoria", "memoria_gated"])
def test_xl_memoria_with_its_cache_reset_before_every_segment_is_memoria(make_model, memoria):
    """The Memoria part reads and writes what Memoria alone does when the cache holds nothing (read in
    its memory attention, or as self-attention slots ahead of the cache's)."""
    both = make_model(f"xl+{memoria}", memory_init="random", xl_positions="shared", segment_length=12)
    alone, missing = _twin(make_model, memoria, both, memory_init="random")
    assert not missing
    segs = segments(count=4)
    memory, fresh = None, torch.ones(3, dtype=torch.bool)
    with torch.no_grad():
        want, mine = run_stream(alone, segs)
        for x, out_alone in zip(segs, want):
            if memory is not None:
                memory.reset_part("xl", fresh)
            out = both(x, memory=memory)
            memory = out.memory
            torch.testing.assert_close(out.logits, out_alone.logits, rtol=0, atol=1e-5)
    for name, t in memory.memoria.state.tensors().items():
        if name == "digest":  # each model draws its own digest projection
            continue
        torch.testing.assert_close(t, getattr(mine.state, name), rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("preset", COMPOSITES)
def test_a_part_that_starts_as_the_backbone_leaves_the_other_part_alone(make_model, preset):
    """With the no-op init every part but xl adds exactly nothing: the composite is `xl`, segment by segment
    (the kNN gate of `memorizing` and the engram slots' gate of `memoria_gated` are nearly shut, not shut:
    only while their memory is empty)."""
    both = make_model(preset, segment_length=12, memory_init="noop")  # (the infinity preset's is random)
    xl, _ = _twin(make_model, "xl", both)
    segs = segments(count=4 if preset not in ("xl+memorizing", "xl+memoria_gated") else 1)
    for a, b in zip(_logits(both, segs), _logits(xl, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", COMPOSITES)
@pytest.mark.parametrize("t,pos", [(1, 0), (2, 7)])
def test_a_token_affects_only_what_comes_after_it(make_model, preset, t, pos):
    model = make_model(preset, memory_init="random", segment_length=12)
    segs = segments(count=4)
    a, b = _logits(model, segs), _logits(model, changed_token(segs, t, pos))
    assert_only_later_tokens_change(a, b, t, pos)


@pytest.mark.parametrize("preset", ["xl+memoria", "xl+memoria_gated"])
def test_the_engrams_and_the_cache_are_both_read(make_model, preset):
    """Forgetting either part changes the next segment (each is read in the same step)."""
    model = make_model(preset, memory_init="random")
    segs = segments(count=4)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        whole = model(segs[3], memory=memory.clone()).logits
        for part in ("xl", "memoria"):
            forgot = memory.clone()
            forgot.reset_part(part)
            assert (model(segs[3], memory=forgot).logits - whole).abs().max() > 1e-4, part


@pytest.mark.parametrize("preset", COMPOSITES)
def test_rows_resets_and_a_saved_memory_keep_what_each_row_reads(make_model, preset):
    # the infinity-former's sticky samples are drawn per row: evenly spaced ones here
    own = {"memory_settings": {"infinity": {"sticky": False}}} if preset == "xl+infinity" else {}
    model = make_model(preset, memory_init="random", segment_length=12, **own)
    segs4 = segments(batch=4, count=5, seed=2)
    with torch.no_grad():
        _, memory = run_stream(model, segs4[:3])
    assert_row_operations_keep_outputs(model, segs4[3:], memory, _logits, atol=1e-5)
    saved = io.BytesIO()
    torch.save(memory.state_dict(), saved)
    saved.seek(0)
    back = memory_from_state_dict(torch.load(saved, weights_only=True), model_config=model.config)
    for a, b in zip(_logits(model, segs4[3:], memory.clone()), _logits(model, segs4[3:], back)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_a_reset_row_starts_a_fresh_stream(model, segments(count=6, seed=3), _logits, keep_atol=1e-5)


def test_a_saved_composite_memory_is_checked_part_by_part(make_model):
    model = make_model("xl+memoria", memory_init="random")
    with torch.no_grad():
        _, memory = run_stream(model, segments(count=2))
    state = memory.state_dict()
    assert state["kind"] == "xl+memoria" and sorted(state["parts"]) == ["memoria", "xl"]
    bad = {**state, "parts": {**state["parts"], "xl": {**state["parts"]["xl"], "mask": state["parts"]["xl"]["mask"][:, :3]}}}
    with pytest.raises(ValueError, match="part 'xl'.*`mask`"):
        memory_from_state_dict(bad, model_config=model.config)
    with pytest.raises(ValueError, match="`parts` must hold"):
        memory_from_state_dict({**state, "parts": {"xl": state["parts"]["xl"]}}, model_config=model.config)
    other = make_model("xl")
    with pytest.raises(ValueError, match="this model's memory is 'xl'"):
        memory_from_state_dict(state, model_config=other.config)


def test_a_composite_model_saves_and_loads_through_the_auto_classes(make_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model("xl+memoria", memory_init="random")
    segs = segments(count=3)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.memory_type == "xl+memoria"
    for a, b in zip(_logits(model, segs), _logits(loaded, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    again = build_model(tmp_path, "xl+memoria")
    assert again.config.memory_kinds == ("xl", "memoria")


def test_each_part_is_worth_what_forgetting_it_costs(make_model):
    """`memoryless_<part>` scores `full`'s tokens with that part reset before every segment (a per-segment
    reference below) and the others carried; `part_gains` pairs each with `full`."""
    import numpy as np

    from memoria_ds.data import TokenCorpus
    from memoria_ds.eval import evaluate_lm, full_protocol, part_gains, protocol_from_name

    model = make_model("xl+memoria", memory_init="random", segment_length=12)
    rng = np.random.default_rng(0)
    corpus = TokenCorpus.from_token_lists([rng.integers(0, VOCAB, 60).tolist()],
                                          metadata={"corpus": "toy", "split": "test"})
    full = evaluate_lm(model, corpus, full_protocol(12, 1), progress=False)
    parts = {p: evaluate_lm(model, corpus, protocol_from_name(f"memoryless_{p}", 12, 1), progress=False)
             for p in ("xl", "memoria")}
    tokens = torch.tensor(np.asarray(corpus.tokens, dtype=np.int64))[None]  # (1, 60): one stream, 5 segments of 12
    for part, result in parts.items():  # the reference: segment by segment, the part forgotten before each
        memory, nll = None, 0.0
        with torch.no_grad():
            for s in range(5):
                x = tokens[:, 12 * s: 12 * s + 12]
                if memory is not None:
                    memory.reset_part(part)
                out = model(x, memory=memory)
                memory = out.memory
                targets = tokens[0, 12 * s + 1: 12 * s + 13]
                logp = out.logits[0, : targets.numel()].log_softmax(-1)
                nll -= float(logp.gather(1, targets[:, None]).sum())
        assert result.scored_tokens == full.scored_tokens == 59
        assert result.nll_sum == pytest.approx(nll, rel=1e-5), part
        assert result.protocol["name"] == f"memoryless_{part}"
    gains = part_gains([full, *parts.values()])
    assert sorted(gains) == ["memoria", "xl"]
    for part, gain in gains.items():
        assert gain.part == part and gain.nats_per_token == pytest.approx(parts[part].nll - full.nll)
        assert gain.describe().startswith(f"gain of the memory's {part} test: ")
    with pytest.raises(ValueError, match="forgets the part 'xl' of a composite memory"):
        evaluate_lm(make_model("xl"), corpus, protocol_from_name("memoryless_xl", 12, 1), progress=False)


def test_a_run_configuration_names_only_parts_its_model_has():
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    ok = load(RunConfig, None, ["model.preset=xl+memoria", "eval.protocols=[full,memoryless,memoryless_xl]"])
    assert ok.eval.protocols == ["full", "memoryless", "memoryless_xl"]
    for preset, name, match in (("xl", "memoryless_xl", "a single kind: use `memoryless`"),
                                ("xl+memoria", "memoryless_memorizing", "its parts are \\['xl', 'memoria'\\]"),
                                ("xl+memoria", "nothing", "unknown eval protocol")):
        with pytest.raises(ConfigError, match=match):
            load(RunConfig, None, [f"model.preset={preset}", f"eval.protocols=[full,{name}]"])


def test_a_composite_preset_names_each_kind_once_and_keeps_each_parts_settings():
    """`memorizing` is itself xl+memorizing: joined with `xl` it is the same model, not xl twice; a single
    kind's preset settings go under its kind; the user's settings merge part by part."""
    from memoria_ds.model.config import composite_preset, resolve_preset

    assert composite_preset("xl+memorizing") == resolve_preset("memorizing") == {
        "memory_type": "xl+memorizing", "xl_positions": "alternate",
        "memory_settings": {"memorizing": {"gate_bias": 0.0}}}
    assert composite_preset("xl+memorizing_no_cache") == {"memory_type": "xl+memorizing", "xl_positions": "alternate"}
    merged = resolve_preset("memorizing", memory_settings={"memorizing": {"size": 8}})
    assert merged["memory_settings"] == {"memorizing": {"gate_bias": 0.0, "size": 8}}


@pytest.mark.parametrize("memoria_reset,bias", [(True, -4.0), (False, -1e4)])
def test_engram_slots_beside_the_cache_give_xl_where_the_slots_are_shut(make_model, memoria_reset, bias):
    """xl+memoria_gated is `xl` where no engram slot can be read: with its Memoria part reset before every
    segment (every slot masked), and with the slots' gate at -1e4 while they hold engrams (the bias falls
    on the engram slots only, ahead of the cache's keys: a bias on a cached key would move the logits)."""
    both = make_model("xl+memoria_gated", memory_init="random", segment_length=12, engram_bias=bias)
    xl, _ = _twin(make_model, "xl", both)
    segs = segments(count=4)
    memory, fresh = None, torch.ones(3, dtype=torch.bool)
    with torch.no_grad():
        want, _ = run_stream(xl, segs)
        for t, (x, out_xl) in enumerate(zip(segs, want)):
            if memory is not None and memoria_reset:
                memory.reset_part("memoria", fresh)
            before = memory.clone() if memory is not None else None
            out = both(x, memory=memory)
            memory = out.memory
            torch.testing.assert_close(out.logits, out_xl.logits, rtol=0, atol=1e-5, msg=f"segment {t}")
        if not memoria_reset:  # the control: the same slots with their gate open are read
            for name, p in both.named_parameters():
                if "engram_bias" in name:
                    p.fill_(0.0)
            assert (both(segs[-1], memory=before).logits - want[-1].logits).abs().max() > 1e-4
