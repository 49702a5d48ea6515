"""Where a Sampler's slots live on the model's mesh.

The model's parameters keep their placement (``redray.sharding.on_mesh``); the
cache's slots are split over the batch axes (data-parallel replicas) and its key/value
heads over ``model``. A mesh over several processes (a Trainer of several hosts, a
``SamplerGroup`` replica of several) works as the Trainer does: every process runs the
same host loop on the same requests; the host's inputs to a compiled step become global
arrays and what the loop reads back is replicated on every device.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redray.sharding import BATCH_AXES, MODEL
from redray.sharding.on_mesh import put


class SlotPlacement:
    """The slots' arrays on ``mesh`` (None: one device, as the model is).

    Attributes:
      mesh: the model's mesh, or None.
      spmd: the mesh spans several processes (each runs this same loop).
      data_parallel: the replicas the slots are split over.
    """

    def __init__(self, mesh, slots: int):
        self.mesh = mesh
        self.spmd = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.data_parallel = 1
        if mesh is not None:
            dp = self.data_parallel = math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)
            if slots % dp:
                raise ValueError(f"slots={slots} must be a multiple of the plan's data-parallel "
                                 f"size ({dp}): each replica decodes its share of the slots")

    def jit(self, fn, cache, replicated: int, **jit):
        """``fn`` compiled; on a mesh, its outputs placed: the cache (of ``cache``'s
        structure) and its key mask split as the module says, then ``replicated``
        outputs the host reads, whole on every device (on every process)."""
        if self.mesh is None:
            return jax.jit(fn, **jit)
        whole = NamedSharding(self.mesh, P())
        return jax.jit(fn, out_shardings=(
            self.cache_sharding(cache), NamedSharding(self.mesh, P(BATCH_AXES)),
            *[whole] * replicated), **jit)

    def host(self, *arrays):
        """The host's inputs to a compiled step: as they are in one process; over
        several, global arrays of the same value on every process (each process passes
        the same, as it runs the same loop)."""
        if not self.spmd:
            return arrays
        whole = NamedSharding(self.mesh, P())
        return [put(x, whole) for x in arrays]

    def cache_sharding(self, cache):
        """The cache's shardings: slots over the batch axes, key/value heads over
        ``model`` where they divide."""
        kv_heads = jax.tree.leaves(cache)[0].shape[-3]
        heads = MODEL.name if kv_heads % self.mesh.shape.get(MODEL.name, 1) == 0 else None

        def spec(leaf):
            lead = (None,) * (leaf.ndim - 4)  # the layer axis of a stacked cache
            return NamedSharding(self.mesh, P(*lead, BATCH_AXES, heads, None, None))
        return jax.tree.map(spec, cache)
