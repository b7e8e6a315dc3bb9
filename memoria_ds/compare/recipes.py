"""What one comparison holds fixed: its recipe, its name on disk, and the refusal of a table
that would mix recipes.

A recipe is every option of the benchmark script that changes what a number means: the data,
the steps and the update schedule, the model's shape, the optimiser, the evaluation. Two
results belong in one table only when their recipes are equal; the variant (which memory,
its settings, its optimiser knobs) and the seed are what a table compares.

    books     benchmarks/real_text.py: train on some texts, perplexity on held-out ones
    sorting   benchmarks/sorting.py at one number of segments K: accuracy on the answer
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Options of benchmarks/real_text.py that define a comparison (as its own `--merge` checks, and
# the update schedule `bptt` and the training `reset` besides).
BOOKS_KEYS = ("train", "heldout", "steps", "streams", "segment", "layers", "width", "heads", "num_wm", "lr",
              "weight_decay", "grad_clip", "reset", "bptt", "eval_segments", "eval_windows", "full_vocab")
# Options of benchmarks/sorting.py that do (`segments` is one K per comparison).
SORTING_KEYS = ("segments", "segment", "train_examples", "test_examples", "epochs", "batch", "layers", "width",
                "heads", "memory_width", "dropout", "lr", "weight_decay", "grad_clip", "data_seed")


@dataclass(frozen=True)
class Task:
    """A kind of comparison: the script that runs one (variant, seed), and what it measures."""

    name: str  # the recipe's `task`
    script: str  # relative to the repository root
    keys: tuple[str, ...]
    metric: str  # "ppl" (lower is better) or "accuracy" (higher is better)
    defaults: tuple[str, ...] = ()  # script options before the user's (the quickstart's book)
    run_options: tuple[tuple[str, str], ...] = ()  # `+run.NAME=true` in a variant -> a script flag


TASKS = {
    "books": Task("books", "benchmarks/real_text.py", BOOKS_KEYS, "ppl"),
    # the quickstart's book (chapters I-X, chapter XI held out) at the quickstart's model size
    "quickstart": Task("books", "benchmarks/real_text.py", BOOKS_KEYS, "ppl",
                       defaults=("--train", "bundled:train", "--heldout", "bundled:validation", "--layers", "2",
                                 "--width", "64", "--heads", "4", "--streams", "4", "--num-wm", "8", "--steps", "138",
                                 "--reset", "every:500", "--eval-segments", "8", "--eval-windows", "0")),
    # `--bptt-example` lets the answer's loss reach the memory's writes of the earlier segments,
    # which changes nothing for a kind that detaches what it carries; where the answer lies in one
    # segment (8 segments of 32 and more) it changes neither the data nor the updates. So it is a
    # variant's setting; where it would change the number of updates (an answer over two
    # segments), the table refuses the variant beside the plain model (`table.build`).
    "sorting": Task("sorting", "benchmarks/sorting.py", SORTING_KEYS, "accuracy",
                    run_options=(("bptt_example", "--bptt-example"),)),
}
# recipe task -> what is measured (`quickstart.sh`: the quickstart runs transcribed in docs/results)
METRICS = {**{t.name: t.metric for t in TASKS.values()}, "quickstart.sh": "ppl"}


class MixedRecipes(ValueError):
    """Results of different recipes were asked for in one table."""


def recipe_from_args(task: Task, args: dict[str, Any], root: Path) -> dict[str, Any]:
    """The recipe of a comparison from the script's resolved options (`--print-args`).

    A local text file enters by its content (sha256), so an edited file is another recipe.

    Raises:
        ValueError: a sorting comparison over several segment counts.
    """
    recipe: dict[str, Any] = {"task": task.name, "script": task.script}
    for key in task.keys:
        recipe[key] = args[key]
    if task.name == "sorting":
        if args.get("bptt_example"):
            raise ValueError("--bptt-example: give it to the variants it is for, as `+run.bptt_example=true` "
                             "(e.g. memformer+run.bptt_example=true), so that each result names it")
        if len(args["segment_list"]) != 1:
            raise ValueError(f"--segments {args['segments']}: one segment count per comparison (each is its own "
                             f"recipe); run one comparison per K")
        recipe["segments"] = args["segment_list"][0]
    else:
        files = {}
        for name in (*args["train"].split(","), *args["heldout"].split(",")):
            path = Path(name) if Path(name).is_absolute() else root / name
            if ":" not in name and path.is_file():
                files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        if files:
            recipe["files_sha256"] = files
    return recipe


def recipe_id(recipe: dict[str, Any]) -> str:
    """Ten hex digits naming a recipe (its canonical JSON's sha256)."""
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The recipe keys on which `a` and `b` differ."""
    return sorted(k for k in {*a, *b} if a.get(k) != b.get(k))


def describe(recipe: dict[str, Any]) -> str:
    """One line a reader can check a table against."""
    r = recipe
    if r.get("task") == "books":
        span = "one update per segment" if r["bptt"] == 1 else f"one update per {r['bptt']} segments"
        windows = "all windows" if not r["eval_windows"] else f"at most {r['eval_windows']} windows"
        return (f"`{r['script']}`: trained on {r['train']}, held out {r['heldout']}; {r['steps']:,} segments of "
                f"{r['streams']} x {r['segment']} tokens, {span}; {r['layers']} x {r['width']}, {r['heads']} heads, "
                f"from scratch; AdamW lr {r['lr']:g}, clip {r['grad_clip']:g}; reset {r['reset']}; scored on "
                f"{windows} of {r['eval_segments']} segments per held-out text, each from an empty memory")
    if r.get("task") == "sorting":
        return (f"`{r['script']}`: {r['segments']} segments of {r['segment']}; {r['train_examples']:,} examples x "
                f"{r['epochs']} epochs in batches of {r['batch']}; {r['layers']} x {r['width']}, {r['heads']} heads, "
                f"from scratch, dropout {r['dropout']:g}; AdamW lr {r['lr']:g}; Memoria's memory attention "
                + ("at the full width" if r["memory_width"] == 1 else f"at {r['memory_width']:g} of the width")
                + f"; accuracy on {r['test_examples']} test examples")
    return r.get("description", json.dumps(r, sort_keys=True))


def check_one_recipe(groups: dict[str, tuple[dict[str, Any], list[str]]]) -> None:
    """Refuse results of more than one recipe in one table.

    Args:
        groups: recipe id -> (the recipe, where its results came from).

    Raises:
        MixedRecipes: with the keys that differ between the first two recipes and where each came from.
    """
    if len(groups) <= 1:
        return
    (_, (first, where_a)), (_, (second, where_b)) = list(groups.items())[:2]
    keys = differences(first, second)
    shown = ", ".join(f"{k} ({_short(first.get(k))} against {_short(second.get(k))})" for k in keys)
    raise MixedRecipes(
        f"these results were measured under {len(groups)} recipes and one table holds one: {where_a[0]} and "
        f"{where_b[0]} differ in {shown}. A schedule, the steps or the data change what a number means; give the "
        f"results of one recipe, or `python -m memoria_ds.compare report` for one table per recipe")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def split_variants(text: str) -> list[str]:
    """`--variants` text -> the variant specs: split at the commas outside brackets, braces and
    quotes, so that a setting's value may be a list or a dict of several entries
    (`transformer+pkm={'n_keys':128,'heads':1}`).

    Raises:
        ValueError: an unbalanced bracket or quote.
    """
    specs, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
            if depth < 0:
                raise ValueError(f"--variants {text!r}: {c!r} at character {i + 1} closes nothing")
        elif c == "," and depth == 0:
            specs.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise ValueError(f"--variants {text!r}: a bracket or quote is not closed")
    return [*specs, text[start:]]


def split_variant(spec: str, task: Task) -> tuple[str, list[str]]:
    """(the variant as the script takes it, the script flags of its `+run.NAME=true` pairs).

    Raises:
        ValueError: a `run.` option the task does not have, or a value other than true.
    """
    preset, *pairs = spec.split("+")
    keep, flags, known = [preset], [], dict(task.run_options)
    for pair in pairs:
        if not pair.startswith("run."):
            keep.append(pair)
            continue
        name, _, value = pair[4:].partition("=")
        if name not in known:
            raise ValueError(f"{pair!r} in {spec!r}: the {task.name} task's run options are "
                             f"{sorted(known) or 'none'}")
        if value not in ("true", "True", "1"):
            raise ValueError(f"{pair!r} in {spec!r}: give run.{name}=true (or leave it out)")
        flags.append(known[name])
    return "+".join(keep), flags


def price_key(spec: str) -> str:
    """The variant whose step a variant's step is: without optimiser knobs (`opt.`), run options
    (`run.`) and the initialisation (`memory_init`), which change no step's work."""
    preset, *pairs = spec.split("+")
    keep = [p for p in pairs if not p.startswith(("opt.", "run.", "memory_init="))]
    return "+".join([preset, *keep])


def slug(spec: str) -> str:
    """A folder name for a variant: its characters that are safe in a path, plus a hash where
    anything was changed or cut (the exact variant is in every result file)."""
    safe = re.sub(r"[^A-Za-z0-9._=+-]+", "_", spec).strip("_")
    if safe == spec and len(spec) <= 80:
        return spec
    return f"{safe[:60]}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"

