"""Bolted onto a pretrained backbone, the memory starts as an exact no-op (SPEC section 2)."""

import pytest
import torch
from model_helpers import run_stream, segments
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from memoria_ds.model import build_model


def backbone_of(model) -> GPT2LMHeadModel:
    """A plain HF GPT-2 with exactly the model's backbone weights and attention implementation."""
    fields = GPT2Config().to_dict()
    config = GPT2Config(
        **{k: v for k, v in model.config.to_dict().items() if k in fields and k != "model_type"},
        attn_implementation=model.config._attn_implementation,
    )
    ref = GPT2LMHeadModel(config)
    missing, unexpected = ref.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k.startswith(("transformer.", "lm_head."))}, strict=False
    )
    assert not unexpected and all(k.endswith("attn.bias") for k in missing), (missing, unexpected)
    return ref.eval()


@pytest.mark.parametrize("preset", ["memoria", "memoria_wm", "memoria_wm_stm", "memoria_fast", "xl", "transformer"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_first_segment_is_the_backbone(make_model, preset, attn):
    """With any init, the first segment (no memory yet) is exactly the plain backbone."""
    model = make_model(preset, memory_init="random", attn_implementation=attn)
    ref = backbone_of(model)
    x = segments(count=1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["memoria", "memoria_wm", "memoria_wm_stm", "memoria_fast"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_noop_init_is_the_backbone_on_every_segment(make_model, preset, attn):
    model = make_model(preset, attn_implementation=attn)  # memory_init="noop" is the default
    ref = backbone_of(model)
    segs = segments(count=6)
    with torch.no_grad():
        outs, memory = run_stream(model, segs)
        for x, out in zip(segs, outs):
            torch.testing.assert_close(out.logits, ref(x).logits, rtol=0, atol=0)
    assert int(memory.state.step.min()) == 5  # the memory did run: 5 steps after the first segment
    if model.config.memoria_config.use_stm:
        assert int(outs[-1].memory_stats.reminded_stm.max()) > 0  # and attended to reminded engrams


def test_random_init_changes_later_segments(make_model):
    model = make_model("memoria", memory_init="random")
    ref = backbone_of(model)
    segs = segments(count=3)
    with torch.no_grad():
        outs, _ = run_stream(model, segs)
        assert (outs[1].logits - ref(segs[1]).logits).abs().max() > 1e-5
        assert (outs[2].logits - ref(segs[2]).logits).abs().max() > 1e-5


def test_noop_output_projections_are_zero_and_the_rest_random(make_model):
    model = make_model("memoria")
    for block in model.memory_blocks:
        attn = block.memory_attention
        assert attn.out_proj.weight.abs().max() == 0 and attn.out_proj.bias.abs().max() == 0
        assert attn.q_proj.weight.std() > 0.01 and attn.kv_proj.weight.std() > 0.01
    assert model.abstractor.queries.std() > 0.5


def test_built_from_a_local_gpt2_checkpoint_starts_as_it(backbone_config, tmp_path):
    """The hub path (`build_model("gpt2")`), exercised with a local directory."""
    gpt2 = GPT2LMHeadModel(backbone_config).eval()
    gpt2.save_pretrained(tmp_path)
    model = build_model(
        str(tmp_path), "memoria", memoria={"num_wm": 4, "num_stm_reminded": 3, "num_ltm_reminded": 3, "stm_capacity": 8}
    ).eval()
    segs = segments(count=4)
    with torch.no_grad():
        outs, _ = run_stream(model, segs)
        for x, out in zip(segs, outs):
            torch.testing.assert_close(out.logits, gpt2(x).logits, rtol=0, atol=0)
    assert model.config.memoria["num_wm"] == 4 and model.config.n_layer == backbone_config.n_layer


def test_built_from_a_base_model_checkpoint_without_prefix(backbone_config, tmp_path):
    """The hub's `gpt2` weights have no `transformer.` prefix and no lm_head (tied)."""
    base = GPT2Model(backbone_config).eval()
    base.save_pretrained(tmp_path)
    model = build_model(str(tmp_path), "xl").eval()
    x = segments(count=1)[0]
    with torch.no_grad():
        hidden = base(x).last_hidden_state
        torch.testing.assert_close(model(x).logits, hidden @ base.wte.weight.T, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["xl", "memoria", "memoria_wm", "memoria_full_width", "memoria_fast"])
@pytest.mark.parametrize("init", ["noop", "random"])
def test_one_seed_gives_every_preset_the_plain_models_backbone(backbone_config, preset, init):
    """A from-scratch comparison is paired: with one seed, every preset starts from the same
    backbone weights as `transformer` (the memory's modules do not shift the backbone's draws),
    so a difference after training is the memory's, not the luck of the init."""
    torch.manual_seed(7)
    plain = build_model(backbone_config, "transformer").state_dict()
    torch.manual_seed(7)
    model = build_model(backbone_config, preset, memory_init=init).state_dict()
    for name, value in plain.items():
        assert torch.equal(model[name], value), name
