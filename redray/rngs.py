"""Randomness: a run's named key streams, and ``nnx.Rngs`` that trace in linear time.

Every random key of a run comes from its ``seed`` through one of the ``KeyStream``s below
(``stream_key(seed, KeyStream.TRAIN)``), so initialization, training, evaluation and
prediction never share a key, and each is reproducible from the seed alone.

``nnx.RngStream.__call__`` bumps its counter with ``count[...] += 1``. Under a trace
(``nnx.eval_shape``, ``jax.jit`` of an init) that update compares the tracers'
shardings, and the AttributeError JAX raises inside that comparison searches the whole
jaxpr built so far for the value's origin: building a model costs time quadratic in its
parameter count (40-77 s for OPT-66B). ``LinearRngStream`` stores the same new count
directly, which is what the ``+=`` ends up doing anyway: same keys, same values.
"""

from __future__ import annotations

import enum

import jax
from flax import nnx


class KeyStream(enum.IntEnum):
    """The independent key streams of a run; the value is folded into ``key(seed)``."""
    INIT = 0     # parameter initialization (the model factory's nnx.Rngs)
    TRAIN = 1    # the training state's key: split once per step, folded per micro-batch
    EVAL = 2     # the rng an evaluation's loss receives
    PREDICT = 3  # the Predictor's default: folded with its call count, then batch start


def stream_key(seed: int, stream: KeyStream) -> jax.Array:
    """The first key of ``stream`` for a run's ``seed``."""
    return jax.random.fold_in(jax.random.key(seed), int(stream))


class LinearRngStream(nnx.RngStream):
    """An ``nnx.RngStream`` drawing the same keys, counting in O(1) under a trace."""

    def __call__(self):
        self.count._check_can_update()  # same guard as the base class (flax 0.12)
        key = jax.random.fold_in(self.key[...], self.count[...])
        self.count.set_value(self.count.get_value() + 1)
        return key


def rngs(seed) -> nnx.Rngs:
    """``nnx.Rngs(seed)`` (an int or a key) with linear-time streams."""
    out = nnx.Rngs(seed)
    for tag, stream in list(vars(out).items()):
        if type(stream) is nnx.RngStream:
            setattr(out, tag, LinearRngStream(stream.key.get_value(), tag=tag))
    return out
