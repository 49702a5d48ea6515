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
         split: bool = True, pad_id: int = 0, key: str = "ids") -> Iterator[dict]:
    """Rows ``{"ids": int32[length], "segment_ids": int32[length]}`` of the documents'
    tokens, in order.

    Args:
      documents: token id sequences, or dicts of per-token sequences: the token ids
        under ``key`` and any others of the same length beside them (a chat row's
        ``loss_mask``), each packed into a column of its own the same way (int32, 0 in
        padding), so a token keeps its mask wherever it lands.
      length: tokens per row.
      split: a document longer than the room left in a row continues in the next row
        (as a new segment there): rows are full but for the last. Without it, a
        document that does not fit starts a new row (the rest of the row is padding),
        and one longer than ``length`` is cut into rows of ``length``.
      pad_id: the token id of padding.
      key: the token ids' name in dict documents (and in the rows: ``"ids"`` is
        always the rows' name for them).
    """
    if length < 2:
        raise ValueError(f"length={length}: rows need at least 2 tokens")
    columns: tuple[str, ...] | None = None

    def empty():
        row = {"ids": np.full(length, pad_id, np.int32), "segment_ids": np.zeros(length, np.int32)}
        row.update((c, np.zeros(length, np.int32)) for c in columns)
        return row

    row, used, segment = None, 0, 0
    for n, doc in enumerate(documents):
        if isinstance(doc, Mapping):
            if key not in doc:
                raise KeyError(f"document {n} holds {sorted(doc)}, not the token ids {key!r}")
            ids = np.asarray(doc[key], np.int32).reshape(-1)
            others = {c: np.asarray(v, np.int32).reshape(-1) for c, v in doc.items() if c != key}
        else:
            ids, others = np.asarray(doc, np.int32).reshape(-1), {}
        if columns is None:
            columns = tuple(others)
            if {"ids", "segment_ids"} & set(columns):
                raise ValueError(f"document {n}: a per-token column named {columns} would "
                                 "take the place of the rows' own ids or segment_ids")
            row = empty()
        if tuple(others) != columns or any(len(v) != len(ids) for v in others.values()):
            raise ValueError(f"document {n}: its per-token columns "
                             f"{ {c: len(v) for c, v in others.items()} } are not "
                             f"{list(columns)} of its {len(ids)} tokens each, as the first "
                             "document's are")
        at = 0
        while at < len(ids):
            room = length - used
            if not split and used and len(ids) - at > room:
                yield row
                row, used, segment, room = empty(), 0, 0, length
            take = min(room, len(ids) - at)
            segment += 1
            row["ids"][used:used + take] = ids[at:at + take]
            row["segment_ids"][used:used + take] = segment
            for c in columns:
                row[c][used:used + take] = others[c][at:at + take]
            used, at = used + take, at + take
            if used == length:
                yield row
                row, used, segment = empty(), 0, 0
    if used:
        yield row


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
