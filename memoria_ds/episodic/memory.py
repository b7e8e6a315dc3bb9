"""EpisodicMemory: the key-value store of MbPA++ (de Masson d'Autume et al. 2019) as plain tensors.

Notation (used in shape comments across memoria_ds/episodic):
    N  examples stored (`len(memory)`)
    C  rows allocated (capacity, N <= C; grows by doubling)
    D  key width (the key encoder's hidden size)
    T  stored token width (the longest example written so far)
    B  rows of a batch written, sampled or gathered
    Q  query examples, K neighbours per query

One row per stored example: its key (a frozen encoder's first-token vector, fp32), its token
ids right-padded with `pad_token_id`, its length (the attention mask is `arange(T) < length`),
its label and the id of the task it came from. The paper stores every example it trains on
and shows that writing each with a probability (keeping 10-50%) costs little accuracy;
`write` takes that probability.

Capacity rule: unbounded, grown by amortised doubling (the paper's memory holds all 575,000
training examples of its text-classification stream). Storing lengths instead of masks halves
the token storage.

Purity: `write` returns a new memory and never changes a tensor that any existing memory
shows. Rows are appended into a shared, over-allocated store; a memory's fields are views
of its first N rows. Only the newest memory of a store appends in place; writing to an
older one (whose rows past its N another write already used) copies the store first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

STATE_FORMAT = 1
_TENSOR_FIELDS = ("keys", "input_ids", "lengths", "labels", "task_ids")
_STATE_KEYS = frozenset(("format", "pad_token_id") + _TENSOR_FIELDS)
_MIN_CAPACITY = 64


@dataclass
class _Store:
    """Over-allocated buffers shared by successive memories; `frontier` = rows anyone appended."""

    keys: Tensor  # (C, D) float32
    input_ids: Tensor  # (C, T) int64
    lengths: Tensor  # (C,) int64
    labels: Tensor  # (C,) int64
    task_ids: Tensor  # (C,) int64
    frontier: int


@dataclass(frozen=True, eq=False)
class EpisodicMemory:
    """The stored examples (rows 0..N-1, in write order). All tensors live on one device.

    Attributes:
        keys: (N, D) float32 keys, whatever the key encoder's dtype.
        input_ids: (N, T) int64 token ids, right-padded with `pad_token_id`.
        lengths: (N,) int64 tokens per example (>= 1); the mask is `arange(T) < lengths[:, None]`.
        labels: (N,) int64 class labels.
        task_ids: (N,) int64 id of the task (dataset) each example came from.
        pad_token_id: the id written at padding positions (BERT 0, RoBERTa 1).
    """

    keys: Tensor
    input_ids: Tensor
    lengths: Tensor
    labels: Tensor
    task_ids: Tensor
    pad_token_id: int = 0
    _store: _Store | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, key_dim: int, pad_token_id: int = 0, device: torch.device | str | None = None) -> EpisodicMemory:
        """A memory holding nothing, for keys of width `key_dim`."""
        if key_dim < 1:
            raise ValueError(f"`key_dim` must be at least 1 (the key encoder's hidden size), got {key_dim}")
        return cls(
            keys=torch.zeros(0, key_dim, dtype=torch.float32, device=device),
            input_ids=torch.zeros(0, 0, dtype=torch.int64, device=device),
            lengths=torch.zeros(0, dtype=torch.int64, device=device),
            labels=torch.zeros(0, dtype=torch.int64, device=device),
            task_ids=torch.zeros(0, dtype=torch.int64, device=device),
            pad_token_id=int(pad_token_id),
        )

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def key_dim(self) -> int:
        return self.keys.shape[1]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def attention_mask(self) -> Tensor:
        """(N, T) int64 attention mask of the stored rows."""
        return (torch.arange(self.width, device=self.device) < self.lengths[:, None]).long()

    def __repr__(self) -> str:  # the tensors are large; show the sizes only
        return f"EpisodicMemory(size={len(self)}, key_dim={self.key_dim}, width={self.width}, device={self.device})"

    # ----------------------------------------------------------------- serialisation
    def state_dict(self) -> dict[str, object]:
        """Compact copies of the N stored rows, the pad id and the format: tensors and ints only.

        The tensors are clones, not views of the over-allocated store: `torch.save` writes a
        view's whole storage, so a view would save the unused capacity too.
        """
        out: dict[str, object] = {"format": STATE_FORMAT, "pad_token_id": self.pad_token_id}
        out.update({name: getattr(self, name).detach().clone() for name in _TENSOR_FIELDS})
        return out

    @classmethod
    def from_state_dict(
        cls, state: dict[str, object], key_dim: int | None = None, device: torch.device | str | None = None
    ) -> EpisodicMemory:
        """Rebuild a memory saved by `state_dict`, checked field by field.

        Args:
            state: the dict `state_dict` made (e.g. one data-parallel rank's shard).
            key_dim: the key width the caller's key encoder produces; checked if given.
            device: where to put the tensors (default: where they are).

        Raises:
            ValueError: one line naming what is wrong (not a dict, unknown format, a missing or
                unexpected entry, a wrong dtype or shape, keys of another width, values a saved
                memory cannot hold).
        """
        def bad(why: str) -> ValueError:
            return ValueError(f"episodic memory state: {why}; pass a dict made by EpisodicMemory.state_dict()")

        if not isinstance(state, dict):
            raise bad(f"expected a dict, got a {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise bad(f"format {state.get('format')!r} is not supported (this version reads {STATE_FORMAT})")
        missing, unexpected = sorted(_STATE_KEYS - state.keys()), sorted(map(str, state.keys() - _STATE_KEYS))
        if missing or unexpected:
            raise bad(f"missing entries {missing}, unexpected entries {unexpected}")
        pad = state["pad_token_id"]
        if not isinstance(pad, int) or isinstance(pad, bool):
            raise bad(f"`pad_token_id` is a {type(pad).__name__}, expected an int")
        tensors = {}
        for name in _TENSOR_FIELDS:
            t = state[name]
            expected_dtype = torch.float32 if name == "keys" else torch.int64
            if not isinstance(t, Tensor):
                raise bad(f"`{name}` is a {type(t).__name__}, expected a tensor")
            if t.dtype != expected_dtype:
                raise bad(f"`{name}` has dtype {t.dtype}, expected {expected_dtype}")
            tensors[name] = t.to(device) if device is not None else t
        keys, ids = tensors["keys"], tensors["input_ids"]
        if keys.dim() != 2 or ids.dim() != 2:
            raise bad(f"`keys` {tuple(keys.shape)} and `input_ids` {tuple(ids.shape)} must be 2-D")
        n = keys.shape[0]
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        expected = {"keys": (n, keys.shape[1]), "input_ids": (n, ids.shape[1]), "lengths": (n,), "labels": (n,),
                    "task_ids": (n,)}
        wrong = [f"`{k}` {shapes[k]} (expected {v})" for k, v in expected.items() if shapes[k] != v]
        if wrong:
            raise bad(f"shapes do not fit {n} stored rows: {', '.join(wrong)}")
        if key_dim is not None and keys.shape[1] != key_dim:
            raise bad(f"keys are {keys.shape[1]} wide but the key encoder makes {key_dim}-wide keys")
        if len({t.device for t in tensors.values()}) > 1:
            raise bad("tensors lie on different devices")
        lengths = tensors["lengths"]
        problems = {
            "`keys` hold non-finite values": ~torch.isfinite(keys).all(),
            f"`lengths` outside 1..{ids.shape[1]}": ((lengths < 1) | (lengths > ids.shape[1])).any(),
            f"padding positions of `input_ids` do not hold pad_token_id {pad}":
                ((torch.arange(ids.shape[1], device=ids.device) >= lengths[:, None]) & (ids != pad)).any(),
            "`labels` are negative": (tensors["labels"] < 0).any(),
        }
        found = [what for what, flag in zip(problems, torch.stack(list(problems.values())).tolist()) if flag]
        if found:
            raise bad("; ".join(found))
        return cls(**tensors, pad_token_id=pad)


@dataclass(frozen=True, eq=False)
class MemoryBatch:
    """Examples taken from a memory, ready for a `transformers` sequence classifier.

    Attributes:
        input_ids: (B, T') int64, T' = the longest example of the batch.
        attention_mask: (B, T') int64, ones then zeros.
        labels: (B,) int64.
        task_ids: (B,) int64.
        indices: (B,) int64 rows of the memory they came from.
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    task_ids: Tensor
    indices: Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def model_inputs(self) -> dict[str, Tensor]:
        """`input_ids`, `attention_mask`, `labels`: keyword arguments for the classifier."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels}


# --------------------------------------------------------------------- write
def write(
    memory: EpisodicMemory,
    keys: Tensor,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
    task_ids: Tensor | int,
    write_prob: float = 1.0,
    generator: torch.Generator | None = None,
) -> EpisodicMemory:
    """Append a batch of examples, each kept with probability `write_prob`, in batch order.

    Three host synchronisations (the checks, the number of kept rows, the longest length: the
    new size and width depend on them); `write` runs once per training batch, outside the
    model's step. Token ids past each example's length are stored as `memory.pad_token_id`,
    whatever the tokenizer wrote.

    Args:
        memory: the memory to extend (left unchanged).
        keys: (B, D) key vectors (any float dtype; stored as float32).
        input_ids: (B, T) token ids.
        attention_mask: (B, T) ones then zeros (right padding; at least one token per row).
        labels: (B,) int class labels (>= 0).
        task_ids: (B,) task ids, or one int for the whole batch.
        write_prob: probability of keeping each example (1: all, as in the paper's main runs).
        generator: source of the keep draws (reproducible writes); the global RNG if None.

    Returns:
        The memory with the kept examples appended after the old rows.

    Raises:
        ValueError: mismatched shapes, keys of another width, non-finite keys, left-padded or
            empty masks, negative labels, `write_prob` outside [0, 1].
    """
    if not 0.0 <= write_prob <= 1.0:
        raise ValueError(f"`write_prob` must lie in [0, 1], got {write_prob}")
    dev = memory.device
    B = keys.shape[0] if keys.dim() == 2 else -1
    if keys.dim() != 2 or keys.shape[1] != memory.key_dim:
        raise ValueError(f"keys must be (B, {memory.key_dim}) for this memory, got {tuple(keys.shape)}")
    if input_ids.dim() != 2 or input_ids.shape[0] != B or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be "
            f"({B}, T) for {B} keys"
        )
    if isinstance(task_ids, int):
        task_ids = torch.full((B,), task_ids, dtype=torch.int64)
    if labels.shape != (B,) or task_ids.shape != (B,):
        raise ValueError(f"labels {tuple(labels.shape)} and task_ids {tuple(task_ids.shape)} must be ({B},)")
    keys, input_ids, labels, task_ids = (t.to(dev) for t in (keys, input_ids, labels, task_ids))
    mask = attention_mask.to(dev).bool()
    lengths = mask.sum(1)  # (B,)
    T = input_ids.shape[1]
    prefix = torch.arange(T, device=dev) < lengths[:, None]  # (B, T) what a right-padded mask looks like
    problems = {
        "keys hold non-finite values": ~torch.isfinite(keys).all(),
        "an attention mask is not ones-then-zeros (left padding? set tokenizer.padding_side='right') or is all "
        "zeros": ((mask != prefix) | (lengths == 0)[:, None]).any(),
        "labels are negative": (labels < 0).any(),
    }
    found = [what for what, flag in zip(problems, torch.stack(list(problems.values())).tolist()) if flag]
    if found:  # one host sync for all the checks
        raise ValueError(f"episodic memory write: {'; '.join(found)}")

    if write_prob >= 1.0:
        rows = torch.arange(B, device=dev)
    else:
        gdev = generator.device if generator is not None else dev
        keep = torch.rand(B, generator=generator, device=gdev) < write_prob  # (B,)
        rows = keep.nonzero().squeeze(1).to(dev)  # host sync: the new size depends on the draws
    n_new = rows.numel()
    if n_new == 0:
        return memory
    lengths = lengths[rows]
    width = max(memory.width, int(lengths.max()))
    ids = torch.where(prefix[rows], input_ids[rows], memory.pad_token_id)[:, :width]  # (n, <=width)

    store, n = _room_for(memory, n_new, width), len(memory)
    end = n + n_new
    store.keys[n:end] = keys[rows].float()
    store.input_ids[n:end] = memory.pad_token_id
    store.input_ids[n:end, : ids.shape[1]] = ids
    store.lengths[n:end] = lengths
    store.labels[n:end] = labels[rows].long()
    store.task_ids[n:end] = task_ids[rows].long()
    store.frontier = end
    return replace(
        memory, keys=store.keys[:end], input_ids=store.input_ids[:end, :width], lengths=store.lengths[:end],
        labels=store.labels[:end], task_ids=store.task_ids[:end], _store=store,
    )


def _room_for(memory: EpisodicMemory, n_new: int, width: int) -> _Store:
    """A store whose rows past N are free and that fits N + n_new rows of `width` tokens: the
    memory's own when it is the newest of its store and large enough, else a bigger copy."""
    n, store = len(memory), memory._store
    if (store is not None and store.frontier == n and store.keys.shape[0] >= n + n_new
            and store.input_ids.shape[1] >= width):
        return store
    old = store.keys.shape[0] if store is not None else n
    capacity = old if old >= n + n_new else max(_MIN_CAPACITY, n + n_new, 2 * old)  # amortised doubling
    dev = memory.device
    grown = _Store(
        keys=torch.zeros(capacity, memory.key_dim, dtype=torch.float32, device=dev),
        input_ids=torch.full((capacity, width), memory.pad_token_id, dtype=torch.int64, device=dev),
        lengths=torch.zeros(capacity, dtype=torch.int64, device=dev),
        labels=torch.zeros(capacity, dtype=torch.int64, device=dev),
        task_ids=torch.zeros(capacity, dtype=torch.int64, device=dev),
        frontier=n,
    )
    grown.keys[:n] = memory.keys
    grown.input_ids[:n, : memory.width] = memory.input_ids
    grown.lengths[:n] = memory.lengths
    grown.labels[:n] = memory.labels
    grown.task_ids[:n] = memory.task_ids
    return grown


# --------------------------------------------------------------------- read
def gather(memory: EpisodicMemory, indices: Tensor) -> MemoryBatch:
    """The examples at rows `indices` (B,), trimmed to their longest length (one host sync).

    Raises:
        ValueError: `indices` is not 1-D or holds rows outside 0..N-1.
    """
    indices = indices.to(memory.device)
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() and bool((indices < 0).any() | (indices >= len(memory)).any()):
        raise ValueError(f"indices must lie in 0..{len(memory) - 1} (the memory holds {len(memory)} examples)")
    lengths = memory.lengths[indices]  # (B,)
    width = int(lengths.max()) if indices.numel() else 0
    return MemoryBatch(
        input_ids=memory.input_ids[indices, :width],
        attention_mask=(torch.arange(width, device=memory.device) < lengths[:, None]).long(),
        labels=memory.labels[indices],
        task_ids=memory.task_ids[indices],
        indices=indices,
    )


def sample(memory: EpisodicMemory, n: int, generator: torch.Generator | None = None) -> MemoryBatch:
    """`min(n, N)` examples drawn uniformly without replacement (a replay batch).

    Asking for more than the memory holds returns the whole memory in random order (early in
    a stream, or with a small `write_prob`).

    Raises:
        ValueError: the memory is empty or `n < 1`.
    """
    if n < 1:
        raise ValueError(f"sample size must be at least 1, got {n}")
    if len(memory) == 0:
        raise ValueError("cannot sample from an empty episodic memory; write examples first")
    gdev = generator.device if generator is not None else memory.device
    rows = torch.randperm(len(memory), generator=generator, device=gdev)[: min(n, len(memory))]
    return gather(memory, rows)


def concat(memories: list[EpisodicMemory]) -> EpisodicMemory:
    """One memory holding every row of `memories`, in their order (e.g. every rank's share, for a search over
    all of them). Keys of one width; the first memory's padding token.

    Raises:
        ValueError: no memory, or keys of different widths.
    """
    if not memories:
        raise ValueError("concat needs at least one episodic memory")
    out = EpisodicMemory.empty(memories[0].key_dim, pad_token_id=memories[0].pad_token_id, device=memories[0].device)
    for m in memories:
        if m.key_dim != out.key_dim:
            raise ValueError(f"episodic memories of key widths {out.key_dim} and {m.key_dim} cannot be joined")
        if len(m):
            every = gather(m, torch.arange(len(m), device=m.device))
            out = write(out, m.keys.to(out.device), every.input_ids.to(out.device), every.attention_mask.to(out.device),
                        every.labels.to(out.device), every.task_ids.to(out.device))
    return out


__all__ = ["EpisodicMemory", "MemoryBatch", "concat", "write", "gather", "sample", "STATE_FORMAT"]
