"""Typed dataclass configs from YAML/JSON files plus dotted command-line overrides.

    cfg = load(RunConfig, "configs/run.yaml", ["optim.lr=3e-4", "model.memory_type=xl"])

Unknown keys and values of the wrong type are errors that name the key, the expected
type and the known keys (as nanoGPT's configurator and torchtune do). Override values are
parsed as YAML scalars (`3e-4`, `true`, `[1, 2]`, `null`), then checked like file values.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"`{where}` must be one of {list(get_args(tp))}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"`{where}` must be {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"`{where}` must be a mapping of {tp.__name__} settings, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if tp in (dict, list):
        origin = tp
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"`{where}` must be a list, got {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)  # bare `list` holds Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"`{where}` must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"`{where}` must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"`{where}` must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"`{where}` must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"`{where}` must be a string, got {value!r}")
        return value
    raise ConfigError(f"`{where}`: unsupported config type {tp!r}")  # a bug in a config class


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a (nested) mapping, checking every key and type."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {[prefix + k for k in unknown]}; known under "
            f"`{prefix.rstrip('.') or cls.__name__}`: {sorted(fields)}"
        )
    kwargs = {name: _coerce(v, hints[name], prefix + name) for name, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # __post_init__ validation
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain JSON/YAML-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def read_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping from `path` (a clear error if missing or malformed)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested mapping (a copy)."""
    out = json.loads(json.dumps(values))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like `section.key=value`")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse the value: {e}")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: `{part}` is not a section")
        node[parts[-1]] = value
    return out


def _is_set(values: dict[str, Any], item: str) -> bool:
    """Whether the dotted key of override `item` is present in `values`."""
    node: Any = values
    for part in item.split("=", 1)[0].strip().split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
         defaults: list[str] | None = None) -> T:
    """`cls` from an optional YAML/JSON file plus dotted overrides, fully checked.

    `defaults` (dotted, like overrides) apply only to keys the file does not set: an entry
    point's own defaults (launch/pretrain.py's learning rate) never beat the user's file.
    """
    values = read_file(path) if path else {}
    values = apply_overrides(values, [d for d in defaults or [] if not _is_set(values, d)])
    return from_dict(cls, apply_overrides(values, overrides or []))


def dump(obj: Any, path: str | Path) -> None:
    """Write a (resolved) config as YAML, the form `load` reads back."""
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
