"""A pydantic config from a YAML/JSON file plus dotted command-line overrides.

    cfg = load(RunConfig, "configs/run.yaml", ["optim.lr=3e-4", "model.preset=xl"])

Override values are parsed as YAML scalars (`3e-4`, `true`, `[1, 2]`, `null`), put into the
file's mapping, and the whole is validated once by the config's pydantic models (typed,
strict, unknown keys refused at every level; torchtune's `config/_parse.py` is the model).
pydantic's errors become one `ConfigError` line that names the key, what it must be and,
for an unknown key, the known ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


_MUST = {
    "int_type": "must be an integer", "int_from_float": "must be an integer", "int_parsing": "must be an integer",
    "bool_type": "must be true or false", "bool_parsing": "must be true or false",
    "float_type": "must be a number", "float_parsing": "must be a number", "finite_number": "must be a number",
    "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be a mapping",
}


def _annotation(cls: type[BaseModel], loc: tuple) -> Any:
    """The annotation of the field at `loc` inside `cls` (None where `loc` leaves the models)."""
    ann: Any = cls
    for part in loc:
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)) or part not in ann.model_fields:
            return None
        ann = ann.model_fields[part].annotation
    return ann


def _choices(ann: Any) -> list[Any]:
    """The values of a Literal annotation (also inside `X | None`)."""
    if get_origin(ann) is Literal:
        return list(get_args(ann))
    return [c for a in get_args(ann) for c in _choices(a)]


def _message(cls: type[BaseModel], e: ValidationError) -> str:
    """pydantic's errors as one line: the first problem, named by its dotted key."""
    errors = e.errors(include_url=False)
    unknown = [err for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        where = unknown[0]["loc"][:-1]
        keys = [".".join(map(str, err["loc"])) for err in unknown if err["loc"][:-1] == where]
        section = _annotation(cls, where)
        known = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
        return f"unknown setting(s) {keys}; known under `{'.'.join(map(str, where)) or cls.__name__}`: {known}"
    err = errors[0]
    key = ".".join(str(p) for p in err["loc"])
    kind, value = err["type"], err.get("input")
    if kind == "value_error":  # a model's own check: its message names the keys
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "literal_error":
        return f"`{key}` must be one of {_choices(_annotation(cls, err['loc']))}, got {value!r}"
    if kind in ("model_type", "model_attributes_type"):
        return f"`{key}` must be a mapping of settings, got {value!r}"
    if kind in _MUST:
        return f"`{key}` {_MUST[kind]}, got {value!r}"
    return f"`{key}`: {err['msg']}, got {value!r}"


def validate(cls: type[T], values: dict[str, Any]) -> T:
    """`cls` from a nested mapping, every key and type checked (ConfigError otherwise)."""
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_message(cls, e)) from None


def to_dict(obj: BaseModel) -> dict[str, Any]:
    """A config (nested) as plain JSON/YAML-able data."""
    return obj.model_dump(mode="json")


def _one_line(e: Exception) -> str:
    """A parser's error in one line: YAML's problem and where (line and column, 1-based)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())


def read_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping from `path` (a clear error if missing or malformed)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                          f"{_one_line(e)}") from None
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
            raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(e)}") from None
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
    return validate(cls, apply_overrides(values, overrides or []))


def dump(obj: BaseModel, path: str | Path) -> None:
    """Write a (resolved) config as YAML, the form `load` reads back."""
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
