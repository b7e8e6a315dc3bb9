"""The house's import rules (docs/design.md), read from the source with `ast`.

- Only `memoria_ds/train/engine/` imports deepspeed (or transformers' DeepSpeed integration).
- Imports go down the floors, never up: data, safe_io, rows < memory < model, eval < train
  < analysis, repro.
- No import cycle anywhere in the package, counting the imports inside functions too.

Each rule is checked on a small synthetic package first, so a checker that sees nothing
cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "memoria_ds"

FLOORS = {"data": 1, "safe_io": 1, "rows": 1, "setting_rules": 1, "memory": 2, "episodic": 2, "model": 3, "eval": 3, "train": 4, "analysis": 5,
          "repro": 5, "compare": 5}
ENGINE = "memoria_ds.train.engine"


def modules(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of a package (a folder's __init__.py is named for the folder)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, resolved to absolute names.

    `from X import y` counts X.y when that is a module of the package, else X.
    """
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if len(subs) < len(node.names):  # a name defined in X itself
                out.append((target, node.lineno))
            out += [(sub, node.lineno) for sub in subs]
    return out


def graph(package: Path) -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int]]]]:
    known = modules(package)
    every = {m: imports(m, p, known) for m, p in known.items()}
    edges = {m: {t for t, _ in every[m] if t in known and t != m} for m in known}
    return edges, every


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def upward(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in edges.items():
        for t in targets:
            if floor(m) is not None and floor(t) is not None and floor(t) > floor(m):
                bad.append(f"{m} -> {t}")
    return sorted(bad)


def deepspeed_outside_engine(every: dict[str, list[tuple[str, int]]], engine: str) -> list[str]:
    bad = []
    for m, found in every.items():
        if m == engine or m.startswith(engine + "."):
            continue
        for target, line in found:
            if target.split(".")[0] == "deepspeed" or target.startswith("transformers.integrations"):
                bad.append(f"{m}:{line} imports {target}")
    return bad


@pytest.fixture
def toy(tmp_path):
    """A package with one cycle, one upward import and one stray deepspeed import."""
    pkg = tmp_path / "memoria_ds"
    for rel, text in {
        "__init__.py": "",
        "memory/__init__.py": "from .a import f\n",
        "memory/a.py": "from .b import g\n",
        "memory/b.py": "def g():\n    from . import a\n",  # a lazy import still closes the circle
        "data/__init__.py": "",
        "data/x.py": "from ..train import loop\n",  # a lower floor importing a higher one
        "train/__init__.py": "",
        "train/loop.py": "import deepspeed\n",
        "train/engine/__init__.py": "import deepspeed.comm\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_checks_see_what_they_look_for(toy):
    edges, every = graph(toy)
    assert cycles(edges) == [["memoria_ds.memory.a", "memoria_ds.memory.b"]]
    assert upward(edges) == ["memoria_ds.data.x -> memoria_ds.train.loop"]
    assert deepspeed_outside_engine(every, ENGINE) == ["memoria_ds.train.loop:1 imports deepspeed"]


def test_only_the_engine_imports_deepspeed():
    _, every = graph(PACKAGE)
    assert deepspeed_outside_engine(every, ENGINE) == []


def test_no_import_goes_up_a_floor():
    edges, _ = graph(PACKAGE)
    unplaced = sorted({m.split(".")[1] for m in edges if "." in m} - set(FLOORS))
    assert unplaced == [], f"place these in FLOORS (and in docs/design.md): {unplaced}"
    assert upward(edges) == []


def test_no_import_cycles():
    edges, _ = graph(PACKAGE)
    assert cycles(edges) == []
