"""From examples to global batches: reading, collate, placement, prefetch, one pass.

Every process runs the same program. Examples come from a list or a row source
(``len`` + ``take_rows(indices)``), or from a stream (an object with
``epoch_batches``, ``in_order`` and ``steps_per_epoch``, e.g. ``redray.data.stream``),
which decides the batches of an epoch itself, as a pure function of (seed, epoch).
Each process collates only the rows its devices hold (read from the batch sharding),
so one host or many see the same batches. Training's order and loop are
``redray/engine/loop.py``'s; evaluation and prediction go through ``each_batch``:
every example once, in order.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from redray.engine import watchdog
from redray.functions import UserFunctionError, check_batch
from redray.sharding import Parallelism


def collate_checked(collate, examples: Sequence) -> dict[str, np.ndarray]:
    """Runs the user's collate and validates its output: a dict of numpy arrays with
    exactly one row per example it was given (a short batch would otherwise fail
    deep inside the placement, far from the function at fault)."""
    return check_batch(collate(list(examples)), len(examples))


def read_rows(source, indices) -> list:
    """Examples at ``indices`` from a list or from a row source with ``take(indices)``."""
    take = getattr(source, "take_rows", None)
    if take is not None:
        return take(indices)
    return [source[int(i)] for i in indices]


def is_stream(source) -> bool:
    """Whether ``source`` streams its examples (decides its own batches) rather than
    being read by index."""
    return hasattr(source, "epoch_batches")


def in_order(source, size: int) -> Iterator[list]:
    """Every example of ``source`` once, in order, in lists of ``size`` (the last may be
    shorter)."""
    if is_stream(source):
        yield from source.in_order(size)
        return
    for start in range(0, len(source), size):
        yield read_rows(source, range(start, min(start + size, len(source))))


def first_examples(source, n: int) -> list:
    """The first ``n`` examples of ``source`` (fewer if it holds fewer)."""
    return next(in_order(source, n), [])


def all_examples(source) -> list:
    """Every example of ``source``, in order, in one list."""
    return [example for chunk in in_order(source, 1024) for example in chunk]


def this_process_rows(batch: dict[str, np.ndarray], geometry, batch_size: int,
                      sharding: NamedSharding, attention=None) -> dict[str, jax.Array]:
    """This process's rows of the global batch (what ``collate`` returned) placed as
    global arrays, after checking it holds this process's share of the rows (and the
    fused attention kernel's bounds, ``attention``)."""
    mine = geometry.process_rows
    rows = next(iter(batch.values())).shape[0]
    if rows != mine.stop - mine.start:
        raise UserFunctionError(
            f"the batch has {rows} rows but this process feeds {mine.stop - mine.start} of "
            f"batch_size={batch_size}: collate must return one row per example")
    if attention is not None:
        attention.check(batch)  # a fused kernel's bounds (documents per row)
    return to_global(batch, sharding, batch_size)


def to_global(batch: dict[str, np.ndarray], sharding: NamedSharding,
              global_rows: int | None = None) -> dict[str, jax.Array]:
    """Places this process's rows of a batch as global arrays split along the batch."""
    out = {}
    for k, v in batch.items():
        shape = None if global_rows is None else (global_rows, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(sharding, v, shape)
    return out


def prefetch(items: Iterable, make: Callable, depth: int = 2) -> Iterator:
    """Yields ``make(item)`` for each item, computed ``depth`` ahead in a background thread.

    Collating and placing the next batches overlaps the current step. An exception in
    ``make`` (the user's collate) is re-raised here, in the training thread.
    """
    if depth <= 0:
        for item in items:
            yield make(item)
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((True, make(item)))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((False, e))
            return
        q.put((True, done))

    thread = threading.Thread(target=work, daemon=True, name="redray-prefetch")
    thread.start()
    try:
        while True:
            ok, value = q.get()
            if not ok:
                raise value
            if value is done:
                return
            yield value
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)


class InFlight:
    """Keeps at most ``limit`` dispatched device programs unfinished.

    JAX dispatches asynchronously. On XLA:CPU with few cores, a long queue of programs
    that hold collectives can deadlock: launches waiting for one device fill XLA's small
    launch thread pool (max(cores, devices) threads), so another device never reaches
    the all-reduce (seen with more than ~32 queued steps on 2 cores). Waiting for the
    program ``limit`` back keeps the devices fed without that risk.
    """

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.queue: collections.deque = collections.deque()

    def add(self, outputs) -> None:
        """Records a dispatched program's outputs; blocks on the oldest beyond the limit."""
        self.queue.append(outputs)
        if len(self.queue) > self.limit:
            jax.block_until_ready(self.queue.popleft())


def each_batch(examples: Sequence, size: int, parallelism: Parallelism, collate: Callable,
               run: Callable, *, pad_last: bool,
               prepare: Callable | None = None) -> list[tuple[int, Any]]:
    """Runs ``run(batch, start)`` over ``examples`` in batches of ``size``, every example
    exactly once and in order; returns ``[(examples in the batch, run's output)]``.

    Each process collates and places only its rows of every batch; at most
    ``InFlight``'s limit of dispatched programs are unfinished at a time. A short last
    batch is either padded to ``size`` by repeating its last example (``pad_last``:
    one program for every batch; the caller drops the padded rows' outputs) or run at
    its own size, split over the devices if it divides, replicated otherwise (so no
    padding enters a mean).

    Args:
      examples: a list, a row source (``len`` + ``take_rows``) or a stream.
      size: examples per batch.
      parallelism: the built plan whose mesh the batches are placed on.
      collate: the user's collate (one row per example, checked).
      run: ``run(placed batch, start) -> device outputs``: dispatches one batch.
      pad_last: the short last batch's policy, above.
      prepare: called once with the first collated (host-local) batch before ``run``.
    """
    pending, in_flight = [], InFlight()
    for k, chunk in enumerate(in_order(examples, size)):
        start, n = k * size, len(chunk)
        rows = size if pad_last else n
        sharding = parallelism.rows_sharding(rows)
        mine = parallelism.process_rows(rows, sharding)
        batch = collate_checked(collate, [chunk[min(i, n - 1)]
                                          for i in range(mine.start, mine.stop)])
        if prepare is not None and start == 0:
            prepare(batch)
        pending.append((n, run(to_global(batch, sharding, rows), start)))
        in_flight.add(pending[-1][1])
        watchdog.progress(f"a batch of {len(examples)} examples from example {start}")
    return pending
