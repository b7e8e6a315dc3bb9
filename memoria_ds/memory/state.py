"""MemoryState: the whole memory of B token streams as plain tensors.

Notation (used in shape comments across memoria_ds/memory):
    B  rows (one independent token stream each)
    C  engram slots per row (`MemoriaConfig.capacity`)
    D  engram width (the model's hidden size)
    N  working-memory engrams per step (`num_wm`)

A slot holds one engram or nothing. Slots are reused: an engram's place says nothing
about its age; `uid` does. `uid = step * N + j` for the j-th working-memory engram written
at memory step `step` of its row, so uids give the creation order (FIFO of STM, "most
recent wins" ties) and `uid // N` is the creation step. Empty slots have `uid = -1`.

The co-retrieval count matrix is dense, `C x C` per row (int16 or int32, see
`MemoriaConfig.count_dtype`; increments saturate instead of wrapping). Rows and columns of a
slot are zeroed when the slot is (re)allocated, never when its engram dies; entries of
empty slots are stale and never read. That makes a reset O(B*C) instead of O(B*C*C), and
a reset row behaves exactly like a fresh one (same allocation order, same results).

Each slot also caches a `digest` of its vector's bits (`vector_digest`), written with the
vector: bit-identical engrams have equal digests, so retrieval can give them exactly one
score (the batched matmul need not compute the same bits for a vector in two columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..rows import BatchRows, rows_field
from .config import MemoriaConfig

EMPTY, WM, STM, LTM = 0, 1, 2, 3
KIND_NAMES = ("empty", "wm", "stm", "ltm")
STATE_FORMAT = 1

_FIELDS = ("vectors", "sq_norms", "digest", "kind", "lifespan", "uid", "counts", "step", "evictions")
_DERIVED = ("digest",)  # recomputed from `vectors` when a saved state lacks it (saved before it existed)
_DIGEST_MAX_DIM = 1 << 15  # below this width the digest's sum stays exact in float64
_DIGEST_BLOCK = 256  # halves per block of the digest's product when it is split (any size gives the same digest)
_DIGEST_COPY_BYTES = 16 << 20  # off the CPU the float64 copy of the halves is made whole up to this size
_MULTIPLIERS: dict[tuple[int, str], Tensor] = {}
# Devices where the engine's steps are tuned for the cache and a small footprint (the digest's
# product by blocks, candidates scored in chunks, edge keys widened into a reused buffer), at the
# cost of more operations. Elsewhere (a GPU) they are tuned for fewer operations: each is a kernel
# launch, and in eager mode the host's launches, not the arithmetic, set a step's time.
CACHE_TUNED_DEVICES = ("cpu",)


def cache_tuned(device: torch.device) -> bool:
    """Whether the engine's steps on `device` take their cache-tuned form (`CACHE_TUNED_DEVICES`)."""
    return device.type in CACHE_TUNED_DEVICES


def vector_digest(vectors: Tensor) -> Tensor:
    """(..., D) float32 -> (...) int64: an exact, order-free digest of each vector's bits.

    Each coordinate's 32-bit pattern is read as two signed 16-bit halves; each half is
    multiplied by a fixed random integer below 2^21 and the products are summed, as one
    float64 matrix-vector product. Every term and partial sum is an integer below 2^52 for
    D < 2^15, so float64 holds them exactly and the summation order (blocking, threads,
    device) cannot change the result: equal bits give equal digests everywhere. Distinct
    vectors share a digest only by a coincidence of a random linear form (never for one
    changed coordinate; about 2^-21 for two, far less for more), and retrieval also
    requires equal squared norms.

    A (..., 2D) float64 copy of the halves is 4x the vectors' own size: 2.5 MB for a step's
    working memory at the paper's settings and B = 4, 82 MB for a whole (4, 1664, 768) state. On a
    CPU (`cache_tuned`) the product runs over blocks of `_DIGEST_BLOCK` halves, whose sums are
    exact too, so the result is the whole product's, bit for bit, with a block-sized copy (the
    engine's peak memory, docs/benchmarks.md). Elsewhere, up to `_DIGEST_COPY_BYTES`, it is one
    product: 3 kernels, where blocks take 18 at D = 768 (on a GPU each is a launch).
    """
    halves = vectors.contiguous().view(torch.int16)  # (..., 2D)
    multipliers = digest_multipliers(vectors.shape[-1], vectors.device)  # (2D,)
    if not cache_tuned(vectors.device) and halves.numel() * 8 <= _DIGEST_COPY_BYTES:
        return (halves.to(torch.float64) @ multipliers).to(torch.int64)
    total = None
    for lo in range(0, halves.shape[-1], _DIGEST_BLOCK):
        part = halves[..., lo : lo + _DIGEST_BLOCK].to(torch.float64) @ multipliers[lo : lo + _DIGEST_BLOCK]  # (...)
        total = part if total is None else total.add_(part)
    return total.to(torch.int64)


