"""Where comparison results live, and how they are read back.

A results root (default `runs/compare`) holds one folder per recipe:

    <root>/<task>-<recipe id>/recipe.json            the recipe, written once
    <root>/<task>-<recipe id>/<variant>/seed<N>.json one file per run: recipe, variant, seed,
                                                     quality, memory gain, CPU time, the script's result
    <root>/<task>-<recipe id>/<variant>/seed<N>.log  the run's output
    <root>/price/<setting>/<variant>.json            a variant's price per step (benchmarks/model_step.py)

Results measured before this command existed are transcribed into `docs/results/*.json`: one
file per recipe (`"results"`: per-seed records, or a summary where the page gave only the
mean, spread and paired change), each record naming the page and section it was copied from,
and `docs/results/price.json` (`"prices"`). They are read the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .recipes import MixedRecipes, differences, recipe_id

FORMAT = "memoria_ds.compare/1"
ROOT = Path(__file__).resolve().parents[2]
DOCS_RESULTS = ROOT / "docs" / "results"


@dataclass
class Comparison:
    """The results of one recipe, from every place they were found."""

    name: str
    recipe: dict[str, Any]
    title: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return recipe_id(self.recipe)


def write_json(path: Path, data: Any) -> None:
    """Write `data` to `path` whole or not at all (a temporary file, then one rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """A JSON file, or a one-line error naming it.

    Raises:
        ValueError: the file cannot be read or is not JSON.
    """
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def run_path(folder: Path, variant_slug: str, seed: int) -> Path:
    return folder / variant_slug / f"seed{seed}.json"


def load(paths: list[Path]) -> tuple[dict[str, Comparison], list[dict[str, Any]]]:
    """Every result and price under `paths`, grouped by recipe.

    Args:
        paths: results roots, recipe folders, run files (`seed<N>.json`), transcribed files, price files.

    Returns:
        (recipe id -> Comparison, price records).

    Raises:
        ValueError: an unreadable file, a file of no known kind, a run whose recipe is not its
            folder's, or one variant and seed found twice.
    """
    comparisons: dict[str, Comparison] = {}
    prices: list[dict[str, Any]] = []
    for path in paths:
        for file in _files(Path(path)):
            data = read_json(file)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"{file}: not a result of `memoria_ds.compare` (no \"format\": \"{FORMAT}\")")
            if "prices" in data:
                prices += [{**p, "_where": str(file)} for p in data["prices"]]
            elif "price" in data:
                prices.append({**data["price"], "_where": str(file)})
            elif "results" in data:  # a transcribed recipe
                c = _comparison(comparisons, data["recipe"], data.get("name"), data.get("title", ""))
                c.records += [{**r, "_where": f"{file}"} for r in data["results"]]
                c.where.append(str(file))
            elif "recipe" in data and "variant" in data:  # one run
                _check_folder(file, data["recipe"])
                c = _comparison(comparisons, data["recipe"], _folder_name(file), "")
                c.records.append({**data, "_where": str(file)})
                if str(file.parent.parent) not in c.where:
                    c.where.append(str(file.parent.parent))
            elif "recipe" in data:  # a recipe.json
                _comparison(comparisons, data["recipe"], file.parent.name, data.get("title", ""))
            else:
                raise ValueError(f"{file}: neither a run, a recipe, a transcribed recipe nor prices")
    for c in comparisons.values():
        seen: dict[tuple[str, Any], str] = {}
        for r in c.records:
            key = (r["variant"], r.get("seed", tuple(r.get("seeds", ()))))
            if key in seen:
                raise ValueError(f"{r['variant']} seed {key[1]} is in {seen[key]} and in {r['_where']}; "
                                 f"keep one of them")
            seen[key] = r["_where"]
    return comparisons, prices


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    return sorted(p for p in path.rglob("*.json") if not p.name.startswith("."))


def _comparison(comparisons: dict[str, Comparison], recipe: dict, name: str | None, title: str) -> Comparison:
    rid = recipe_id(recipe)
    c = comparisons.setdefault(rid, Comparison(name or f"{recipe.get('task', 'recipe')}-{rid}", recipe))
    if name and not c.title and title:  # a transcribed file names the recipe for a reader
        c.name, c.title = name, title
    return c


def _folder_name(file: Path) -> str:
    return file.parent.parent.name


def _check_folder(file: Path, recipe: dict) -> None:
    """A run's recipe is its folder's: a run file moved or edited by hand is refused."""
    folder_recipe = file.parent.parent / "recipe.json"
    if folder_recipe.is_file():
        theirs = read_json(folder_recipe).get("recipe", {})
        if theirs != recipe:
            raise MixedRecipes(f"{file}: its recipe is not its folder's ({folder_recipe}); they differ in "
                               f"{', '.join(differences(theirs, recipe))}. A run belongs in the folder of its recipe")
