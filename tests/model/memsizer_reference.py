"""The reference MemSizer run on deterministic tiny weights: the golden values of
tests/model/test_memsizer_reference.py, and the map of its weights onto ours.

The reference is jcyk/memsizer (commit 78e90ec1, its head), a fairseq plug-in. Its language
model is fairseq's transformer decoder (`MemsizerDecoder`, `src/memsizer.py`) whose layers
(`MemsizerDecoderLayer`, `src/memsizer_layer.py`) attend with `CausalAttention`
(`src/attention.py`): `masked_revatt` over a whole sequence, `incremental_revatt` one token at
a time. fairseq 0.10 (which the reference pins) does not install on this Python (3.11), and the
two files import only four fairseq names, so `load_reference` runs the reference's own two files
with those names replaced by what fairseq gives them at these settings (`_fairseq_stubs`, each
citing its source): `quant_noise(m, 0, _)` is `m`, `LayerNorm` is `torch.nn.LayerNorm` (no
apex), `FairseqDropout` is dropout, `with_incremental_state` adds fairseq's dict-keyed state
methods, `get_activation_fn("relu")` is relu. The decoder around the layers (the scaled token
embedding, fairseq's sinusoidal positions, the final layer norm, the tied output projection) is
`MemsizerDecoder.extract_features_scriptable` and `output_layer` written out here
(`reference_logits`): the base `memsizer_lm` architecture with `--decoder-normalize-before` and
`--share-decoder-input-output-embed`, no adaptive input or softmax. Its sinusoids use fairseq's
formula (`SinusoidalPositionalEmbedding.get_embedding`) evaluated in float64, as everything here.

To regenerate (torch only):

    git clone https://github.com/jcyk/memsizer /tmp/memsizer
    python tests/model/memsizer_reference.py --reference /tmp/memsizer

which builds the reference at `TINY`, loads `reference_weights(...)`, runs it in float64 on
`INPUT_SEED`'s tokens, whole (`masked_revatt`) and one token at a time with its incremental state
(`incremental_revatt`), and writes `memsizer_reference_logits.json` next to this file (the names
and shapes of its parameters included, so the test needs no reference to rebuild them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import types
import uuid
from pathlib import Path

import torch
from torch import nn

GOLDEN = Path(__file__).with_name("memsizer_reference_logits.json")
COMMIT = "78e90ec19764bc7182cf629e9effd16479ecf10a"
# The reference's arguments (`memsizer_lm` with --decoder-normalize-before): 2 layers, 16 wide, 2 query
# heads, 4 slots, an FFN of 24, relu (its default), no dropout.
TINY = dict(vocab_size=29, decoder_embed_dim=16, decoder_attention_heads=2, decoder_ffn_embed_dim=24,
            decoder_layers=2, causal_proj_dim=4)
WEIGHT_SEED, INPUT_SEED, BATCH, LENGTH = 51, 1051, 2, 10
PADDING_IDX = 1  # fairseq dictionaries' <pad>: positions start at PADDING_IDX + 1; the inputs avoid ids 0..3


def _fairseq_stubs() -> dict[str, types.ModuleType]:
    """The fairseq names `src/attention.py` and `src/memsizer_layer.py` import, as fairseq 0.10 defines them
    for these settings (no quantisation noise, no apex, CPU)."""

    class FairseqIncrementalState:  # fairseq/incremental_decoding_utils.py
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._incremental_state_id = str(uuid.uuid4())

        def get_incremental_state(self, incremental_state, key):
            full = f"{self._incremental_state_id}.{key}"
            return None if incremental_state is None or full not in incremental_state else incremental_state[full]

        def set_incremental_state(self, incremental_state, key, value):
            if incremental_state is not None:
                incremental_state[f"{self._incremental_state_id}.{key}"] = value
            return incremental_state

    def with_incremental_state(cls):
        cls.__bases__ = (FairseqIncrementalState,) + tuple(b for b in cls.__bases__ if b != FairseqIncrementalState)
        return cls

    class FairseqDropout(nn.Module):  # fairseq/modules/fairseq_dropout.py (apply_during_inference False)
        def __init__(self, p, module_name=None):
            super().__init__()
            self.p = p

        def forward(self, x, inplace: bool = False):
            return nn.functional.dropout(x, p=self.p, training=True, inplace=inplace) if self.training and self.p > 0 \
                else x

    def layer_norm(normalized_shape, eps=1e-5, elementwise_affine=True, export=False):  # fairseq/modules/layer_norm.py
        return nn.LayerNorm(normalized_shape, eps, elementwise_affine)

    def quant_noise(module, p, block_size):  # fairseq/modules/quant_noise.py: `if p <= 0: return module`
        assert p <= 0
        return module

    def get_activation_fn(activation):  # fairseq/utils.py (the two this test can ask for)
        return {"relu": nn.functional.relu, "gelu": nn.functional.gelu}[activation]

    modules = {name: types.ModuleType(name) for name in (
        "fairseq", "fairseq.utils", "fairseq.incremental_decoding_utils", "fairseq.modules",
        "fairseq.modules.quant_noise", "fairseq.modules.fairseq_dropout")}
    modules["fairseq"].utils = modules["fairseq.utils"]
    modules["fairseq.utils"].get_activation_fn = get_activation_fn
    modules["fairseq.incremental_decoding_utils"].with_incremental_state = with_incremental_state
    modules["fairseq.modules"].LayerNorm = layer_norm
    modules["fairseq.modules.quant_noise"].quant_noise = quant_noise
    modules["fairseq.modules.fairseq_dropout"].FairseqDropout = FairseqDropout
    return modules


def load_reference(checkout: Path) -> types.ModuleType:
    """The reference's `src/memsizer_layer.py` (importing its `src/attention.py`), run with fairseq stubbed."""
    sys.modules.update(_fairseq_stubs())
    package = types.ModuleType("memsizer_src")  # its `src`, without its __init__ (that imports all of fairseq)
    package.__path__ = [str(checkout / "src")]
    sys.modules["memsizer_src"] = package
    return importlib.import_module("memsizer_src.memsizer_layer")


