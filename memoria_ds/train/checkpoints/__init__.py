"""Checkpoints of a run: what is written, what a resume picks, and each rank's memory shard.

    store.py   the atomic checkpoint (engine + per-rank shards + manifest), validation, pruning
    resume.py  which checkpoint to resume from, compatibility, world-size changes (universal)
    shards.py  a rank's shard: memory rows by global stream id, stream positions, RNG states

See docs/training.md ("Checkpoints", "Resume").
"""

from .resume import (check_compatible, choose_checkpoint, describe_resume, ensure_universal, fingerprint,
                     set_aside_newer, set_aside_records)
from .shards import make_shard, restore_memories, rng_state, seed_everything, set_rng_state
from .store import (ENGINE_TAG, CheckpointError, CheckpointInfo, find_latest, list_checkpoints, load_all_shards,
                    load_shard, save_checkpoint, validate)

__all__ = [
    "ENGINE_TAG", "CheckpointError", "CheckpointInfo", "check_compatible", "choose_checkpoint", "describe_resume",
    "ensure_universal", "find_latest", "fingerprint", "list_checkpoints", "load_all_shards", "load_shard",
    "make_shard", "restore_memories", "rng_state", "save_checkpoint", "seed_everything", "set_aside_newer",
    "set_aside_records", "set_rng_state", "validate",
]
