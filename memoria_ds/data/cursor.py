"""EpochCursor: the (epoch, step) position of a segment iterator, shared by the stream kinds."""

from __future__ import annotations

from collections.abc import Iterator

from memoria_ds.data.batch import StreamBatch


class EpochCursor:
    """Iterates `batch_at(epoch, step)` from a stored position, epoch after epoch.

    Iterating yields the remaining batches of the current epoch and then moves to the next
    epoch. A position at the end of an epoch is read as the start of the next one.
    Subclasses set `self._epoch, self._step = 0, 0` and define `steps_per_epoch` and
    `batch_at`.
    """

    _epoch: int
    _step: int

    @property
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    def batch_at(self, epoch: int, step: int) -> StreamBatch:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[StreamBatch]:
        self._normalise()
        while self._step < self.steps_per_epoch:
            batch = self.batch_at(self._epoch, self._step)
            self._step += 1
            yield batch
        self._normalise()

    @property
    def epoch(self) -> int:
        self._normalise()
        return self._epoch

    @property
    def step(self) -> int:
        """The step the next batch will have."""
        self._normalise()
        return self._step

    def _normalise(self) -> None:
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0

    def set_position(self, epoch: int, step: int) -> None:
        """Jump to (epoch, step): the next batch yielded is that one."""
        if epoch < 0 or not 0 <= step <= self.steps_per_epoch:
            raise ValueError(f"no position (epoch {epoch}, step {step}) in {self.steps_per_epoch} steps/epoch")
        self._epoch, self._step = epoch, step
        self._normalise()
