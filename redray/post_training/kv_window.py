"""The KV cache of a Sampler's slots, as a window of the columns its live sequences use.

Every slot writes its next token at the same cache column ``t`` (one ``cache_index``
for the batch, which is what every redray model's call takes), and a prompt joining at
``t`` is written right-aligned behind it, at ``[t - P, t)``. A row's tokens are always
contiguous and end at ``t``; the key mask (``kv_valid``) marks them.

The cache holds the live window only: its columns run from the oldest live sequence's
start to as far as the next decoding round may write, rounded up to one of
``WINDOW_RUNGS`` widths per doubling (``window``). When the window no longer fits
(``t`` at its end, a prompt longer than the room behind ``t``) or fits a much smaller
one, the cache is copied into a new window (``KVWindow.fit``), the columns renumbered
from its start; narrowing the batch makes that copy anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PROMPT_BUCKET = 16  # prompts are left-padded to a multiple of this (one compile per size)
# columns a decoding round's window keeps ahead of ``t`` at least: a round that reaches
# the window's end stops and the window grows (one copy); more room makes every step
# read more (of 1, 8, 16 and 32, 8 and 16 ran the benchmark's workload fastest, within
# the noise of each other)
ROOM = 16
# widths a window takes per doubling of its columns (``window``; a power of two):
# every multiple of ``PROMPT_BUCKET`` up to 16 of them (256 columns), then 8 per
# doubling. Each width a round reads is one compile. Of a ladder of 2 widths per
# doubling (up to a third of the columns idle) and of 8 (under an eighth), 8 ran the
# benchmark's workload 4-11% faster (five runs side by side, docs/performance/sampler.md)
# with as many compiles: its rounds change width where they narrow the batch
WINDOW_RUNGS = 8


class KVWindow:
    """The slots' KV cache as its live window (see the module): ``cache`` and its key
    mask ``kv_valid`` (slots x ``width`` columns), ``t`` the column every slot writes
    next, ``start`` each slot's first column, ``shifts`` the times the rows moved left.

    Args:
      slots: the rows.
      length: the widest window.
      room: the columns a window keeps past ``t`` at least (a round's steps).
      empty: ``(rows, width) -> (cache, kv_valid)``, an empty window, compiled.
      placement: the slots' ``SlotPlacement`` (the copies' compiled shardings).
    """

    def __init__(self, slots: int, length: int, room: int, empty, placement):
        self.slots, self.length, self.room = slots, length, room
        self.empty, self.placement = empty, placement
        self.rewindow = None  # the copy into a new window, compiled once
        self.calls = 0  # compiled calls made (empty windows, copies): a Sampler's count
        self.peak = 0  # the most rows x columns the cache held (a Sampler's count)
        self.reset()

    def reset(self) -> None:
        """An empty window: every slot free."""
        self.cache, self.kv_valid = self.empty(self.slots, PROMPT_BUCKET)
        self.calls += 1
        self.held()
        self.t = 0
        self.start = np.zeros(self.slots, np.int64)  # each slot's first cache column
        self.shifts = 0  # times the rows were moved left (``fit``)

    @property
    def width(self) -> int:
        """The cache's columns now."""
        return self.kv_valid.shape[1]

    def oldest(self, active) -> int:
        """The first column of the oldest live sequence (``t`` when none is live)."""
        return int(self.start[active].min()) if active.any() else self.t

    def narrow(self, keep, active) -> None:
        """Keeps the rows ``keep`` (``active``: the kept slots' liveness), in a window
        of their live columns."""
        self.start = self.start[keep]
        self.fit(self.oldest(active), keep)

    def fit(self, begin: int, keep=None, empty: bool = False, ahead: int | None = None) -> None:
        """Makes the cache's window hold columns ``[begin, end)``, ``end`` the next
        round's room past ``t`` (``begin`` may be negative: room on the left for a
        prompt), copying it (and its rows ``keep``) when they do not fit, or when a
        window of at most two thirds of its width would, or when ``keep`` is given;
        ``empty``: no row is live, a new window is made empty rather than copied;
        ``ahead``: room for that many steps past ``t`` (within the widest window).
        Columns are renumbered from the window's start (see the module)."""
        end = self.t + self.room
        if ahead is not None:
            end = max(end, min(self.t + ahead, begin + self.length))
        width = window(end - begin, self.length)
        fits = 0 <= begin and end <= self.width and width > self.width * 2 // 3
        if fits and keep is None:
            return
        if self.t + 1 - begin > width:
            raise RuntimeError("the KV cache is full of one live sequence: max_length is "
                               "smaller than a request's prompt plus completion")
        inside = 0 <= begin and begin + width <= self.width
        self.calls += 1
        if empty:
            self.cache, self.kv_valid = self.empty(len(self.kv_valid), width)
        else:
            host = self.placement.host
            if self.rewindow is None:
                self.rewindow = self.placement.jit(rewindowed, self.cache, 0,
                                                   static_argnums=(4, 5))
            keep = None if keep is None else host(np.asarray(keep, np.int32))[0]
            self.cache, self.kv_valid = self.rewindow(
                self.cache, self.kv_valid, keep, *host(np.int32(begin)), width, inside)
        self.t -= begin
        self.start -= begin
        self.shifts += begin > 0
        self.held()

    def held(self, tokens: int | None = None) -> None:
        """Counts the cache's rows x columns now (or ``tokens``) into ``peak``."""
        self.peak = max(self.peak, self.kv_valid.size if tokens is None else tokens)


