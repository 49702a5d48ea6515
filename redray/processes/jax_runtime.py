"""The processes of one JAX runtime: joining it (``join_jax``, at ``served_at``), and host
values they agree on: process 0's, sent to every process (a plan's timings, a reward, a
completion), so that every host acts alike."""

from __future__ import annotations

import socket

import jax
import numpy as np

# A dead peer must end a runtime quickly, never leave the others in a long hang.
HEARTBEAT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 10


def served_at(host: str) -> str:
    """``host:port``, the port free on this machine now: where a runtime's process 0
    serves it (``host``: this node's address as the others reach it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


def join_jax(address: str, world: int, rank: int) -> None:
    """Joins the JAX runtime served at ``address`` as process ``rank`` of ``world``
    (waits until all have); on CPU over gloo collectives. A run's hosts
    (``redray.cluster.hosts``) and a sampler replica's processes
    (``redray.post_training.remote``) join theirs so."""
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=world, process_id=rank,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)


def from_process_zero(tree):
    """Process 0's numpy arrays (a pytree of them) on every process; one process: as
    they are. Every process calls it (a collective), with arrays of the same shapes."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
