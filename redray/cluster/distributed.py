"""One ``jax.distributed`` runtime over a Ray Train worker group.

Ray 2.60's JaxTrainer sets JAX up only on TPU/GPU, so every worker does it here: rank 0
picks its address and a free port, ``broadcast_from_rank_zero`` shares it, CPUs use gloo
collectives, and GPUs keep the devices Ray assigned (CUDA_VISIBLE_DEVICES untouched).
"""

from __future__ import annotations

from redray.sharding.hosts import join, served_at


def initialize() -> tuple[int, int]:
    """Joins this worker to the job's runtime; returns (rank, world size)."""
    import ray
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    address = served_at(ray.util.get_node_ip_address()) if rank == 0 else None
    join(broadcast_from_rank_zero(address), world, rank)
    return rank, world


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()
