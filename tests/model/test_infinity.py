"""The infinity-former kind: its continuous maths against closed forms, numerical integrals and
torch's distributions, the whole model against a slow reference, and the model contract."""

import io

import pytest
import torch
import torch.nn.functional as F
from infinity_reference import ReferenceInfinity, expectation, ridge_fit
from model_helpers import (
    VOCAB, assert_a_reset_row_starts_a_fresh_stream, assert_only_later_tokens_change,
    assert_row_operations_keep_outputs, changed_token, run_stream, segments,
)

from memoria_ds.model import MemoriaGPT2Config, MemoriaGPT2LMHeadModel, build_model, memory_from_state_dict
from memoria_ds.model.recurrent import InfinityMemory, InfinitySettings
from memoria_ds.model.recurrent import continuous as C

SEGMENT = 12


def _model(make_model, **settings):
    model = make_model("infinity", segment_length=SEGMENT, memory_settings=settings)
    torch.manual_seed(0)
    return model


def _logits(model, segs, memory=None, seed=0):
    torch.manual_seed(seed)  # sticky memories draw their samples
    with torch.no_grad():
        outs, _ = run_stream(model, segs, memory=memory)
    return [o.logits for o in outs]


# ------------------------------------------------------------------ the continuous maths


def test_basis_and_regression_points():
    mu, sigma = C.basis(7)  # rounded up to 8: 4 centres x 2 widths
    assert mu.tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1, 1])
    assert sigma.tolist() == [0.005, 0.01] * 4
    pts = C.padded_positions(4)  # 8 points, 1/8 apart around [0, 1]: 2 below, 4 inside, 2 above
    assert pts.tolist() == pytest.approx([-0.375, -0.125, 0.125, 0.375, 0.625, 0.875, 1.125, 1.375])
    inf = C.infinity_positions(4, 2, 0.5)
    assert inf[(inf >= 0) & (inf <= 1)].tolist() == pytest.approx([0.25, 0.5, 0.625, 0.75, 0.875, 1.0])


@pytest.mark.parametrize("length,samples", [(12, 0), (9, 0), (8, 6), (7, 4)])
def test_regression_matrix_is_the_ridge_solution_with_zeros_outside(length, samples):
    torch.manual_seed(0)
    n = 10
    x = torch.randn(length + samples, 3, dtype=torch.float64)
    if samples:
        g = C.regression_matrix(length + samples, C.infinity_positions(length, samples, 0.5), n)
    else:
        g = C.regression_matrix(length, C.padded_positions(length), n)
    torch.testing.assert_close(C.fit(x[None], g)[0], ridge_fit(x, n, samples, 0.5))


def test_a_smooth_signal_is_recovered():
    n = 64
    t = C.padded_positions(32)[16:48]  # the 32 inner points (16 padding points each side)
    x = torch.sin(2 * torch.pi * t)[:, None]
    coef = C.fit(x[None], C.regression_matrix(32, C.padded_positions(32), n))[0]
    mu, sigma = C.basis(n)
    recon = C.evaluate(t, mu, sigma) @ coef
    assert (recon - x).abs()[4:-4].max() < 0.05  # ridge shrinks a little; the ends are pulled to the padding's 0


@pytest.mark.parametrize("mu,var", [(0.3, 0.01), (0.9, 1e-4), (0.5, 0.2)])
def test_gaussian_expectation_is_the_integral(mu, var):
    got = C.gaussian_expectation(torch.tensor(mu, dtype=torch.float64), torch.tensor(var, dtype=torch.float64), 10)
    torch.testing.assert_close(got, expectation(torch.tensor(mu, dtype=torch.float64), var, 10), rtol=1e-5, atol=1e-6)


