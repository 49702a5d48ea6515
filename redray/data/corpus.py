"""A corpus of parquet or JSON-lines files, cut into pieces whose row counts are known
before a row is read.

A piece is one parquet row group (its row count is in the file's footer) or one byte
range of a JSON-lines file (about ``JSONL_PIECE_BYTES``, ending at a line end; its rows
are counted once, when the corpus is opened, by reading the file's line ends). Knowing
every piece's rows is what lets every host agree on the number of batches and lets a
resumed run seek straight to the piece that holds its next row.

Paths are local paths, globs, folders, or URIs any ``pyarrow.fs`` filesystem reaches
(``s3://``, ``gs://``, ``hdfs://``...). Nothing here imports Ray: the pieces are read
with pyarrow, inside Ray Data's read tasks (``redray/data/stream.py``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import io
import os
import posixpath
from typing import Sequence

import pyarrow as pa

JSONL_PIECE_BYTES = 32 << 20
_KINDS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclasses.dataclass(frozen=True)
class Piece:
    """A part of one file with a known row count.

    Attributes:
      path: the file, as its filesystem names it.
      kind: "parquet" or "jsonl".
      index: the parquet row group (parquet), else the piece's number in its file.
      start, stop: the byte range (jsonl; 0, 0 for parquet).
      rows: the rows it holds.
    """
    path: str
    kind: str
    index: int
    start: int
    stop: int
    rows: int


class Corpus:
    """The files of ``paths`` and their pieces (see the module docstring).

    Args:
      paths: a path, glob, folder or URI, or a list of them; files are taken in sorted
        order per entry, so a piece's position means the same rows in every run.
      filesystem: a ``pyarrow.fs.FileSystem`` for all paths (default: from each URI,
        the local one for plain paths).

    Raises:
      FileNotFoundError / ValueError: naming the path and what is accepted.
    """

    def __init__(self, paths: str | os.PathLike | Sequence, filesystem=None):
        entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not entries:
            raise ValueError("no data path given")
        self.filesystem = filesystem
        self.files: list[tuple[str, str]] = []  # (kind, path)
        for entry in entries:
            self.files += [(_kind(p), p) for p in self._expand(os.fspath(entry))]
        kinds = {k for k, _ in self.files}
        if len(kinds) > 1:
            raise ValueError("mixing parquet and JSON-lines files in one source is not "
                             "supported: give one kind per source")
        self.kind = kinds.pop()
        self.pieces: list[Piece] = []
        for kind, path in self.files:
            with self.open(path) as f:
                self.pieces += _parquet_pieces(f, path) if kind == "parquet" \
                    else _jsonl_pieces(f, path)
        self.rows = sum(p.rows for p in self.pieces)
        if not self.rows:
            raise ValueError(f"{entries[0]!r}{' ...' if len(entries) > 1 else ''} holds no rows")

    def open(self, path: str):
        """``path`` opened for random access."""
        return _open(path, self.filesystem)

    def _expand(self, entry: str) -> list[str]:
        fs, path = (self.filesystem, entry) if self.filesystem else _filesystem(entry)
        from pyarrow import fs as pafs

        def prefixed(p: str) -> str:  # keep the URI scheme: each file is opened by it
            return entry[:len(entry) - len(path)] + p if "://" in entry else p

        if any(c in path for c in "*?["):
            base = posixpath.dirname(path.split("*")[0].split("?")[0].split("[")[0])
            infos = fs.get_file_info(pafs.FileSelector(base or ".", recursive="**" in path))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File
                           and fnmatch.fnmatch(i.path, path))
        else:
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
                found = sorted(i.path for i in infos if i.type == pafs.FileType.File
                               and os.path.splitext(i.path)[1].lower() in _KINDS)
            elif info.type == pafs.FileType.File:
                found = [path]
            else:
                found = []
        if not found:
            raise FileNotFoundError(f"no data file matches {entry!r}")
        for p in found:
            _kind(p)
        return [prefixed(p) for p in found]

    def read(self, piece: Piece, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``[start, stop)`` of ``piece`` as a table."""
        return read_piece(piece, start, stop, self.filesystem)


def read_piece(piece: Piece, start: int = 0, stop: int | None = None,
               filesystem=None) -> pa.Table:
    """Rows ``[start, stop)`` of ``piece`` as a table (``filesystem``: the corpus's, or
    None for the one of the piece's path)."""
    stop = piece.rows if stop is None else stop
    with _open(piece.path, filesystem) as f:
        if piece.kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.ParquetFile(f).read_row_group(piece.index)
        else:
            import pyarrow.json as pj

            f.seek(piece.start)
            data = f.read(piece.stop - piece.start)
            table = pj.read_json(io.BytesIO(data)) if data.strip() else pa.table({})
    if table.num_rows != piece.rows:
        raise ValueError(f"{piece.path} changed since it was opened: its piece {piece.index} "
                         f"holds {table.num_rows} rows, not {piece.rows}")
    return table.slice(start, stop - start)


def _open(path: str, filesystem=None):
    fs, inner = (filesystem, path) if filesystem is not None else _filesystem(path)
    return fs.open_input_file(inner)


def _kind(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in _KINDS:
        raise ValueError(f"cannot read {path!r}: use .parquet, .jsonl or .json (JSON lines) files")
    return _KINDS[ext]


def _filesystem(entry: str):
    """(filesystem, path inside it) of a local path or a URI."""
    from pyarrow import fs as pafs

    if "://" in entry:
        return pafs.FileSystem.from_uri(entry)
    return pafs.LocalFileSystem(), os.path.abspath(entry)


def _parquet_pieces(f, path: str) -> list[Piece]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(f).metadata
    return [Piece(path, "parquet", g, 0, 0, meta.row_group(g).num_rows)
            for g in range(meta.num_row_groups) if meta.row_group(g).num_rows]


def _jsonl_pieces(f, path: str) -> list[Piece]:
    """Byte ranges of about ``JSONL_PIECE_BYTES`` ending at line ends, with their rows
    (non-empty lines), from one pass over the file."""
    pieces, start, rows, offset, pending = [], 0, 0, 0, b""
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            offset += len(line) + 1
            rows += bool(line.strip())
            if offset - start >= JSONL_PIECE_BYTES and rows:
                pieces.append(Piece(path, "jsonl", len(pieces), start, offset, rows))
                start, rows = offset, 0
    if pending.strip():
        rows += 1
    offset += len(pending)
    if rows:
        pieces.append(Piece(path, "jsonl", len(pieces), start, offset, rows))
    return pieces
