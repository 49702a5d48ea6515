"""The slots of a Sampler as the host schedules them: each slot's request (its key,
sampling, last token, tokens left), which slots a round refills or the batch narrows
into, and the one packed array each compiled call takes and returns.

A compiled call's inputs, and the outputs the host reads, are a row per slot in one
int32 array (``packed``: one transfer each way); the layouts below name its columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from redray.post_training.sampling import SamplingParams

# a compiled call's inputs and the outputs the host reads, a row per slot, each in one
# int32 array (``packed``: one transfer): (name, columns, dtype) in their order; None
# columns: the prompts' width (inputs), the call's steps (outputs)
SAMPLING = (("temperature", 1, np.float32), ("top_k", 1, np.int32), ("top_p", 1, np.float32))
PREFILL_INPUTS = (("t", 1, np.int32), ("ids", None, np.int32), ("mask", None, np.int32),
                  ("where", 1, np.int32), ("source", 1, np.int32), ("id", 1, np.int32),
                  ("seed", 1, np.int32)) + SAMPLING
DECODE_INPUTS = (("t", 1, np.int32), ("refill_at", 1, np.int32), ("token", 1, np.int32),
                 ("active", 1, np.bool_), ("counts", 1, np.int32), ("remaining", 1, np.int32),
                 ("keys", 2, np.uint32)) + SAMPLING
PREFILL_OUTPUTS = (("token", 1, np.int32), ("logprob", 1, np.float32), ("keys", 2, np.uint32))
DECODE_OUTPUTS = (("out", None, np.int32), ("written", None, np.bool_),
                  ("lps", None, np.float32), ("token", 1, np.int32), ("active", 1, np.bool_),
                  ("counts", 1, np.int32), ("remaining", 1, np.int32), ("by_eos", 1, np.bool_),
                  ("t", 1, np.int32))
# a call that refills its own slots (``decode_steps.refill_step``): the requests waiting
# (a row each: the prompt left-padded to the queue's width, its id, its sampling and
# maximum), every slot's state in and out (the request it decodes, -1: free; its first
# cache column; ``t`` on every row), and each request's tokens out
QUEUE_INPUTS = (("ids", None, np.int32), ("mask", None, np.int32), ("id", 1, np.int32),
                ("seed", 1, np.int32), ("count", 1, np.int32),
                ("max_new", 1, np.int32)) + SAMPLING
SLOT_STATE = (("token", 1, np.int32), ("active", 1, np.bool_), ("counts", 1, np.int32),
              ("remaining", 1, np.int32), ("keys", 2, np.uint32), ("owner", 1, np.int32),
              ("start", 1, np.int32), ("t", 1, np.int32)) + SAMPLING
# ``reason``: 0 still decoding in a slot, 1 ended by EOS, 2 by its maximum
REQUEST_OUTPUTS = (("out", None, np.int32), ("lps", None, np.float32),
                   ("length", 1, np.int32), ("reason", 1, np.int32))


class Slots:
    """The host's copy of every slot's request: its id and key, sampling, tokens so far.
    A request's key, ``fold_in(key(seed), id)``, is made by the compiled call that takes
    it into a slot (the host makes no key: each would be a call and a read)."""

    # what a slot holds besides its request's id: as a compiled call returns it
    DECODING = ("keys", "token", "active", "counts", "remaining") + tuple(
        name for name, _, _ in SAMPLING)

    def __init__(self, slots: int, seed: int):
        self.seed = seed
        self.ids = np.zeros(slots, np.int32)
        # key data (uint32), not typed keys: host values, made global with the rest
        self.keys = np.zeros((slots, 2), np.uint32)
        self.token = np.zeros(slots, np.int32)
        self.active = np.zeros(slots, bool)
        self.counts = np.zeros(slots, np.int32)
        self.remaining = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.top_p = np.ones(slots, np.float32)

    def assign(self, slots, params: list[SamplingParams], ids: list[int]) -> None:
        self.ids[slots] = ids
        self.counts[slots] = 0
        self.remaining[slots] = [p.max_new_tokens for p in params]
        self.temperature[slots] = [p.temperature for p in params]
        self.top_k[slots] = [p.top_k for p in params]
        self.top_p[slots] = [p.top_p for p in params]

    def sampling(self) -> dict:
        return {name: getattr(self, name) for name, _, _ in SAMPLING}

    def take(self, keep) -> None:
        """Keeps the slots ``keep``, in that order (the batch narrowed)."""
        for name in ("ids",) + self.DECODING:
            setattr(self, name, getattr(self, name)[keep])


def packed(layout, values: dict, width: int | None = None):
    """Values of one row each (``(rows,)`` or ``(rows, k)``), named as in ``layout``
    (``DECODE_INPUTS``, ...), side by side in one int32 array, their bits kept: a compiled
    call's inputs, or the outputs it returns, in one transfer (``unpacked`` splits them
    by the same layout). Host values give a NumPy array, traced ones a traced one;
    ``width``: the columns of the layout's None blocks (None: any)."""
    if set(values) != {name for name, _, _ in layout}:
        raise KeyError(f"packed values {sorted(values)} are not the layout's {layout}")
    xp = jnp if any(isinstance(v, jax.Array) for v in values.values()) else np
    columns = []
    for name, n, dtype in layout:
        x = xp.asarray(values[name]).astype(dtype)
        x = x.reshape(x.shape[0], -1)
        n = width if n is None else n
        if n is not None and x.shape[1] != n:
            raise ValueError(f"{name!r} has {x.shape[1]} columns, the layout {n}")
        columns.append(bitcast(x, np.int32) if dtype in (np.float32, np.uint32)
                       else x.astype(np.int32))
    return xp.concatenate(columns, 1)


