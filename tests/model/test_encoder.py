"""The Memoria encoders' contract: the stated initialisation, loading (by name, save/load, Auto classes, remote
code), the memory per row (resets, rows, resume from a saved memory), dtypes, padding, settings, checkpointing."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from encoder_helpers import PAD, SMALL_ENCODER_MEMORIA, document_segments, randomize, tiny_backbone, tiny_encoder
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertForSequenceClassification,
    GPT2Config,
    RobertaForSequenceClassification,
)

from memoria_ds.model.encoder import (
    EncoderMemory,
    MemoriaBertConfig,
    MemoriaBertForSequenceClassification,
    MemoriaRobertaForSequenceClassification,
    add_encoder_remote_code,
    build_encoder_model,
    encoder_config,
)
from memoria_ds.model.remote_code import add_remote_code
from memoria_ds.setting_rules import SettingError

BAD_SETTING = (SettingError, StrictDataclassError)  # HF's strict config wraps the SettingError, message kept

PLAIN = {"bert": BertForSequenceClassification, "roberta": RobertaForSequenceClassification}
MODEL = {"bert": MemoriaBertForSequenceClassification, "roberta": MemoriaRobertaForSequenceClassification}


def plain_twin(model, family: str):
    """The backbone's own HF classifier with the Memoria model's backbone and head weights."""
    plain = PLAIN[family](tiny_backbone(family, num_labels=model.config.num_labels)).eval()
    missing, unexpected = plain.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}, strict=False)
    assert not missing and not unexpected
    return plain


def padded(ids: torch.Tensor, family: str, row: int = 1, count: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) with the last `count` tokens of `row` padding."""
    mask = torch.ones_like(ids)
    mask[row, -count:] = 0
    return ids.masked_fill(mask == 0, PAD[family]), mask


def run(model, segs, memory=None, resets=None, **kwargs):
    """Feed the segments in order; returns (logits per segment, final memory)."""
    logits = []
    for t, ids in enumerate(segs):
        reset = resets[t] if resets is not None else None
        with torch.no_grad():
            out = model(ids, memory=memory, reset=reset, **kwargs)
        memory = out.memory
        logits.append(out.logits)
    return logits, memory


# ------------------------------------------------------------------ the stated initialisation
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_fresh_model_is_exactly_its_backbone_classifier(family):
    """memory_init="noop": the memory attention's output projection is zero, so every segment's logits are the
    plain HF classifier's bit for bit, while the memory fills (padding included)."""
    model = tiny_encoder(family)
    plain = plain_twin(model, family)
    memory = None
    for ids in document_segments(family):
        ids, mask = padded(ids, family)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, memory=memory)
            torch.testing.assert_close(out.logits, plain(ids, attention_mask=mask).logits, rtol=0, atol=0)
        memory = out.memory
    assert int(out.memory_stats.reminded_stm.min()) > 0  # the memory was read, and added nothing


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_the_backbone_preset_is_its_hf_classifier_and_carries_nothing(family, tmp_path):
    """Preset `backbone` (the baseline the memory is measured against): HF's classifier bit for bit, its
    weight names, no memory module, a memory that keeps only the batch size; it saves and loads."""
    model = tiny_encoder(family, "backbone")
    assert model.memory_modules() == [] and not any("memory" in n or "abstractor" in n
                                                    for n, _ in model.named_parameters())
    plain = PLAIN[family](model.config).eval()
    plain.load_state_dict(model.state_dict(), strict=True)  # exactly HF's weights, by HF's names
    memory = None
    for ids in document_segments(family):
        ids, mask = padded(ids, family)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, labels=torch.tensor([0, 2]), memory=memory,
                        reset=torch.tensor([False, True]))
            ref = plain(ids, attention_mask=mask, labels=torch.tensor([0, 2]))
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
        assert out.memory_stats is None and out.memory.state_dict()["kind"] == "none"
        memory = out.memory
    with pytest.raises(ValueError, match="has no memory"):
        model(ids, memory=tiny_encoder(family).empty_memory(2))
    model.save_pretrained(tmp_path)
    loaded = build_encoder_model(tmp_path)
    assert loaded.config.use_memory is False and loaded.memory_modules() == []


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_checkpoint_loads_by_name_and_starts_as_it(family, tmp_path):
    """A saved HF classifier (BertForSequenceClassification / RobertaForSequenceClassification) loads by name into
    the Memoria model, whose memory modules are initialised as stated: its logits are the checkpoint's."""
    plain = PLAIN[family](tiny_backbone(family, num_labels=3)).eval()
    plain.save_pretrained(tmp_path)
    model = build_encoder_model(tmp_path, memoria=SMALL_ENCODER_MEMORIA, memory_layer_index=1)
    assert isinstance(model, MODEL[family]) and not model.training
    assert model.config.num_labels == 3
    ids = document_segments(family, count=1)[0]
    for layer in model.memory_layers.values():
        assert not layer.memory_attention.out_proj.weight.any() and not layer.memory_attention.out_proj.bias.any()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_the_authors_initialisation_is_random_and_not_a_noop():
    """memory_init="random" (preset memoria_authors): every new weight as the authors' code draws it (BERT's
    N(0, initializer_range), the abstractor's queries N(0, 0.02) as their Abstractor draws them). Around a trained
    backbone (layer norms away from 1 and 0) their post-norm memory attention changes the stream at once."""
    model = tiny_encoder("bert", "memoria_authors", initializer_range=0.02)
    attention = model.memory_layers["2"].memory_attention
    with torch.no_grad():
        assert 0.015 < float(attention.out_proj.weight.std()) < 0.025 and not attention.out_proj.bias.any()
        assert torch.equal(attention.ln.weight, torch.ones(32)) and not attention.ln.bias.any()
        assert 0.015 < float(model.abstractor.queries.std()) < 0.025
        assert 0.8 < float(tiny_encoder("bert").abstractor.queries.std()) < 1.2  # the transformer style: N(0, 1)
    ids = document_segments("bert", count=1)[0]
    trained = tiny_encoder("bert")
    randomize(trained)
    model.load_state_dict({k: v for k, v in trained.state_dict().items() if k.startswith("bert.")}, strict=False)
    seen = []  # the last layer's output, as the pooler reads it
    model.bert.pooler.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        model(ids)
        plain = plain_twin(model, "bert").bert(ids).last_hidden_state
    assert (seen[0] - plain).abs().max() > 1e-2