def bucket(n: int) -> int:
    """``n`` tokens rounded up to ``PROMPT_BUCKET``."""
    return -(-n // PROMPT_BUCKET) * PROMPT_BUCKET


def window(n: int, length: int) -> int:
    """The cache columns for a window of ``n``, at most ``length``: ``n`` rounded up to
    ``PROMPT_BUCKET`` columns, then, past ``2 * WINDOW_RUNGS`` buckets, to one of
    ``WINDOW_RUNGS`` widths per doubling (less than 1/``WINDOW_RUNGS`` of the columns
    idle, and few compiled widths however long the sequences grow)."""
    units = -(-n // PROMPT_BUCKET)
    step = 1 << max(0, units.bit_length() - WINDOW_RUNGS.bit_length())
    return min(-(-units // step) * step * PROMPT_BUCKET, length)


def write(big, new, rows, cols, every: bool = False):
    """``new``'s (rows, heads, width) tokens into ``big`` at rows ``rows``, columns
    ``cols`` (a stacked cache's layer axis leads both); rows out of range write nothing.
    ``every``: ``rows`` are all of ``big``'s, in order (``new`` may have more: padding),
    and ``cols`` consecutive: one slice is written, not scattered (on XLA:CPU the
    scatter took 8 ms more of a 64 x 32-token prefill's 85)."""
    axis = big.ndim - 4
    new = new.astype(big.dtype)
    if every:
        new = jax.lax.slice_in_dim(new, 0, big.shape[axis], axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(big, new, cols[0], axis + 2)
    lead = (slice(None),) * axis
    heads = jnp.arange(big.shape[-3])
    return big.at[(*lead, rows[:, None, None], heads[None, :, None], cols[None, None, :])].set(
        new, mode="drop")


def rewindowed(cache, kv_valid, keep, begin, width: int, inside: bool):
    """The rows ``keep`` (None: all; sorted: a gather of sorted rows runs 4x faster on
    XLA:CPU) and the columns ``[begin, begin + width)`` of the cache and its key mask;
    ``inside``: those columns are all in the old window, else the ones outside it are
    empty (masked)."""
    def take(x, rows_axis, columns_axis):
        if not inside:  # a padded slice: twice as fast on XLA:CPU as a gather with fill
            padding = [(0, 0)] * x.ndim
            padding[columns_axis] = (width, width)
            x, begin_ = jnp.pad(x, padding), begin + width
        else:
            begin_ = begin
        x = jax.lax.dynamic_slice_in_dim(x, begin_, width, columns_axis)
        if keep is not None:
            x = jnp.take(x, keep, axis=rows_axis, indices_are_sorted=True, unique_indices=True)
        return x
    return (jax.tree.map(lambda x: take(x, x.ndim - 4, x.ndim - 2), cache),
            take(kv_valid, 0, 1))