def digest_multipliers(dim: int, device: torch.device | str) -> Tensor:
    """(2 * dim,) float64: `vector_digest`'s fixed random integers, made once per width and
    device. The random draw happens once per width, on the CPU (`MemoriaKind` makes it when a
    model is built, and `MemoryEngine` before a compiled step): a compiled forward then only
    copies the made values to its device, which traces."""
    if dim >= _DIGEST_MAX_DIM:
        raise ValueError(f"engram width {dim} is above the supported {_DIGEST_MAX_DIM - 1}")
    key = (dim, str(device))
    if key not in _MULTIPLIERS:
        cpu = (dim, "cpu")
        if cpu not in _MULTIPLIERS:
            gen = torch.Generator().manual_seed(0x5EED)
            # on the CPU whatever the default device (a model built under `torch.device("meta")` too)
            _MULTIPLIERS[cpu] = torch.randint(1, 1 << 21, (2 * dim,), generator=gen, device="cpu").to(torch.float64)
        _MULTIPLIERS[key] = _MULTIPLIERS[cpu].to(device)
    return _MULTIPLIERS[key]


@dataclass
class MemoryState(BatchRows):
    """The memory of B rows. All tensors live on one device; engram data are fp32.

    Row operations (`take_rows`, `put_rows`, `to`, `clone`, `cat`) come from `BatchRows`.

    Attributes:
        vectors: (B, C, D) float32 engram vectors (detached copies; no gradient).
        sq_norms: (B, C) float32 cached `|v|^2` of each slot's vector.
        digest: (B, C) int64 cached `vector_digest` of each slot's vector.
        kind: (B, C) int8, one of EMPTY, WM, STM, LTM.
        lifespan: (B, C) float32 remaining lifespan (0 for empty slots).
        uid: (B, C) int64 creation-order id (`step * N + j`), -1 for empty slots.
        counts: (B, C, C) int16/int32 co-retrieval counts; `counts[b, i, i]` is how often i fired.
        step: (B,) int64 memory steps taken by each row since its last reset.
        evictions: (B,) int64 capacity evictions since the row's last reset.
    """

    vectors: Tensor
    sq_norms: Tensor
    digest: Tensor
    kind: Tensor
    lifespan: Tensor
    uid: Tensor
    counts: Tensor
    step: Tensor
    evictions: Tensor
    # Scratch buffers reused by the step functions (never serialised, copied or compared):
    # a fresh multi-MB temporary per step costs page faults that dominate small steps on CPU.
    scratch: dict = rows_field(rows=False, default_factory=dict, repr=False, compare=False)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A reusable uninitialised scratch tensor (contents undefined on return); inside a compiled
        step a graph temporary (the compiler plans its memory; a Python dict that gains keys between
        steps would make the next step recompile)."""
        if torch.compiler.is_compiling():
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = self.scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != self.device:
            buf = self.scratch[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    # ----------------------------------------------------------------- construction
    @classmethod
    def empty(
        cls, config: MemoriaConfig, batch_size: int, dim: int, device: torch.device | str | None = None
    ) -> MemoryState:
        """A fresh memory for `batch_size` rows of `dim`-wide engrams."""
        if batch_size < 0 or dim < 1:
            raise ValueError(f"need batch_size >= 0 and dim >= 1, got {batch_size} and {dim}")
        B, C, D = batch_size, config.capacity, dim
        return cls(
            vectors=torch.zeros(B, C, D, dtype=torch.float32, device=device),
            sq_norms=torch.zeros(B, C, dtype=torch.float32, device=device),
            digest=torch.zeros(B, C, dtype=torch.int64, device=device),
            kind=torch.zeros(B, C, dtype=torch.int8, device=device),
            lifespan=torch.zeros(B, C, dtype=torch.float32, device=device),
            uid=torch.full((B, C), -1, dtype=torch.int64, device=device),
            counts=torch.zeros(B, C, C, dtype=getattr(torch, config.count_dtype), device=device),
            step=torch.zeros(B, dtype=torch.int64, device=device),
            evictions=torch.zeros(B, dtype=torch.int64, device=device),
        )

    # ----------------------------------------------------------------- shape helpers
    @property
    def batch_size(self) -> int:
        return self.vectors.shape[0]

    @property
    def capacity(self) -> int:
        return self.vectors.shape[1]

    @property
    def dim(self) -> int:
        return self.vectors.shape[2]

    @property
    def device(self) -> torch.device:
        return self.vectors.device

    def tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in _FIELDS}

    def created_step(self, config: MemoriaConfig) -> Tensor:
        """(B, C) int64 memory step at which each engram was written; -1 for empty slots."""
        return torch.where(self.uid >= 0, torch.div(self.uid, config.num_wm, rounding_mode="floor"), -1)

    def check(self, config: MemoriaConfig) -> None:
        """Raise ValueError if this state cannot be used with `config` (shapes, dtypes)."""
        self.check_layout(config.count_dtype)
        if self.capacity != config.capacity:
            raise ValueError(
                f"memory state has capacity {self.capacity} but the config asks for {config.capacity}; "
                f"set `capacity={self.capacity}` to reuse this state"
            )

    def check_layout(self, count_dtype: str | None = None) -> None:
        """Raise ValueError unless every field has the engine's dtype and a shape that fits the
        others (`counts` may be int16 or int32 unless `count_dtype` names one)."""
        if self.vectors.dim() != 3:
            raise ValueError(f"memory state field `vectors` has shape {tuple(self.vectors.shape)}, expected (B, C, D)")
        counts = (getattr(torch, count_dtype),) if count_dtype else (torch.int16, torch.int32)
        expected = {
            "vectors": (torch.float32,), "sq_norms": (torch.float32,), "digest": (torch.int64,), "kind": (torch.int8,),
            "lifespan": (torch.float32,), "uid": (torch.int64,), "counts": counts, "step": (torch.int64,),
            "evictions": (torch.int64,),
        }
        B, C = self.batch_size, self.capacity
        shapes = {"vectors": (B, C, self.dim), "counts": (B, C, C), "step": (B,), "evictions": (B,)}
        for name, dtypes in expected.items():
            t = getattr(self, name)
            if t.dtype not in dtypes:
                raise ValueError(f"memory state field `{name}` has dtype {t.dtype}, expected {dtypes[0]}")
            if tuple(t.shape) != shapes.get(name, (B, C)):
                raise ValueError(f"memory state field `{name}` has shape {tuple(t.shape)}, expected {shapes.get(name, (B, C))}")
            if t.device != self.device:
                raise ValueError(f"memory state field `{name}` is on {t.device}, the rest on {self.device}")

    def check_values(self) -> None:
        """Raise ValueError unless the values are ones the engine can hold (a saved state that is
        damaged or crafted: non-finite engrams, an unknown kind, a live engram without a uid or
        lifespan, negative counters), after `check_layout`."""
        self.check_layout()
        live = self.kind != EMPTY
        problems = {
            "`vectors` or `sq_norms` hold non-finite values": ~(torch.isfinite(self.vectors).all()
                                                                 & torch.isfinite(self.sq_norms).all()),
            f"`kind` holds values outside {EMPTY}..{LTM}": ((self.kind < EMPTY) | (self.kind > LTM)).any(),
            "a live engram has no uid or no positive lifespan": (live & ((self.uid < 0) | ~(self.lifespan > 0))).any(),
            "an empty slot has a uid or a lifespan": (~live & ((self.uid != -1) | (self.lifespan != 0))).any(),
            "`counts`, `step` or `evictions` are negative": ((self.counts < 0).any() | (self.step < 0).any()
                                                              | (self.evictions < 0).any()),
        }
        bad = [what for what, flag in problems.items() if bool(flag)]
        if bad:
            raise ValueError(f"memory state is damaged or crafted: {'; '.join(bad)}")

    # ----------------------------------------------------------------- reset
    def reset(self, mask: Tensor | None = None) -> None:
        """Empty all rows, or the rows where the (B,) bool `mask` is True, in place.

        No host synchronisation: the mask may live on the device. Counts and vectors of a
        reset row are left stale; they are zeroed slot by slot as slots are reused, so the
        row behaves exactly like a fresh memory.
        """
        if mask is None:
            self.kind.zero_()
            self.lifespan.zero_()
            self.uid.fill_(-1)
            self.step.zero_()
            self.evictions.zero_()
            return
        mask = mask.to(device=self.device, dtype=torch.bool)
        if mask.shape != (self.batch_size,):
            raise ValueError(f"reset mask must have shape ({self.batch_size},), got {tuple(mask.shape)}")
        rows = mask[:, None]
        self.kind.masked_fill_(rows, EMPTY)
        self.lifespan.masked_fill_(rows, 0.0)
        self.uid.masked_fill_(rows, -1)
        self.step.masked_fill_(mask, 0)
        self.evictions.masked_fill_(mask, 0)

    # ----------------------------------------------------------------- serialisation
    def state_dict(self) -> dict[str, object]:
        """Tensors plus the format version; round-trips bit-exactly through `from_state_dict`."""
        out: dict[str, object] = {"format": STATE_FORMAT}
        out.update({k: v.detach() for k, v in self.tensors().items()})
        return out

    @classmethod
    def from_state_dict(
        cls, state_dict: dict[str, object], config: MemoriaConfig | None = None,
        device: torch.device | str | None = None,
    ) -> MemoryState:
        """Rebuild a state saved by `state_dict`, checked against `config` if given.

        Raises:
            ValueError: a missing field, an unknown format, shapes/dtypes that do not fit, or
                values the engine cannot hold (`check_values`).
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"a memory state must be a mapping of its fields, got a {type(state_dict).__name__}")
        fmt = state_dict.get("format")
        if fmt != STATE_FORMAT:
            raise ValueError(f"memory state format {fmt!r} is not supported (this version reads {STATE_FORMAT})")
        missing = [k for k in _FIELDS if k not in state_dict and k not in _DERIVED]
        if missing:
            raise ValueError(f"memory state is missing field(s) {missing}")
        tensors = {}
        for k in _FIELDS:
            t = state_dict.get(k)
            if t is None and k == "digest" and isinstance(state_dict["vectors"], Tensor):
                t = vector_digest(state_dict["vectors"].to(torch.float32))  # a state saved before digests
            if not isinstance(t, Tensor):
                raise ValueError(f"memory state field `{k}` is {type(t).__name__}, expected a tensor")
            tensors[k] = t.to(device) if device is not None else t
        state = cls(**tensors)
        if config is not None:
            state.check(config)
        state.check_values()
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Copy a saved state into this one in place (same shapes required)."""
        other = MemoryState.from_state_dict(state_dict, device=self.device)
        for name, t in self.tensors().items():
            src = getattr(other, name)
            if src.shape != t.shape or src.dtype != t.dtype:
                raise ValueError(
                    f"memory state field `{name}`: saved {tuple(src.shape)} {src.dtype}, "
                    f"this state {tuple(t.shape)} {t.dtype}"
                )
            t.copy_(src)

    def __repr__(self) -> str:  # tensors are large; show the shape only
        return f"MemoryState(batch_size={self.batch_size}, capacity={self.capacity}, dim={self.dim}, device={self.device})"


def field_names() -> tuple[str, ...]:
    return _FIELDS


__all__ = ["MemoryState", "EMPTY", "WM", "STM", "LTM", "KIND_NAMES", "CACHE_TUNED_DEVICES", "cache_tuned",
           "field_names", "vector_digest"]
