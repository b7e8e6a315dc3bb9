"""The ZeRO choices the planner considers, and what one run costs a rank under one (`Footprint`).

Shared by the language models' estimates (`footprint.py`) and the classifiers' (`encoder_estimates.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# ZeRO choices the planner considers, cheapest first: name -> (stage, offload, DeepSpeed JSON)
ZERO_CHOICES = {
    "1": (1, False, "ds_configs/zero1.json"),
    "2": (2, False, "ds_configs/zero2.json"),
    "3": (3, False, "ds_configs/zero3.json"),
    "2-offload": (2, True, "ds_configs/zero2_offload.json"),
    "3-offload": (3, True, "ds_configs/zero3_offload.json"),
}
SINGLE_GPU_CONFIG = "ds_configs/single_gpu.json"  # ZeRO-1 on one rank: nothing to shard


@dataclass(frozen=True)
class Footprint:
    """Estimated GPU memory of one rank, in bytes, and what it is made of."""

    params: dict[str, int]
    zero: str
    model_states: dict[str, float]  # {"gpu": per GPU, "cpu": per node}, DeepSpeed's estimate
    activations: float
    rows_per_rank: int
    engram_row: dict[str, int]

    @property
    def engram_bytes(self) -> float:
        return self.rows_per_rank * sum(v for k, v in self.engram_row.items() if k != "capacity")

    @property
    def total(self) -> float:
        return self.model_states["gpu"] + self.activations + self.engram_bytes


__all__ = ["Footprint", "SINGLE_GPU_CONFIG", "ZERO_CHOICES"]
