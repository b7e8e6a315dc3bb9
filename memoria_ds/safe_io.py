"""Files that carry no code: nested state as safetensors (tensors) plus JSON (the rest).

Everything memoria_ds writes itself and reads back (memory and stream shards of a
checkpoint, the plain engine's state, memory trace states) goes through `save_tree` /
`load_tree`, never through pickle: a file passed around (a colleague's run directory, a
shared memory snapshot) is data, and opening it cannot run anything.

A tree is nested dicts, lists and tuples of tensors, NumPy arrays, str, int, float, bool
and None (a random-number state, an optimizer's state dict, a memory state). Its tensors
are stored in one safetensors file; its structure, as JSON, in the file's metadata, with
each tensor replaced by a reference to its key. Anything else is refused when writing.

A file's format is read from its own structure (`sniff`), never from one byte: a
safetensors file is an 8-byte little-endian header length followed by that many bytes of
JSON object, inside the file; a `torch.save` file is a zip archive; a bare pickle starts
with the PROTO opcode and a protocol number. Anything malformed in a tree (a reference to a
tensor the file does not hold, an unknown `$` entry, an unhashable key, nesting deeper than
`MAX_DEPTH`) raises `TreeError`, a ValueError naming the file: never a KeyError or a
RecursionError from inside.

Files written by earlier versions with `torch.save` are pickles: `load_tree` refuses them
with `PickleRefused`, naming the command that converts them once, for files whose source
the user trusts:

    python -m memoria_ds.safe_io convert runs/old/checkpoints     # every legacy .pt under it

`convert` touches only legacy pickles (`rank_*.pt`, `engine.pt`, `memory_*.pt` that are
pickles), loads them with torch's restricted unpickler (`weights_only=True`, after an
opcode scan that allows exactly the NumPy globals an RNG state needs), writes the new file
beside the old one, reads it back and compares it with what was loaded, and only then
updates the checkpoint's manifest and removes the pickle.
"""

from __future__ import annotations

import argparse
import enum
import fnmatch
import hashlib
import importlib
import json
import os
import pickletools
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "memoria_ds.tree/1"
_FORMAT_KEY, _TREE_KEY = "format", "memoria_ds.tree"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container
_PROTO = 0x80  # a pickle of protocol 2+ starts with PROTO and the protocol number
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header's length
MAX_DEPTH = 64  # nesting a tree may have (memoria_ds's own trees nest fewer than 10 levels)
_TAGS = ("$tensor", "$ndarray", "$tuple", "$items")
CONVERT = "python -m memoria_ds.safe_io convert"


class PickleRefused(ValueError):
    """A file is a pickle (it could run code when loaded) and was not read."""


class TreeError(ValueError):
    """A safetensors file whose tree is not one `save_tree` writes (damaged or crafted)."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"cannot store a tree nested deeper than {MAX_DEPTH} levels")
    depth += 1
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
        return {"$tuple": [_encode(v, tensors, depth) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, depth) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _encode(v, tensors, depth) for k, v in obj.items()}
        return {"$items": [[_encode(k, tensors, depth), _encode(v, tensors, depth)] for k, v in obj.items()]}
    raise TypeError(f"cannot store a {type(obj).__name__} without pickle (tensors, arrays, numbers, str, "
                    f"None, lists, tuples and dicts only)")


def _decode(obj: Any, tensor: Any, depth: int = 0) -> Any:
    """The tree `_encode` made, rebuilt; `tensor(tag, key)` gives what a `$tensor`/`$ndarray`
    reference stands for. Raises TreeError for anything `_encode` never writes."""
    if depth > MAX_DEPTH:
        raise TreeError(f"the tree is nested deeper than {MAX_DEPTH} levels")
    depth += 1
    if isinstance(obj, list):
        return [_decode(v, tensor, depth) for v in obj]
    if not isinstance(obj, dict):
        return obj  # what JSON gives besides lists and objects: str, int, float, bool, None
    tags = [k for k in obj if k.startswith("$")]
    if not tags:
        return {k: _decode(v, tensor, depth) for k, v in obj.items()}
    if len(obj) != 1 or tags[0] not in _TAGS:
        raise TreeError(f"an entry with the key(s) {sorted(obj)[:4]}, which no tree holds")
    tag, value = next(iter(obj.items()))
    if tag in ("$tensor", "$ndarray"):
        if not isinstance(value, str):
            raise TreeError(f"a tensor reference {value!r} that is not a name")
        return tensor(tag, value)
    if not isinstance(value, list):
        raise TreeError(f"a {tag} entry that is a {type(value).__name__}, not a list")
    if tag == "$tuple":
        return tuple(_decode(v, tensor, depth) for v in value)
    out = {}
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise TreeError("a $items entry that is not a [key, value] pair")
        key = _freeze(_decode(pair[0], tensor, depth))
        try:
            hash(key)
        except TypeError:
            raise TreeError(f"a mapping key of type {type(key).__name__}, which cannot be a key") from None
        out[key] = _decode(pair[1], tensor, depth)
    return out


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def save_tree(tree: Any, path: str | os.PathLike) -> None:
    """Write `tree` to `path` as safetensors + JSON metadata (not atomic: write a temp and rename)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, tensors)
    save_file(tensors, str(path), metadata={_FORMAT_KEY: FORMAT, _TREE_KEY: json.dumps(structure)})


