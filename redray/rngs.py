"""``nnx.Rngs`` whose streams trace in linear time.

``nnx.RngStream.__call__`` bumps its counter with ``count[...] += 1``. Under a trace
(``nnx.eval_shape``, ``jax.jit`` of an init) that update compares the tracers'
shardings, and the AttributeError JAX raises inside that comparison searches the whole
jaxpr built so far for the value's origin: building a model costs time quadratic in its
parameter count (40-77 s for OPT-66B). ``LinearRngStream`` stores the same new count
directly, which is what the ``+=`` ends up doing anyway: same keys, same values.
"""

from __future__ import annotations

import jax
from flax import nnx


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
