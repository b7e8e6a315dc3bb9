"""Checkpoints: engine state plus every rank's memory shard, written atomically.

Layout of one checkpoint (`<run_dir>/checkpoints/step_00000100/`):

    manifest.json     written last; its presence (and validity) makes the checkpoint real
    engine/           the engine's own files (DeepSpeed: weights, optimizer, scheduler per rank)
    zero_to_fp32.py   DeepSpeed's consolidation script (DeepSpeed copies it here)
    rank_00000.safetensors   rank 0's shard: memory rows of its streams (by global stream
    rank_00001.safetensors   id), the data streams' position, RNG states, the step

Every rank writes its own shard (DeepSpeed's `client_state` is written by rank 0 only
under ZeRO-1/2, so per-rank state cannot go there). Everything is first written into
`checkpoints/.staging-step_XXXXXXXX/`; rank 0 writes the manifest (sizes of every file,
sha256 of the shards) after a barrier, then renames the staging folder into place. A
process killed while saving leaves only a staging folder, which is ignored and later
removed: the previous checkpoint stays intact and stays the one `--resume auto` picks.

The shards are safetensors + JSON (`memoria_ds.safe_io`): reading them cannot run code.
DeepSpeed's files under `engine/` are pickles by DeepSpeed's design (docs/training.md,
"Files that run code when loaded"). Shards written by older versions as pickles
(`rank_*.pt`) are refused with the command that converts them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from ...safe_io import CONVERT, PickleRefused, check_pickles, check_tree, file_sha256, is_pickle, load_tree, save_tree
from ..engine import DEEPSPEED_PICKLE_GLOBALS
from .. import distributed as dist_utils
from .. import faults
from .shards import check_shard, saved_model_config

MANIFEST = "manifest.json"
ENGINE_TAG = "engine"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    world_size: int
    manifest: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step of a `step_XXXXXXXX` checkpoint folder."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step_XXXXXXXX)")
    return int(match.group(1))


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


_LEGACY = re.compile(r"^(rank_\d{5}\.pt|engine/engine\.pt)$")  # pickles of memoria_ds before safe_io


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_tree(obj: Any, path: Path) -> None:
    """`safe_io.save_tree` into a temporary name, synced, then renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_tree(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: Path,
    step: int,
    engine,
    shard: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    exclude_frozen: bool,
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a complete checkpoint for `step`, atomically. Every rank calls this.

    Args:
        root: `<run_dir>/checkpoints`.
        engine: the TrainEngine (its `save` writes `engine/`).
        shard: this rank's state (memory rows, stream ids, data position, RNG).
        meta: JSON-able facts for the manifest (config hash, model type, versions, ...).
        keep_last: complete checkpoints to keep (older ones are removed by rank 0).

    Returns:
        The final checkpoint directory.
    """
    root = Path(root)
    final = root / step_dir_name(step)
    staging = root / f".staging-{step_dir_name(step)}"
    failure = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)  # a killed save's leftovers
            staging.mkdir()
        except OSError as e:  # read-only, full, or a file where a folder belongs
            failure = f"rank 0: {_short(e)}"
    _agree(failure, root, staging, step, rank)

    try:
        engine.save(staging, ENGINE_TAG, exclude_frozen=exclude_frozen)
        if faults.active("disk_full_during_save", step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staging / shard_name(rank)))
        atomic_save_tree(dict(shard, format=FORMAT, rank=rank, world_size=world_size, step=step),
                         staging / shard_name(rank))
    except (OSError, RuntimeError) as e:  # disk full, read-only, quota: torch raises RuntimeError for those too
        failure = f"rank {rank}: {_short(e)}"
    _agree(failure, root, staging, step, rank)
    if faults.active("kill_during_save", step):
        faults.kill(f"while saving step {step}")

    failure = None
    if rank == 0:
        try:
            _finalise(root, staging, final, step, world_size, meta, keep_last)
        except (OSError, RuntimeError) as e:
            failure = f"rank 0: {_short(e)}"
    _agree(failure, root, staging, step, rank)  # (a collective: every rank sees the final folder)
    return final


def _finalise(root: Path, staging: Path, final: Path, step: int, world_size: int, meta: dict[str, Any],
              keep_last: int) -> None:
    """Rank 0, once every rank's files are in `staging`: the manifest, the rename, pruning."""
    files = {}
    for p in sorted(staging.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(staging))] = p.stat().st_size
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "engine_tag": ENGINE_TAG,
        "files": files,
        # every file (engine state included): a flipped byte anywhere is caught before loading
        # (about 1 s per GB on rank 0; checked newest first on resume, not when pruning)
        "sha256": {rel: file_sha256(staging / rel) for rel in files},
        "meta": meta,
    }
    atomic_write_bytes(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(staging)
    if final.exists():  # a re-save of the same step: move the old one aside first
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, final)
    _fsync_dir(root)
    prune(root, keep_last)


