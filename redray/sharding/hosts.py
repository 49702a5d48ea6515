"""Host values the processes of one runtime agree on: process 0's, sent to every process
(a plan's timings, a reward, a completion), so that every host acts alike."""

from __future__ import annotations

import jax
import numpy as np


def from_process_zero(tree):
    """Process 0's numpy arrays (a pytree of them) on every process; one process: as
    they are. Every process calls it (a collective), with arrays of the same shapes."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
