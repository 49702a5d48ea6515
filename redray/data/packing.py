"""Sequence packing: many documents per row of a fixed length, with segment ids.

A language model trained on rows of ``length`` tokens wastes the padding of every
short document. Packing lays documents end to end in rows; ``segment_ids`` (1, 2, ...
per document in a row, 0 for padding) let the models' attention stay inside a
document and restart its positions (``segment_ids=`` of redray's decoder models), and
``next_token_mask`` keeps the loss from predicting one document's first token from
the previous one's last.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np


def pack(documents: Iterable[Sequence[int]], length: int, *, split: bool = True,
         pad_id: int = 0) -> Iterator[dict]:
    """Rows ``{"ids": int32[length], "segment_ids": int32[length]}`` of the documents'
    tokens, in order.

    Args:
      documents: token id sequences.
      length: tokens per row.
      split: a document longer than the room left in a row continues in the next row
        (as a new segment there): rows are full but for the last. Without it, a
        document that does not fit starts a new row (the rest of the row is padding),
        and one longer than ``length`` is cut into rows of ``length``.
      pad_id: the token id of padding.
    """
    if length < 2:
        raise ValueError(f"length={length}: rows need at least 2 tokens")
    ids = np.full(length, pad_id, np.int32)
    seg = np.zeros(length, np.int32)
    used, segment = 0, 0
    for doc in documents:
        doc = np.asarray(doc, np.int32).reshape(-1)
        while len(doc):
            room = length - used
            if not split and used and len(doc) > room:
                yield {"ids": ids, "segment_ids": seg}
                ids, seg = np.full(length, pad_id, np.int32), np.zeros(length, np.int32)
                used, segment, room = 0, 0, length
            take = min(room, len(doc))
            segment += 1
            ids[used:used + take], seg[used:used + take] = doc[:take], segment
            used, doc = used + take, doc[take:]
            if used == length:
                yield {"ids": ids, "segment_ids": seg}
                ids, seg = np.full(length, pad_id, np.int32), np.zeros(length, np.int32)
                used, segment = 0, 0
    if used:
        yield {"ids": ids, "segment_ids": seg}


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
