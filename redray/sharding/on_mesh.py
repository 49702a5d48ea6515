"""A model on a mesh: its automatic specs, its arrays put on their shardings, and the mesh
and platform a placed model is on.

One way for every part that places a model: the engine's ``ModelRuntime.place`` (a
user's module or a Predictor's parameters, copied), ``from_pretrained`` (a
checkpoint's tensors, from the host) and the ``Sampler`` (a model placed by its
specs, weights updated in place of the old ones).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redray.sharding.specs import derive_specs


def put(value, sharding: NamedSharding, copy: bool = False):
    """``value`` on ``sharding``.

    An array on this process's devices is moved (``copy``: into fresh buffers first, so
    a step that donates the result never frees the caller's); one spread over several
    processes is resharded (``copy``: by a compiled copy); a host value (the same on
    every process) is cut into each device's shard here, without ``device_put``'s check
    across processes that it is the same. A key array keeps its implementation."""
    if isinstance(value, jax.Array) and sharding.is_fully_addressable:
        return jax.device_put(jnp.copy(value) if copy else value, sharding)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.jit(jnp.copy, out_shardings=sharding)(value) if copy \
            else jax.device_put(value, sharding)
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(value), sharding, copy),
                                        impl=jax.random.key_impl(value))
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def mesh_of(tree):
    """The mesh of the first array of ``tree`` on a ``NamedSharding``, or None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def platform_of(tree) -> str:
    """The platform of the devices ``tree``'s first array is on ("cpu", "gpu", ...)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def model_specs(graphdef, state, parallelism, inputs: dict, whole: list | None = None,
                stacked: dict | None = None):
    """Automatic specs of a model's (params, extra) on a built plan (a mesh or an
    abstract one), traced on ``model(**inputs)``; ``whole`` receives the layer parameters
    left unsplit over ``model``, ``stacked`` the scanned layers' arrays (``derive_specs``)."""
    def forward(st, kwargs):
        return nnx.merge(graphdef, *jax.tree.map(lambda x: x, st))(**kwargs)

    return derive_specs(state, parallelism.mesh, forward, (inputs,), whole=whole,
                        passes=parallelism.spec_passes(), stacked=stacked)


def placed_state(model, parallelism, inputs: dict):
    """``model``'s state placed on ``parallelism``'s mesh (built if it is not) by its
    automatic specs, traced on ``model(**inputs)``."""
    parallelism = parallelism.build() if parallelism.mesh is None else parallelism
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    specs = model_specs(graphdef, (params, extra), parallelism, inputs)
    placed = jax.tree.map(lambda x, s: put(x, NamedSharding(parallelism.mesh, s)), (params, extra),
                          specs, is_leaf=lambda x: isinstance(x, P))
    return nnx.state(nnx.merge(graphdef, *placed))


def device_memory(device) -> float:
    """The bytes a device may hold: its allocator's limit, or on a CPU the machine's
    memory shared by this process's devices."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend has it
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(jax.local_device_count(), 1)
