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


def test_it_searches_a_models_own_keys(tmp_path: Path) -> None:
    """`--model`: the store and the queries are the model's kNN-LM keys over a text (its width)."""
    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    build_model(GPT2Config(n_layer=1, n_embd=24, n_head=2, n_positions=64), "memoria").save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 97} and some more text {i % 13}." for i in range(400)), encoding="utf-8")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "knn_index.py"), "--model", str(tmp_path / "m"), "--text",
           str(text), "--entries", "500", "--batch", "2", "--segment", "16", "--k", "8", "--indexes", "Flat",
           "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert f"keys={tmp_path / 'm'} over {text}" in done.stdout and "dim=24 " in done.stdout, done.stdout
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"exact", "Flat"} and float(rows["Flat"][-1]) == 1.0, done.stdout
    short = subprocess.run(cmd[:6] + ["--entries", "100000"] + cmd[8:], capture_output=True, text=True, timeout=300)
    assert short.returncode == 2 and "lower --entries" in short.stderr
