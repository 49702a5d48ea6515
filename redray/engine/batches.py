"""From examples to global batches: order, collate, placement, prefetch, one pass.

Every process runs the same program. Global batch ``i`` of an epoch is always the rows
``order[i*B:(i+1)*B]``; each process collates only the rows its devices hold (read from
the batch sharding), so one host or many see the same batches. Evaluation and
prediction go through ``each_batch``: every example once, in order.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redray.engine import watchdog
from redray.pipeline import check_batch
from redray.sharding import batch_sharding, data_parallel_size


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The example order of an epoch: a pure function of (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def collate_checked(collate, examples: Sequence) -> dict[str, np.ndarray]:
    """Runs the user's collate and validates its output: a dict of numpy arrays with
    exactly one row per example it was given (a short batch would otherwise fail
    deep inside the placement, far from the function at fault)."""
    return check_batch(collate(list(examples)), len(examples))


def process_rows(sharding: NamedSharding, rows: int) -> slice:
    """The rows of a ``rows``-long batch that this process's devices hold.

    With the batch split over hosts, each host feeds its block; with it replicated
    (a model axis spanning hosts, or a replicated remainder batch), every host feeds all.
    """
    index_map = sharding.addressable_devices_indices_map((rows,))
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [rows if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    return slice(min(starts), max(stops))


def read_rows(source, indices) -> list:
    """Examples at ``indices`` from a list or from a row source with ``take(indices)``."""
    take = getattr(source, "take_rows", None)
    if take is not None:
        return take(indices)
    return [source[int(i)] for i in indices]


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


def each_batch(examples: Sequence, size: int, mesh: Mesh, collate: Callable, run: Callable,
               *, pad_last: bool, prepare: Callable | None = None) -> list[tuple[int, Any]]:
    """Runs ``run(batch, start)`` over ``examples`` in batches of ``size``, every example
    exactly once and in order; returns ``[(examples in the batch, run's output)]``.

    Each process collates and places only its rows of every batch; at most
    ``InFlight``'s limit of dispatched programs are unfinished at a time. A short last
    batch is either padded to ``size`` by repeating its last example (``pad_last``:
    one program for every batch; the caller drops the padded rows' outputs) or run at
    its own size, split over the devices if it divides, replicated otherwise (so no
    padding enters a mean).

    Args:
      examples: a list, or a row source (``len`` + ``take_rows``).
      size: examples per batch.
      mesh: the mesh the batches are placed on.
      collate: the user's collate (one row per example, checked).
      run: ``run(placed batch, start) -> device outputs``: dispatches one batch.
      pad_last: the short last batch's policy, above.
      prepare: called once with the first collated (host-local) batch before ``run``.
    """
    dp = data_parallel_size(mesh)
    pending, in_flight = [], InFlight()
    for start in range(0, len(examples), size):
        n = min(size, len(examples) - start)
        rows = size if pad_last else n
        sharding = batch_sharding(mesh) if rows % dp == 0 else NamedSharding(mesh, P())
        mine = process_rows(sharding, rows)
        indices = [min(start + i, start + n - 1) for i in range(mine.start, mine.stop)]
        batch = collate_checked(collate, read_rows(examples, indices))
        if prepare is not None and start == 0:
            prepare(batch)
        pending.append((n, run(to_global(batch, sharding, rows), start)))
        in_flight.add(pending[-1][1])
        watchdog.progress(f"a batch of {len(examples)} examples from example {start}")
    return pending
