"""The MemSizer equals the reference implementation's logits for the same weights, read whole and
one token at a time.

The reference is jcyk/memsizer (commit 78e90ec1): its `CausalAttention` and `MemsizerDecoderLayer`
run as they are, with the four fairseq names they import stubbed, and its decoder written out
(`memsizer_reference.py` says how and why). CI cannot download it, so its logits were recorded
once, for a deterministic tiny state dict drawn from a seed, in float64, and committed as
`memsizer_reference_logits.json`: the whole sequence through `masked_revatt` (its training form)
and the same tokens one at a time through `incremental_revatt` (its recurrent form, S_t and t in
its incremental state). The test rebuilds the weights from the seed, maps them onto ours
(`memsizer_reference.to_ours`) and compares: our model reading the sequence at once, and our
`memsizer_carry` model reading it one token per segment (its carried S and t), each against both.

To regenerate: `python tests/model/memsizer_reference.py --reference /tmp/memsizer` (its docstring).
"""

from __future__ import annotations

import json

import pytest
import torch
from memsizer_reference import BATCH, GOLDEN, LENGTH, input_ids, reference_weights, to_ours

from memoria_ds.model.memsizer import MemSizerConfig, MemSizerLMHeadModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# float64 on both sides: the computations differ only in summation order
ATOL = 1e-10


def our_model(golden: dict, memory_type: str = "none") -> MemSizerLMHeadModel:
    t = golden["config"]
    config = MemSizerConfig(vocab_size=t["vocab_size"], n_positions=LENGTH, n_layer=t["decoder_layers"],
                            n_head=t["decoder_attention_heads"], n_embd=t["decoder_embed_dim"],
                            n_inner=t["decoder_ffn_embed_dim"], memsizer_slots=t["causal_proj_dim"],
                            activation_function="relu", embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
                            layer_norm_epsilon=1e-5, memory_type=memory_type, bos_token_id=0, eos_token_id=0)
    model = MemSizerLMHeadModel(config).double().eval()
    missing, unexpected = model.load_state_dict(
        to_ours(reference_weights(golden["reference_shapes"], golden["weight_seed"])), strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"]), (missing, unexpected)
    assert model.lm_head.weight is model.memsizer.wte.weight  # tied: loaded with wte
    return model


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _ids(golden: dict) -> torch.Tensor:
    ids = torch.tensor(golden["input_ids"])
    assert torch.equal(ids, input_ids(golden["config"]["vocab_size"]))
    return ids


def test_the_reference_reads_the_same_whole_and_one_token_at_a_time(golden):
    """Its own two forms agree (recorded): masked_revatt's prefix sums and incremental_revatt's S_t, t."""
    whole = torch.tensor(golden["logits"], dtype=torch.float64)
    assert whole.shape == (BATCH, LENGTH, golden["config"]["vocab_size"])
    torch.testing.assert_close(torch.tensor(golden["incremental_logits"], dtype=torch.float64), whole, atol=ATOL,
                               rtol=0)


def test_logits_read_at_once_equal_the_reference(golden):
    model = our_model(golden)
    with torch.no_grad():
        logits = model(_ids(golden)).logits
    for key in ("logits", "incremental_logits"):
        torch.testing.assert_close(logits, torch.tensor(golden[key], dtype=torch.float64), atol=ATOL, rtol=0)


def test_logits_read_one_token_per_segment_with_the_carried_memory_equal_the_reference(golden):
    model = our_model(golden, memory_type="memsizer")
    ids, memory, out = _ids(golden), None, []
    with torch.no_grad():
        for t in range(LENGTH):
            o = model(ids[:, t : t + 1], memory=memory)
            memory = o.memory
            out.append(o.logits)
    assert memory.tokens.tolist() == [LENGTH] * BATCH
    for key in ("incremental_logits", "logits"):
        torch.testing.assert_close(torch.cat(out, 1), torch.tensor(golden[key], dtype=torch.float64), atol=ATOL,
                                   rtol=0)


def test_every_reference_parameter_has_one_of_ours(golden):
    """The map covers every parameter of ours (none left at its init) with as many numbers."""
    model = our_model(golden)
    ours = to_ours(reference_weights(golden["reference_shapes"], golden["weight_seed"]))
    params = dict(model.named_parameters())
    assert set(ours) == set(params)  # lm_head is wte (tied)
    assert sum(torch.Size(s).numel() for s in golden["reference_shapes"].values()) == \
        sum(p.numel() for p in params.values())


@pytest.mark.parametrize("name", ["layers.1.self_attn.q_proj.bias", "layers.0.self_attn.k_layer_norm.weight",
                                  "layers.1.self_attn.v_proj.weight"])
def test_a_changed_weight_changes_the_logits(golden, name):
    """The comparison is sensitive: one number of the query, key or value path off by 1e-6 moves the
    logits past ATOL."""
    weights = reference_weights(golden["reference_shapes"], golden["weight_seed"])
    weights[name] = weights[name].clone()
    weights[name].view(-1)[1] += 1e-6
    model = our_model(golden)
    model.load_state_dict(to_ours(weights), strict=False)
    with torch.no_grad():
        logits = model(_ids(golden)).logits
    assert (logits - torch.tensor(golden["logits"], dtype=torch.float64)).abs().max() > 100 * ATOL
