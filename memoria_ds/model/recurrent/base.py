"""The recurrent-memory protocol: what a kind of memory does around the backbone's blocks.

One forward of the model is one memory step, the same for every kind:

    memory = kind.prepare(memory, B, device, reset)        # fresh if None; checked; rows reset
    read, pending = kind.read(memory, dtype, module)       # what the blocks attend to
    hidden = blocks(embed(ids, read.positions(...)), read) # self-attention (+ read.layer_kv),
                                                           # memory attention (+ read.engrams)
    stats = kind.write(memory, read, pending, writes, hidden, valid)   # after the blocks
    loss = loss + kind.auxiliary_loss(pending)             # when the kind trains one (else None)

`module` is the model's trainable module of this kind: Memoria's abstractor, or the
`nn.Module` that `kind.build_module()` made once when the model was built (registered as
`memory_net`; e.g. the Compressive Transformer's compression network), or None. A kind's
own settings are the config's `memory_settings` dict, parsed by its `settings_class`
(`kind.settings`).

`read` is a `MemoryRead`: the per-forward view of the memory that the blocks need, and
nothing else. Decoding inside `generate()` attends to a *frozen* read
(`kind.frozen_read`, from a copy of the memory) and never prepares or writes. `pending` is
whatever the kind must carry from its read to its write (Memoria's retrieval), opaque to
the model. The memory is updated in place by `write`, at fixed addresses: every new value is
copied into the tensor its field holds (`BatchRows.store_`), so a captured step (a CUDA graph)
replays over the same state; what the forward read, the backward still needs after that write,
so a `read` reads copies (`read_copy.held`, `read_copy.read_copy`: opaque to the compiler's
partitioner, which could otherwise recompute a read in the backward from the overwritten
input). Row operations come from `BatchRows`, as does `detach_()`: the training loop cuts
the carried state's graph with it at the end of each span of `optim.bptt_segments`
segments. A kind that detaches what it carries gets no gradient across segments; one that
keeps the graph (`memformer`) changes that state out of place (`store_` replaces a value with a
graph; `reset` too): its address changes with each training step.

One file per kind: `none.py`, `xl.py`, `memoria.py`, `compressive.py`, ...; `KINDS` in `__init__.py`.

Notation: B rows, L tokens, D width, M cached slots, H heads, hd head width.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...rows import BatchRows
from ...setting_rules import SettingError, check_fields
from ..composition import PLACES
from ..config import KIND_SETTINGS, MemoriaGPT2Config
from ..memory_attention import MemoryInputs

FORMAT = 1  # the version of every memory's `state_dict`


def at_fixed_addresses(memory: Any) -> Any:
    """`memory` with its tensors marked as inputs at fixed addresses (`BatchRows.mark_static_`: every
    write stores in place, so a CUDA graph replays over them); a memory of no tensors as it is."""
    return memory.mark_static_() if isinstance(memory, BatchRows) else memory


def check_format(state_dict: dict[str, Any], kind: str) -> None:
    """Raise ValueError unless `state_dict` is a memory of `kind` in this version's format."""
    if state_dict.get("kind") != kind:
        raise ValueError(f"saved memory is of kind {state_dict.get('kind')!r}, expected {kind!r}")
    if state_dict.get("format") != FORMAT:
        raise ValueError(f"memory format {state_dict.get('format')!r} is not supported (this version reads {FORMAT})")


