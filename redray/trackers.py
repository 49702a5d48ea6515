"""TensorBoard and Weights & Biases beside MLflow: the same rows, params and tags, each
tracker one ``redray.tracking.QueuedLogger`` (its own thread, retries and replay marks).

``tracking=("mlflow", "tensorboard", "wandb")`` on ``redray.fit``/``redray.run`` picks
them (``trackers``); the run's tracker actor (``redray.cluster.tracker``) holds one
logger per name and sends each what it gets.

- TensorBoard: event files in ``<run folder>/tensorboard`` (``tensorboard --logdir``
  on the run folder also shows its profiles). Metrics are scalars at their step; the
  params, the tags and the sharding plan are text summaries at step 0. A resumed run
  appends to the same folder; the steps already in its event files are its marks.
- Weights & Biases: ``wandb.init`` in the run folder, in the mode ``WANDB_MODE`` says
  (``offline`` works without a network: ``wandb sync`` uploads it later). Params and
  tags go to the run's config, the plan and artifacts to its files. W&B's steps only
  go forward: a row of an earlier step than the session's newest (the run's start-up
  phases, logged at its first step once it ends) updates the run's summary. The run's id is
  kept in every checkpoint, as MLflow's is, and a resumed run continues it; the steps
  already in its local ``.wandb`` files are its marks.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct
import time

from redray.tracking import QueuedLogger

TRACKERS = ("mlflow", "tensorboard", "wandb")


def trackers(tracking) -> tuple[str, ...]:
    """The trackers of ``tracking``: True (MLflow), False or None (none), a name, or
    names of ``TRACKERS``; anything else raises ``ValueError`` saying what to give."""
    if tracking is True:
        return ("mlflow",)
    if tracking is False or tracking is None:
        return ()
    names = (tracking,) if isinstance(tracking, str) else tracking
    try:
        names = tuple(dict.fromkeys(names))
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) and n in TRACKERS for n in names):
        raise ValueError(f"tracking={tracking!r}: give True (MLflow), False (none), or "
                         f"trackers among {', '.join(map(repr, TRACKERS))}, e.g. "
                         "tracking=('mlflow', 'tensorboard')")
    import importlib.util

    for name in names:  # checked where the run is set up, not when its tracker starts
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"tracking={tracking!r}: {name!r} is not installed here: "
                             f"pip install 'redray[{name}]'")
    return names


class TensorBoardLogger(QueuedLogger):
    """A run's TensorBoard event files in a folder, ``TensorBoardLogger(logdir)``
    (``QueuedLogger``)."""

    kind = "TensorBoard"

    def _open(self):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        os.makedirs(self.where, exist_ok=True)
        self._newest = logged_steps(self.where)
        self.run_id = self.where
        return EventFileWriter(self.where, max_queue_size=1000, flush_secs=5)

    def _write(self, writer, rows: list) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for step, stamp, values, _ in rows:
            if values:
                writer.add_event(Event(wall_time=stamp / 1000, step=step, summary=Summary(
                    value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])))
        writer.flush()

    def _apply(self, writer, item: tuple) -> None:
        kind = item[0]
        if kind in ("params", "tags"):
            table = "\n".join(f"| {k} | {v} |" for k, v in sorted(item[1].items()))
            writer.add_event(_text(f"redray/{kind}", f"| {kind[:-1]} | value |\n|---|---|\n"
                                   + table))
        elif kind == "text":
            writer.add_event(_text(f"redray/{item[2]}", f"```\n{item[1]}\n```"))
        elif kind == "end":
            writer.close()
        # artifacts: the files stay where they are (the run folder TensorBoard reads)


def _text(tag: str, markdown: str):
    """An event holding ``markdown`` as TensorBoard's text plugin reads it, at step 0."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_STRING

    tensor = TensorProto(dtype=DT_STRING, string_val=[markdown.encode()],
                         tensor_shape=TensorShapeProto())
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    return Event(wall_time=time.time(), step=0, summary=Summary(value=[
        Summary.Value(tag=tag, metadata=metadata, tensor=tensor)]))


