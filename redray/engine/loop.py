"""The training loop, the one place a training batch passes through, in order:

1. which examples (``TrainingData.batches``: an epoch's order, a pure function of
   (seed, epoch), or a stream's own batches; this process's rows of each);
2. collated by the user's function, its output checked (``collate_checked``);
3. placed as global arrays on the batch sharding (``to_global``), a few batches ahead
   in a background thread (``prefetch``);
4. the optimizer step on it;
5. the events ``Trainer.fit`` sends to its hooks (``training_steps`` yields them).

``TrainingData`` is what decides a run's batches, which a resume must match.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np
from jax.sharding import NamedSharding

from redray.checkpoint import CheckpointMismatch
from redray.engine.batches import (InFlight, collate_checked, is_stream, prefetch, read_rows,
                                   to_global)
from redray.engine.hooks import EpochEnd, Position, StepInfo
from redray.sharding import BatchGeometry


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """A training source as one run reads it: its order (seed, shuffle), its batch size
    and, for a stream, its count of parallel streams.

    Attributes:
      source: a list, a row source (``len`` + ``take_rows``) or a stream.
      seed, shuffle: each epoch's order is a pure function of (seed, epoch).
      batch_size: the global batch.
      streams: a stream's parallel streams (None for other sources).
    """
    source: Any
    seed: int
    shuffle: bool
    batch_size: int
    streams: int | None = None

    @classmethod
    def of(cls, source, seed: int, shuffle: bool, geometry: BatchGeometry,
           resumed: dict | None = None) -> "TrainingData":
        """A stream's count of parallel streams is the checkpoint's when resuming (so a
        resume on another number of hosts reads the same batches), else its own."""
        streams = None
        if is_stream(source):
            saved = ((resumed or {}).get("stream") or {}).get("streams")
            streams = source.resolve_streams(saved, geometry.groups, geometry.batch_size)
        return cls(source, seed, shuffle, geometry.batch_size, streams)

    def settings(self) -> dict:
        """What decides the batches: a run resumes only with the same (kept in meta)."""
        out = {"examples": len(self.source), "seed": self.seed, "batch_size": self.batch_size,
               "shuffle": self.shuffle}
        if self.streams is not None:
            out["stream"] = self.source.settings(self.streams)
        return out

    def check_resume(self, meta: dict | None, directory: str | None) -> None:
        """Refuses to resume a run on other data or another order: that would silently
        train on different batches than the run it continues."""
        if meta is None:
            return
        changed = [f"{k}: checkpoint {meta.get(k)!r}, now {v!r}"
                   for k, v in self.settings().items() if meta.get(k) != v]
        if changed:
            raise CheckpointMismatch(
                f"the checkpoint in {directory} was written by a run with "
                f"other data settings ({'; '.join(changed)}): resuming would train on "
                "different batches. Use the same settings, or start a new run (another "
                "name or directory, or resume=False)")

    def steps_per_epoch(self) -> int:
        """Full batches in one epoch (the last partial one is dropped); refuses a source
        without one."""
        if is_stream(self.source):
            per_epoch = self.source.steps_per_epoch(self.batch_size, self.streams)
        else:
            per_epoch = len(self.source) // self.batch_size
        if not per_epoch:
            raise ValueError(f"{self.source!r} gives no full batch of {self.batch_size} "
                             "examples per epoch: lower batch_size or add data")
        return per_epoch

    def batches(self, epoch: int, mine: slice, start: int, stop: int) -> Iterator[list]:
        """This process's examples (rows ``mine`` of each global batch) of batches
        ``start..stop-1`` of ``epoch``: a stream's own, or the rows
        ``order[i*B:(i+1)*B]`` of ``epoch_order`` read from a list or row source."""
        if is_stream(self.source):
            yield from self.source.epoch_batches(epoch, self.seed, self.shuffle,
                                                 self.batch_size, mine, start, stop,
                                                 self.streams)
            return
        order = epoch_order(len(self.source), self.seed, epoch, self.shuffle)
        size = self.batch_size
        for i in range(start, stop):
            yield read_rows(self.source, order[i * size:(i + 1) * size][mine])


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The example order of an epoch: a pure function of (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def training_steps(data: TrainingData, epochs: int, max_steps: int | None, *,
                   position: Position, done: int, geometry: BatchGeometry,
                   sharding: NamedSharding, collate: Callable, step: Callable,
                   depth: int, first_batch: Callable | None = None) -> Iterator:
    """Runs the steps the budget leaves, from ``position`` with ``done`` steps done;
    yields ``(epoch, first batch)`` as an epoch starts, a ``StepInfo`` after each step
    and an ``EpochEnd`` (with the position after it) after an epoch's last step.

    Args:
      data: the training data.
      epochs, max_steps: the run's budget (totals for the run).
      position, done: where the run stands.
      geometry: this process's rows of each batch.
      sharding: the batch's sharding.
      collate: the user's collate (checked).
      step: runs one optimizer step on a placed batch; returns its metrics.
      depth: batches collated and placed ahead, in a background thread.
      first_batch: called with the first collated batch (host-local numpy).
    """
    per_epoch = data.steps_per_epoch()
    first_epoch, first_index = position.resume_point()
    seen = first_batch is None

    def make(examples):
        nonlocal seen
        batch = collate_checked(collate, examples)
        if not seen:
            first_batch(batch)
            seen = True
        return to_global(batch, sharding, geometry.batch_size)

    for epoch in range(first_epoch, epochs):
        if max_steps is not None and done >= max_steps:
            return
        start = first_index if epoch == first_epoch else 0
        stop = per_epoch if max_steps is None else min(per_epoch, start + max_steps - done)
        yield epoch, start
        batches = data.batches(epoch, geometry.process_rows, start, stop)
        in_flight = InFlight()
        for i, placed in zip(range(start, stop), prefetch(batches, make, depth)):
            metrics = step(placed)
            in_flight.add(metrics)
            done += 1
            yield StepInfo(done, Position(epoch, i + 1, False), metrics, i == per_epoch - 1)
        complete = stop == per_epoch
        yield EpochEnd(epoch, done, complete,
                       Position(epoch, per_epoch, True) if complete else None)
        if not complete:  # max_steps ended the run inside this epoch
            return


def tokens_per_example(batch: dict) -> int:
    """Tokens in one example: the width of the batch's first 2-D integer array (e.g.
    ``input_ids``), or 0 when the batch has no tokens."""
    for key in sorted(batch):
        value = batch[key]
        if not hasattr(value, "shape"):  # a list: its array (an abstract one is read as is)
            value = np.asarray(value)
        if len(value.shape) == 2 and np.issubdtype(value.dtype, np.integer):
            return int(value.shape[1])
    return 0
