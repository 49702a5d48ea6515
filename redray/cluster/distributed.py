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


def serve_address() -> str:
    """Where a runtime's process 0 serves it: this node's address and a free port."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def join(address: str, world: int, rank: int) -> None:
    """Joins the runtime served at ``address`` as process ``rank`` of ``world`` (waits
    until all have); on CPU over gloo collectives."""
    import jax

    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=world, process_id=rank,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)


def initialize() -> tuple[int, int]:
    """Joins this worker to the job's runtime; returns (rank, world size)."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    join(broadcast_from_rank_zero(serve_address() if rank == 0 else None), world, rank)
    return rank, world


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()
