"""One ``jax.distributed`` runtime over a Ray Train worker group.

Ray 2.60's JaxTrainer sets JAX up only on TPU/GPU, so every worker does it here: rank 0
picks its address and a free port, ``broadcast_from_rank_zero`` shares it, CPUs use gloo
collectives, and GPUs keep the devices Ray assigned (CUDA_VISIBLE_DEVICES untouched).
"""

from __future__ import annotations

import socket

# A dead peer must end the job quickly, never leave the others in a long hang.
HEARTBEAT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def initialize() -> tuple[int, int]:
    """Joins this worker to the job's runtime; returns (rank, world size)."""
    import jax
    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    address = f"{ray.util.get_node_ip_address()}:{_free_port()}" if rank == 0 else None
    address = broadcast_from_rank_zero(address)
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=world, process_id=rank,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    return rank, world


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()
