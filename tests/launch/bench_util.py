"""Load a benchmark script (benchmarks/*.py) as a module, with its folder importable while it loads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(script: str, name: str):
    """`benchmarks/<script>` as a module called `name` (its own imports of sibling scripts work)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as an import does (dataclasses look their module up there)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)
