"""Product-Key Memory layers (`model/pkm.py`, `pkm_layers`): the layer against a slow exact
reference, padding, causality, capture by torch.compile, and the option on models of every kind.

(XLM's own layer is the reference of `test_pkm_reference.py`.)
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from model_helpers import VOCAB, run_stream, segments

from memoria_ds.model import MemoriaGPT2Config, MemoriaGPT2LMHeadModel, build_model
from memoria_ds.model.pkm import MaskedBatchNorm1d, PKMSettings, ProductKeyMemory

TINY = PKMSettings(n_keys=5, heads=2, knn=3, k_dim=6)
SMALL = dict(n_keys=8, heads=2, knn=4, k_dim=16)  # in a 64-wide model


def layer(settings: PKMSettings = TINY, dim: int = 7, seed: int = 0) -> ProductKeyMemory:
    """A float64 layer with every weight drawn far from its init (batch-norm gains, running statistics)."""
    torch.manual_seed(seed)
    pkm = ProductKeyMemory(dim, settings).double()
    with torch.no_grad():
        for name, p in pkm.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith("norm.weight") else 1.0)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
        if pkm.query_norm is not None:
            pkm.query_norm.running_mean.normal_()
            pkm.query_norm.running_var.uniform_(0.5, 2.0)
    return pkm


def read(pkm: ProductKeyMemory, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output, its batch statistics applied as the model applies them."""
    out, stats = pkm(x, valid)
    pkm.update_running(stats)
    return out


def slow_reference(pkm: ProductKeyMemory, x: torch.Tensor) -> torch.Tensor:
    """The layer written out: every one of the n^2 full keys [C1[i], C2[j]] scored per token and
    head, the exact top-k by sorting all of them, a softmax over the kept scores, the weighted sum
    of their values, heads added. Batch norm in training mode over every token (as BatchNorm1d)."""
    shape, D = x.shape, x.shape[-1]
    x = x.reshape(-1, D)
    if pkm.input_norm is not None:
        x = F.layer_norm(x, (D,), pkm.input_norm.weight, pkm.input_norm.bias, pkm.input_norm.eps)
    q = x @ pkm.query.weight.T + pkm.query.bias
    if pkm.query_norm is not None:
        bn = pkm.query_norm
        q = F.batch_norm(q, None, None, bn.weight, bn.bias, True, 0.0, bn.eps) if pkm.training else \
            (q - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    n, k, H, K = pkm.n_keys, pkm.knn, pkm.heads, pkm.k_dim
    out = torch.zeros(x.shape[0], D, dtype=x.dtype)
    for t in range(x.shape[0]):
        for h in range(H):
            query = q[t, h * K:(h + 1) * K]
            full = [(query @ torch.cat([pkm.keys[h, 0, i], pkm.keys[h, 1, j]]), i * n + j)
                    for i in range(n) for j in range(n)]
            kept = sorted(full, key=lambda s: float(s[0].detach()), reverse=True)[:k]
            weights = torch.softmax(torch.stack([s for s, _ in kept]), dim=0)
            for w, (_, slot) in zip(weights, kept):
                out[t] = out[t] + w * pkm.values.weight[slot]
    return out.view(shape)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("settings", [TINY, PKMSettings(n_keys=4, heads=3, knn=4, k_dim=4, query_batchnorm=False),
                                      PKMSettings(n_keys=6, heads=1, knn=2, k_dim=2, placement="after")],
                         ids=["batchnorm", "no-batchnorm+knn=n_keys", "after"])
def test_the_layer_equals_the_slow_exact_reference(settings, mode):
    pkm = layer(settings).train(mode == "train")
    x = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    got, want = read(pkm, x), slow_reference(pkm, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn_like(want)
    grads = torch.autograd.grad((got * g).sum(), [x, *pkm.parameters()])
    wants = torch.autograd.grad((want * g).sum(), [x, *pkm.parameters()])
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_the_masked_batch_norm_is_batch_norm_when_every_row_is_real():
    torch.manual_seed(0)
    ours, torchs = MaskedBatchNorm1d(5).double(), torch.nn.BatchNorm1d(5).double()

    def step(x, valid=None):
        y, stats = ours(x, valid)
        ours.update_running(stats)
        return y

    for _ in range(3):
        x = torch.randn(9, 5, dtype=torch.float64)
        torch.testing.assert_close(step(x), torchs(x), rtol=0, atol=1e-14)
        torch.testing.assert_close(step(x, torch.ones(9, dtype=torch.bool)), torchs(x * 1), rtol=0, atol=1e-14)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(torchs, name), rtol=0, atol=1e-14)
    ours.eval(), torchs.eval()
    x = torch.randn(4, 5, dtype=torch.float64)
    y, stats = ours(x)
    assert stats is None
    torch.testing.assert_close(y, torchs(x), rtol=0, atol=1e-14)


def test_padding_changes_neither_the_real_tokens_outputs_nor_the_batch_statistics():
    """XLM issue 171: batch norm over padded positions. Here a padded position, whatever it holds,
    changes nothing: the real tokens read what they read as a batch of real tokens alone."""
    pkm_a, pkm_b = layer(), layer()
    pkm_a.train(), pkm_b.train()
    x = torch.randn(3, 6, 7, dtype=torch.float64)
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[0, 4:], valid[2, 1:] = False, False  # rows ending inside the segment
    padded = torch.where(valid[..., None], x, 1e3 * torch.randn_like(x))  # padding holds anything
    got = read(pkm_a, padded, valid)
    alone = read(pkm_b, x[valid])  # (real tokens, D): no padding at all
    torch.testing.assert_close(got[valid], alone, rtol=0, atol=1e-12)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(pkm_a.query_norm, name), getattr(pkm_b.query_norm, name), rtol=0, atol=1e-12)
    # without the mask the padding would move them (the check can fail)
    pkm_c = layer().train()
    assert (read(pkm_c, padded)[valid] - alone).abs().max() > 1e-3


