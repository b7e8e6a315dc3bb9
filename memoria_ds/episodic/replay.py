"""ReplaySchedule: when MbPA++'s sparse experience replay is due.

MbPA++ trains on the stream once and, every `replay_every` new examples, takes one gradient
step on `replay_size` examples drawn uniformly from the episodic memory
(`memory.sample`). The paper replays 100 stored examples per 10,000 new ones, a 1% replay
rate (de Masson d'Autume et al. 2019; the survey (shared/papers): "a 1%
experience replay to learning new examples ratio is sufficient"). The public ports count
steps instead of examples (Daikon-Sun/EM-in-LLL `train.py`: every 100 steps, a batch of the
average batch size; h3lio5/episodic-lifelong-learning `main.py`: 64 examples every 201
steps of 32); counting examples keeps the 1% rate whatever the batch sizes are.

Rule: after the batch that brings the count of examples seen from s to s + b, replay
`(s + b) // replay_every - s // replay_every` times, so a stream of S examples gets exactly
`S // replay_every` replays whatever its batch sizes (a batch larger than `replay_every`
may make more than one due). The schedule holds the count of examples seen, which belongs
in every checkpoint (with data parallelism, one schedule per rank counting that rank's
examples, next to that rank's memory shard).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

REPLAY_EVERY = 10_000  # new examples between replays (paper)
REPLAY_SIZE = 100  # examples per replay batch (paper)
STATE_FORMAT = 1
_STATE_KEYS = frozenset(("format", "replay_every", "replay_size", "seen"))


@dataclass(frozen=True)
class ReplaySchedule:
    """Replay `replay_size` stored examples once per `replay_every` examples seen.

    Attributes:
        replay_every: new examples between replays (paper: 10,000); 0: never (the memory is kept for local
            adaptation alone, the paper's "local adaptation only" baseline).
        replay_size: examples per replay batch (paper: 100).
        seen: examples trained on so far (not counting replayed ones).
    """

    replay_every: int = REPLAY_EVERY
    replay_size: int = REPLAY_SIZE
    seen: int = 0

    def __post_init__(self) -> None:
        for name, least in (("replay_every", 0), ("replay_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"`{name}` must be an int >= {least}, got {value!r}")
        if not isinstance(self.seen, int) or isinstance(self.seen, bool) or self.seen < 0:
            raise ValueError(f"`seen` must be a non-negative int, got {self.seen!r}")

    def advance(self, batch_size: int) -> tuple[ReplaySchedule, int]:
        """Count a batch of `batch_size` new examples.

        Returns:
            The schedule after the batch, and how many replay batches are due now (usually 0 or 1).
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            raise ValueError(f"`batch_size` must be an int >= 0 (examples in the batch), got {batch_size!r}")
        seen = self.seen + batch_size
        if self.replay_every == 0:
            return replace(self, seen=seen), 0
        return replace(self, seen=seen), seen // self.replay_every - self.seen // self.replay_every

    def state_dict(self) -> dict[str, int]:
        return {"format": STATE_FORMAT, "replay_every": self.replay_every, "replay_size": self.replay_size,
                "seen": self.seen}

    @classmethod
    def from_state_dict(cls, state: dict[str, int], expect: ReplaySchedule | None = None) -> ReplaySchedule:
        """Rebuild a saved schedule; with `expect`, refuse one saved with other settings.

        Raises:
            ValueError: not a dict made by `state_dict`, or settings that differ from `expect`'s.
        """
        if not isinstance(state, dict) or state.keys() != _STATE_KEYS or state["format"] != STATE_FORMAT:
            got = sorted(map(str, state.keys())) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"replay schedule state: expected entries {sorted(_STATE_KEYS)} with format "
                             f"{STATE_FORMAT}, got {got}; pass a dict made by ReplaySchedule.state_dict()")
        schedule = cls(replay_every=state["replay_every"], replay_size=state["replay_size"], seen=state["seen"])
        if expect is not None and (expect.replay_every, expect.replay_size) != (schedule.replay_every,
                                                                               schedule.replay_size):
            raise ValueError(
                f"replay schedule state was saved with replay_every={schedule.replay_every}, replay_size="
                f"{schedule.replay_size} but this run asks for {expect.replay_every}, {expect.replay_size}; "
                f"resume with the saved settings"
            )
        return schedule


__all__ = ["ReplaySchedule", "REPLAY_EVERY", "REPLAY_SIZE"]