def _agree(failure: str | None, root: Path, staging: Path, step: int, rank: int) -> None:
    """Every rank learns whether any rank failed to write; if one did, the staging folder goes
    and every rank raises the same `CheckpointError` (no rank waits forever at a barrier)."""
    failures = [f for f in dist_utils.gather_objects(failure) if f is not None]
    if not failures:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist_utils.barrier()
    kept = [p.name for p, problem in list_checkpoints(root) if problem is None]
    try:
        free = f" ({shutil.disk_usage(root).free / 2**20:,.1f} MiB free now)"
    except OSError:
        free = ""
    raise CheckpointError(
        f"could not write checkpoint {step_dir_name(step)} under {root} ({'; '.join(failures)}); its partial "
        f"files were removed and the earlier checkpoints are intact ({', '.join(kept) or 'none yet'}). Free "
        f"space there{free} or make it writable (or point run_dir elsewhere), and resume with --resume auto"
    )


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints, and stale staging folders."""
    complete = [c for c in list_checkpoints(root) if c[1] is None]
    for path, _ in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    for p in root.glob(".staging-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".old-*"):
        shutil.rmtree(p, ignore_errors=True)


def _short(e: BaseException) -> str:
    """One line for an I/O failure: the OS's reason and path, or the first line of torch's message."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _check_manifest_fields(path: Path, manifest: dict[str, Any]) -> None:
    """The manifest's fields have the types `save_checkpoint` writes, and every file it names
    lies inside the checkpoint (a crafted `../` name is not read, not even to hash it)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt ({what})")

    def count(key: str, least: int) -> None:
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise bad(f"`{key}` is {value!r}, not an integer >= {least}")

    count("step", 0)
    count("world_size", 1)
    files = manifest.get("files", {})
    digests = manifest.get("sha256") or manifest.get("shard_sha256", {})
    if not isinstance(files, dict) or not isinstance(digests, dict):
        raise bad("`files` and `sha256` must be objects")
    root = path.resolve()
    for rel in [*files, *digests]:
        inside = bool(rel) and not Path(rel).is_absolute() and ".." not in Path(rel).parts
        if not inside or not (path / rel).resolve().is_relative_to(root):
            raise bad(f"the file name {rel!r} points outside the checkpoint")
    for rel, size in files.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"the size of {rel} is {size!r}")
    for rel, digest in digests.items():
        if not isinstance(digest, str):
            raise bad(f"the checksum of {rel} is {digest!r}")
    meta = manifest.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k, {}), dict) for k in ("config", "fingerprint")):
        raise bad("`meta` and its `config` and `fingerprint` must be objects")


def validate(path: Path, verify_contents: bool = True) -> CheckpointInfo:
    """Check that `path` is a complete checkpoint; raise CheckpointError saying what is wrong.

    Args:
        verify_contents: also check every file against its SHA-256 in the manifest (manifests
            written before every file had one carry the shards' only). False checks presence
            and sizes only (cheap: what pruning needs).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {MANIFEST}: it was never completed (the process probably died "
            f"while saving); use an earlier checkpoint or `--resume auto`"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt ({e})") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is corrupt (not a JSON object)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {manifest.get('format')!r}; this version reads {FORMAT}")
    _check_manifest_fields(path, manifest)
    legacy = sorted(rel for rel in manifest.get("files", {}) if _LEGACY.match(rel))
    if legacy:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds memoria_ds pickles from an older version ({', '.join(legacy[:3])}): not "
            f"read, since loading a pickle can run any code it carries. If you trust where it came from, convert it "
            f"once with `{CONVERT} {path}`"
        )
    for rel, size in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {rel}")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is {f.stat().st_size} bytes, the manifest says {size}")
    digests = manifest.get("sha256") or manifest.get("shard_sha256", {})
    for name, digest in digests.items() if verify_contents else ():
        if file_sha256(path / name) != digest:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} does not match its checksum (corrupt)")
    if verify_contents:
        _check_no_code(path, manifest)
        _check_trees(path, manifest)
    return CheckpointInfo(path=path, step=int(manifest["step"]), world_size=int(manifest["world_size"]), manifest=manifest)


