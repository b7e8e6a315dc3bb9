"""The PKM layer equals XLM's `HashingMemory` for the same weights.

The reference is `xlm/model/memory/memory.py` of facebookresearch/XLM (commit cd281d32, the
repository's head when the golden values were made), `HashingMemoryProductFast` built by
`HashingMemory.build` from its own argument defaults with the paper's query batch norm on
(`mem_query_batchnorm`), at tiny sizes (`TINY`). Its code is CC BY-NC: it is not vendored; its
outputs were recorded once, for a deterministic state dict drawn from a seed
(`reference_weights`, names and shapes the reference's), in float64, and committed as
`pkm_reference_outputs.json`: the output in training mode (batch statistics), the running
statistics it leaves, the gradients of a fixed projection of that output (input, query
network, sub-keys, values), and the output in evaluation mode (running statistics). The
running statistics agree to float64 rounding; the rest to the reference's float32 softmax
(`ATOL`).

To regenerate (needs torch and numpy; the reference's package `__init__`s are skipped, so
nothing else of XLM is imported but `xlm/utils.py` and `xlm/logger.py`):

    git clone https://github.com/facebookresearch/XLM /tmp/XLM
    python tests/model/test_pkm_reference.py --reference /tmp/XLM
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from memoria_ds.model.pkm import PKMSettings, ProductKeyMemory

GOLDEN = Path(__file__).with_name("pkm_reference_outputs.json")
# XLM's argument names (`--mem_*`); the rest keep XLM's defaults (pq_fast, uniform keys, different
# keys per head, a query network of one linear layer, softmax scores, no dropout)
TINY = dict(input_dim=8, mem_n_keys=6, mem_heads=2, mem_knn=3, mem_k_dim=4, mem_query_batchnorm=True)
WEIGHT_SEED, INPUT_SEED, BATCH, LENGTH = 51, 1051, 2, 5
# float64 on both sides, the same top-k selections; but the reference takes its softmax in float32
# whatever the input's dtype (`scores.float()`), ours in float64 here (float32 or wider: the same
# in float32 and bf16 runs), which moves outputs and gradients by up to ~2e-6 at these sizes
ATOL = 1e-5
# reference name -> ours
NAMES = {
    "query_proj.query_mlps.0.weight": "query.weight",
    "query_proj.query_mlps.0.bias": "query.bias",
    "query_proj.query_mlps.1.weight": "query_norm.weight",
    "query_proj.query_mlps.1.bias": "query_norm.bias",
    "query_proj.query_mlps.1.running_mean": "query_norm.running_mean",
    "query_proj.query_mlps.1.running_var": "query_norm.running_var",
    "keys": "keys",
    "values.weight": "values.weight",
}


def reference_weights(shapes: dict[str, list[int]], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """A deterministic float64 state dict under the reference's names, far from its init: running
    statistics off 0/1 (evaluation mode shows them), batch-norm gains and shifts off 1/0, sub-keys
    and values of unit scale (the top-k selections depend on them)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return mean + std * torch.randn(shape, generator=g, dtype=torch.float64)

    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("running_var"):
            out[name] = 0.5 + 1.5 * torch.rand(shape, generator=g, dtype=torch.float64)
        elif name.endswith("1.weight"):
            out[name] = normal(shape, 0.3, mean=1.0)
        elif name.endswith(("1.bias", "running_mean")):
            out[name] = normal(shape, 0.5)
        else:
            out[name] = normal(shape, 1.0 if name in ("keys", "values.weight") else 0.5)
    return out


