"""Before a run starts: can everything it loads be reached? (the Hugging Face hub, offline)

A run that needs the hub (a pretrained backbone by name, a corpus without `data.path`, a
tokenizer by name) and cannot reach it would otherwise spend tens of seconds in retries
and end in a long traceback. `check_sources` finds out in a few milliseconds (a cached
copy, `HF_HUB_OFFLINE`, or one TCP connection to the hub) and stops with a few lines
that say what to do instead, before the run directory is created.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from ..data.corpora import PG19_HUB, WIKITEXT_HUB
from ..data.enwik8 import ENWIK8_HUB
from .build import GPT2_SHAPES
from .config import ENCODER_BACKBONES, RunConfig
from .parse import ConfigError

# The hub repositories behind each named corpus.
CORPUS_REPOS = {"wikitext103": WIKITEXT_HUB, "pg19": PG19_HUB, "enwik8": ENWIK8_HUB}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be used right now, or None if a connection opens."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"no connection to {host}:{port} ({e.strerror or type(e).__name__})"
    return None


def _hub_name(name: str, key: str) -> str:
    """`name` if it can be a hub repository id; else the path it names does not exist."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{key}={name!r} is neither a directory nor a Hugging Face hub name; give the path "
                          f"of a save_pretrained directory or a hub id such as 'gpt2'") from None
    return name


def _model_cached(name: str, weights: bool) -> bool:
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(name, filename), str)

    return cached("config.json") and (not weights or any(cached(f) for f in WEIGHT_FILES))


def _dataset_cached(repo: str) -> bool:
    import datasets

    return (Path(datasets.config.HF_DATASETS_CACHE) / repo.replace("/", "___")).is_dir()


def hub_needs(cfg: RunConfig) -> list[str]:
    """What this run would fetch from the hub (nothing local or already cached).

    Raises:
        ConfigError: a backbone or tokenizer that is neither a directory nor a hub name.
    """
    needs = []
    m, d = cfg.model, cfg.data
    local = Path(m.backbone).is_dir()
    named_shape = (m.backbone in ENCODER_BACKBONES if m.task == "classification"
                   else m.backbone.split("/")[-1] in GPT2_SHAPES)
    if not local and not (m.from_scratch and named_shape):
        if not _model_cached(_hub_name(m.backbone, "model.backbone"), weights=not m.from_scratch):
            needs.append(f"the backbone {m.backbone!r} (model.backbone)")
    repo = CORPUS_REPOS.get(d.corpus)
    if repo is not None and d.path is None and not _dataset_cached(repo):
        needs.append(f"the corpus {d.corpus!r} ({repo}; data.corpus)")
    if d.corpus == "documents" and not d.files and not Path(d.path).exists() and not _dataset_cached(d.path):
        needs.append(f"the documents {d.path!r} (data.path)")
    if (d.tokenizer is not None and not Path(d.tokenizer).exists()
            and not _model_cached(_hub_name(d.tokenizer, "data.tokenizer"), weights=False)):
        needs.append(f"the tokenizer {d.tokenizer!r} (data.tokenizer)")
    return needs


def check_local_files(cfg: RunConfig) -> None:
    """Every `data.files` path exists (a glob must match something).

    Raises:
        ConfigError: the first split and path that finds no file.
    """
    import glob

    for split, paths in cfg.data.files.items():
        for path in [paths] if isinstance(paths, str) else paths:
            if not glob.glob(str(path)):
                raise ConfigError(f"data.files.{split}: {str(path)!r} matches no file")


def check_sources(cfg: RunConfig) -> None:
    """Stop with what to do if a local data file is missing, or the run needs the hub and
    cannot reach it.

    Raises:
        ConfigError: a few lines: why, what needed it, the offline alternatives.
    """
    check_local_files(cfg)
    needs = hub_needs(cfg)
    if not needs:
        return
    why = hub_unreachable()
    if why is None:
        return
    tips = []
    if any("backbone" in n for n in needs):
        tips += ["fine-tune a local copy: model.backbone=DIR (a save_pretrained directory or a hub snapshot)",
                 "or train from scratch at that shape: model.from_scratch=true (launch/pretrain.py)"]
    if any("corpus" in n for n in needs):
        tips.append("point data.path=DIR at a local copy of the corpus (docs/data.md), or use "
                    "data.corpus=files with data.files='{train: [a.txt], validation: [b.txt]}'")
    if any("tokenizer" in n for n in needs):
        tips.append("data.tokenizer=DIR (a local tokenizer), or leave it unset for the bundled GPT-2 BPE")
    tips.append("or run the bundled example, which needs no network: bash launch/quickstart.sh")
    raise ConfigError(
        f"the Hugging Face hub cannot be reached ({why}), and this run needs it for "
        + ", ".join(needs) + ". Nothing was written. To run without it:\n  - " + "\n  - ".join(tips)
    )
