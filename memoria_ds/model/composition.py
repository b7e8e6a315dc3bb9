"""Several memory kinds in one model: which compose, and how a composite is named.

A model carries one memory kind, or several joined by `+` in `memory_type` (and in a preset
name, `model.preset=xl+memoria`): `"xl+memoria"` keeps Transformer-XL's cache in every block's
self-attention and Memoria's engrams in its memory attention, each with its own settings and its
own per-stream state (`recurrent/composite.py`). The parts' settings are the ones a single kind
of that name reads (`xl_memory_length`, the `memoria` dict, ...); a part with `memory_settings` of
its own finds them under its name (`memory_settings={"memorizing": {"size": 4096}}`).

Two parts compose when they read through different places of a block (`PLACES`): one may fill
the self-attention's cached slots (and the positions a segment is embedded at), one the memory
attention's engrams or, read as self-attention slots, slots of their own ahead of the cached ones
(`CompositeRead.slot_mask`), one a side attention, one a block's own attention, and only one may bring
trainable modules of a kind (`memory_net`, or Memoria's abstractor: the model holds one). The
order of the parts is the order they are written in after the blocks; the name is kept as given.
"""

from __future__ import annotations

from typing import Any

from ..setting_rules import SettingError

SEPARATOR = "+"

# where each kind reads in a block, and whether it brings trainable modules of its own ("modules"):
# each kind declares its own (`MemoryKind.places`; registered when its class is defined, which the
# package's `__init__` does before any config is read, as for `config.KIND_SETTINGS`)
PLACES: dict[str, frozenset[str]] = {}
# the place of a kind that only its own model family runs (model/families.py: the Memory Mosaic's
# `mosaic`, the MemSizer's `memsizer`): it composes with nothing
OWN_MODEL = "own model"


def memory_kinds(memory_type: str) -> tuple[str, ...]:
    """The kinds of a `memory_type`, in order: `("xl", "memoria")` for `"xl+memoria"`."""
    return tuple(memory_type.split(SEPARATOR))


def is_composite(memory_type: str) -> bool:
    return SEPARATOR in memory_type


def places(kind: str, memory_read: str = "cross_attention") -> frozenset[str]:
    """Where `kind` reads in a block (Memoria read as self-attention slots: slots of its own, ahead of
    the cached slots of a part beside it, `xl+memoria` with `memory_read="self_attention"`)."""
    where = PLACES[kind]
    return where - {"engrams"} | {"engram slots"} if kind == "memoria" and memory_read == "self_attention" else where


def check_composition(memory_type: Any, memory_read: str = "cross_attention") -> None:
    """Raise a SettingError on `memory_type` unless it names one known kind, or known kinds that compose.

    Args:
        memory_read: Memoria's `memory_read` (read as self-attention slots, its engrams are slots of their own).
    """
    if not isinstance(memory_type, str):
        raise SettingError("memory_type", f"({memory_type!r}) must be a string: a kind, or kinds joined by "
                           f"'{SEPARATOR}'; known kinds: {sorted(PLACES)}")
    kinds = memory_kinds(memory_type)
    unknown = [k for k in kinds if k not in PLACES]
    if unknown:
        raise SettingError("memory_type", f"({memory_type!r}): unknown kind {unknown[0]!r}; known: {sorted(PLACES)}"
                           f"{f', joined by {SEPARATOR!r}' if len(kinds) > 1 else ''}")
    if len(kinds) == 1:
        return
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    own = [k for k in kinds if OWN_MODEL in PLACES[k]]
    if repeated or "none" in kinds or own:
        what = (f"repeats {repeated[0]!r}" if repeated else
                "joins `none`, which is no memory" if "none" in kinds else
                f"joins `{own[0]}`, which only its own model family runs")
        raise SettingError("memory_type", f"({memory_type!r}) {what}: name each kind once, e.g. 'xl+memoria'")
    taken: dict[str, str] = {}
    for kind in kinds:
        for place in sorted(places(kind, memory_read)):
            if place in taken:
                both = ("both bring trainable modules of their own (the model holds one kind's)" if place == "modules"
                        else f"both read through the blocks' {place}")
                raise SettingError("memory_type", f"({memory_type!r}): {taken[place]!r} and {kind!r} {both}; a "
                                   f"composite takes one kind per place (e.g. 'xl+memoria', 'xl+infinity', "
                                   f"'xl+memorizing')")
            taken[place] = kind


def part_settings(memory_type: str, settings: Any, kind: str) -> Any:
    """The `memory_settings` of part `kind` of a composite (its entry of the composite's mapping)."""
    if not is_composite(memory_type):
        return settings
    return (settings or {}).get(kind)


__all__ = ["PLACES", "OWN_MODEL", "SEPARATOR", "check_composition", "is_composite", "memory_kinds", "part_settings", "places"]