def inputs(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, D) input and (B, L, D) output projection of the gradient check."""
    g = torch.Generator().manual_seed(INPUT_SEED)
    return (torch.randn(BATCH, LENGTH, dim, generator=g, dtype=torch.float64),
            torch.randn(BATCH, LENGTH, dim, generator=g, dtype=torch.float64))


def settings() -> PKMSettings:
    return PKMSettings(n_keys=TINY["mem_n_keys"], heads=TINY["mem_heads"], knn=TINY["mem_knn"],
                       k_dim=TINY["mem_k_dim"], query_batchnorm=True)


def run(layer: torch.nn.Module, query_weight: torch.Tensor) -> dict[str, list]:
    """What the golden file records, for either implementation (their parameters named as the reference's)."""
    x, projection = inputs(TINY["input_dim"])
    x.requires_grad_(True)
    layer.train()
    out = layer(x)
    if isinstance(layer, ProductKeyMemory):  # ours returns the batch statistics for the model to apply
        out, stats = out
        layer.update_running(stats)
    (out * projection).sum().backward()
    params = dict(layer.named_parameters())
    norm = {k: v for k, v in layer.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    record = {"train_output": out.tolist(), "grad_input": x.grad.tolist(),
              "grad_query_weight": query_weight.grad.tolist()}
    record["grad_keys"] = params["keys"].grad.tolist()
    record["grad_values"] = params["values.weight"].grad.tolist()
    record["running_mean"], record["running_var"] = [v.tolist() for k, v in sorted(norm.items())]
    layer.eval()
    with torch.no_grad():
        out = layer(x.detach())
        record["eval_output"] = (out[0] if isinstance(layer, ProductKeyMemory) else out).tolist()
    return record


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def ours(golden: dict) -> ProductKeyMemory:
    layer = ProductKeyMemory(TINY["input_dim"], settings()).double()
    weights = reference_weights(golden["reference_shapes"], golden["weight_seed"])
    missing, unexpected = layer.load_state_dict({NAMES[k]: v for k, v in weights.items()}, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return layer


def test_outputs_and_gradients_equal_the_reference(golden):
    layer = ours(golden)
    got = run(layer, layer.query.weight)
    for key in ("train_output", "running_mean", "running_var", "grad_input", "grad_query_weight", "grad_keys",
                "grad_values", "eval_output"):
        expected = torch.tensor(golden[key], dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64), expected, atol=ATOL, rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_every_reference_parameter_has_one_of_ours(golden):
    layer = ProductKeyMemory(TINY["input_dim"], settings())
    mine = {k: v.shape for k, v in layer.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert sorted(NAMES.values()) == sorted(mine)
    for name, shape in golden["reference_shapes"].items():
        assert list(mine[NAMES[name]]) == shape, name


def test_a_changed_weight_changes_the_output(golden):
    """The comparison is sensitive: one sub-key off by 1e-2 moves the output past 100 ATOL."""
    layer = ours(golden)
    with torch.no_grad():
        layer.keys[1, 0, 2, 1] += 1e-2
    got = torch.tensor(run(layer, layer.query.weight)["train_output"], dtype=torch.float64)
    assert (got - torch.tensor(golden["train_output"], dtype=torch.float64)).abs().max() > 100 * ATOL


def load_reference(checkout: Path) -> types.ModuleType:
    """`xlm.model.memory.memory` of a checkout, without running `xlm/__init__` or `xlm/model/__init__`
    (they import the whole of XLM)."""
    for name, folder in (("xlm", checkout / "xlm"), ("xlm.model", checkout / "xlm" / "model")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return importlib.import_module("xlm.model.memory.memory")


def regenerate(checkout: Path) -> None:
    """Run the reference on the deterministic weights; write GOLDEN."""
    memory = load_reference(checkout)
    parser = argparse.ArgumentParser()
    memory.HashingMemory.register_args(parser)
    params = parser.parse_args([f"--{k}={v}" for k, v in TINY.items() if k != "input_dim"])
    memory.HashingMemory.check_params(params)
    layer = memory.HashingMemory.build(TINY["input_dim"], TINY["input_dim"], params)
    assert type(layer).__name__ == "HashingMemoryProductFast"
    shapes = {k: list(v.shape) for k, v in layer.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert sorted(shapes) == sorted(NAMES), sorted(shapes)
    layer = layer.double()
    layer.load_state_dict(reference_weights(shapes), strict=False)
    record = run(layer, layer.query_proj.query_mlps[0].weight)
    GOLDEN.write_text(json.dumps({
        "reference": "facebookresearch/XLM xlm/model/memory/memory.py (HashingMemoryProductFast)",
        "arguments": TINY, "weight_seed": WEIGHT_SEED, "input_seed": INPUT_SEED, "dtype": "float64",
        "reference_shapes": shapes, **record,
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--reference", type=Path, required=True, help="a checkout of facebookresearch/XLM")
    regenerate(cli.parse_args().reference)
    sys.exit(0)