def logged_steps(logdir: str) -> dict[str, int]:
    """The newest step of every scalar in the event files of ``logdir`` (a file cut short
    by a killed process: what it holds before the cut)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    newest: dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        try:
            for event in EventFileLoader(path).Load():
                for value in event.summary.value:  # the loader gives scalars as tensors
                    if (value.WhichOneof("value") == "simple_value"
                            or value.metadata.plugin_data.plugin_name == "scalars"):
                        newest[value.tag] = max(event.step, newest.get(value.tag, event.step))
        except Exception:  # noqa: BLE001 - a torn record ends what the file says
            continue
    return newest


class WandbLogger(QueuedLogger):
    """A run's Weights & Biases run (``QueuedLogger``), its local files in ``folder``.

    Args:
      folder: where ``wandb`` keeps the run's files (``<folder>/wandb``).
      project: the W&B project (redray's experiment).
      name: the run's display name (redray's run name).
      resume: continue the W&B run of ``run_id``, else the newest one in ``folder``.
      run_id: the run to continue (read from a checkpoint).
    """

    kind = "W&B"

    def __init__(self, folder: str, project: str, name: str, resume: bool = True,
                 run_id: str | None = None):
        self.folder, self.project, self.name = folder, project, name
        self.resume, self._wanted_run_id = resume, run_id
        super().__init__(os.path.join(folder, "wandb"))

    def _open(self):
        import wandb

        os.makedirs(self.folder, exist_ok=True)
        # None: a new run, its id W&B's
        run_id = self._wanted_run_id or (newest_run_id(self.where) if self.resume else None)
        run = wandb.init(project=self.project, name=self.name, id=run_id, resume="allow",
                         dir=self.folder, settings=wandb.Settings(console="off", silent=True))
        self.run_id = run.id
        self._newest = wandb_steps(self.where, run.id)
        self._step = 0  # the newest step this session logged
        return run

    def _write(self, run, rows: list) -> None:
        for step, _, values, _ in rows:
            if not values:
                continue
            if step < self._step:  # W&B's steps only go forward
                run.summary.update(values)
            else:
                run.log(values, step=step)
                self._step = step

    def _apply(self, run, item: tuple) -> None:
        kind = item[0]
        if kind in ("params", "tags"):
            run.config.update(item[1], allow_val_change=True)
        elif kind == "text":
            with open(os.path.join(run.dir, item[2]), "w") as f:
                f.write(item[1])
        elif kind == "artifacts":
            shutil.copytree(item[1], os.path.join(run.dir, item[2]), dirs_exist_ok=True)
        elif kind == "end":
            run.finish(exit_code=0 if item[1] == "FINISHED" else 1)


def newest_run_id(wandb_dir: str) -> str | None:
    """The id of the newest run whose files are in ``wandb_dir`` (``run-<time>-<id>`` or
    ``offline-run-<time>-<id>``), or None."""
    runs = [os.path.basename(p).rsplit("-", 2) for p in glob.glob(os.path.join(
        wandb_dir, "*run-*-*")) if os.path.isdir(p)]
    runs = [(stamp, run_id) for _, stamp, run_id in runs if len(stamp) == 15]
    return max(runs)[1] if runs else None


# W&B's local run files (.wandb): a header, then records in 32 KiB blocks, each record
# (or its pieces) behind a header of a CRC, a length and a kind (LevelDB's log format).
_HEADER, _BLOCK, _PIECE = 7, 32768, struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str):
    """The records of a ``.wandb`` file, as W&B's ``Record`` protos (a file cut short by
    a killed process: the records before the cut)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    at, pieces = _HEADER, b""
    while at + _PIECE.size <= len(data):
        left = _BLOCK - at % _BLOCK
        if left < _PIECE.size:  # a block's tail too short for a header: padding
            at += left
            continue
        _, length, kind = _PIECE.unpack_from(data, at)
        start, at = at + _PIECE.size, at + _PIECE.size + length
        if kind == 0 or at > len(data):
            break
        pieces = data[start:at] if kind in (_FULL, _FIRST) else pieces + data[start:at]
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def wandb_steps(wandb_dir: str, run_id: str) -> dict[str, int]:
    """The newest step of every metric the run ``run_id`` logged into ``wandb_dir``, over
    all its sessions' files."""
    newest: dict[str, int] = {}
    for path in glob.glob(os.path.join(wandb_dir, f"*run-*-{run_id}", f"run-{run_id}.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    newest[key] = max(step, newest.get(key, step))
    return newest