def test_training_from_the_noop_makes_the_memory_matter():
    """The zero output projection receives a gradient at once; after a few steps the rest of the memory has
    learned too, and the second segment's logits depend on the first segment."""
    model = tiny_encoder("bert").train()
    randomize(model)  # a trained backbone ...
    for layer in model.memory_layers.values():  # ... and the stated init of the memory attention's projection
        torch.nn.init.zeros_(layer.memory_attention.out_proj.weight)
        torch.nn.init.zeros_(layer.memory_attention.out_proj.bias)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first, second = document_segments("bert", count=2)
    labels = torch.tensor([0, 2])
    for step in range(3):
        out = model(first, labels=labels)
        out2 = model(second, labels=labels, memory=out.memory)
        (out.loss + out2.loss).backward()
        out_proj = model.memory_layers["3"].memory_attention.out_proj.weight
        queries = model.abstractor.queries.grad
        if step == 0:
            assert out_proj.grad.abs().max() > 0
            assert queries is None or not queries.any()
        else:  # reached once the projection moved
            assert queries.abs().max() > 0
        opt.step()
        opt.zero_grad()
    model.eval()
    other = torch.roll(first, 1, dims=1)
    a, _ = run(model, [first, second])
    b, _ = run(model, [other, second])
    assert (a[1] - b[1]).abs().max() > 1e-4


