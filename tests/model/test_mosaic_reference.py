"""The Memory Mosaic equals the reference implementation's logits for the same weights.

The reference is `nanoMosaics/mosaic_model.py` of facebookresearch/MemoryMosaics (commit
1fff63b1, the repository's head when the golden values were made). CI cannot download it, so
its logits were recorded once, for a deterministic tiny state dict drawn from a seed
(`reference_weights`, below, names and shapes the reference's), in float64, and committed as
`mosaic_reference_logits.json` (480 numbers). The test rebuilds the same weights from the
seed, maps them onto ours (`memoria_ds.model.mosaic.convert.from_reference`) and compares.

To regenerate (needs only torch; the reference imports nothing else):

    git clone https://github.com/facebookresearch/MemoryMosaics /tmp/MemoryMosaics
    python tests/model/test_mosaic_reference.py --reference /tmp/MemoryMosaics

which builds the reference model at `TINY`, loads `reference_weights(...)`, runs it in float64
on `INPUT_SEED`'s tokens and writes the JSON next to this file (the names and shapes of its
parameters included, so the test needs no reference to rebuild them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from memoria_ds.model.mosaic import MemoryMosaicConfig, MemoryMosaicLMHeadModel
from memoria_ds.model.mosaic.convert import from_reference, reference_name

GOLDEN = Path(__file__).with_name("mosaic_reference_logits.json")
# The reference's MemoryMosaicConfig fields. pmem_count 2: the average over persistent memories
# is exercised; block_size above the input length: the leaky-average matrix is cropped.
TINY = dict(block_size=16, vocab_size=24, n_layer=2, n_head=2, n_embd=16, dropout=0.0, pmem_size=6,
            pmem_count=2, bias=True)
WEIGHT_SEED, INPUT_SEED, BATCH, LENGTH = 38, 1038, 2, 10
# float64 on both sides: the two computations differ only in summation order
ATOL = 1e-10


def reference_weights(shapes: dict[str, list[int]], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """A deterministic float64 state dict under the reference's names, far from its init (so
    that a wrong sign, scale or mask shows): leak rates 10|p| in [0, 4] (some p negative: the
    abs is exercised), key scales up to exp(14) (above the clamp at log 65535 for the persistent
    memory's squared scale), value/output scales, mixes outside [0, 1], layer norms off 1/0.
    """
    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)

    def normal(shape, std, mean=0.0):
        return mean + std * torch.randn(shape, generator=g, dtype=torch.float64)

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("leaky_key_beta"):
            out[name] = uniform(shape, -0.4, 0.4)
        elif name.endswith("key_scale"):
            out[name] = uniform(shape, -0.1, 0.7)
        elif name.endswith(("val_scale", "out_scale")):
            out[name] = uniform(shape, -0.1, 0.05)
        elif name.endswith("v_featurizer.coef"):
            out[name] = uniform(shape, -0.25, 1.25)
        elif name.endswith(("P_k", "P_v")):
            out[name] = normal(shape, shape[-1] ** -0.5)
        elif ".ln_" in name:
            out[name] = normal(shape, 0.2, mean=1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("wte.weight"):
            out[name] = normal(shape, 0.5)
        else:
            out[name] = normal(shape, 0.3 if name.endswith("weight") else 0.1)
    return out


def input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(INPUT_SEED))


def our_model(golden: dict) -> MemoryMosaicLMHeadModel:
    t = golden["config"]
    config = MemoryMosaicConfig(vocab_size=t["vocab_size"], n_positions=t["block_size"], n_layer=t["n_layer"],
                                n_head=t["n_head"], n_embd=t["n_embd"], pmem_size=t["pmem_size"],
                                pmem_count=t["pmem_count"], bias=t["bias"], embd_pdrop=0.0, attn_pdrop=0.0,
                                resid_pdrop=0.0, layer_norm_epsilon=1e-5)
    return MemoryMosaicLMHeadModel(config).double().eval()


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_logits_equal_the_reference(golden):
    model = our_model(golden)
    weights = from_reference(reference_weights(golden["reference_shapes"], golden["weight_seed"]))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"]), (missing, unexpected)
    assert model.lm_head.weight is model.mosaic.wte.weight  # tied: loaded with wte
    ids = torch.tensor(golden["input_ids"])
    assert torch.equal(ids, input_ids(golden["config"]["vocab_size"]))
    with torch.no_grad():
        logits = model(ids).logits
    expected = torch.tensor(golden["logits"], dtype=torch.float64)
    assert logits.shape == expected.shape == (BATCH, LENGTH, golden["config"]["vocab_size"])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_every_reference_parameter_has_one_of_ours(golden):
    """The mapping is a bijection onto our parameters (none left at its init)."""
    model = our_model(golden)
    ours = [reference_name(n) for n in golden["reference_shapes"]]
    assert sorted(ours) == sorted(n for n, _ in model.named_parameters())  # lm_head is wte (tied)
    for name, shape in golden["reference_shapes"].items():
        mine = dict(model.named_parameters())[reference_name(name)]
        assert mine.numel() == torch.Size(shape).numel(), name


def test_a_changed_weight_changes_the_logits(golden):
    """The comparison is sensitive: one per-head scalar off by 1e-6 moves the logits past ATOL."""
    model = our_model(golden)
    weights = reference_weights(golden["reference_shapes"], golden["weight_seed"])
    weights["mosaic.h.1.attn.v_featurizer.val_scale"] = weights["mosaic.h.1.attn.v_featurizer.val_scale"] + 1e-6
    model.load_state_dict(from_reference(weights), strict=False)
    with torch.no_grad():
        logits = model(torch.tensor(golden["input_ids"])).logits
    assert (logits - torch.tensor(golden["logits"], dtype=torch.float64)).abs().max() > 100 * ATOL


def regenerate(reference: Path) -> None:
    """Run the reference on the deterministic weights; write GOLDEN."""
    path = reference / "nanoMosaics" / "mosaic_model.py" if reference.is_dir() else reference
    spec = importlib.util.spec_from_file_location("reference_mosaic_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.MemoryMosaic(module.MemoryMosaicConfig(**TINY))
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    weights = reference_weights(shapes)
    model = model.double().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(reference_name(n) is None or n == "lm_head.weight" for n in missing)
    assert model.lm_head.weight is model.mosaic.wte.weight  # tied: loaded with wte
    ids = input_ids(TINY["vocab_size"])
    with torch.no_grad():
        logits, _ = model(ids, targets=ids)  # with targets the reference returns every position's logits
    GOLDEN.write_text(json.dumps({
        "reference": "facebookresearch/MemoryMosaics nanoMosaics/mosaic_model.py",
        "config": TINY, "weight_seed": WEIGHT_SEED, "input_seed": INPUT_SEED, "dtype": "float64",
        "reference_shapes": shapes, "input_ids": ids.tolist(), "logits": logits.tolist(),
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}: logits {tuple(logits.shape)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True,
                        help="a checkout of facebookresearch/MemoryMosaics (or its nanoMosaics/mosaic_model.py)")
    regenerate(parser.parse_args().reference)
    sys.exit(0)
