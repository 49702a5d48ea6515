"""A Trainer's checkpoints: where they go, the one its run resumed from, the newest one
restored onto the plan's shardings (at ``init``, and when a non-finite step rolls back),
and what a save keeps beside the state.

The writer and reader of the files is ``redray.checkpoint.Checkpointer``; this is the
Trainer's side of it, so the Trainer keeps one value for everything checkpointed.
"""

from __future__ import annotations

import time
from types import MappingProxyType

from redray.checkpoint import CheckpointConfig, Checkpointer, CheckpointMismatch
from redray.engine.state import CHECKPOINT_ITEMS

# What a Trainer's checkpoint meta holds beyond the step (and reads back on resume): the
# position in the data. A meta without them is an unreadable checkpoint.
POSITION_META = {"epoch": int, "batch": int, "epoch_done": bool}


class RunCheckpoints:
    """The checkpoints of one Trainer's run: ``config`` (None: none saved), the writer
    once ``open`` (``writer``) and the meta of the checkpoint the run resumed from
    (``resumed_from``, None for a fresh run)."""

    def __init__(self, config: CheckpointConfig | None, trainable: str | None):
        self.config = config
        self.trainable = trainable
        self.writer: Checkpointer | None = None
        self.resumed_from: dict | None = None

    def open(self, targets) -> dict | None:
        """Starts the writer and, when the config resumes, restores the newest complete
        checkpoint onto ``targets`` (the plan's shardings). Returns its items (its meta
        is then ``resumed_from``), or None: the run starts fresh."""
        if self.config is None:
            return None
        self.writer = Checkpointer(self.config, CHECKPOINT_ITEMS)
        found = self.restore_newest(targets) if self.config.resume else None
        if found is None:
            return None
        items, self.resumed_from = found
        return items

    def restore_newest(self, targets):
        """(items, meta) of the newest complete checkpoint (a save in flight waited for),
        restored onto ``targets``, or None (none, or no checkpoints at all). A checkpoint
        of other trainable parameters is refused."""
        if self.writer is None:
            return None
        self.writer.wait()
        return self.writer.restore_latest(targets, check=self._check_trainable,
                                          required=POSITION_META)

    def _check_trainable(self, meta: dict) -> None:
        if meta.get("trainable") != self.trainable:
            raise CheckpointMismatch(
                f"the checkpoint in {self.writer.directory} trained "
                f"trainable={meta.get('trainable')!r}, this run trains "
                f"trainable={self.trainable!r}: its saved parameters do not fit. Use the same "
                "trainable, or start a new run (another name or directory, or resume=False)")

    def resumed(self):
        """The resumed checkpoint's meta, read-only (None for a fresh run)."""
        return None if self.resumed_from is None else MappingProxyType(self.resumed_from)

    def resumed_path(self) -> str:
        return self.writer.step_path(self.resumed_from["step"])

    @property
    def directory(self) -> str | None:
        return None if self.writer is None else self.writer.directory

    @property
    def saving(self) -> int | None:
        """The step whose checkpoint is being written, if one is."""
        return None if self.writer is None else self.writer.saving

    def wait(self) -> None:
        """Returns once every checkpoint started has been written."""
        if self.writer is not None:
            self.writer.wait()

    def newest(self) -> str | None:
        """The newest complete checkpoint's path (a save in flight waited for), this
        run's or the one it resumed from; None if there is none."""
        if self.writer is None:
            return None
        self.writer.wait()
        saved = self.writer.last_saved
        if saved is None and self.resumed_from is not None:
            saved = self.resumed_path()
        return saved

    def save(self, items: dict, step: int, position, fields: dict, on_commit,
             stacked: dict | None = None) -> None:
        """Starts saving ``items`` of ``step`` at ``position`` (a ``hooks.Position``), its
        meta ``fields`` beside the step, the position, the trainable parameters' regex
        (which a resume checks) and the time; ``on_commit(step, path, meta)`` once
        complete. ``stacked``: the arrays that stack layers, stored a layer a chunk."""
        meta = {"step": step, "epoch": position.epoch, "batch": position.batch,
                "epoch_done": position.epoch_done, **fields, "trainable": self.trainable,
                "time": time.time()}
        self.writer.save(items, meta, on_commit=on_commit, stacked=stacked)

    def kept_run(self) -> dict:
        """What the resumed checkpoint kept of the run (its ``run`` meta), to update."""
        return dict((self.resumed_from or {}).get("run", {}))
