"""`deterministic: true`: every op on a deterministic kernel, so that a step repeats bit for bit.

On a CPU the toolkit's steps already repeat. On a GPU some kernels accumulate in an order
that changes from run to run: SDPA's fused kernels, which the Memory Mosaics' attention
takes (the persistent memory's read, the carried memory's masked read), split their backward
over the keys unless torch's deterministic mode is on
(aten/src/ATen/native/transformers/cuda/attention_backward.cu; measured on an H200,
docs/benchmarks.md), and cuBLAS needs a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`). With the mode on, an op that has no
deterministic kernel stops the run with torch's error naming it, instead of drifting.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # the setting cuBLAS documents for reproducible results


def make_deterministic() -> None:
    """Turn torch's deterministic mode on for this process (each rank calls it).

    Call it before the first CUDA matrix product: cuBLAS reads its workspace setting when
    its handle is made. A `CUBLAS_WORKSPACE_CONFIG` already set is kept.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


__all__ = ["make_deterministic", "CUBLAS_WORKSPACE"]
