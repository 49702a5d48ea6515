"""Sequence packing: many documents per row of a fixed length, with segment ids.

A language model trained on rows of ``length`` tokens wastes the padding of every
short document. Packing lays documents end to end in rows; ``segment_ids`` (1, 2, ...
per document in a row, 0 for padding) let the models' attention stay inside a
document and restart its positions (``segment_ids=`` of redray's decoder models), and
``next_token_mask`` keeps the loss from predicting one document's first token from
the previous one's last.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np


def pack(documents: Iterable[Sequence[int] | Mapping[str, Sequence]], length: int, *,
         split: bool | None = None, pad_id: int = 0, key: str = "ids",
         open_rows: int = 64) -> Iterator[dict]:
    """Rows ``{"ids": int32[length], "segment_ids": int32[length]}`` of the documents'
    tokens.

    Args:
      documents: token id sequences, or dicts of per-token sequences: the token ids
        under ``key`` and any others of the same length beside them (a chat row's
        ``loss_mask``), each packed into a column of its own the same way (int32, 0 in
        padding), so a token keeps its mask wherever it lands.
      length: tokens per row.
      split: True: documents are laid end to end in order, and one longer than the
        room left in a row continues in the next (as a new segment there): rows are
        full but for the last (pretraining text). False: a document is never cut
        across rows unless it is longer than ``length`` (then it is cut into rows of
        ``length`` and its rest placed as a document): each goes whole into the open row
        with the least room that holds it (best fit), a new row where none does, up to
        ``open_rows`` rows open at once (the fullest is written out when one more is
        needed); rows come out as they fill, so not in the documents' order. None
        (default): False for documents with per-token columns (a conversation with its
        loss mask must keep its beginning: a cut one would learn its later turns
        without the turns before), True otherwise.
      pad_id: the token id of padding.
      key: the token ids' name in dict documents (and in the rows: ``"ids"`` is
        always the rows' name for them).
      open_rows: without ``split``, how many rows wait for documents at once.
    """
    if length < 2:
        raise ValueError(f"length={length}: rows need at least 2 tokens")
    if open_rows < 1:
        raise ValueError(f"open_rows={open_rows}: at least one row must be open")
    columns: tuple[str, ...] | None = None
    rows: list[list] = []  # [row, used, segments] of each open row, oldest first

    def opened():
        return _opened(length, pad_id, columns)

    for n, doc in enumerate(documents):
        ids, others = _document(doc, n, key)
        if columns is None:
            columns = tuple(others)
            if {"ids", "segment_ids"} & set(columns):
                raise ValueError(f"document {n}: a per-token column named {columns} would "
                                 "take the place of the rows' own ids or segment_ids")
            split = not columns if split is None else split
        _check_columns(n, ids, others, columns)
        at = 0
        while at < len(ids):
            left = len(ids) - at
            if split:
                entry = rows[0] if rows else opened()
                rows[:] = [entry]
            else:
                fits = [e for e in rows if length - e[1] >= min(left, length)]
                entry = min(fits, key=lambda e: length - e[1]) if fits else None
                if entry is None:
                    if len(rows) >= open_rows:
                        fullest = max(rows, key=lambda e: e[1])
                        rows[:] = [e for e in rows if e is not fullest]
                        yield fullest[0]
                    entry = opened()
                    rows.append(entry)
            take = min(length - entry[1], left)
            _put(entry, ids[at:at + take], {c: v[at:at + take] for c, v in others.items()},
                 columns)
            at += take
            if entry[1] == length:
                rows[:] = [e for e in rows if e is not entry]
                yield entry[0]
    for entry in rows:
        if entry[1]:
            yield entry[0]


def _opened(length: int, pad_id: int, columns: tuple[str, ...]) -> list:
    """A new open row of ``pack``: [its columns, tokens used, segments]."""
    row = {"ids": np.full(length, pad_id, np.int32), "segment_ids": np.zeros(length, np.int32)}
    row.update((c, np.zeros(length, np.int32)) for c in columns)
    return [row, 0, 0]


def _put(entry: list, ids, others: dict, columns: tuple[str, ...]) -> None:
    """A piece of a document (its ``ids`` and per-token ``others``) into an open row
    ``entry``, as a segment of its own."""
    row, used, _ = entry
    row["ids"][used:used + len(ids)] = ids
    row["segment_ids"][used:used + len(ids)] = entry[2] + 1
    for c in columns:
        row[c][used:used + len(ids)] = others[c]
    entry[1], entry[2] = used + len(ids), entry[2] + 1


def _check_columns(n: int, ids, others: dict, columns: tuple[str, ...]) -> None:
    """Document ``n``'s per-token columns are the first document's, each as long as its
    ids."""
    if tuple(others) != columns or any(len(v) != len(ids) for v in others.values()):
        raise ValueError(f"document {n}: its per-token columns "
                         f"{ {c: len(v) for c, v in others.items()} } are not "
                         f"{list(columns)} of its {len(ids)} tokens each, as the first "
                         "document's are")


def _document(doc, n: int, key: str) -> tuple[np.ndarray, dict]:
    """A document's token ids and its other per-token columns, as int32 arrays."""
    if isinstance(doc, Mapping):
        if key not in doc:
            raise KeyError(f"document {n} holds {sorted(doc)}, not the token ids {key!r}")
        return np.asarray(doc[key], np.int32).reshape(-1), \
            {c: np.asarray(v, np.int32).reshape(-1) for c, v in doc.items() if c != key}
    return np.asarray(doc, np.int32).reshape(-1), {}


def next_token_mask(segment_ids) -> np.ndarray:
    """(batch, length - 1): 1 where token ``t + 1`` is the next token of token ``t``'s
    document (same segment, not padding). Multiply a next-token loss by it."""
    seg = segment_ids
    return (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)


def efficiency(rows: Iterable[dict]) -> float:
    """Real tokens over all token slots of packed rows."""
    real = slots = 0
    for row in rows:
        real += int(np.count_nonzero(row["segment_ids"]))
        slots += len(row["segment_ids"])
    return real / slots if slots else 0.0
