"""Preprocessing a corpus once, on the cluster, into parquet files a Stream reads.

``prepare(source, output, transform=..., pack=...)`` reads every row of ``source`` in
order through Ray Data, runs ``transform`` (e.g. tokenization) in parallel on the
cluster's CPUs (a short list of rows, already in this process, is transformed here:
Ray Data's start costs more than the work), optionally packs the results into rows of
a fixed number of tokens (``packing.pack``), and writes parquet files with small row
groups (fine-grained pieces for a Stream's shuffle). Transforms that change the number
of rows (filtering, packing, chunking) belong here rather than in a Stream: a Stream
must know every piece's rows before reading it.

The driver only writes: rows arrive in order, in Ray Data's blocks, and leave in row
groups, so its memory holds a few blocks and one row group, whatever the corpus size.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from redray.data.packing import pack as pack_rows

# A list of at most this many rows is transformed in this process by default. Through
# Ray Data, the demo's 79 documents took 14.3 s to tokenize and pack on 2 cores (a
# Ray Data run per split, worker processes that load the tokenizer), here about 2 s.
LOCAL_ROWS = 10_000


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What ``prepare`` wrote: the files, their rows, and (when packing) how full the
    rows are."""
    files: list[str]
    rows: int
    documents: int
    packing_efficiency: float | None


def prepare(source: Any, output: str, *, transform: Callable | None = None,
            pack: int | None = None, key: str = "ids", split: bool | None = None,
            rows_per_file: int = 100_000, row_group_rows: int = 1024,
            parallel: bool | None = None) -> Prepared:
    """Writes ``source``, transformed (and packed), as parquet files in ``output``.

    Args:
      source: parquet/JSON-lines paths, globs or URIs (read as a ``Corpus``), or a list
        of dicts.
      output: the folder to write ``part-00000.parquet``... into (created; it must not
        already hold parquet files, which a Stream of it would also read).
      transform: ``fn(row) -> row`` run on every row; it may return None to drop the
        row, or a list of rows (a conversation's row per assistant turn,
        ``redray.data.chat.transform(..., turns="each")``).
      pack: a row length in tokens: the rows' ``key`` sequences are packed into rows of
        that many tokens with ``segment_ids`` (``redray.data.pack``; ``split`` as there),
        and with them every per-token column: a column of the first row that holds a
        sequence as long as its ``key`` (a chat row's ``loss_mask``), each in a column
        of the packed rows, 0 in padding. The packed rows name the token ids ``key``.
      rows_per_file, row_group_rows: the output's layout.
      parallel: True reads and transforms through Ray Data, on the cluster's CPUs;
        False in this process (a list of dicts only: files are read through Ray Data).
        The default: in this process for a list of at most ``LOCAL_ROWS`` rows,
        through Ray Data otherwise. The output is the same either way.

    Returns:
      A ``Prepared``: read it with ``redray.Stream(output)``.
    """
    os.makedirs(output, exist_ok=True)
    if any(name.endswith(".parquet") for name in os.listdir(output)):
        raise FileExistsError(f"{output} already holds parquet files: give an empty folder "
                              "(a Stream of it would read the old files too)")
    source_rows = _source_rows(source, transform, parallel)
    documents = 0

    def rows():
        nonlocal documents
        for row in source_rows:
            documents += 1
            yield dict(row.items()) if hasattr(row, "items") else dict(row)

    produced = rows() if pack is None else _packed(rows(), pack, split, key)
    files, total, real = _write_parts(produced, output, rows_per_file, row_group_rows,
                                      pack is not None)
    if not total:
        raise ValueError("prepare wrote no rows: the source is empty or the transform "
                         "dropped every row")
    return Prepared(files, total, documents, real / (total * pack) if pack else None)