def test_a_batch_with_one_real_token_leaves_the_running_statistics():
    pkm = layer().train()
    before = pkm.query_norm.running_var.clone()
    valid = torch.zeros(2, 3, dtype=torch.bool)
    valid[1, 0] = True
    out = read(pkm, torch.randn(2, 3, 7, dtype=torch.float64), valid)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(pkm.query_norm.running_var, before, rtol=0, atol=0)


def test_in_evaluation_a_token_depends_on_itself_alone_and_in_training_on_the_batch_statistics():
    """Causality (docs/field_memories.md, "Product-Key Memory"): the layer is per token, except that in
    training the query batch norm's statistics are those of every real token of the micro-batch, later
    ones included (as XLM's and the paper's layer). In evaluation (running statistics) and without
    batch norm, changing token t changes no other token's output."""
    x = torch.randn(2, 6, 7, dtype=torch.float64)
    changed = x.clone()
    changed[1, 4] += 1.0
    for pkm in (layer().eval(), layer(PKMSettings(n_keys=5, heads=2, knn=3, k_dim=6, query_batchnorm=False)).train()):
        a, b = read(pkm, x), read(pkm, changed)
        keep = torch.ones(2, 6, dtype=torch.bool)
        keep[1, 4] = False
        torch.testing.assert_close(a[keep], b[keep], rtol=0, atol=0)
        assert (a[1, 4] - b[1, 4]).abs().max() > 1e-6
    pkm = layer().train()
    a, b = read(pkm, x), read(pkm, changed)
    assert (a[1, :4] - b[1, :4]).abs().max() > 1e-9  # the batch statistics carry a later token back


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("settings,key", [
    (dict(pkm_layers=[2]), "pkm_layers"),
    (dict(pkm_layers=[1, 1]), "pkm_layers"),
    (dict(pkm_layers=[1], pkm=dict(knn=9, n_keys=8)), "pkm.knn"),
    (dict(pkm_layers=[1], pkm=dict(k_dim=15)), "pkm.k_dim"),
    (dict(pkm_layers=[1], pkm=dict(n_key=8)), "pkm.n_key"),
    (dict(pkm_layers=[1], pkm=dict(heads=True)), "pkm.heads"),
    (dict(pkm_layers=[1], pkm=dict(placement="before")), "pkm.placement"),
    (dict(pkm=dict(n_keys=8)), "pkm"),
    (dict(pkm_layers=1), "pkm_layers"),
])
def test_a_bad_setting_is_refused_by_name(backbone_config, settings, key):
    # a SettingError, or HF's strict validation wrapping one (what depends on the backbone's shape): not a ValueError
    with pytest.raises(Exception, match=re.escape(f"`{key}` ")):
        MemoriaGPT2Config.from_backbone(backbone_config, "xl", **settings)


def test_the_sizes_resolve_to_the_papers_defaults(backbone_config):
    config = MemoriaGPT2Config.from_backbone(backbone_config, "xl", pkm_layers=[1])
    assert config.pkm == dict(n_keys=512, heads=4, knn=32, k_dim=256, query_batchnorm=True, placement="replace",
                              input_dropout=0.0, query_dropout=0.0, value_dropout=0.0)
    assert MemoriaGPT2Config.from_backbone(backbone_config, "xl").pkm is None


def test_the_memory_mosaic_refuses_pkm_layers(backbone_config):
    with pytest.raises(Exception, match="`pkm_layers` .*persistent memory"):
        build_model(backbone_config, "memory_mosaic", pkm_layers=[0])


# ---------------------------------------------------------------------------- in a model


