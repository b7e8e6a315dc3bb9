"""Argument checks shared by the benchmark scripts (`real_text.py`, `sorting.py`).

A mistake is found before any download, data generation or training, and reported as
argparse reports its own: the usage line, one line that says what to change, exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memoria_ds.compare.recipes import split_variants


def int_list(p: argparse.ArgumentParser, flag: str, text: str, minimum: int) -> list[int]:
    """`"0,1,2"` -> [0, 1, 2]; every entry an integer of at least `minimum`, none twice."""
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        p.error(f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 0,1,2")
    if any(v < minimum for v in values):
        p.error(f"{flag} {text!r}: every value must be at least {minimum}")
    if len(set(values)) != len(values):
        p.error(f"{flag} {text!r}: a value is given twice")
    return values


def at_least(p: argparse.ArgumentParser, a: argparse.Namespace, minimum: float, *names: str) -> None:
    """Each named option (argparse's dest) is at least `minimum`."""
    for name in names:
        if getattr(a, name) < minimum:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least {minimum}")


def variants(p: argparse.ArgumentParser, text: str, parse_variant) -> list[str]:
    """The comma-separated variant specs (a setting's list or dict may hold commas), each parsed once
    here (`parse_variant` raises ValueError)."""
    try:
        specs = split_variants(text)
    except ValueError as e:
        p.error(str(e))
    for spec in specs:
        try:
            parse_variant(spec)
        except ValueError as e:
            p.error(f"--variants: {e}")
    if len(set(specs)) != len(specs):
        p.error(f"--variants {text!r}: a variant is given twice")
    return specs


def result_files(p: argparse.ArgumentParser, flag: str, paths: list[str]) -> list[dict]:
    """Earlier `--json` outputs, read whole: each must exist and hold a JSON object with `results`."""
    out = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            p.error(f"{flag}: cannot read {path} ({e.strerror})")
        except ValueError as e:
            p.error(f"{flag}: {path} is not JSON ({e})")
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            p.error(f"{flag}: {path} is not a benchmark's --json output (no `results` list)")
        out.append(data)
    return out


def output_file(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """`--json PATH` can be written at the end (its folder exists, it is not a folder itself)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        p.error(f"{flag} {path}: is a directory; give a file name")
    if not target.parent.is_dir():
        p.error(f"{flag} {path}: the folder {target.parent} does not exist")


def device(p: argparse.ArgumentParser, name: str) -> None:
    """`--device NAME` names a device torch knows and this machine has."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        p.error(f"--device {name}: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {name}: this machine has no CUDA device torch can use; run on --device cpu")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {name}: cpu or cuda")


__all__ = ["int_list", "at_least", "variants", "result_files", "output_file", "device"]