def unpacked(packed, layout, width: int | None = None) -> dict:
    """The columns ``packed`` joined by ``layout``, by name, from a NumPy or a traced
    array (a block of 1 column as a vector; ``width``: the columns of the layout's None
    blocks)."""
    out, at = {}, 0
    for name, n, dtype in layout:
        n = width if n is None else n
        x = packed[:, at:at + n]
        at += n
        if dtype in (np.float32, np.uint32):
            x = bitcast(x, dtype)
        else:
            x = x != 0 if dtype is np.bool_ else x.astype(dtype)
        out[name] = x[:, 0] if n == 1 else x
    return out


def bitcast(x, dtype):
    """``x``'s bits as ``dtype`` (of the same size), on the host or traced."""
    return x.view(dtype) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, dtype)


def sampling_columns(inputs: dict) -> tuple:
    """The sampling columns of unpacked inputs, in ``sample_rows``' order."""
    return tuple(inputs[name] for name, _, _ in SAMPLING)


def on_ladder(n: int) -> bool:
    """Whether ``n`` is 2^k or 3 x 2^k (the batch sizes a narrowed cache takes: few
    compiled shapes, at most a third of the rows idle)."""
    odd = n // 3 if n % 3 == 0 else n
    return odd > 0 and odd & (odd - 1) == 0


def smaller(size: int, data_parallel: int) -> int | None:
    """The next batch size below ``size`` that stays split over ``data_parallel``
    replicas, on a ladder of 2^k and 1.5 x 2^k (64, 48, 32, 24, ...: a few compiled
    sizes, at most a third of the rows idle), or None."""
    for below in range(size - 1, 0, -1):
        if on_ladder(below) and below % data_parallel == 0:
            return below
    return None


def narrowed(active, data_parallel: int):
    """With no prompt waiting, the slots the live sequences move into (``active``: each
    slot's): the fewest down ``smaller``'s sizes that still hold them, the live ones and
    enough idle ones, in order; None when no smaller size holds them."""
    size, live = len(active), np.nonzero(active)[0]
    while (below := smaller(size, data_parallel)) and below >= len(live):
        size = below
    if size == len(active):
        return None
    idle = np.setdiff1d(np.arange(len(active)), live)
    return np.sort(np.concatenate([live, idle[:size - len(live)]]))


def refill_at(size: int, waiting: int, data_parallel: int, narrow: bool) -> int:
    """The free slots at which a decoding round ends: enough to refill (an eighth of
    the batch, at most the prompts ``waiting``, at least 1), or, with no prompt waiting,
    to narrow the batch to its next size down (``size + 1``: never, it runs on)."""
    if waiting:
        return min(waiting, max(1, size // 8))
    below = smaller(size, data_parallel) if narrow else None
    return size - below if below else size + 1
