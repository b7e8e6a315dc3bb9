"""Steps from data set sizes, and a rough A100-80GB GPU-hours estimate, for a run configuration.

**Steps.** Language modelling: the training split's N tokens laid out as B contiguous
streams cut into L-token segments (`StreamLayout`, the training's own arithmetic), times
the epochs. Token counts are exact when the corpus is prepared here (`count=True`, or a
local corpus), else the approximations in `APPROX_TOKENS` (stated as such). Sorting:
`num_train // B` batches of examples, each `num_segments` steps.

**Time per optimiser step** (every constant below is an assumption, not a measurement: no
GPU was available when this was written; the result is good to a factor of about 2):

    compute  = FLOPs / (world * A100 bf16 peak 312 TFLOP/s * MFU 0.35)
               FLOPs per token = 6 * parameters            (forward + backward)
                               + 12 * layers * D * keys    (self-attention; keys = L/2, + XL memory)
                               + 12 * memory layers * D * engrams   (Memoria's cross-attention)
    latency  = per micro-batch: 0.3 ms per block (kernel launches at these small batches; x2 for
               blocks with a memory attention) + 6 ms per Memoria memory step (remind with the
               depth-10 search, memorize); + 2 ms optimizer step
    comms    = gradient reduction, 2 x 2 bytes x parameters / bandwidth (100 GB/s in a node,
               12 GB/s per GPU across nodes), x1.5 under ZeRO-3; none on one rank; not overlapped
    offload  = 12 bytes x parameters / 20 GB/s (optimizer states over PCIe and CPU Adam)

The final evaluation (every protocol, read sequentially) is added with forward-only FLOPs
(2 x parameters per token) and a third of the per-block latency. GPU-hours = ranks x hours.
The paper's batch of 8 streams is small: a GPT-2 small step is latency-bound, so extra ranks
mostly add communication (the estimate shows it); one GPU per run, many runs side by side,
is the efficient way to reproduce the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..data.streams import StreamLayout
from ..model.composition import memory_kinds
from ..model import MemoriaGPT2Config
from ..model.pkm import PKMSettings
from ..model.recurrent import memory_kind
from ..train.config import RunConfig

A100_BF16_PEAK = 312e12
MFU = 0.35
BLOCK_LATENCY_S = 0.3e-3
MEMORY_BLOCK_FACTOR = 2.0
MEMORY_STEP_S = 6e-3
OPTIMIZER_STEP_S = 2e-3
INTRA_NODE_BYTES_S = 100e9
INTER_NODE_BYTES_S = 12e9
OFFLOAD_BYTES_S = 20e9

# Token counts of the real corpora for when they are not prepared here (GPT-2 tokens; enwik8:
# bytes without newlines). Approximate: word counts from the data sets' papers times an
# assumed tokens-per-word ratio. `--count-tokens` replaces them with the exact counts.
APPROX_TOKENS: dict[str, dict[str, float | str]] = {
    "wikitext103": {"train": 119e6, "validation": 0.25e6, "test": 0.28e6,
                    "source": "103.2M / 0.22M / 0.25M words (Merity et al. 2017) x ~1.15 GPT-2 tokens per word"},
    "pg19": {"train": 180e6, "validation": 3.9e6, "test": 9.1e6,
             "source": "first 2,000 of 28,602 training books ~ 138M of 1.97B words, held out 3.0M / 7.0M words "
                       "(Rae et al. 2020) x ~1.3 GPT-2 tokens per word"},
    "enwik8": {"train": 88.9e6, "validation": 4.94e6, "test": 4.94e6,
               "source": "90M / 5M / 5M bytes less ~1.2% newlines (dropped)"},
}


@dataclass(frozen=True)
class Schedule:
    """How long a run is.

    Attributes:
        steps_per_epoch: optimiser steps in one pass over the training split (None if unknown).
        total_steps: optimiser steps the run takes (`max_steps` or epochs x steps per epoch).
        tokens_per_step: input tokens per optimiser step over all ranks (B x L).
        eval_steps: sequential segments the final evaluation reads (all protocols together).
        eval_rows: rows per rank in each evaluation step.
        source: where the sizes come from (exact counts, or the approximation used).
    """

    steps_per_epoch: int | None
    total_steps: int
    tokens_per_step: int
    eval_steps: int
    eval_rows: int
    source: str


def _token_counts(cfg: RunConfig, splits: tuple[str, ...], count: bool) -> tuple[dict[str, int] | None, str]:
    """Exact counts by preparing the corpus (cached, as the run itself would), or the approximation."""
    local = cfg.data.corpus in ("bundled", "files")
    if count or local:
        from ..train.build import load_corpora

        try:
            corpora = load_corpora(cfg.data, splits, rank=0)
            return {s: corpora[s].num_tokens for s in splits}, "exact token counts of the prepared corpus"
        except (OSError, ValueError) as e:
            if local:
                raise
            note = f" (counting failed: {str(e).splitlines()[0][:120]})"
    else:
        note = ""
    approx = APPROX_TOKENS.get(cfg.data.corpus)
    if approx is None:
        return None, "unknown corpus size" + note
    return {s: int(approx[s]) for s in splits}, f"approximate: {approx['source']}{note}"


def schedule(cfg: RunConfig, world_size: int, count: bool = False) -> Schedule:
    """Steps of training and evaluation of `cfg` on `world_size` ranks.

    Args:
        count: prepare the corpus to count its tokens exactly (slow for the real corpora the
            first time; the result is cached where the training will find it).
    """
    o, d, e = cfg.optim, cfg.data, cfg.eval
    batch = o.micro_batch_size * o.grad_accum * world_size
    L = d.segment_length
    if d.corpus == "sorting":
        s = d.sorting_settings
        per_epoch = s["num_train"] // batch * s["num_segments"]
        readings = 2 if "memoryless" in e.protocols else 1  # with the memory, and reset before every segment
        eval_steps = readings * math.ceil(s["num_test"] / batch) * s["num_segments"] if e.at_end else 0
        total = o.max_steps or o.epochs * per_epoch
        return Schedule(per_epoch, total, batch * L, eval_steps, o.micro_batch_size * o.grad_accum,
                        f"{s['num_train']:,} generated training examples, {s['num_test']:,} test examples")
    splits = ("train", e.split)
    known_steps = o.max_steps is not None
    counts, source = (None, "max_steps given") if known_steps and e.max_steps else _token_counts(cfg, splits, count)
    per_epoch = StreamLayout(counts["train"], batch, L, d.tail).steps_per_epoch if counts else None
    total = o.max_steps or o.epochs * (per_epoch or 0)
    eval_steps = 0
    streams = e.num_streams or world_size
    for name in e.protocols if e.at_end else ():
        n_streams = 1 if name == "paper" else streams
        steps = math.ceil(counts[e.split] / n_streams / L) if counts else (e.max_steps or 0)
        eval_steps += min(steps, e.max_steps) if e.max_steps else steps
    return Schedule(per_epoch, total, batch * L, eval_steps, max(1, streams // world_size), source)


@dataclass(frozen=True)
class Cost:
    """Estimated wall clock and GPU-hours on A100 80GB (see the module docstring for the method)."""

    step_s: float
    compute_s: float
    latency_s: float
    comms_s: float
    eval_s: float
    hours: float
    gpu_hours: float


def flops_per_token(config: MemoriaGPT2Config, params: int, segment_length: int) -> float:
    """Training FLOPs (forward + backward) per token. A PKM layer's value table is counted by the
    rows a token reads, not whole (`PKMSettings.untouched_parameters`)."""
    keys = segment_length / 2 + memory_kind(config).cached_slots(segment_length)
    flops = 6.0 * params + 12.0 * config.n_layer * config.n_embd * keys
    if config.pkm_layers:
        pkm = PKMSettings.from_dict(config.pkm)
        flops += len(config.pkm_layers) * (pkm.selection_flops() - 6.0 * pkm.untouched_parameters(config.n_embd))
    if "memoria" in memory_kinds(config.memory_type):
        mem = config.memoria_config
        width = config.resolved_memory_inner_dim
        flops += 12.0 * len(config.resolved_memory_layers) * width * (mem.num_wm + mem.num_reminded)
    return flops


def estimate_cost(config: MemoriaGPT2Config, params: int, sched: Schedule, cfg: RunConfig, world_size: int,
                  num_nodes: int, zero_stage: int, offload: bool) -> Cost:
    """GPU-hours of one run; see the module docstring for every assumption."""
    L = cfg.data.segment_length
    fpt = flops_per_token(config, params, L)
    compute = fpt * sched.tokens_per_step / (world_size * A100_BF16_PEAK * MFU)
    memory_blocks = len(config.resolved_memory_layers)
    block_latency = BLOCK_LATENCY_S * (config.n_layer + (MEMORY_BLOCK_FACTOR - 1) * memory_blocks)
    engine = MEMORY_STEP_S if "memoria" in memory_kinds(config.memory_type) else 0.0
    latency = cfg.optim.grad_accum * (block_latency + engine) + OPTIMIZER_STEP_S
    return step_cost(compute=compute, latency=latency, params=params, sched=sched, segment_length=L,
                     world_size=world_size, num_nodes=num_nodes, zero_stage=zero_stage, offload=offload,
                     block_latency=block_latency, engine=engine)


def step_cost(*, compute: float, latency: float, params: int, sched: Schedule, segment_length: int, world_size: int,
              num_nodes: int, zero_stage: int, offload: bool, block_latency: float, engine: float) -> Cost:
    """A run's `Cost` from its step's compute and latency (seconds): the gradient reduction and offload
    traffic added, the final evaluation, the hours (shared by the language models' and the classifiers'
    estimates)."""
    comms = 0.0
    if world_size > 1:
        bandwidth = INTER_NODE_BYTES_S if num_nodes > 1 else INTRA_NODE_BYTES_S
        comms = 2 * 2 * params / bandwidth * (1.5 if zero_stage == 3 else 1.0)
    if offload:
        comms += 12 * params / OFFLOAD_BYTES_S
    step = compute + latency + comms
    eval_tokens = sched.eval_rows * world_size * segment_length
    eval_step = (2.0 * params * eval_tokens / (world_size * A100_BF16_PEAK * MFU) + block_latency / 3 + engine)
    eval_s = sched.eval_steps * eval_step
    hours = (sched.total_steps * step + eval_s) / 3600
    return Cost(step_s=step, compute_s=compute, latency_s=latency, comms_s=comms, eval_s=eval_s, hours=hours,
                gpu_hours=hours * world_size)

__all__ = ["APPROX_TOKENS", "Cost", "Schedule", "estimate_cost", "flops_per_token", "schedule", "step_cost"]
