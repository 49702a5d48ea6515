"""Examples streamed from files through Ray Data, in an order that is a pure function of
(seed, epoch), with a resume that seeks instead of re-reading.

``redray.data.stream(paths, transform=...)`` is a training, evaluation or prediction
source like a list, except that nothing is materialized: each host reads only the
pieces (parquet row groups, JSON-lines byte ranges; ``corpus.py``) its rows come from,
as they are needed, through a Ray Dataset that runs the user's ``transform`` (e.g.
tokenization) in parallel on the cluster, and keeps at most a shuffle window of rows
per stream in memory.

The order of an epoch (``epoch_segments``):

1. The pieces are permuted by ``(seed, epoch)`` and their rows laid end to end.
2. That sequence is cut into ``streams`` equal parts (the rows that do not divide are
   left out of this epoch: a different few each epoch); stream ``s`` holds part ``s``.
3. Each stream is cut into windows of ``shuffle_buffer`` rows; the rows of window ``w``
   are permuted by ``(seed, epoch, s, w)``.
4. Global batch ``i`` is, for each stream in turn, its rows ``[i*b, (i+1)*b)`` with
   ``b = batch_size / streams``.

A process reads the streams its devices' rows of the batch come from (one stream per
host when ``streams`` equals the number of hosts: the default). Every host computes
the same segments, so all agree on the number of batches without talking. Resuming at
batch ``i`` opens each stream at row ``i*b``: the window holding it is read (from the
pieces that hold it, found by the row counts) and its first ``i*b mod
shuffle_buffer`` rows skipped; nothing before that window is read again.

Shuffle quality: rows move across the whole corpus with their piece (step 1) and
within a window of ``shuffle_buffer`` rows (step 3). Rows of one piece stay within
about ``piece rows + shuffle_buffer`` of each other in the order: write files whose
row groups are small against the buffer (``pyarrow.parquet.write_table(...,
row_group_size=...)``) for a finer mix.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from redray.data.corpus import Corpus, read_piece

DEFAULT_SHUFFLE_BUFFER = 10_000


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of piece ``piece``."""
    piece: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def epoch_segments(piece_rows: Sequence[int], seed: int, epoch: int, shuffle: bool,
         streams: int) -> list[list[Segment]]:
    """Each stream's segments for an epoch, in order (steps 1 and 2 of the module
    docstring); every stream holds ``sum(piece_rows) // streams`` rows."""
    order = np.random.default_rng([seed, epoch]).permutation(len(piece_rows)) if shuffle \
        else np.arange(len(piece_rows))
    per_stream = sum(piece_rows) // streams
    out: list[list[Segment]] = [[] for _ in range(streams)]
    s, filled = 0, 0
    for p in order:
        start, rows = 0, int(piece_rows[p])
        while rows and s < streams:
            take = min(rows, per_stream - filled)
            out[s].append(Segment(int(p), start, start + take))
            start, rows, filled = start + take, rows - take, filled + take
            if filled == per_stream:
                s, filled = s + 1, 0
    return out