def reference_args(**overrides) -> types.SimpleNamespace:
    """The reference layer's `args` at TINY (what `memsizer_lm`'s argument parser and architecture give)."""
    values = dict(TINY, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, activation_fn="relu",
                  decoder_normalize_before=True, q_init_scale=32.0, kv_init_scale=1.0, quant_noise_pq=0,
                  quant_noise_pq_block_size=8)
    values.update(overrides)
    return types.SimpleNamespace(**values)


class ReferenceLM(nn.Module):
    """`MemsizerDecoder` at TINY with the attribute names of `src/memsizer.py` (`embed_tokens`, `layers`,
    `layer_norm`); `reference_logits` runs it as `extract_features_scriptable` does."""

    def __init__(self, layer_module: types.ModuleType, args: types.SimpleNamespace) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.decoder_embed_dim, padding_idx=PADDING_IDX)
        self.layers = nn.ModuleList(layer_module.MemsizerDecoderLayer(args, no_encoder_attn=True)
                                    for _ in range(args.decoder_layers))
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim)


def fairseq_sinusoids(num_embeddings: int, dim: int, padding_idx: int = PADDING_IDX) -> torch.Tensor:
    """`SinusoidalPositionalEmbedding.get_embedding` (fairseq/modules/sinusoidal_positional_embedding.py),
    in float64."""
    half = dim // 2
    emb = math.log(10000) / (half - 1)
    emb = torch.exp(torch.arange(half, dtype=torch.float64) * -emb)
    emb = torch.arange(num_embeddings, dtype=torch.float64).unsqueeze(1) * emb.unsqueeze(0)
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
    if dim % 2 == 1:
        emb = torch.cat([emb, torch.zeros(num_embeddings, 1, dtype=torch.float64)], dim=1)
    emb[padding_idx, :] = 0
    return emb


def reference_logits(model: ReferenceLM, tokens: torch.Tensor, incremental: bool) -> torch.Tensor:
    """(B, T) tokens -> (B, T, V) logits, as `MemsizerDecoder.forward` computes them: the whole sequence
    with the future mask (`masked_revatt`), or one token at a time with an incremental state
    (`incremental_revatt`: the position of step t is padding_idx + t + 1, the prefix length's)."""
    B, T = tokens.shape
    D = model.embed_tokens.embedding_dim
    table = fairseq_sinusoids(PADDING_IDX + 1 + T, D)
    positions = table[PADDING_IDX + 1 + torch.arange(T)]  # make_positions: no padding in the inputs

    def decode(ids: torch.Tensor, pos: torch.Tensor, state: dict | None) -> torch.Tensor:
        x = math.sqrt(D) * model.embed_tokens(ids) + pos  # embed_scale; no layernorm_embedding, no dropout (eval)
        x = x.transpose(0, 1)  # T x B x C
        mask = None if state is not None else torch.triu(torch.full((x.shape[0],) * 2, float("-inf"),
                                                                    dtype=x.dtype), 1)  # buffered_future_mask
        for layer in model.layers:
            x, _, _ = layer(x, None, None, state, self_attn_mask=mask, self_attn_padding_mask=None)
        x = model.layer_norm(x).transpose(0, 1)
        return x @ model.embed_tokens.weight.T  # output_layer: the shared input/output embedding

    if not incremental:
        return decode(tokens, positions, None)
    state: dict = {}
    return torch.cat([decode(tokens[:, t : t + 1], positions[t : t + 1], state) for t in range(T)], dim=1)


