"""Files that carry no code: nested state as safetensors (tensors) plus JSON (the rest).

Everything memoria_ds writes itself and reads back (memory and stream shards of a
checkpoint, the plain engine's state, memory trace states) goes through `save_tree` /
`load_tree`, never through pickle: a file passed around (a colleague's run directory, a
shared memory snapshot) is data, and opening it cannot run anything.

A tree is nested dicts, lists and tuples of tensors, NumPy arrays, str, int, float, bool
and None (a random-number state, an optimizer's state dict, a memory state). Its tensors
are stored in one safetensors file; its structure, as JSON, in the file's metadata, with
each tensor replaced by a reference to its key. Anything else is refused when writing.

Files written by earlier versions with `torch.save` are pickles: `load_tree` refuses them
with `PickleRefused`, naming the command that converts them once, for files whose source
the user trusts:

    python -m memoria_ds.safe_io convert runs/old/checkpoints     # every .pt under it
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import importlib
import json
import os
import pickletools
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "memoria_ds.tree/1"
_FORMAT_KEY, _TREE_KEY = "format", "memoria_ds.tree"
_ZIP_MAGIC, _PICKLE_MAGIC = b"PK\x03\x04", b"\x80"  # torch.save's zip container; a bare pickle
CONVERT = "python -m memoria_ds.safe_io convert"


class PickleRefused(ValueError):
    """A file is a pickle (it could run code when loaded) and was not read."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()  # own storage: no sharing between entries
        return {"$tensor": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj)).clone()
        return {"$ndarray": key}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"$items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"cannot store a {type(obj).__name__} without pickle (tensors, arrays, numbers, str, "
                    f"None, lists, tuples and dicts only)")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        return tensors[obj["$tensor"]]
    if "$ndarray" in obj:
        return tensors[obj["$ndarray"]].numpy()
    if "$tuple" in obj:
        return tuple(_decode(v, tensors) for v in obj["$tuple"])
    if "$items" in obj:
        return {_freeze(_decode(k, tensors)): _decode(v, tensors) for k, v in obj["$items"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_tree(tree: Any, path: str | os.PathLike) -> None:
    """Write `tree` to `path` as safetensors + JSON metadata (not atomic: write a temp and rename)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, tensors)
    save_file(tensors, str(path), metadata={_FORMAT_KEY: FORMAT, _TREE_KEY: json.dumps(structure)})


def is_pickle(path: str | os.PathLike) -> bool:
    """True if `path` starts like a `torch.save` zip container or a bare pickle."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == _ZIP_MAGIC or head[:1] == _PICKLE_MAGIC


def load_tree(path: str | os.PathLike, device: str | torch.device = "cpu") -> Any:
    """Read a tree written by `save_tree`; nothing in the file is executed.

    Raises:
        PickleRefused: the file is a pickle (an older memoria_ds wrote it with torch.save).
        ValueError: the file is not a memoria_ds tree (or is damaged).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if is_pickle(path):
        raise PickleRefused(
            f"{path} is a pickle (written by an older memoria_ds with torch.save): not read, since loading a "
            f"pickle can run any code it carries. If you trust where it came from, convert it once with "
            f"`{CONVERT} {path}`"
        )
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get(_FORMAT_KEY) != FORMAT:
                raise ValueError(f"{path} is a safetensors file but not a memoria_ds state "
                                 f"(format {meta.get(_FORMAT_KEY)!r}, expected {FORMAT!r})")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            structure = json.loads(meta[_TREE_KEY])
    except (SafetensorError, json.JSONDecodeError, KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable memoria_ds state file ({e})") from None
    return _decode(structure, tensors)


# --------------------------------------------------------------------------- other tools' pickles
def pickle_globals(path: str | os.PathLike) -> set[str]:
    """The classes and functions a `torch.save` file would import when unpickled, read from its
    opcodes without unpickling it (`torch.serialization.get_unsafe_globals_in_checkpoint`;
    torch's own tensor-rebuilding functions are not listed).

    Raises:
        PickleRefused: the file cannot be scanned (not a torch.save zip file).
    """
    try:
        return set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as e:  # noqa: BLE001 - any failure to scan means: do not load it
        raise PickleRefused(f"{path} could not be checked before loading ({type(e).__name__}: {e}); not loaded") from None


def check_pickles(paths: list[Path], allowed: frozenset[str], writer: str) -> None:
    """Refuse pickle files that would import anything but what `writer` itself writes.

    A file that only references the allow-listed classes (plain data classes and enums of
    `writer`) can rebuild data and nothing else; one that references, say, `os.system` or
    `builtins.eval` is refused before anything in it is loaded.

    Raises:
        PickleRefused: naming the file and the first unexpected imports.
    """
    for path in paths:
        extra = sorted(pickle_globals(path) - allowed)
        if extra and set(extra) <= _GETATTR:  # an enum member written as getattr(Enum, name): only that
            extra = [why] if (why := _enum_lookups_only(path, allowed)) else []
        if extra:
            raise PickleRefused(
                f"{path} would import {', '.join(extra[:4])} when loaded, which {writer} never writes: not loaded "
                f"(a file that runs code on load; take checkpoints only from people you trust)"
            )


# Some Python builds (3.11.0-3.11.3, e.g. Debian 12's 3.11.2) pickle an enum member as
# `getattr(EnumClass, "member")`, so files they write import `getattr`. It is accepted in
# exactly that form: called once per use, on an allow-listed Enum class, with a member's name.
_GETATTR = frozenset({"builtins.getattr", "__builtin__.getattr"})
_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                         "BINUNICODE8"})
_MARK = object()


class _Refused(Exception):
    pass


class _Global(str):
    """A class or function a pickle imports (its dotted name), as it moves on the pickle's stack."""


def _data_pickle(path: str | os.PathLike) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
        return z.read(name)


def _enum_member(cls_name: str, member: Any, allowed: frozenset[str]) -> bool:
    if cls_name not in allowed or type(member) is not str:
        return False
    module, _, name = cls_name.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return isinstance(cls, type) and issubclass(cls, enum.Enum) and member in cls.__members__


def _enum_lookups_only(path: str | os.PathLike, allowed: frozenset[str]) -> str | None:
    """None when every `getattr` in the torch.save file at `path` is `getattr(<allowed Enum>,
    "<one of its members>")`; else a description of the first other use.

    Reads the opcodes and follows what each does to the stack (what is imported, which
    strings and tuples are built, what is memoized and fetched back) without unpickling.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    bad = "builtins.getattr (not as an enum member lookup)"

    def pop() -> Any:
        item = stack.pop()
        if isinstance(item, _Global) and item in _GETATTR:  # getattr used other than as REDUCE's function
            raise _Refused
        return item

    def pop_to_mark() -> list[Any]:
        items = []
        while stack[-1] is not _MARK:
            items.append(pop())
        stack.pop()
        return items[::-1]

    try:
        for op, arg, _ in pickletools.genops(_data_pickle(path)):
            name = op.name
            if name == "GLOBAL":
                stack.append(_Global(arg.replace(" ", ".")))
            elif name == "STACK_GLOBAL":
                attr, module = pop(), pop()
                stack.append(_Global(f"{module}.{attr}"))
            elif name in _STRING_OPS:
                stack.append(str(arg))
            elif name == "MARK":
                stack.append(_MARK)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                items = [pop() for _ in range(int(name[-1]))]
                stack.append(tuple(items[::-1]))
            elif name == "TUPLE":
                stack.append(tuple(pop_to_mark()))
            elif name == "REDUCE":
                if isinstance(stack[-2], _Global) and stack[-2] in _GETATTR:
                    args = stack.pop()
                    stack.pop()
                    if not (isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], _Global)
                            and _enum_member(args[0], args[1], allowed)):
                        return bad
                else:  # any other call: neither its function nor its arguments may be getattr
                    pop(), pop()
                stack.append(None)
            else:  # any other opcode: pops what it takes and pushes results nothing here follows
                for taken in reversed(op.stack_before):
                    if taken is pickletools.stackslice:
                        pop_to_mark()
                    elif taken is not pickletools.markobject:
                        pop()
                stack.extend(None for _ in op.stack_after)
    except _Refused:
        return bad
    except Exception as e:  # noqa: BLE001 - a pickle that cannot be followed is not loaded
        return f"an unreadable pickle ({type(e).__name__}: {e})"
    return None


# --------------------------------------------------------------------------- conversion
def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _update_manifest(folder: Path, old: str, new: str) -> None:
    """A checkpoint's manifest.json names the converted file (`old` -> `new`, relative to
    `folder`) with its new size and SHA-256."""
    path = folder / "manifest.json"
    if not path.is_file():
        return
    manifest = json.loads(path.read_text())
    target = folder / new
    for key, value in (("files", target.stat().st_size), ("sha256", None), ("shard_sha256", None)):
        table = manifest.get(key)
        if isinstance(table, dict) and old in table:
            del table[old]
            table[new] = file_sha256(target) if value is None else value
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)


OURS = ("rank_*.pt", "engine.pt", "memory_*.pt")  # the pickles older memoria_ds versions wrote


def convert(path: Path) -> list[Path]:
    """Rewrite memoria_ds's own pickles at or under `path` as trees; returns the new files.

    This unpickles them (with `weights_only=False`): run it only on files you trust.
    DeepSpeed's own files (`engine/*.pt`) are left as they are.
    """
    files = [path] if path.is_file() else sorted({p for pattern in OURS for p in path.rglob(pattern)})
    out = []
    for old in files:
        if not is_pickle(old):
            continue
        tree = torch.load(old, map_location="cpu", weights_only=False)
        new = old.with_suffix(".safetensors")
        tmp = new.with_name(new.name + ".tmp")
        save_tree(tree, tmp)
        os.replace(tmp, new)
        folder = old.parent if old.name != "engine.pt" else old.parent.parent
        _update_manifest(folder, str(old.relative_to(folder)), str(new.relative_to(folder)))
        old.unlink()
        out.append(new)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m memoria_ds.safe_io", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="rewrite memoria_ds's own pickle files (shards, engine.pt, memory "
                                       "states) as safetensors; unpickles them: only for files you trust")
    c.add_argument("paths", nargs="+", type=Path)
    a = p.parse_args(argv)
    for path in a.paths:
        if not path.exists():
            print(f"error: {path} does not exist", file=sys.stderr)
            sys.exit(2)
    for path in a.paths:
        done = convert(path)
        print(f"{path}: {len(done)} file(s) converted" + "".join(f"\n  {d}" for d in done))


if __name__ == "__main__":
    main()