# ------------------------------------------------------------------ saving and loading
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_save_load_round_trip_and_the_auto_classes(family, tmp_path):
    model = tiny_encoder(family, "memoria_authors")
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), type(model.config))
    segs = document_segments(family, count=3)
    want, _ = run(model, segs)
    drop = {"_name_or_path", "architectures"}
    for loaded in (MODEL[family].from_pretrained(tmp_path),
                   AutoModelForSequenceClassification.from_pretrained(tmp_path), build_encoder_model(tmp_path)):
        assert type(loaded) is MODEL[family]
        assert {k: v for k, v in loaded.config.to_dict().items() if k not in drop} == {
            k: v for k, v in model.config.to_dict().items() if k not in drop}
        got, _ = run(loaded.eval(), segs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    changed = build_encoder_model(tmp_path, memoria={"use_ltm": False})  # settings override the saved ones
    assert changed.config.memoria["use_ltm"] is False and changed.config.memoria["num_wm"] == 4


def test_the_export_loads_with_remote_code_in_a_fresh_process(tmp_path):
    """The causal models' route: `auto_map` and two one-line modules; a fresh process that never imports
    memoria_ds loads it through AutoModelForSequenceClassification with trust_remote_code=True."""
    model = tiny_encoder("roberta", "memoria_authors")
    assert add_remote_code(model, tmp_path)  # the export's one route, for every model
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.py")) == ["configuration_memoria_roberta.py",
                                                             "modeling_memoria_roberta.py"]
    ids = document_segments("roberta", count=1)[0]
    script = (
        "import sys, torch; from transformers import AutoModelForSequenceClassification as A; "
        "assert 'memoria_ds' not in sys.modules; "
        f"m = A.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval(); "
        f"ids = torch.tensor({ids.tolist()}); "
        "out = m(ids); print(type(m).__name__); print(out.logits.tolist())"
    )
    env_root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": env_root, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    name, logits = done.stdout.strip().splitlines()[-2:]
    assert name == "MemoriaRobertaForSequenceClassification"
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(eval(logits)), model(ids).logits, rtol=0, atol=1e-6)
    assert add_encoder_remote_code(plain_twin(model, "roberta"), tmp_path / "plain") is False
    assert add_remote_code(plain_twin(model, "roberta"), tmp_path / "plain") is False


# ------------------------------------------------------------------ the memory, row by row
def test_a_reset_row_starts_fresh_and_the_others_go_on():
    """Row 1 starts a new document before segment 3: its logits are those of a fresh memory, its state is a fresh
    row's after one step, and the other rows compute what they compute without the reset."""
    model = tiny_encoder("bert", "memoria_authors")
    randomize(model)
    segs = document_segments("bert", batch=3, count=4)
    no_reset, memory_a = run(model, segs)
    resets = [None, None, None, torch.tensor([False, True, False])]
    with_reset, memory_b = run(model, segs, resets=resets)
    fresh, memory_f = run(model, segs[3:])
    torch.testing.assert_close(with_reset[3][1], fresh[0][1], rtol=0, atol=1e-6)
    for row in (0, 2):
        torch.testing.assert_close(with_reset[3][row], no_reset[3][row], rtol=0, atol=1e-6)
    assert (with_reset[3][1] - no_reset[3][1]).abs().max() > 1e-4
    b, f = memory_b.state.take_rows([1]), memory_f.state.take_rows([1])
    assert torch.equal(b.kind, f.kind) and torch.equal(b.uid, f.uid) and torch.equal(b.step, f.step)
    torch.testing.assert_close(b.lifespan, f.lifespan, rtol=0, atol=1e-6)


def test_a_saved_memory_resumes_exactly():
    """The memory's state_dict round-trips through a file; continuing from it equals continuing live, bit for bit;
    rows taken apart and put back together continue the same."""
    model = tiny_encoder("roberta", "memoria_authors")
    randomize(model)
    segs = document_segments("roberta", batch=3, count=5)
    _, memory = run(model, segs[:3])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    loaded = EncoderMemory.from_state_dict(torch.load(buffer), config=model.memory_settings)
    parts = EncoderMemory.cat([memory.take_rows([2]), memory.take_rows([0, 1])])  # rows re-ordered ...
    regrouped = EncoderMemory.empty(model.memory_settings, 3, 32)
    regrouped.put_rows([2, 0, 1], parts)  # ... and put back in place
    live, final = run(model, segs[3:], memory=memory.clone())
    for other in (loaded, regrouped):
        got, memory_b = run(model, segs[3:], memory=other)
        for a, b in zip(got, live):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for name, t in final.state.tensors().items():
            assert torch.equal(t, getattr(memory_b.state, name)), name


def test_memories_that_do_not_fit_are_refused():
    model = tiny_encoder("bert")
    ids = document_segments("bert", count=1)[0]
    memory = model(ids).memory
    with pytest.raises(ValueError, match="rows"):
        model(ids[:1], memory=memory)
    with pytest.raises(ValueError, match="EncoderMemory"):
        model(ids, memory=memory.state)
    with pytest.raises(ValueError, match="capacity"):
        tiny_encoder("bert", memoria={"capacity": 128})(ids, memory=memory)
    with pytest.raises(ValueError, match="kind"):
        EncoderMemory.from_state_dict({**memory.state_dict(), "kind": "memoria"})
    with pytest.raises(ValueError, match="shape"):
        model(ids, memory=memory, reset=torch.tensor([True]))