def _check_no_code(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a checkpoint with a file that could run code when loaded.

    A checksum does not help against a crafted checkpoint (its author writes the manifest
    too), so: our own files must be safetensors, not pickles, and DeepSpeed's pickles under
    `engine/` may import only the data classes DeepSpeed writes (`DEEPSPEED_PICKLE_GLOBALS`),
    read from their opcodes without unpickling them.
    """
    for rel in manifest.get("files", {}):
        f = path / rel
        if rel.endswith(".safetensors") and is_pickle(f):
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is a pickle, not safetensors: not read (a file "
                                  f"that runs code on load; take checkpoints only from people you trust)")
        if rel.startswith(f"{ENGINE_TAG}/") and rel.endswith(".pt"):
            try:
                check_pickles([f], DEEPSPEED_PICKLE_GLOBALS, "DeepSpeed")
            except PickleRefused as e:
                raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None


def _check_trees(path: Path, manifest: dict[str, Any]) -> None:
    """Every safetensors file of ours reads as a tree, and every rank's shard as a shard whose
    memories fit the model of the checkpoint's own run configuration (`saved_model_config`; the
    fingerprint check makes it the resuming run's model): a file damaged or crafted behind a
    matching checksum makes the checkpoint unusable here (so `--resume auto` falls back past it),
    not the run crash later. A manifest without a model section gets the value checks only; the
    resume then checks the memories against the running model (`restore_memories`)."""
    files = manifest.get("files", {})
    saved = manifest.get("meta", {}).get("config", {})
    try:
        model_config = saved_model_config(manifest) if isinstance(saved.get("model"), dict) else None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None
    for rel in files:
        if rel.endswith(".safetensors"):
            try:
                check_tree(path / rel)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None
    for rank in range(int(manifest["world_size"])):
        if shard_name(rank) not in files:
            raise CheckpointError(f"checkpoint {str(path)!r} has no shard for rank {rank} of {manifest['world_size']}")
        try:
            check_shard(load_tree(path / shard_name(rank)), rank, model_config)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {str(path)!r}: {e}") from None


def list_checkpoints(root: Path, verify_contents: bool = False) -> list[tuple[Path, str | None]]:
    """Finalised checkpoint folders under `root`, oldest first, with the reason each is unusable (or None).

    By default only completeness is checked (manifest, files, sizes); `verify_contents` hashes
    every file too (see `validate`).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and _STEP_DIR.match(p.name):
            try:
                validate(p, verify_contents)
                out.append((p, None))
            except CheckpointError as e:
                out.append((p, str(e)))
    return out


def find_latest(root: Path) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest usable checkpoint under `root` (or None), and a note for each newer one skipped."""
    skipped = []
    for path, _ in reversed(list_checkpoints(root)):  # newest first; only as many hashed as needed
        try:
            return validate(path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def load_shard(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    """Rank `rank`'s shard of a checkpoint (read as data: nothing in it is executed)."""
    path = info.path / shard_name(rank)
    try:
        shard = load_tree(path)
        check_shard(shard, rank)
        return shard
    except PickleRefused as e:
        raise CheckpointError(str(e)) from None
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(info.path)!r}: {e}") from None


def load_all_shards(info: CheckpointInfo) -> list[dict[str, Any]]:
    return [load_shard(info, r) for r in range(info.world_size)]
