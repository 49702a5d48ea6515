"""Every supported data source becomes a Ray Dataset; hosts read rows from its blocks.

Sources: a list of dicts, a Hugging Face ``datasets.Dataset``, a parquet / json /
jsonl path or glob (or a list of them), or a ``ray.data.Dataset``. The driver
materializes the dataset once into Ray's object store; each host then reads the rows
of its share of every batch (``RowSource.take_rows``), fetching whole blocks on first
use. Which rows make which batch is decided by the engine from (seed, epoch), so all
hosts agree without talking, every host gets the same number of batches, and a
resumed run can start at any step.
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Any, Sequence

_READERS = {".parquet": "read_parquet", ".json": "read_json", ".jsonl": "read_json"}


def to_dataset(source: Any):
    """A ``ray.data.Dataset`` for any supported source.

    Raises:
      TypeError / FileNotFoundError / ValueError: naming the source and what is accepted.
    """
    import ray.data

    if isinstance(source, ray.data.Dataset):
        return source
    path = (str, os.PathLike)
    if isinstance(source, path) or (
            isinstance(source, (list, tuple)) and source and isinstance(source[0], path)):
        return _read_files([os.fspath(s) for s in ([source] if isinstance(source, path)
                                                   else source)])
    try:
        import datasets as hf_datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        hf_datasets = None
    if hf_datasets is not None and isinstance(source, hf_datasets.Dataset):
        return ray.data.from_huggingface(source)
    if hf_datasets is not None and isinstance(source, hf_datasets.DatasetDict):
        raise TypeError(f"got a datasets.DatasetDict with splits {list(source)}: pass one split, "
                        "e.g. data['train']")
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("the data list is empty")
        if not all(isinstance(row, dict) for row in source[:100]):
            raise TypeError("a data list must hold dicts (one per example), e.g. "
                            "[{'text': ...}, ...]; got " + type(source[0]).__name__)
        return ray.data.from_items(list(source))
    raise TypeError(f"unsupported data source {type(source).__name__}: use a list of dicts, a "
                    "datasets.Dataset, a parquet/json/jsonl path or glob, or a ray.data.Dataset")


def _read_files(patterns: list[str]):
    import ray.data

    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if os.path.isdir(pattern):
            matched = sorted(f for ext in _READERS
                             for f in glob.glob(os.path.join(pattern, f"*{ext}")))
        if not matched or not all(os.path.exists(f) for f in matched):
            raise FileNotFoundError(f"no data file matches {pattern!r}")
        files += matched
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    unknown = kinds - set(_READERS)
    if unknown:
        raise ValueError(f"cannot read {sorted(unknown)} files: use .parquet, .json or .jsonl")
    readers = {_READERS[k] for k in kinds}
    if len(readers) > 1:
        raise ValueError("mixing parquet and json files in one source is not supported")
    reader = getattr(ray.data, readers.pop())

    def read(path):
        if reader is ray.data.read_json and (path.endswith(".jsonl") or _is_json_lines(path)):
            return reader(path, lines=True)
        return reader(path)

    # One read per file, joined in sorted order: a multi-file read may list them in any
    # order, and row positions must mean the same rows in every run.
    parts = [read(f) for f in files]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _is_json_lines(path: str) -> bool:
    with open(path) as f:
        first = f.read(1)
        f.seek(0)
        return first == "{" and len(f.readline().strip()) < os.path.getsize(path)


class RowSource:
    """Random access to the rows of a materialized Ray Dataset, from any host.

    Picklable (it holds object references to the blocks), so the driver materializes
    once and every worker reads from the same blocks. ``take_rows`` returns dicts in
    the order asked; a block is fetched on first use and kept.
    """

    def __init__(self, dataset):
        # Row positions must mean the same rows in every run (the order is built on
        # them), so execution keeps the source's order. A dataset carries its own copy
        # of the context from when it was made: set it there.
        dataset.context.execution_options.preserve_order = True
        materialized = dataset.materialize()
        bundles = list(materialized.iter_internal_ref_bundles())
        self._refs, self._starts = [], []
        count = 0
        for bundle in bundles:
            for ref, meta in zip(bundle.block_refs, bundle.metadata):
                if meta.num_rows:
                    self._refs.append(ref)
                    self._starts.append(count)
                    count += meta.num_rows
        self._len = count
        self._keep = materialized  # keeps the blocks alive as long as this source
        self._cache: dict[int, list] = {}

    def __len__(self) -> int:
        return self._len

    def __getstate__(self):
        return {"refs": self._refs, "starts": self._starts, "len": self._len,
                "keep": self._keep}

    def __setstate__(self, state):
        self._refs, self._starts, self._len = state["refs"], state["starts"], state["len"]
        self._keep, self._cache = state["keep"], {}

    def _block(self, b: int) -> list:
        if b not in self._cache:
            import ray
            from ray.data.block import BlockAccessor

            block = ray.get(self._refs[b])
            self._cache[b] = list(BlockAccessor.for_block(block).iter_rows(public_row_format=True))
        return self._cache[b]

    def take_rows(self, indices: Sequence[int]) -> list[dict]:
        """The examples at ``indices`` (global row numbers), in that order."""
        out = []
        for i in indices:
            i = int(i)
            if not 0 <= i < self._len:
                raise IndexError(f"row {i} out of range for {self._len} rows")
            b = bisect.bisect_right(self._starts, i) - 1
            out.append(_plain(self._block(b)[i - self._starts[b]]))
        return out

    def __getitem__(self, i: int) -> dict:
        return self.take_rows([i])[0]


def _plain(row) -> dict:
    """A row as a plain dict (Ray may hand out read-only mapping views)."""
    return dict(row.items()) if hasattr(row, "items") else dict(row)
