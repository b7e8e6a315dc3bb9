"""save_pretrained -> from_pretrained gives the same model; the Auto classes know it."""

import pytest
import torch
from model_helpers import run_stream, segments
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from memoria_ds.model import MemoriaGPT2Config, MemoriaGPT2LMHeadModel, build_model


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_round_trip_gives_identical_logits(make_model, tmp_path, preset):
    model = make_model(preset, memory_init="random", memory_layers=[1])
    model.save_pretrained(tmp_path)
    loaded = MemoriaGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    drop = {"_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k not in drop} == {
        k: v for k, v in model.config.to_dict().items() if k not in drop
    }
    segs = segments(count=4)
    with torch.no_grad():
        a, _ = run_stream(model, segs)
        b, _ = run_stream(loaded, segs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=0)


def test_auto_classes_load_it(make_model, tmp_path):
    model = make_model("memoria", memory_init="random")
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), MemoriaGPT2Config)
    x = segments(count=1)[0]
    for auto in (AutoModel, AutoModelForCausalLM):
        loaded = auto.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, MemoriaGPT2LMHeadModel)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_build_model_reloads_a_saved_memoria_model(make_model, tmp_path):
    model = make_model("memoria_wm_stm", memory_init="random")
    model.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path)).eval()
    assert loaded.config.memoria["use_ltm"] is False
    x = segments(count=1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_tied_embeddings_survive(make_model, tmp_path):
    model = make_model("memoria")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = MemoriaGPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
