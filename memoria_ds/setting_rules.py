"""The rule of one setting: its type and range, and an error that names its key.

Every memory setting (a kind's `memory_settings`, the Memoria options of `MemoriaGPT2Config`,
the backbone's sizes, the kNN-LM's) is checked by the same rules before anything is built:

- an integer is an `int`, never a bool (`true` is not block 1);
- a number is finite (`nan` and `inf` are no size, weight, rate or temperature);
- a choice is one of its values, a flag is true or false;
- the range the setting declares (`least` / `most` inclusive, `above` / `below` exclusive).

A dataclass of settings declares its ranges with its fields (the type comes from the
annotation) and checks them all in `__post_init__`:

    @dataclass(frozen=True)
    class MemformerSettings(KindSettings):
        num_slots: int = setting(1024, least=1)
        temperature: float = setting(0.5, above=0)

A failed check raises `SettingError`, which names the setting's key; each holder re-keys it
under its own name (`e.within("memory_settings")`), so the run configuration names the whole
dotted key: "`model.settings.memory_settings.num_slots` (0) must be an integer >= 1".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin


class SettingError(ValueError):
    """A setting that cannot be used.

    Attributes:
        key: its dotted name as its holder knows it (`num_slots`, `memory_settings.num_slots`).
        problem: what is wrong and what is allowed (the message after the key).
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"`{key}` {problem}")
        self.key, self.problem = key, problem

    def within(self, prefix: str) -> SettingError:
        """The same error, named from the holder of `prefix` (`prefix.key`)."""
        return SettingError(f"{prefix}.{self.key}", self.problem)


_NOUNS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
          list: "a list of integers"}


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """What one setting may hold.

    Attributes:
        type: `int`, `float` (an int is a number too), `bool`, `str`, or `list` (of integers;
            the bounds then hold for every item).
        least / most: inclusive bounds; above / below: exclusive bounds.
        choices: the values allowed (a string setting).
        optional: None is allowed too, meaning `none` (said in the message).
        what: the noun of the message instead of the type's ("a block index").
        note: said after the range, in parentheses ("0: off").
    """

    type: type
    least: float | None = None
    above: float | None = None
    below: float | None = None
    most: float | None = None
    choices: tuple[Any, ...] | None = None
    optional: bool = False
    none: str = ""
    what: str = ""
    note: str = ""

    def allowed(self) -> str:
        """What the setting may hold, as the message says it."""
        if self.choices is not None:
            return ("None or " if self.optional else "") + f"one of {list(self.choices)}"
        text = (self.what or _NOUNS[self.type]) + self._range()
        if self.note:
            text += f" ({self.note})"
        if self.optional:
            text += ", or None" + (f" ({self.none})" if self.none else "")
        return text

    def _range(self) -> str:
        low = (f"[{_num(self.least)}" if self.least is not None else
               f"({_num(self.above)}" if self.above is not None else None)
        high = (f"{_num(self.most)}]" if self.most is not None else
                f"{_num(self.below)})" if self.below is not None else None)
        if low and high:
            return f" in {low}, {high}"
        if low:
            return f" {'>=' if self.least is not None else '>'} {low[1:]}"
        if high:
            return f" {'<=' if self.most is not None else '<'} {high[:-1]}"
        return ""

    def check(self, key: str, value: Any) -> None:
        """Raise SettingError naming `key` unless `value` is allowed."""
        if value is None and self.optional:
            return
        if not self._fits(value):
            if self.choices is not None:
                raise SettingError(key, f"must be {self.allowed()}, got {value!r}")
            raise SettingError(key, f"({value!r}) must be {self.allowed()}")

    def _fits(self, value: Any) -> bool:
        if self.type is bool:
            return isinstance(value, bool)
        if self.type is str:
            return isinstance(value, str) and (self.choices is None or value in self.choices)
        if self.type is list:
            return isinstance(value, list) and all(self._number_fits(v, int) for v in value)
        return self._number_fits(value, self.type)

    def _number_fits(self, value: Any, kind: type) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            return False
        if not math.isfinite(value):
            return False
        return ((self.least is None or value >= self.least) and (self.above is None or value > self.above)
                and (self.below is None or value < self.below) and (self.most is None or value <= self.most))


def setting(default: Any, **rule: Any) -> Any:
    """A dataclass field with `default` whose rule adds `rule` (Rule's attributes but `type`) to its annotation."""
    return dataclasses.field(default=default, metadata={"rule": rule})


@functools.cache
def rules_of(cls: type) -> dict[str, Rule]:
    """Every field's rule of the settings dataclass `cls`: its annotation's type (`X | None`: optional,
    `Literal[...]`: choices) plus what its `setting(...)` declares."""
    hints = typing.get_type_hints(cls)
    rules = {}
    for f in dataclasses.fields(cls):
        ann, optional = hints[f.name], False
        if get_origin(ann) in (Union, types.UnionType):
            args = [a for a in get_args(ann) if a is not type(None)]
            ann, optional = args[0], len(args) < len(get_args(ann))
        declared = dict(f.metadata.get("rule", {}))
        if get_origin(ann) is Literal:
            declared.setdefault("choices", get_args(ann))
            ann = str
        rules[f.name] = Rule(get_origin(ann) or ann, optional=optional, **declared)
    return rules


def check_fields(settings: Any) -> None:
    """Check every field of the settings dataclass instance `settings` by its rule (SettingError)."""
    for name, rule in rules_of(type(settings)).items():
        rule.check(name, getattr(settings, name))


__all__ = ["Rule", "SettingError", "check_fields", "rules_of", "setting"]
