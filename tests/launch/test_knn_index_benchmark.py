"""benchmarks/knn_index.py: exact search and FAISS indexes of kNN-LM's shared datastore, timed side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_times_exact_search_and_each_index() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "knn_index.py"), "--entries", "600", "--dim", "16",
           "--batch", "2", "--segment", "8", "--k", "16", "--indexes", "Flat;IVF4,Flat", "--nprobe", "4",
           "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"exact", "Flat", "IVF4,Flat"}, done.stdout
    assert float(rows["Flat"][-1]) == 1.0 and float(rows["IVF4,Flat"][-1]) == 1.0, "exact indexes find every neighbour"


def test_a_bad_argument_exits_2() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "knn_index.py"), "--k", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--k" in done.stderr
