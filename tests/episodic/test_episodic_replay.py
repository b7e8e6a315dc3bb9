"""ReplaySchedule: exactly one replay per `replay_every` examples over any batch sizes."""

from __future__ import annotations

import random

import pytest

from memoria_ds.episodic import REPLAY_EVERY, REPLAY_SIZE, ReplaySchedule


def test_paper_defaults():
    assert (REPLAY_EVERY, REPLAY_SIZE) == (10_000, 100)
    assert ReplaySchedule() == ReplaySchedule(replay_every=10_000, replay_size=100, seen=0)


@pytest.mark.parametrize("every, max_batch", [(10, 3), (10, 37), (7, 7), (1, 4), (100, 250)])
def test_replays_equal_floor_of_seen_over_every_at_each_point_of_the_stream(every, max_batch):
    rng = random.Random(every * 1000 + max_batch)
    schedule, replays, seen = ReplaySchedule(replay_every=every, replay_size=5), 0, 0
    for _ in range(300):
        size = rng.choice([0, 1, max_batch, rng.randint(0, max_batch)])
        schedule, due = schedule.advance(size)
        seen += size
        replays += due
        assert replays == seen // every and schedule.seen == seen
        assert due == seen // every - (seen - size) // every  # the batch that crosses a boundary reports it


def test_resuming_from_the_state_dict_continues_the_count():
    sizes = [3, 9, 4, 4, 4, 1, 12, 7] * 5
    full, saved_at = ReplaySchedule(replay_every=10), 17
    schedule, total = full, 0
    for i, size in enumerate(sizes):
        if i == saved_at:
            schedule = ReplaySchedule.from_state_dict(schedule.state_dict(), expect=ReplaySchedule(replay_every=10))
        schedule, due = schedule.advance(size)
        total += due
    assert total == sum(sizes) // 10 and schedule.seen == sum(sizes)


def test_replay_every_zero_never_replays_but_counts():
    schedule, total = ReplaySchedule(replay_every=0), 0
    for size in (3, 10_000, 7):
        schedule, due = schedule.advance(size)
        total += due
    assert total == 0 and schedule.seen == 10_010


def test_bad_settings_and_states_are_refused():
    with pytest.raises(ValueError, match="`replay_every` must be an int >= 0"):
        ReplaySchedule(replay_every=-1)
    with pytest.raises(ValueError, match="`replay_size` must be an int >= 1"):
        ReplaySchedule(replay_size=0)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        ReplaySchedule().advance(-1)
    state = ReplaySchedule(replay_every=10, seen=33).state_dict()
    with pytest.raises(ValueError, match="resume with the saved settings"):
        ReplaySchedule.from_state_dict(state, expect=ReplaySchedule())
    with pytest.raises(ValueError, match="replay schedule state: expected entries"):
        ReplaySchedule.from_state_dict({k: v for k, v in state.items() if k != "seen"})
    with pytest.raises(ValueError, match="`seen` must be a non-negative int"):
        ReplaySchedule.from_state_dict({**state, "seen": -4})
