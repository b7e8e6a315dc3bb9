"""A run's checks that need its model's shape or the machine, before any data or model work.

    check_run(cfg, info, precision)   # in setup, before the corpora are read
    check_datastore(cfg, tokens)      # once the training split is read (an uncapped kNN-LM datastore)

The configuration's own checks run when it loads (config.py, `model.config.check_model_settings`:
every setting by its rule). What is left needs the backbone's shape or the machine:

- the model's settings against its backbone (a memorizing `layer` past the last block,
  `memory_layers` out of range, a segment longer than the positions): the model's config is
  built, no weights read, and a mistake is a `ConfigError` naming the dotted key;
- the kNN-LM's FAISS index against the keys' width and the training-text datastore's cap
  (`eval.knn_lm.train_max_entries`);
- a span of `optim.bptt_segments` segments against the memory of the rank: one backward keeps
  every segment's activations, so a span that cannot fit is refused with the estimate
  (`activation_memory.span_bytes`, a low one) instead of growing until the kernel kills the run.

Each is a `ConfigError` (exit status 2), the same on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from ..model import MemoriaGPT2Config
from ..setting_rules import SettingError
from .activation_memory import fmt_bytes, span_bytes, vocab_size
from .build import run_model_config
from .config import RunConfig
from .distributed import DistInfo
from .parse import ConfigError


def check_run(cfg: RunConfig, info: DistInfo, precision: str) -> None:
    """Refuse (ConfigError) what the model's shape or this machine rules out; see the module docstring."""
    config = model_config(cfg)
    knn = cfg.eval.knn_lm
    if knn.enabled and knn.train_datastore and knn.index != "exact":
        from ..eval.knn_lm import check_index

        try:
            check_index(knn.index, config.n_embd, knn.train_max_entries, "`eval.knn_lm.train_max_entries`")
        except SettingError as e:
            raise ConfigError(str(e.within("eval.knn_lm"))) from None
    if cfg.optim.bptt_segments > 1:
        check_span_fits(cfg, config, precision, info.device, _local_ranks(info))


def check_datastore(cfg: RunConfig, train_tokens: int) -> None:
    """Once the training split is read: an uncapped kNN-LM training datastore (no
    `eval.knn_lm.train_max_entries`) holds at most a pair per training token after the first, so
    an index that needs more entries to train is refused now, not at the final evaluation."""
    knn = cfg.eval.knn_lm
    if not (knn.enabled and knn.train_datastore and knn.index != "exact" and knn.train_max_entries is None):
        return
    from ..eval.knn_lm import check_index

    try:
        check_index(knn.index, model_config(cfg).n_embd, max(train_tokens - 1, 0),
                    f"the training split ({train_tokens} tokens)")
    except SettingError as e:
        raise ConfigError(str(e.within("eval.knn_lm"))) from None


def model_config(cfg: RunConfig) -> MemoriaGPT2Config:
    """The config of the run's model (no weights read); a setting that does not fit the backbone is a
    ConfigError naming its dotted key."""
    try:
        return run_model_config(cfg)
    except (SettingError, StrictDataclassError) as e:
        cause = e if isinstance(e, SettingError) else e.__cause__
        if not isinstance(cause, SettingError):
            raise ConfigError(f"model.settings: {cause or e}") from None
        # the run gives the model its segment length unless model.settings does
        given = cause.key != "segment_length" or "segment_length" in cfg.model.settings
        where = "model.settings" if given else "data"
        raise ConfigError(str(cause.within(where))) from None


def available_bytes(device: torch.device, local_ranks: int = 1) -> tuple[int, str] | None:
    """Memory a rank may still use, and where it is: the GPU's free memory, or the machine's available
    memory (`MemAvailable`, within a cgroup's limit) shared by the node's `local_ranks`; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a cgroup (v2) limit below the machine's: a container, a SLURM job
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    share = f" for each of {local_ranks} ranks" if local_ranks > 1 else ""
    return max(0, available) // local_ranks, f"of memory available on this machine{share}"


def check_span_fits(cfg: RunConfig, config: MemoriaGPT2Config, precision: str, device: torch.device,
                    local_ranks: int = 1, available: tuple[int, str] | None = None) -> None:
    """Refuse a span of `optim.bptt_segments` segments whose activations alone (`span_bytes`, a low
    estimate) exceed the memory available to the rank (`available`: bytes and where; None measures it).

    Raises:
        ConfigError: the estimate, the memory, how many segments fit and what to lower.
    """
    available = available or available_bytes(device, local_ranks)
    if available is None:
        return
    free, where = available
    o = cfg.optim
    vocab = vocab_size(cfg) if cfg.model.from_scratch and "vocab_size" not in cfg.model.settings else None
    size = {"micro_batch": o.micro_batch_size, "segment_length": cfg.data.segment_length, "precision": precision,
            "recompute": o.bptt_recompute, "vocab_size": vocab}
    need = span_bytes(config, segments=o.bptt_segments, **size)
    if need <= free:
        return
    one = span_bytes(config, segments=1, **size)
    per = span_bytes(config, segments=2, **size) - one  # what each further segment adds
    fit = 0 if one > free else 1 + int((free - one) // per)
    fits = f"at most {fit} segments fit" if fit else "not even one segment fits"
    replay = ""
    if not o.bptt_recompute and span_bytes(config, segments=o.bptt_segments, **{**size, "recompute": True}) <= free:
        replay = ", or set optim.bptt_recompute=true (memory replay: a segment then keeps little more than its memory)"
    raise ConfigError(
        f"`optim.bptt_segments` ({o.bptt_segments}) keeps the activations of {o.bptt_segments} segments for one "
        f"backward: at least about {fmt_bytes(need)} per rank ({o.micro_batch_size} streams x "
        f"{cfg.data.segment_length} tokens, {precision}, model.preset={cfg.model.preset}{', memory replay' if o.bptt_recompute else ''}), more "
        f"than the {fmt_bytes(free)} {where}: {fits}; lower optim.bptt_segments, optim.micro_batch_size or "
        f"data.segment_length{replay}")


def _local_ranks(info: DistInfo) -> int:
    """Ranks sharing this machine's memory (the launchers say; else all of them, the safe guess)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun, the deepspeed launcher
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    return max(1, info.world_size)


__all__ = ["available_bytes", "check_run", "check_span_fits", "model_config"]