# ------------------------------------------------------------------ dtypes, padding, settings, checkpointing
def test_a_bf16_forward_keeps_the_memory_in_fp32():
    model = tiny_encoder("bert", "memoria_authors").to(torch.bfloat16)
    logits, memory = run(model, document_segments("bert", count=3))
    assert logits[-1].dtype == torch.bfloat16 and torch.isfinite(logits[-1].float()).all()
    assert memory.state.vectors.dtype == torch.float32 and memory.state.lifespan.dtype == torch.float32
    assert int((memory.state.kind == 2).sum()) > 0
    fp32 = tiny_encoder("bert", "memoria_authors")  # the bf16 run's memory continues in an fp32 model
    more, _ = run(fp32, document_segments("bert", count=1, seed=1), memory=memory)
    assert more[0].dtype == torch.float32 and torch.isfinite(more[0]).all()


def test_rows_without_tokens_and_ignored_labels():
    """A finished document's row (no real token) computes finite logits and takes its step; label -100 leaves a
    row out of the loss, which is 0 (not NaN) when every row is left out."""
    model = tiny_encoder("roberta")
    ids = document_segments("roberta", count=1)[0]
    mask = torch.ones_like(ids)
    mask[1] = 0
    out = model(ids.masked_fill(mask == 0, PAD["roberta"]), attention_mask=mask, labels=torch.tensor([2, -100]))
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[:1], torch.tensor([2])))
    none = model(ids, labels=torch.tensor([-100, -100]))
    assert none.loss.item() == 0.0
    summed = model(ids, labels=torch.tensor([2, 0]), num_items_in_batch=4)  # as HF's Trainer passes it
    torch.testing.assert_close(summed.loss, torch.nn.functional.cross_entropy(summed.logits, torch.tensor([2, 0]),
                                                                              reduction="sum") / 4)


@pytest.mark.parametrize("family,longest", [("bert", 40), ("roberta", 38)])
def test_segments_must_fit_the_backbones_positions(family, longest):
    model = tiny_encoder(family)  # max_position_embeddings=40; RoBERTa's positions start at pad_token_id + 1
    assert model.positions_per_segment == longest
    ids = torch.randint(3, 50, (1, longest))
    assert model(ids).logits.shape == (1, 3)
    with pytest.raises(ValueError, match="shorter segments"):
        model(torch.randint(3, 50, (1, longest + 1)))


def test_settings_are_checked_with_the_fix_in_the_message():
    assert encoder_config(tiny_backbone("bert", num_hidden_layers=12)).memory_layer_index == 9  # the authors'
    with pytest.raises(BAD_SETTING, match="num_hidden_layers - 2"):
        tiny_encoder("bert", memory_layer_index=3)
    with pytest.raises(BAD_SETTING, match="memory_init"):
        tiny_encoder("bert", memory_residual="post_norm")
    with pytest.raises(BAD_SETTING, match="memoria.num_wm"):
        tiny_encoder("bert", memoria={"num_wm": 0})
    with pytest.raises(ValueError, match="unknown encoder preset"):
        tiny_encoder("bert", "memoria_full_width")
    with pytest.raises(ValueError, match="BERT, RoBERTa"):
        encoder_config(GPT2Config(n_layer=2, n_embd=32, n_head=4))
    config = MemoriaBertConfig.from_dict(tiny_encoder("bert").config.to_dict())
    assert config.memoria == tiny_encoder("bert").config.memoria  # stored resolved: capacity included
    assert config.memoria["capacity"] > 0 and config.memoria["num_stm_reminded"] == 3


def test_activation_checkpointing_gives_the_same_gradients():
    """Checkpointed layers recompute in backward; the memory step runs once (the engine's step advances by one)."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_encoder("bert", "memoria_authors").train()
        randomize(model)
        if checkpointing:
            model.activation_checkpointing_enable()
        first, second = document_segments("bert", count=2)
        out = model(first, labels=torch.tensor([0, 1]))
        out = model(second, labels=torch.tensor([0, 1]), memory=out.memory)
        out.loss.backward()
        assert out.memory.state.step.tolist() == [2, 2]
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(k.startswith("abstractor") for k in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)
