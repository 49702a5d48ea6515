"""The device mesh: axes ``data``, ``fsdp`` and ``model`` over every device."""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "model")
# The batch dimension is split over both data-parallel axes: fsdp is data parallelism
# whose parameters are sharded too (ZeRO-3).
BATCH_AXES = ("data", "fsdp")


def _axis_size(name: str, value, n_devices: int) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a valid axis size: use a positive int or 'auto'")
    if n_devices % value:
        raise ValueError(
            f"{name}={value} does not divide the {n_devices} devices: choose a divisor of "
            f"{n_devices} ({', '.join(str(d) for d in _divisors(n_devices))})")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(data_axis="auto", fsdp_axis=1, model_axis=1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the 3-axis mesh (data, fsdp, model) over ``devices`` (default: all).

    Args:
      data_axis: data-parallel size, or "auto" for what the other axes leave.
      fsdp_axis: size of the axis that shards parameters and optimizer state
        (ZeRO-3) while also splitting the batch; "auto" for what is left.
      model_axis: tensor-parallel size; "auto" for what is left.
      devices: the devices to span; ``jax.devices()`` (every host's) by default.

    At most one axis may be "auto"; it takes the devices the others leave.

    Returns:
      A ``jax.sharding.Mesh`` with axis names ``("data", "fsdp", "model")``.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {name: _axis_size(name, v, n) for name, v in
             (("data_axis", data_axis), ("fsdp_axis", fsdp_axis), ("model_axis", model_axis))}
    auto = [k for k, v in sizes.items() if v is None]
    if len(auto) > 1:
        raise ValueError(f"only one axis may be 'auto', got {auto}: give the others a size")
    fixed = math.prod(v for v in sizes.values() if v is not None)
    if n % fixed:
        raise ValueError(
            f"axis sizes {({k: v for k, v in sizes.items() if v})} multiply to {fixed}, "
            f"which does not divide the {n} devices")
    if auto:
        sizes[auto[0]] = n // fixed
    elif fixed != n:
        raise ValueError(
            f"axis sizes multiply to {fixed} but there are {n} devices: make one axis 'auto' "
            f"or pass devices=jax.devices()[:{fixed}]")
    shape = (sizes["data_axis"], sizes["fsdp_axis"], sizes["model_axis"])
    return Mesh(device_grid(devices, shape), AXES)


def hybrid_shapes(shape: tuple[int, int, int], processes: int,
                  local: int) -> tuple[tuple, tuple] | None:
    """(across hosts, inside a host) shapes of a (data, fsdp, model) mesh whose ``model``
    axis stays inside each host (its all-reduces on the fast interconnect: NVLink, ICI),
    ``fsdp`` inside as far as it fits, ``data`` across hosts; None when ``model`` needs
    more devices than a host has."""
    data, fsdp, model = shape
    if local % model:
        return None
    rest = local // model
    fsdp_in = math.gcd(fsdp, rest)
    data_in = rest // fsdp_in
    if data % data_in:
        return None
    across = (data // data_in, fsdp // fsdp_in, 1)
    if math.prod(across) != processes:
        return None
    return across, (data_in, fsdp_in, model)


def device_grid(devices: Sequence[jax.Device], shape: tuple[int, int, int]) -> np.ndarray:
    """``devices`` arranged as ``shape``: on several hosts, each host's devices hold
    whole ``model`` groups (and as much of ``fsdp`` as fits), hosts line up along
    ``data`` (JAX's hybrid mesh); on one host, JAX's device mesh (the physical topology
    on TPU, the device order elsewhere)."""
    from jax.experimental import mesh_utils

    hosts: dict[int, int] = {}
    for d in devices:
        hosts[d.process_index] = hosts.get(d.process_index, 0) + 1
    if len(hosts) > 1 and len(set(hosts.values())) == 1:
        split = hybrid_shapes(shape, len(hosts), next(iter(hosts.values())))
        if split is not None:
            return mesh_utils.create_hybrid_device_mesh(split[1], split[0], devices,
                                                        process_is_granule=True)
        warnings.warn(f"model_axis={shape[2]} is larger than a host's "
                      f"{next(iter(hosts.values()))} devices: its all-reduces cross hosts "
                      "(the slow network); a model axis within a host is faster",
                      stacklevel=3)
    elif len(hosts) == 1:
        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # a subset of a TPU slice, say: the given order
    # Model-parallel peers stay neighbours in the device order.
    return np.array(devices, dtype=object).reshape(shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch-major array: the leading dimension over data and fsdp."""
    return NamedSharding(mesh, P(BATCH_AXES))


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]