def reference_weights(shapes: dict[str, list[int]], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """A deterministic float64 state dict under the reference's names, far from its init (so that a
    transposed block, a wrong slice of the fused projection, a missing bias or norm shows): layer norms
    off 1/0, biases nonzero, the query projection large enough that each head's softmax over the
    slots is far from uniform (and the heads differ)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return mean + std * torch.randn(shape, generator=g, dtype=torch.float64)

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if "norm" in name:
            out[name] = normal(shape, 0.2, mean=1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("embed_tokens.weight"):
            out[name] = normal(shape, 0.5)
        elif name.endswith("q_proj.weight"):
            out[name] = normal(shape, 0.8)
        else:
            out[name] = normal(shape, 0.3 if name.endswith("weight") else 0.1)
    return out


def to_ours(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's weights as a `MemSizerLMHeadModel` state dict. Its q/k/v projections
    (nn.Linear, (out, in)) are our one `c_attn` (a GPT-2 Conv1D, (in, out)): concatenated in that
    order and transposed; its FFN's fc1/fc2 are GPT-2's `mlp.c_fc` / `mlp.c_proj` (transposed)."""
    out = {"memsizer.wte.weight": state_dict["embed_tokens.weight"],
           "memsizer.ln_f.weight": state_dict["layer_norm.weight"], "memsizer.ln_f.bias": state_dict["layer_norm.bias"]}
    layers = sorted({int(n.split(".")[1]) for n in state_dict if n.startswith("layers.")})
    for i in layers:
        ref, ours = f"layers.{i}.", f"memsizer.h.{i}."
        for part in ("weight", "bias"):
            out[ours + f"ln_1.{part}"] = state_dict[ref + f"self_attn_layer_norm.{part}"]
            out[ours + f"ln_2.{part}"] = state_dict[ref + f"final_layer_norm.{part}"]
            out[ours + f"attn.k_norm.{part}"] = state_dict[ref + f"self_attn.k_layer_norm.{part}"]
            out[ours + f"attn.v_norm.{part}"] = state_dict[ref + f"self_attn.v_layer_norm.{part}"]
        qkv = [ref + f"self_attn.{p}_proj." for p in "qkv"]
        out[ours + "attn.c_attn.weight"] = torch.cat([state_dict[p + "weight"] for p in qkv]).T.contiguous()
        out[ours + "attn.c_attn.bias"] = torch.cat([state_dict[p + "bias"] for p in qkv])
        out[ours + "mlp.c_fc.weight"] = state_dict[ref + "fc1.weight"].T.contiguous()
        out[ours + "mlp.c_fc.bias"] = state_dict[ref + "fc1.bias"]
        out[ours + "mlp.c_proj.weight"] = state_dict[ref + "fc2.weight"].T.contiguous()
        out[ours + "mlp.c_proj.bias"] = state_dict[ref + "fc2.bias"]
    return out


def input_ids(vocab_size: int) -> torch.Tensor:
    """(BATCH, LENGTH) tokens in 4..V-1 (fairseq's dictionaries keep 0..3 for <s>, <pad>, </s>, <unk>)."""
    return torch.randint(4, vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(INPUT_SEED))


def regenerate(checkout: Path) -> None:
    """Run the reference on the deterministic weights, whole and one token at a time; write GOLDEN."""
    layer_module = load_reference(checkout)
    torch.manual_seed(0)
    model = ReferenceLM(layer_module, reference_args())
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    model = model.double().eval()
    model.load_state_dict(reference_weights(shapes))
    ids = input_ids(TINY["vocab_size"])
    with torch.no_grad():
        whole = reference_logits(model, ids, incremental=False)
        stepwise = reference_logits(model, ids, incremental=True)
    print(f"reference whole vs one token at a time: max |difference| {(whole - stepwise).abs().max().item():.2e}")
    GOLDEN.write_text(json.dumps({
        "reference": f"jcyk/memsizer {COMMIT[:8]} src/attention.py, src/memsizer_layer.py (fairseq stubbed); "
                     f"the decoder of src/memsizer.py written out (tests/model/memsizer_reference.py)",
        "config": TINY, "weight_seed": WEIGHT_SEED, "input_seed": INPUT_SEED, "dtype": "float64",
        "reference_shapes": shapes, "input_ids": ids.tolist(), "logits": whole.tolist(),
        "incremental_logits": stepwise.tolist(),
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}: logits {tuple(whole.shape)}, whole and incremental")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="a checkout of jcyk/memsizer")
    regenerate(parser.parse_args().reference)
