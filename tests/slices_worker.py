"""One process of tests/test_checkpoint_slices.py: joins a ``jax.distributed`` runtime,
loads each checkpoint folder split over every process's devices, writes what it loaded
(process 0, gathered: ``<folder>/multi.npz``) and saves it back (``<folder>/multi-out``).

    python tests/slices_worker.py ADDRESS WORLD RANK FOLDER...
"""

import sys


def main(address: str, world: int, rank: int, folders: list[str]) -> None:
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from redray import Parallelism
    from redray.models import from_pretrained, save_pretrained
    from redray.processes.jax_runtime import join_jax
    from redray.sharding import flatten

    join_jax(address, world, rank)
    for folder in folders:
        model = from_pretrained(folder, parallelism=Parallelism.of(fsdp_axis=2, model_axis=2))
        paths, leaves, _ = flatten(nnx.state(model, nnx.Param))
        assert any(not leaf.is_fully_addressable for leaf in leaves), folder  # spread
        values = {p: np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
                  for p, leaf in zip(paths, leaves)}
        if rank == 0:
            np.savez(f"{folder}/multi.npz", **{p.replace("/", "|"): v for p, v in values.items()})
        save_pretrained(model, f"{folder}/multi-out", max_shard_bytes=40_000)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