def sniff(path: str | os.PathLike) -> str:
    """A file's format from its structure: "safetensors", "zip" (a `torch.save` file), "pickle"
    (a bare pickle of protocol 2-5) or "unknown".

    A safetensors file begins with the length N of its header (8 bytes, little-endian), and the
    N bytes that follow, inside the file, are a JSON object: that is checked, not one byte
    (header lengths are multiples of 8, so 1 file in 32 starts with the byte a pickle starts with).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            length = int.from_bytes(head, "little")
            if 2 <= length <= min(size - 8, _MAX_HEADER):
                try:
                    header = json.loads(f.read(length).decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    header = None
                if isinstance(header, dict):
                    return "safetensors"
    if head[:4] == _ZIP_MAGIC and zipfile.is_zipfile(path):
        return "zip"
    if len(head) >= 2 and head[0] == _PROTO and 2 <= head[1] <= 5:
        return "pickle"
    return "unknown"


def is_pickle(path: str | os.PathLike) -> bool:
    """True if `path` is a `torch.save` zip container or a bare pickle (by `sniff`)."""
    return sniff(path) in ("zip", "pickle")


def _open_tree(path: Path, device: str | torch.device, read_tensors: bool) -> Any:
    from safetensors import SafetensorError, safe_open

    kind = sniff(path)
    if kind != "safetensors":
        if kind in ("zip", "pickle"):
            raise PickleRefused(
                f"{path} is a pickle (written by an older memoria_ds with torch.save): not read, since loading a "
                f"pickle can run any code it carries. If you trust where it came from, convert it once with "
                f"`{CONVERT} {path}`"
            )
        raise ValueError(f"{path} is not a memoria_ds state file (not safetensors: damaged, or another format)")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get(_FORMAT_KEY) != FORMAT:
                raise ValueError(f"{path} is a safetensors file but not a memoria_ds state "
                                 f"(format {meta.get(_FORMAT_KEY)!r}, expected {FORMAT!r})")
            names = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in names} if read_tensors else {}
            structure = json.loads(meta[_TREE_KEY])
    except (SafetensorError, json.JSONDecodeError, KeyError, OSError, RecursionError) as e:
        why = "its tree is nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ValueError(f"{path} is not a readable memoria_ds state file ({why})") from None

    def tensor(tag: str, key: str) -> Any:
        if key not in names:
            raise TreeError(f"a reference to tensor {key!r}, which the file does not hold")
        if not read_tensors:
            return None
        if tag == "$tensor":
            return tensors[key]
        try:
            return tensors[key].numpy()
        except TypeError as e:  # a dtype NumPy lacks (bfloat16): `_encode` never writes one as an array
            raise TreeError(f"an array {key!r} of dtype {tensors[key].dtype} ({e})") from None

    try:
        return _decode(structure, tensor)
    except TreeError as e:
        raise TreeError(f"{path} is damaged or crafted: {e}") from None


def load_tree(path: str | os.PathLike, device: str | torch.device = "cpu") -> Any:
    """Read a tree written by `save_tree`; nothing in the file is executed.

    Raises:
        PickleRefused: the file is a pickle (an older memoria_ds wrote it with torch.save).
        TreeError: a safetensors state whose tree is malformed (damaged or crafted).
        ValueError: the file is not a memoria_ds tree (or is damaged).
        FileNotFoundError: there is no file at `path`.
    """
    return _open_tree(Path(path), device, read_tensors=True)


def check_tree(path: str | os.PathLike) -> None:
    """What `load_tree` checks of a file's structure, without reading its tensors (cheap).

    Raises:
        the errors of `load_tree`.
    """
    _open_tree(Path(path), "cpu", read_tensors=False)


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


OURS = ("rank_*.pt", "engine.pt", "memory_*.pt")  # the pickles older memoria_ds versions wrote
# All a legacy pickle of ours may import besides torch's tensors: a NumPy RNG state
# (`np.random.get_state()` holds a uint32 array; its dtype class is allowed too, `_numpy_globals`).
# NumPy 1 and 2 name the rebuilding function apart.
LEGACY_GLOBALS = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
                  "numpy.dtype")


class ConvertRefused(ValueError):
    """A file `convert` does not convert; the message says why. Nothing was changed."""


def is_legacy(path: Path) -> bool:
    """A pickle with the name of a file older memoria_ds versions wrote (`OURS`)."""
    return any(fnmatch.fnmatch(path.name, pattern) for pattern in OURS) and is_pickle(path)


def _numpy_globals() -> list[tuple[Any, str]]:
    out = []
    for name in LEGACY_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # numpy 2 warns on numpy.core
                out.append((getattr(importlib.import_module(module), attr), name))
        except (ImportError, AttributeError):
            continue
    uint32 = type(np.dtype(np.uint32))  # the array's dtype class, `numpy.dtypes.UInt32DType` on NumPy 2
    return out + [(uint32, f"{uint32.__module__}.{uint32.__name__}")]


def _load_legacy(path: Path) -> Any:
    """A legacy pickle's contents, loaded as data only: an opcode scan first (a zip file may
    import only `LEGACY_GLOBALS`), then torch's restricted unpickler with exactly those allowed."""
    if sniff(path) == "zip":
        try:
            extra = sorted(pickle_globals(path) - set(LEGACY_GLOBALS))
        except PickleRefused as e:
            raise ConvertRefused(f"{e}; not converted") from None
        if extra:
            raise ConvertRefused(f"{path} would import {', '.join(extra[:4])} when loaded, which memoria_ds never "
                                 f"wrote: not converted, not loaded (a file that runs code on load)")
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure of the restricted loader: not converted
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConvertRefused(f"{path} cannot be loaded as data only ({type(e).__name__}: {first}): not "
                             f"converted") from None


