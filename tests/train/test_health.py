"""The divergence check before a checkpoint (issue 17 item 3): hand-made states."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from memoria_ds.memory.config import MemoriaConfig
from memoria_ds.model import MemoriaMemory, XLMemory
from memoria_ds.train.health import (
    DivergedState,
    check_before_save,
    largest_magnitude,
    local_weights,
    memory_magnitude,
    weights_magnitude,
)

CPU = torch.device("cpu")


def _memoria(dim: int = 4) -> MemoriaMemory:
    cfg = MemoriaConfig(num_wm=2, num_stm_reminded=2, num_ltm_reminded=2, stm_capacity=4, search_depth=1)
    return MemoriaMemory.empty(cfg, batch_size=2, dim=dim)


def test_largest_magnitude_by_hand():
    a, b = torch.tensor([1.0, -7.5, 2.0]), torch.tensor([[3.0], [-4.0]], dtype=torch.bfloat16)
    assert float(largest_magnitude([a, b], CPU)) == 7.5
    assert float(largest_magnitude([], CPU)) == 0.0
    assert math.isinf(float(largest_magnitude([a, torch.tensor([float("nan")])], CPU)))  # NaN reads as +inf
    assert math.isinf(float(largest_magnitude([a, torch.tensor([-float("inf")])], CPU)))
    # finite_only: a large finite value does not count, a non-finite one does
    assert float(largest_magnitude([a], CPU, finite_only=[torch.tensor([1e30])])) == 7.5
    assert math.isinf(float(largest_magnitude([a], CPU, finite_only=[torch.tensor([float("nan")])])))


def test_memory_magnitude_reads_activations_and_checks_counters_for_finiteness_only():
    mem = _memoria()
    assert float(memory_magnitude([mem, None], CPU)) == 0.0
    mem.state.vectors[1, 2, 3] = -123.0
    mem.prev_hidden[0, 0, 1] = 45.0
    assert float(memory_magnitude([mem], CPU)) == 123.0
    mem.state.sq_norms[0, 0] = 1e20  # a squared norm is derived: large is not diverging by itself
    mem.state.lifespan[0, 0] = 1e7
    assert float(memory_magnitude([mem], CPU)) == 123.0
    mem.state.lifespan[1, 1] = float("nan")
    assert math.isinf(float(memory_magnitude([mem], CPU)))

    xl = XLMemory.empty(batch_size=1, num_layers=2, num_heads=2, head_dim=4, length=3)
    xl.values[0, 1, 0, 2, 3] = 9.0
    assert float(memory_magnitude([xl], CPU)) == 9.0


def test_local_weights_reads_a_zero3_partition_not_the_empty_placeholder():
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.bias.fill_(0.25)
    layer.weight.ds_tensor = torch.tensor([0.5, -8.0])  # what DeepSpeed ZeRO-3 leaves on a rank
    assert [t.tolist() for t in local_weights(layer)] == [[0.5, -8.0], [0.25, 0.25]]
    assert weights_magnitude(layer, CPU) == 8.0


def _check(module, memories, last_good=None, max_weight=10.0, max_memory=100.0):
    check_before_save(7, module, memories, max_weight=max_weight, max_memory=max_memory, device=CPU,
                      checkpoints=Path("run/checkpoints"), last_good=last_good)


def test_check_before_save_passes_a_healthy_state_and_names_what_diverged():
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    mem = _memoria()
    mem.state.vectors[0, 0, 0] = 100.0  # at the limit: fine
    _check(layer, [mem])

    mem.state.vectors[0, 0, 0] = 2.5e8
    with pytest.raises(DivergedState) as e:
        _check(layer, [mem], last_good="step_00000005")
    msg = str(e.value)
    assert "state at step 7 is diverging: memory values reach 2.5e+08 (limit 100, checkpoint.max_abs)" in msg
    assert "weights up to 3" in msg and "No checkpoint was written for step 7" in msg
    assert str(Path("run/checkpoints/step_00000005")) in msg and "lower optim.lr" in msg

    with torch.no_grad():
        layer.bias[1] = float("nan")
    with pytest.raises(DivergedState, match=r"weights are not finite .*checkpoint.max_weight_growth.*"
                                            r"There is no earlier checkpoint: start again"):
        _check(layer, [mem])

    with torch.no_grad():
        layer.bias.fill_(0.0)
        layer.weight[0, 0] = 11.0
    mem.state.vectors.zero_()
    with pytest.raises(DivergedState, match=r"weights reach 11 \(limit 10"):
        _check(layer, [mem])
    _check(layer, [mem], max_weight=math.inf)  # .inf: finiteness only
