"""What a run's activations and memory rows take, from its configuration alone (nothing built).

Parts (per rank; `repro/footprint.py` adds the model states and plans ZeRO with them):

- **Activations** (rough): Korthikanti et al. (2022), s*b*h*(34 + 5*a*k/h) bytes per layer in
  16-bit without recomputation (k = keys attended), plus the logits and their fp32 log-softmax,
  plus the memory cross-attention of Memoria blocks (`activation_bytes`). Good to about 30% on
  GPUs; in fp32 on CPU, twice the bytes.
- **A bptt span** (`optim.bptt_segments`): one backward keeps every segment's activations
  (`span_bytes`); `train/preflight.py` refuses a span that cannot fit before the run starts.
- **Memory rows** (exact, from the state's fields: `engram_bytes_per_row`).
"""

from __future__ import annotations

import torch

from ..data import VOCAB_SIZE, enwik8_vocabulary
from ..memory import MemoriaConfig
from ..model.composition import memory_kinds
from ..model import MemoriaGPT2Config
from ..model.pkm import PKMSettings
from ..model.recurrent import memory_kind
from .build import GPT2_SHAPES
from .config import RunConfig

GIB = 1024**3


def vocab_size(cfg: RunConfig) -> int:
    """The corpus vocabulary, without loading the corpus."""
    if cfg.data.corpus == "sorting":
        return VOCAB_SIZE
    if cfg.data.corpus == "enwik8" and cfg.data.tokenizer is None:
        return len(enwik8_vocabulary(cfg.data.loader.get("newlines", "drop")).symbols)
    name = (cfg.data.tokenizer or "gpt2").split("/")[-1]
    if name in GPT2_SHAPES:
        return 50257
    from ..data import load_tokenizer

    return len(load_tokenizer(cfg.data.tokenizer))




def engram_row_bytes(mem: MemoriaConfig, width: int) -> dict[str, int]:
    """Bytes of one row of the engine's `MemoryState` of `width`-wide engrams."""
    c = mem.capacity
    count = torch.tensor([], dtype=getattr(torch, mem.count_dtype)).element_size()
    return {"vectors": c * width * 4, "counts": c * c * count,
            "slots": c * (4 + 8 + 1 + 4 + 8),  # sq_norms fp32, digest int64, kind int8, lifespan fp32, uid int64
            "capacity": c}


def engram_bytes_per_row(config: MemoriaGPT2Config, segment_length: int) -> dict[str, int]:
    """Bytes of one memory row of the model (`MemoryState` fields plus the carried context)."""
    d = config.n_embd
    if "memoria" in memory_kinds(config.memory_type):
        row = engram_row_bytes(config.memoria_config, d)
        capacity = row.pop("capacity")
        return {**row, "previous_segment": segment_length * (d * 4 + 1), "capacity": capacity}
    kind = memory_kind(config)
    length = kind.cached_slots(segment_length)  # xl, compressive: cached keys/values
    if length:
        return {"keys_values": 2 * config.n_layer * length * d * 2, "capacity": 0}  # 16-bit cache
    own = kind.row_bytes(segment_length)  # another kind's state (the infinity-former's)
    if own:
        return {**own, "capacity": 0}
    return {"capacity": 0}


def activation_bytes(config: MemoriaGPT2Config, micro_batch: int, segment_length: int,
                     vocab_size: int | None = None, fp32: bool = False) -> float:
    """Activations of one micro-batch forward+backward, 16-bit, no recomputation (rough).

    `vocab_size`: the logits' width when it is not the config's (a from-scratch model gets the corpus's).
    `fp32`: activations of an fp32 run instead (twice the bytes; fp32 logits and their log-softmax).
    """
    s, b, h, a, n = segment_length, micro_batch, config.n_embd, config.n_head, config.n_layer
    keys = s + memory_kind(config).cached_slots(s)
    total = n * s * b * h * (34 + 5 * a * keys / h)
    if "memoria" in memory_kinds(config.memory_type):  # per memory block: 2 layer norms, q/out projections, probabilities
        mem = config.memoria_config
        engrams = mem.num_wm + mem.num_reminded
        total += len(config.resolved_memory_layers) * (s * b * h * 16 + 5 * a * s * b * engrams)
    if config.pkm_layers:  # each PKM layer's own activations; "replace" drops the MLP's (19 s b h of the 34)
        pkm = PKMSettings.from_dict(config.pkm)
        mlp = 19 * s * b * h if pkm.placement == "replace" else 0
        total += len(config.pkm_layers) * (s * b * pkm.activation_bytes(h, 2) - mlp)
    # 16-bit logits, fp32 log-softmax and its gradient; in fp32, the logits and their log-softmax
    logits = s * b * (vocab_size or config.vocab_size) * (4 + 4 if fp32 else 2 + 4 + 4)
    return total * (2 if fp32 else 1) + logits


def span_bytes(config: MemoriaGPT2Config, micro_batch: int, segment_length: int, segments: int, precision: str,
               recompute: bool = False, vocab_size: int | None = None) -> float:
    """What one backward over a span of `segments` segments keeps (`optim.bptt_segments`), per micro-batch.

    The span's losses are back-propagated once, so every segment's activations are kept until then
    (`activation_bytes`); with `recompute` (memory replay) a segment keeps only the memory it passes
    on and its input, and one segment's activations are rebuilt in backward. Rough, and rather low
    than high: on CPU in fp32 the real loop grew by 12 MB a segment for the tests' 32-wide Memformer
    (this says 13: its logits dominate), by 1.5 to 3 times this for 128-wide models (Memformer's slot
    attention the most), and by more under `recompute`. A span this estimate does not fit cannot run.
    """
    one = activation_bytes(config, micro_batch, segment_length, vocab_size, fp32=precision == "fp32")
    if not recompute:
        return segments * one
    row = sum(v for k, v in engram_bytes_per_row(config, segment_length).items() if k != "capacity")
    kept = micro_batch * (row + segment_length * config.n_embd * 4)
    return segments * kept + one


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.{1 if n >= 10 * size else 2}f} {unit}"
    return f"{int(n)} B"


__all__ = ["GIB", "activation_bytes", "engram_bytes_per_row", "fmt_bytes", "span_bytes", "vocab_size"]