def same_tree(a: Any, b: Any) -> bool:
    """`a` and `b` hold the same values, bit for bit (NaN equals NaN; a tuple subclass is a tuple)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and _bits(a) == _bits(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, tuple) == isinstance(a, tuple) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_tree(x, y) for x, y in zip(a, b)))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


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


def convert_file(old: Path) -> Path:
    """Rewrite one legacy pickle as a tree beside it; returns the new file.

    The pickle is removed only after the new file was read back and found equal to it (and
    the checkpoint's manifest names the new file). A run killed half-way leaves both files;
    running it again finishes the job.

    Raises:
        ConvertRefused: not a legacy pickle, one that would import more than data, or a new
            file in the way that holds something else. Nothing was changed.
    """
    if not is_legacy(old):
        kind = sniff(old)
        what = f"a {kind} file" if kind != "unknown" else "neither safetensors nor a pickle"
        raise ConvertRefused(f"{old} is not a legacy memoria_ds pickle ({' / '.join(OURS)} written by "
                             f"torch.save; this is {what}): left as it is")
    new = old.with_suffix(".safetensors")
    tree = _load_legacy(old)
    if new.exists():  # an earlier conversion stopped before removing the pickle: finish it if it matches
        try:
            done = sniff(new) == "safetensors" and same_tree(tree, load_tree(new))
        except ValueError:
            done = False
        if not done:
            raise ConvertRefused(f"{new} exists and holds something else than {old}: neither is changed (move one "
                                 f"aside and run again)")
    else:
        tmp = new.with_name(f".{new.name}.tmp-{os.getpid()}")
        try:
            save_tree(tree, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            if not same_tree(tree, load_tree(tmp)):
                raise ConvertRefused(f"{old}: the converted copy does not read back equal; not converted")
            os.replace(tmp, new)
        except TypeError as e:  # something save_tree cannot store without pickle
            raise ConvertRefused(f"{old}: {e}; not converted") from None
        finally:
            tmp.unlink(missing_ok=True)
    folder = old.parent if old.name != "engine.pt" else old.parent.parent
    try:
        _update_manifest(folder, str(old.relative_to(folder)), str(new.relative_to(folder)))
    except (OSError, ValueError, AttributeError) as e:  # an unreadable manifest: keep both files
        raise ConvertRefused(f"{folder / 'manifest.json'} could not be updated ({type(e).__name__}: {e}); {new} "
                             f"is written and verified, {old} is kept") from None
    old.unlink()
    return new


def convert(path: Path) -> tuple[list[Path], list[str]]:
    """Rewrite memoria_ds's own legacy pickles at or under `path` as trees.

    Returns the new files and, for each file not converted, why (a file named directly that
    is not a legacy pickle is reported; in a folder, other files are not looked at).
    DeepSpeed's own files (`engine/*.pt`) are never touched.
    """
    files = [path] if path.is_file() else sorted({p for pattern in OURS for p in path.rglob(pattern) if is_legacy(p)})
    done, refused = [], []
    for old in files:
        try:
            done.append(convert_file(old))
        except ConvertRefused as e:
            refused.append(str(e))
    return done, refused


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m memoria_ds.safe_io", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="rewrite memoria_ds's own legacy pickle files (shards, engine.pt, memory "
                                       "states) as safetensors, loading them as data only; other files are left as "
                                       "they are")
    c.add_argument("paths", nargs="+", type=Path)
    a = p.parse_args(argv)
    for path in a.paths:
        if not path.exists():
            print(f"error: {path} does not exist", file=sys.stderr)
            sys.exit(2)
    failed = False
    for path in a.paths:
        if path.is_file() and sniff(path) == "safetensors":
            print(f"{path}: already safetensors, nothing to convert (left as it is)")
            continue
        done, refused = convert(path)
        print(f"{path}: {len(done)} file(s) converted" + "".join(f"\n  {d}" for d in done))
        for why in refused:
            print(f"error: {why}", file=sys.stderr)
        failed = failed or bool(refused)
    if failed:
        sys.exit(2)


if __name__ == "__main__":
    main()