def window_order(n: int, seed: int, epoch: int, stream: int, window: int,
                 shuffle: bool) -> np.ndarray:
    """The order of a window's ``n`` rows (step 3)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, stream, window, 1]).permutation(n)


def segments_from(segments: list[Segment], row: int) -> list[Segment]:
    """The segments covering a stream from its row ``row`` on."""
    out, seen = [], 0
    for seg in segments:
        if seen + seg.rows > row:
            skip = max(0, row - seen)
            out.append(Segment(seg.piece, seg.start + skip, seg.stop))
        seen += seg.rows
    return out


class Stream:
    """Files read as a stream (see the module docstring).

    Args:
      paths: a parquet or JSON-lines path, glob, folder or URI (``s3://``, ``gs://``: any
        filesystem pyarrow reaches), or a list of them.
      transform: ``fn(row) -> row`` run on every row through Ray Data (in parallel on
        the cluster) before ``collate``, e.g. tokenization; one row out per row in.
      batch_transform: ``fn(batch) -> batch`` on dicts of numpy arrays, the same but
        per batch of rows (``ray.data.Dataset.map_batches``); it must keep the number of
        rows (to change it, filter or pack, write new files with ``redray.data.prepare``).
      shuffle_buffer: rows per shuffle window, per stream: the bound on rows held in
        memory per stream read (with the pieces being read: a parquet row group is
        read whole).
      streams: parallel streams an epoch is cut into; default: the number of hosts of
        the run's first session (kept in its checkpoints). Batches must divide by it.
      filesystem: a ``pyarrow.fs.FileSystem`` for every path (default: from each URI).
      read_ahead: how many pieces Ray Data may read ahead of the window being used.
    """

    def __init__(self, paths, *, transform: Callable | None = None,
                 batch_transform: Callable | None = None,
                 shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER, streams: int | None = None,
                 filesystem=None, read_ahead: int = 2):
        if transform is not None and batch_transform is not None:
            raise ValueError("give transform (per row) or batch_transform (per batch), not both")
        for name, fn in (("transform", transform), ("batch_transform", batch_transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        if not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer={shuffle_buffer!r}: give a number of rows >= 1")
        if streams is not None and (not isinstance(streams, int) or streams < 1):
            raise ValueError(f"streams={streams!r}: give a number >= 1, or None for the "
                             "number of hosts")
        self.corpus = Corpus(paths, filesystem)
        self.transform, self.batch_transform = transform, batch_transform
        self.shuffle_buffer, self.streams, self.read_ahead = shuffle_buffer, streams, read_ahead

    def __len__(self) -> int:
        return self.corpus.rows

    def __repr__(self) -> str:
        return (f"Stream({len(self.corpus.files)} {self.corpus.kind} file(s), "
                f"{len(self.corpus.pieces)} pieces, {self.corpus.rows} rows)")

    # ---------------------------------------------------------------- the engine's side
    def settings(self, streams: int) -> dict:
        """What decides the batches besides seed and batch size (kept in checkpoints)."""
        fn = self.transform or self.batch_transform
        return {"files": [os.path.basename(p) for _, p in self.corpus.files[:3]],
                "file_count": len(self.corpus.files), "pieces": len(self.corpus.pieces),
                "transform": None if fn is None else _name(fn),
                "shuffle_buffer": self.shuffle_buffer, "streams": streams}

    def resolve_streams(self, saved: int | None, groups: int, batch_size: int) -> int:
        """The run's stream count: the checkpoint's, else the one given, else ``groups``
        (the run's hosts feeding distinct rows)."""
        streams = saved or self.streams or groups
        if batch_size % streams:
            raise ValueError(f"batch_size={batch_size} does not divide into {streams} streams: "
                             "give Stream(streams=...) a divisor of the batch size")
        return streams

    def steps_per_epoch(self, batch_size: int, streams: int) -> int:
        return (self.corpus.rows // streams) // (batch_size // streams)

    def epoch_batches(self, epoch: int, seed: int, shuffle: bool, batch_size: int,
                      rows: slice, start: int, stop: int, streams: int) -> Iterator[list]:
        """This process's rows (``rows`` of each global batch) of batches
        ``start..stop-1`` of ``epoch``."""
        per = batch_size // streams
        segments = epoch_segments([p.rows for p in self.corpus.pieces], seed, epoch, shuffle,
                                  streams)
        needed = range(rows.start // per, (rows.stop - 1) // per + 1)
        readers = {s: self._rows(segments[s], s, seed, epoch, shuffle, start * per)
                   for s in needed}
        for _ in range(start, stop):
            batch = []
            for s in needed:
                chunk = [next(readers[s]) for _ in range(per)]
                lo, hi = max(rows.start - s * per, 0), min(rows.stop - s * per, per)
                batch += chunk[lo:hi]
            yield batch

    def in_order(self, size: int) -> Iterator[list]:
        """Every row once, in file order, in lists of ``size`` (the last may be short)."""
        segments = [Segment(i, 0, p.rows) for i, p in enumerate(self.corpus.pieces)]
        chunk = []
        for row in self._read(segments):
            chunk.append(row)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    # ---------------------------------------------------------------- reading
    def _rows(self, segments: list[Segment], stream: int, seed: int, epoch: int,
              shuffle: bool, first: int) -> Iterator[dict]:
        """A stream's rows from its row ``first`` on, window-shuffled (step 3)."""
        total = sum(seg.rows for seg in segments)
        w = first // self.shuffle_buffer
        source = self._read(segments_from(segments, w * self.shuffle_buffer))
        skip = first - w * self.shuffle_buffer
        while w * self.shuffle_buffer < total:
            n = min(self.shuffle_buffer, total - w * self.shuffle_buffer)
            window = [next(source) for _ in range(n)]
            for j in window_order(n, seed, epoch, stream, w, shuffle)[skip:]:
                yield window[j]
            w, skip = w + 1, 0

    def _read(self, segments: list[Segment]) -> Iterator[dict]:
        """The rows of ``segments`` in order, through Ray Data (transform applied)."""
        expected = sum(seg.rows for seg in segments)
        if not expected:
            return
        dataset = read_segments(self.corpus, segments)
        if self.transform is not None:
            dataset = dataset.map(self.transform)
        elif self.batch_transform is not None:
            dataset = dataset.map_batches(self.batch_transform, batch_format="numpy")
        seen = 0
        # Whole blocks as numpy columns, rows as views into them: a row dict per row
        # from Ray's row iterator costs more than the step it feeds on a small model.
        for block in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            columns = list(block.items())
            n = len(columns[0][1]) if columns else 0
            for i in range(min(n, expected - seen)):
                yield {k: v[i] for k, v in columns}
            seen += n
            if seen > expected:
                break
        if seen != expected:
            fn = self.batch_transform or self.transform
            raise ValueError(
                f"{_name(fn) if fn else 'reading'} gave {seen} rows for {expected} read "
                "from the files: a stream's transform must keep one row per row (to filter "
                "or pack rows, write new files once with redray.data.prepare)")


def read_segments(corpus: Corpus, segments: list[Segment]):
    """A Ray Dataset of the rows of ``segments``, in order (one read task each)."""
    import ray.data

    from redray.processes.ray_local import ensure_ray

    ensure_ray()
    return ordered(ray.data.read_datasource(_datasource(corpus, segments),
                                            override_num_blocks=len(segments)))


def ordered(dataset):
    """``dataset`` set to yield its rows in order, quietly (a pass per epoch and stream
    would otherwise print Ray Data's progress and plans)."""
    context = dataset.context
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return dataset


def _datasource(corpus: Corpus, segments: list[Segment]):
    """A Ray Data datasource reading ``segments`` in order, one read task each. A task
    carries its piece and the filesystem, not the corpus (which may list many pieces)."""
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    filesystem = corpus.filesystem

    class Segments(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            tasks = []
            for seg in segments:
                piece = corpus.pieces[seg.piece]
                meta = BlockMetadata(num_rows=seg.rows, size_bytes=None, exec_stats=None,
                                     input_files=(piece.path,))
                tasks.append(ReadTask(
                    lambda piece=piece, seg=seg: [read_piece(piece, seg.start, seg.stop,
                                                             filesystem)], meta))
            return tasks

    return Segments()


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