def test_kl_is_torch_kl():
    mu, var = torch.tensor([0.2, 0.7]), torch.tensor([0.01, 0.3])
    want = torch.distributions.kl_divergence(torch.distributions.Normal(mu, var.sqrt()),
                                             torch.distributions.Normal(-1.0, 0.05))
    torch.testing.assert_close(C.kl_to_prior(mu, var, -1.0, 0.05), want)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(0.5, var.sqrt()),
                                             torch.distributions.Normal(0.5, 0.05))
    torch.testing.assert_close(C.kl_to_prior(torch.tensor([3.0, 3.0]), var, 0.5, 0.05), want)  # mu_0 > 0: no mean term


def test_sticky_bins():
    # one narrow density at 0.3 (bin 38 of 128) for row 0; row 1 has no density that counts: uniform
    mu = torch.tensor([[0.3, 0.9], [0.5, 0.5]])
    sigma = torch.tensor([[1e-4, 1e-4], [0.1, 0.1]])
    mass = C.bin_mass(mu, sigma, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert mass[0].argmax().item() == int(0.3 * 128) and mass[0].max().item() == pytest.approx(1.0)
    torch.testing.assert_close(mass[1], torch.full((128,), 1 / 128))
    positions = C.sticky_positions(mass, 5)
    assert positions[0].tolist() == [int(0.3 * 128) / 128] * 5  # the left edge of the bin, as the authors' code
    assert (positions[1].diff() >= 0).all()


# ------------------------------------------------------------------ against the slow reference


def test_matches_the_reference_over_segments(make_model):
    model = _model(make_model, sticky=False, mask_dropout=0.0, kl_weight=1.0, num_basis=10, num_samples=6)
    model.train()  # dropout is 0: train mode only adds the regulariser
    with torch.no_grad():  # weights large enough that the long-term attention moves the logits by O(1)
        for p in model.memory_net.parameters():
            p.normal_(0.0, 0.3)
    ref = ReferenceInfinity(model, rows=2)
    segs = segments(batch=2, length=SEGMENT, count=4, seed=2)
    memory = None
    for t, x in enumerate(segs):
        out = model(x, labels=x, memory=memory)
        memory = out.memory
        kls = []
        for row in range(2):
            logits, kl = ref.step(row, x[row])
            torch.testing.assert_close(out.logits[row], logits, rtol=1e-4, atol=1e-4, msg=f"segment {t} row {row}")
            kls.append(kl)
        lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        want = 0.0 if kls[0] is None else sum(kls) / 2
        assert (out.loss - lm).item() == pytest.approx(want, rel=1e-4, abs=1e-6)
        if t >= 1:
            for row in range(2):
                torch.testing.assert_close(memory.coefficients[row], torch.stack(ref.coef[row]).float(),
                                           rtol=1e-4, atol=1e-5)


def test_first_segment_is_the_backbone_and_noop_init_is_the_backbone_throughout(make_model, backbone_config):
    model = _model(make_model)
    plain = MemoriaGPT2LMHeadModel(MemoriaGPT2Config.from_backbone(model.config, "transformer")).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    segs = segments(count=3)
    got, want = _logits(model, segs), _logits(plain, segs)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert (got[2] - want[2]).abs().max() > 1e-4  # the preset's random init reads its memory
    noop = build_model(backbone_config, "infinity", segment_length=SEGMENT, memory_init="noop").eval()
    plain.load_state_dict(noop.state_dict(), strict=False)
    for a, b in zip(_logits(noop, segs), _logits(plain, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_regulariser_and_lm_loss_train_the_long_term_attention(make_model):
    model = _model(make_model, kl_weight=1.0).train()
    segs = segments(count=3)
    memory = None
    for x in segs[:2]:
        memory = model(x, labels=x, memory=memory).memory
    out = model(segs[2], labels=segs[2], memory=memory)
    out.loss.backward()
    net = model.memory_net
    for module in (net.key[0], net.value[1], net.out[0], net.mu[1], net.sigma[0], net.mask[1]):
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0  # the queries are GPT-2's


@pytest.mark.parametrize("t,pos", [(2, 0), (2, 7), (1, 11)])
def test_a_token_affects_only_what_comes_after_it(make_model, t, pos):
    model = _model(make_model)
    segs = segments(count=4, length=SEGMENT)
    a, b = _logits(model, segs), _logits(model, changed_token(segs, t, pos))
    assert_only_later_tokens_change(a, b, t, pos, later=0)


def test_the_unbounded_memory_reaches_far_back(make_model):
    """Segment 0 still shapes the memory after 5 more segments (through B_past; fading as it is
    re-fitted and squeezed into [0, tau] each segment), and the logits 3 segments later."""
    model = _model(make_model, sticky=False)
    segs = segments(count=6, length=SEGMENT)
    changed = [s.clone() for s in segs]
    changed[0][:, 5] = (changed[0][:, 5] + 1) % VOCAB
    with torch.no_grad():
        a, memory_a = run_stream(model, segs)
        b, memory_b = run_stream(model, changed)
    assert (a[3].logits - b[3].logits).abs().max() > 0
    assert (memory_a.coefficients - memory_b.coefficients).abs().max() > 0


def test_save_and_load_keep_the_model(make_model, tmp_path):
    model = _model(make_model, num_basis=8)
    model.save_pretrained(tmp_path)
    loaded = build_model(tmp_path).eval()
    assert loaded.config.memory_settings == model.config.memory_settings
    segs = segments(count=4, length=SEGMENT)
    for a, b in zip(_logits(model, segs), _logits(loaded, segs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_round_trip_continues_identically(make_model):
    model = _model(make_model)
    segs = segments(count=6, length=SEGMENT)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    buffer = io.BytesIO()
    torch.save(memory.state_dict(), buffer)
    buffer.seek(0)
    restored = memory_from_state_dict(torch.load(buffer))
    assert isinstance(restored, InfinityMemory)
    for a, b in zip(_logits(model, segs[3:], memory.clone()), _logits(model, segs[3:], restored)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"`mass` has shape .*, expected \(B=\d+, Y=\d+, K=128\)"):
        memory_from_state_dict(memory.state_dict() | {"mass": memory.mass[:, :, :3]})


def test_take_and_put_rows_keep_outputs(make_model):
    model = _model(make_model, sticky=False)  # row subsets draw other random samples with sticky memories
    segs = segments(batch=4, count=5, length=SEGMENT)
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
    assert_row_operations_keep_outputs(model, segs[3:], memory, _logits, atol=1e-5)


# a diverged step's row: its NaN must never reach a later segment
@pytest.mark.parametrize("poison", [(), ("hidden", "coefficients")])
def test_a_reset_row_starts_a_fresh_stream(make_model, poison):
    model = _model(make_model, sticky=False)
    segs = segments(count=6, length=SEGMENT)
    assert_a_reset_row_starts_a_fresh_stream(model, segs, _logits, poison, keep_atol=1e-5)


def test_generate_reads_the_memory(make_model):
    model = _model(make_model)
    segs = segments(batch=1, count=3, length=SEGMENT)
    with torch.no_grad():
        _, memory = run_stream(model, segs)
    before = memory.clone()
    prompt = segments(batch=1, length=4, count=1, seed=5)[0]
    out = model.generate(prompt, memory=memory, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
    torch.testing.assert_close(memory.coefficients, before.coefficients, rtol=0, atol=0)


def test_settings(backbone_config):
    config = MemoriaGPT2Config.from_backbone(backbone_config, "infinity")
    assert config.memory_settings == InfinitySettings().to_dict() and config.memory_init == "random"
    assert InfinitySettings().sizes(150) == (150, 150)  # the authors' WikiText-103 config: 150 basis, 150 samples
    with pytest.raises(ValueError, match="needs `memory_settings.num_basis`"):
        build_model(backbone_config, "infinity")  # neither num_basis nor segment_length
    with pytest.raises(ValueError, match="tau"):
        MemoriaGPT2Config.from_backbone(backbone_config, "infinity", memory_settings={"tau": 1.5})
    with pytest.raises(ValueError, match="unknown infinity setting"):
        MemoriaGPT2Config.from_backbone(backbone_config, "infinity", memory_settings={"basis": 8})