def _source_rows(source: Any, transform: Callable | None, parallel: bool | None):
    """The transformed rows of ``source``: in this process, or through Ray Data
    (``prepare``'s ``parallel``)."""
    listed = _is_row_list(source)
    if parallel is False and not listed:
        raise ValueError("prepare(parallel=False) transforms a list of dicts in this "
                         f"process; {type(source).__name__} sources are read through Ray "
                         "Data: leave parallel unset")
    if parallel is False or (parallel is None and listed and len(source) <= LOCAL_ROWS):
        return _here(source, transform)
    dataset = _dataset(source)
    if transform is not None:
        dataset = dataset.flat_map(lambda row: _as_rows(transform(row)))
    return dataset.iter_rows()


def _packed(rows, pack: int, split: bool | None, key: str):
    """``rows``' ``key`` sequences packed into rows of ``pack`` tokens, with every
    per-token column of the first row beside them (``prepare``'s ``pack``)."""
    columns = None

    def tokens():
        nonlocal columns
        for row in rows:
            if key not in row:
                raise KeyError(f"packing reads the token ids under {key!r}, but the "
                               f"rows hold {sorted(row)}: give key=... or return it "
                               "from the transform")
            if columns is None:  # the per-token columns, as the first row has them
                columns = [c for c, v in row.items() if c != key and _per_token(v, row[key])]
            yield {key: row[key], **{c: row.get(c, ()) for c in columns}}
    return ({key: r["ids"], **{c: v for c, v in r.items() if c != "ids"}}
            for r in pack_rows(tokens(), pack, split=split, key=key))


def _write_parts(rows, output: str, rows_per_file: int, row_group_rows: int,
                 packed: bool) -> tuple[list[str], int, int]:
    """Writes ``rows`` as ``part-00000.parquet``... in ``output``: (the files, the rows
    written, and of a ``packed`` run's tokens those that are not padding)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files, total, real, writer, in_file, group = [], 0, 0, None, 0, []

    def flush():
        nonlocal writer, in_file
        if not group:
            return
        table = pa.Table.from_pylist(group)
        if writer is None:
            files.append(os.path.join(output, f"part-{len(files):05d}.parquet"))
            writer = pq.ParquetWriter(files[-1], table.schema)
        writer.write_table(table, row_group_size=row_group_rows)
        in_file += len(group)
        group.clear()
        if in_file >= rows_per_file:
            writer.close()
            writer, in_file = None, 0

    for row in rows:
        group.append({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items()})
        total += 1
        if packed:
            real += int(sum(1 for s in row["segment_ids"] if s))
        if len(group) == row_group_rows or in_file + len(group) >= rows_per_file:
            flush()
    flush()
    if writer is not None:
        writer.close()
    return files, total, real


def _is_row_list(source) -> bool:
    """Whether ``source`` is a list (or tuple) of row dicts, not paths."""
    return isinstance(source, (list, tuple)) and bool(source) and isinstance(source[0], dict)


def _here(source: list, transform: Callable | None):
    """The rows of a list, transformed in this process (the dropped ones left out)."""
    for row in source:
        if transform is None:
            yield row
        else:
            yield from _as_rows(transform(dict(row)))


def _as_rows(out) -> list:
    """What a transform returned, as a list of rows: None none, a list its rows."""
    if out is None:
        return []
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _per_token(value, ids) -> bool:
    """Whether a row's ``value`` is a per-token column beside its token ``ids``."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") \
            or len(value) != len(ids):
        return False
    return len(value) == 0 or isinstance(value[0], (int, bool)) or hasattr(value[0], "dtype")


def _dataset(source):
    """Every row of ``source`` in order, as a Ray Dataset."""
    import ray.data

    from redray.data.corpus import Corpus
    from redray.processes.ray_local import ensure_ray
    from redray.data.stream import Segment, ordered, read_segments

    ensure_ray()
    if _is_row_list(source):
        return ordered(ray.data.from_items(list(source)))
    corpus = Corpus(source)
    return read_segments(corpus, [Segment(i, 0, p.rows) for i, p in enumerate(corpus.pieces)])