class MemoryRead:
    """What the blocks of one forward read from the memory; the methods' defaults read nothing.

    Attributes every read has (a field, or a class attribute set to None):
        engrams: (B, E, D) vectors every memory attention attends to, or None.
        slot_mask: (B, M) bool, which cached self-attention slots hold a token, or None.
        collects_kv: the blocks return this segment's keys/values (for the kind's write).
        collects_queries: the blocks also return this segment's self-attention queries
            (detached; e.g. for the Compressive Transformer's reconstruction loss).
    """

    engrams: Tensor | None
    slot_mask: Tensor | None
    collects_kv: ClassVar[bool] = False
    collects_queries: ClassVar[bool] = False
    engram_slots: ClassVar[bool] = False  # `engrams` are key/value slots of every block's self-attention
    has_side: ClassVar[bool] = False  # `side_attention` adds to every block's self-attention output
    replaces_attention: ClassVar[bool] = False  # `block_attention` may replace a block's self-attention

    def positions(self, positions: Tensor) -> Tensor:
        """The absolute positions to embed, given the segment's (1, L) positions."""
        return positions

    def layer_kv(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(B, H, M, hd) cached keys and values that block `layer`'s self-attention prepends."""
        return None, None

    def memory_inputs(self, query_mask: Tensor | None, use_sdpa: bool) -> MemoryInputs | None:
        """The per-forward inputs of the memory attentions (None: no memory attention input)."""
        return None

    def side_attention(self, layer: int, hidden: Tensor, queries: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """A kind's own attention beside block `layer`'s self-attention (when `has_side`).

        Args:
            hidden: (B, L, D) the block's input. queries: (B, H, L, hd) its self-attention's
                queries (with their gradient).

        Returns:
            (B, L, D) added to the self-attention's output, and tensors for the kind's write
            (`BlockWrites.side`, one tuple per block).
        """
        raise NotImplementedError

    def block_attention(self, layer: int, attn: Any, hidden: Tensor, attention_mask: Tensor | None,
                        kv: Any) -> Tensor | None:
        """A self-attention of the kind's own in place of block `layer`'s (when `replaces_attention`),
        or None where the block's own runs (e.g. `memorizing`: its one kNN-augmented block).

        Args:
            attn: the block's HF `GPT2Attention` (its projections are to be used, so LoRA and
                ZeRO-3 see them). hidden: (B, L, D) its `ln_1` output. attention_mask: the
                self-attention mask. kv: the block's `ExtendedKeyValues` (decode cache, and
                this segment's keys/values kept for the write).

        Returns:
            (B, L, D) the attention's output after `c_proj` and dropout, or None.
        """
        return None

    def take_rows(self, rows: Tensor | list[int]) -> MemoryRead:
        """The read of `rows` (HF expands a read for beams); a read of nothing is itself."""
        return self


class EmptyRead(MemoryRead):
    """The read of a memory that holds nothing (`none`)."""

    engrams = None
    slot_mask = None


@dataclass
class BlockWrites:
    """What the blocks returned for the kind's write: per block, in order.

    Attributes:
        memory: the forward's `MemoryInputs` (Memoria's masks), or None.
        reminded: what each block's read of Memoria's reminded engrams attended with
            (`memory_attention.RemindedRead`; `contribution(reminded, memory)` gives their weights).
        keys / values: (B, H, L, hd) this segment's detached keys/values (when the read collects them).
        queries: (B, H, L, hd) this segment's detached self-attention queries (when the read collects them).
        side: per block, the tensors a side read's `side_attention` returned.
    """

    memory: Any = None
    reminded: list[Any] = field(default_factory=list)
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    queries: list[Tensor] = field(default_factory=list)
    side: list[tuple[Tensor, ...]] = field(default_factory=list)

    def add(
        self, reminded: Any, keys: Tensor | None, values: Tensor | None, queries: Tensor | None = None,
        *side: Tensor,
    ) -> None:
        if reminded is not None:
            self.reminded.append(reminded)
        if keys is not None:
            self.keys.append(keys)
            self.values.append(values)
        if queries is not None:
            self.queries.append(queries)
        if side:
            self.side.append(side)


class KindSettings:
    """Base of a kind's `settings_class`, a frozen dataclass of its settings. Every field is
    checked by its rule (`memoria_ds.setting_rules`: the annotation's type, bool is no integer,
    numbers finite, the range its `setting(...)` declares); a subclass that needs more (settings
    that depend on each other) extends `__post_init__`. `from_dict` parses the config's
    `memory_settings`: a mapping of known names (an unknown one is refused, naming the known
    ones); its errors are `SettingError`s keyed `memory_settings.<name>`. `to_dict` gives every
    setting, resolved. Subclasses set `kind` (the name in messages)."""

    kind: ClassVar[str] = "memory"

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Any:
        known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
        if not isinstance(values, dict):
            raise SettingError("memory_settings", f"({values!r}) must be a mapping of {cls.kind} settings; "
                               f"known: {known}")
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            more = f" (so are {unknown[1:]})" if len(unknown) > 1 else ""
            raise SettingError(f"memory_settings.{unknown[0]}", f"is an unknown {cls.kind} setting{more}; "
                               f"known: {known}")
        try:
            return cls(**values)
        except SettingError as e:
            raise e.within("memory_settings") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


class MemoryKind:
    """Base of the kinds. Subclasses set `name` and `memory_class` and implement
    `empty`, `read` and `write`; `prepare` and `frozen_read` are shared. A kind with
    settings of its own sets `settings_class`; one with trainable weights outside the
    backbone's blocks implements `build_module`; one with a training loss of its own
    implements `auxiliary_loss`.

    Args:
        config: the model's config (read at each call, so later edits to it apply).
    """

    name: ClassVar[str]
    memory_class: ClassVar[type]
    carries_state: ClassVar[bool] = True  # False: nothing crosses segments (decode caches may be used freely)
    # True: the state keeps its graph, so a later segment's loss trains this segment's write (given
    # `optim.bptt_segments` > 1); False: the kind detaches what it carries
    trains_across_segments: ClassVar[bool] = False
    # parses the config's `memory_settings` dict: `settings_class.from_dict(d)` (raises ValueError on a bad
    # value, naming it) and `.to_dict()` (every setting, resolved); None: the kind takes no settings.
    # An optional `.check_model(config)` refuses settings that do not fit the model (the config calls it)
    settings_class: ClassVar[Any] = None
    # where the kind reads in a block, the places of `composition.PLACES` ("cached slots", "engrams",
    # "side attention", "own attention"; `composition.OWN_MODEL` for a kind that only its own model family
    # runs) and "modules" if it brings trainable ones: which kinds compose follows from them; None: a
    # kind that is not a part (the composite)
    places: ClassVar[frozenset[str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.settings_class is not None:  # the config resolves `memory_settings` with it
            KIND_SETTINGS[cls.name] = cls.settings_class
        if cls.places is not None:  # the config checks a composite's parts with them
            PLACES[cls.name] = cls.places

    def __init__(self, config: MemoriaGPT2Config) -> None:
        self.config = config
        # parsed here, when the model is built, not in a forward: a compiled forward then reads a
        # cached value instead of tracing the dataclass parsing (a graph break)
        self._parsed: tuple[dict[str, Any], Any] = self._parse()

    def _parse(self) -> tuple[dict[str, Any], Any]:
        raw = dict(self.config.memory_settings or {})
        return raw, None if self.settings_class is None else self.settings_class.from_dict(dict(raw))

    @property
    def settings(self) -> Any:
        """This kind's typed settings (from `config.memory_settings`, parsed again only when it changed), or None."""
        if self._parsed[0] != (self.config.memory_settings or {}):
            self._parsed = self._parse()
        return self._parsed[1]

    def build_module(self) -> nn.Module | None:
        """The trainable module of this kind, made once by the model (`model.memory_net`); None: none."""
        return None

    def cached_slots(self, segment_length: int) -> int:
        """Key/value slots per layer that each segment's self-attention attends to besides its own
        tokens (the cost planner counts them)."""
        return 0

    def row_bytes(self, segment_length: int) -> dict[str, int]:
        """Bytes of one row's state by part, for the footprint planner (beyond cached slots); {}: none."""
        return {}

    def auxiliary_loss(self, pending: Any) -> Tensor | None:
        """A loss of the kind's own that the model adds to the LM loss (after `write`), or None."""
        return None

    def empty(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> Any:
        """A fresh memory of this kind for `batch_size` rows."""
        raise NotImplementedError

    def check(self, memory: Any) -> None:
        """Raise ValueError if `memory` does not fit this model (beyond rows and device)."""

    @classmethod
    def check_state(cls, state_dict: dict[str, Any], config: MemoriaGPT2Config | None = None) -> None:
        """Raise ValueError, naming the field, unless `state_dict` (a saved memory of this kind, read
        from a file: untrusted) is one this kind can run: every field a tensor of the dtype the kind
        writes, of a shape that fits the other fields and, given the model's `config`, the model
        (widths, heads, layers, slots, capacities), with values in range (finite, masks boolean,
        counts non-negative, lengths within capacity). Without `config` only what the file itself
        fixes is checked. Each kind implements it in its own file with a `saved_state.SavedState`;
        `memory_from_state_dict` calls it before a memory is rebuilt.
        """
        raise NotImplementedError(f"memory kind {cls.name!r} does not check its saved state")

    def prepare(
        self, memory: Any | None, batch_size: int, device: torch.device, dtype: torch.dtype, reset: Tensor | None
    ) -> Any:
        """The memory this forward runs on: fresh if None, else checked, with `reset` rows made fresh.

        Raises:
            TypeError: a memory of another kind.
            ValueError: another batch size or device, a misshapen reset mask, or a state
                that does not fit this model.
        """
        if memory is None:
            return at_fixed_addresses(self.empty(batch_size, device, dtype))
        if not isinstance(memory, self.memory_class):
            raise TypeError(
                f"a `{self.name}` model takes a {self.memory_class.__name__}, got {type(memory).__name__}"
            )
        if memory.batch_size != batch_size:
            raise ValueError(
                f"memory holds {memory.batch_size} rows but the batch has {batch_size}; use take_rows/put_rows"
            )
        if self.carries_state and memory.device != device:
            raise ValueError(
                f"memory is on {memory.device} but the inputs are on {device}; call memory.to({str(device)!r})"
            )
        self.check(memory)
        if reset is not None:
            if reset.shape != (batch_size,):
                raise ValueError(f"`reset` must be a ({batch_size},) bool mask, got shape {tuple(reset.shape)}")
            memory.reset(reset)
        return memory

    def read(self, memory: Any, dtype: torch.dtype, abstractor: nn.Module | None) -> tuple[MemoryRead, Any]:
        """What this segment's blocks attend to, and what `write` needs from the read.

        `abstractor` is the model's module of this kind (Memoria's abstractor, `memory_net`, or None).
        """
        raise NotImplementedError

    def frozen_read(self, memory: Any, dtype: torch.dtype, abstractor: nn.Module | None) -> MemoryRead:
        """A read for decoding that leaves `memory` untouched (it reads a copy)."""
        return self.read(memory.clone(), dtype, abstractor)[0]

    def write(
        self, memory: Any, read: MemoryRead, pending: Any, writes: BlockWrites, hidden: Tensor, valid: Tensor
    ) -> Any:
        """Update `memory` in place after the blocks; return the step's stats (or None).

        Args:
            hidden: (B, L, D) the final hidden states (after ln_f).
            valid: (B, L) bool, real (not padded) positions of the segment.
        """
        raise NotImplementedError


__all__ = ["FORMAT", "at_fixed_addresses", "BlockWrites", "EmptyRead", "MemoryKind", "MemoryRead", "check_format"]
