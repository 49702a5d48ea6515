"""From examples to global batches: order, collate, placement, prefetch.

Every process runs the same program. Global batch ``i`` of an epoch is always the rows
``order[i*B:(i+1)*B]``; each process collates only the rows its devices hold (read from
the batch sharding), so one host or many see the same batches.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from redray.pipeline import check_batch


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The example order of an epoch: a pure function of (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def collate_checked(collate, examples: Sequence, exact: bool = False) -> dict[str, np.ndarray]:
    """Runs the user's collate and validates its output."""
    return check_batch(collate(list(examples)), len(examples) if exact else None)


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