@pytest.mark.parametrize("preset", ["xl", "memoria", "transformer"])
@pytest.mark.parametrize("placement", ["replace", "after"])
def test_a_model_with_pkm_layers_trains_and_round_trips(make_model, tmp_path, preset, placement):
    model = make_model(preset, memory_init="random", pkm_layers=[1], pkm=dict(SMALL, placement=placement)).train()
    assert (model.transformer.h[1].mlp is None) == (placement == "replace")
    assert model.transformer.h[0].mlp is not None
    pkm = model.memory_blocks[1].pkm
    assert pkm is not None and model.memory_blocks[0].pkm is None
    assert any(m is pkm for m in model.memory_modules())
    segs = segments(count=3)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[2, 8:] = 0
    memory = None
    for x in segs:
        out = model(x, labels=x, memory=memory, attention_mask=mask)
        out.loss.backward()
        memory = out.memory.detach_() if hasattr(out.memory, "detach_") else out.memory
    for name, p in pkm.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert pkm.query_norm.num_batches_tracked == 3
    model.save_pretrained(tmp_path)
    loaded = MemoriaGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    model.eval()
    assert loaded.config.pkm == model.config.pkm and loaded.config.pkm_layers == [1]
    for name, t in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], t, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        a, _ = run_stream(model, segments(count=2, seed=5))
        b, _ = run_stream(loaded, segments(count=2, seed=5))
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_moves_the_running_statistics_once(make_model, reentrant):
    """The statistics are returned by the block and applied after it: a recompute in backward (the
    block runs twice) does not move them again; the gradients are those without checkpointing."""
    plain = make_model("xl", memory_init="random", pkm_layers=[1], pkm=SMALL).train()
    checkpointed = make_model("xl", memory_init="random", pkm_layers=[1], pkm=SMALL).train()
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    x = segments(count=1)[0]
    for model in (plain, checkpointed):
        model(x, labels=x).loss.backward()
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(checkpointed.get_buffer(name), buffer, rtol=0, atol=0, msg=name)
    assert int(checkpointed.memory_blocks[1].pkm.query_norm.num_batches_tracked) == 1
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_model_reads_a_position_after_it_never(make_model):
    """Model-level causality in evaluation: a changed token changes no earlier logit."""
    model = make_model("xl", memory_init="random", pkm_layers=[0, 1], pkm=SMALL)
    segs = segments(count=2)
    changed = [s.clone() for s in segs]
    changed[1][:, 7] = (changed[1][:, 7] + 1) % VOCAB
    with torch.no_grad():
        a, _ = run_stream(model, segs)
        b, _ = run_stream(model, changed)
    torch.testing.assert_close(a[0].logits, b[0].logits, rtol=0, atol=0)
    torch.testing.assert_close(a[1].logits[:, :7], b[1].logits[:, :7], rtol=0, atol=1e-6)
    assert (a[1].logits[:, 7] - b[1].logits[:, 7]).abs().max() > 1e-4


def test_after_the_mlp_under_the_noop_init_the_model_is_its_backbone(make_model):
    plain = make_model("memoria")
    with_pkm = make_model("memoria", pkm_layers=[0, 1], pkm=dict(SMALL, placement="after"))
    with_pkm.load_state_dict(plain.state_dict(), strict=False)
    assert not with_pkm.memory_blocks[1].pkm.values.weight.any()
    segs = segments(count=3)
    with torch.no_grad():
        a, _ = run_stream(plain, segs)
        b, _ = run_stream(with_pkm, segs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=0)


def test_a_gpt2_checkpoint_loads_around_a_replaced_mlp(make_model, tmp_path):
    """The removed MLP's weights in a checkpoint are expected, not loaded; everything else is."""
    plain = make_model("transformer")
    plain.save_pretrained(tmp_path)
    model = build_model(str(tmp_path), "xl", pkm_layers=[1], pkm=SMALL)
    assert model.transformer.h[1].mlp is None
    torch.testing.assert_close(model.transformer.h[0].mlp.c_fc.weight, plain.transformer.h[0].mlp.c_fc.weight)
    torch.testing.assert_close(model.transformer.h[1].attn.c_attn.weight, plain.transformer.h[1].attn.c_attn.weight)
    half = (SMALL["k_dim"] // 2) ** -0.5
    assert model.memory_blocks[1].pkm.keys.abs().max() <= half  # XLM's init, not left empty


def test_a_compiled_step_is_one_graph_and_equals_eager(make_model):
    """Captured whole (`fullgraph=True`, AOTAutograd's backward): losses, gradients and the batch
    norm's running statistics as eager, with padded rows."""
    settings = dict(memory_init="random", pkm_layers=[0, 1], pkm=dict(SMALL, placement="after"), segment_length=12)
    eager = make_model("memoria", **settings).train()
    compiled = make_model("memoria", **settings).train()
    compiled.load_state_dict(eager.state_dict())
    segs = segments(count=3, seed=4)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 5:] = 0

    def loss_of(model, x, memory):
        return model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory, attention_mask=mask)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x, m: loss_of(compiled, x, m).loss)(segs[0], None)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    compiled.load_state_dict(eager.state_dict())  # explain ran a forward in training mode: statistics moved
    torch._dynamo.reset()
    compiled.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    for model in (eager, compiled):
        memory = model.empty_memory(3)
        for x in segs:
            out = loss_of(model, x, memory)
            out.loss.backward()
            memory = out.memory
            memory.detach_()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, b), c in zip(eager.named_buffers(), compiled.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6, msg=name)
