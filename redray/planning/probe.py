"""The live cluster's numbers for the planner, measured through the real runtime: each
device's matmul rate and memory bandwidth (an elementwise kernel's bytes), and the
all-reduce bandwidth and latency inside a host, between the hosts of a slice and, on
TPU multislice, across slices (a device's slice: its ``slice_index``, else
``MEGASCALE_NUM_SLICES``: ``parallelism.device_slices``). A level the cluster does not
have (one host, one slice) takes the preset's figure, and the hardware's source says
so. A fused attention kernel's rate is not timed: the preset's share of the matmul
rate, scaled to the measured one.

Every process runs the probe (its collectives need all of them); the numbers of process
0 are given to all, so every host plans the same. A folder given as ``cache`` keeps them
per cluster (platform, device kind, devices, hosts): a restart plans from the same
numbers without probing again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redray.planning.hardware import PRESETS, Hardware, Link
from redray.processes.jax_runtime import from_process_zero
from redray.sharding.on_mesh import device_memory
from redray.sharding.parallelism import device_slices

# Two all-reduce sizes: the small one's time is mostly latency, the large one's
# bandwidth, at the size of a model's gradients rather than a cache's (measured on
# XLA:CPU over gloo, 2 hosts x 4 devices: a byte of a 32 MiB all-reduce costs 1.6x one
# of a 4 MiB one).
SMALL, LARGE = 1 << 10, 1 << 25
REPEATS = 5
# Where a link cannot be measured (one device per host, one host): the preset's figure
# for the platform, else these.
UNMEASURED = Link(10e9, 10e-6)


def _timed(fn, *args, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn(*args)`` over ``repeats`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _grid() -> Mesh:
    """Every device as (hosts, devices of a host)."""
    hosts = jax.process_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object).reshape(hosts, -1), ("hosts", "local"))


def _slice_grid(by_slice: dict[int, list]) -> Mesh | None:
    """Every device as (slices, hosts of a slice, devices of a host); None where the
    slices or their hosts differ in size."""
    slices = [sorted(v, key=lambda d: (d.process_index, d.id)) for v in by_slice.values()]
    hosts = {len({d.process_index for d in v}) for v in slices}
    if len({len(v) for v in slices}) != 1 or len(hosts) != 1:
        return None
    grid = np.array(slices, dtype=object).reshape(len(slices), hosts.pop(), -1)
    return Mesh(grid, ("slices", "hosts", "local"))


def ones(shape: tuple, dtype, sharding: NamedSharding) -> jax.Array:
    """Ones of ``shape`` on ``sharding``, each device's shard made on the host: a
    measurement's input costs no program of its own (each is a compile, ten of the
    probe's twenty on a tiny run's start)."""
    shard = np.ones(sharding.shard_shape(shape), jnp.dtype(dtype))
    return jax.make_array_from_callback(shape, sharding, lambda idx: shard)


def _matmul_rate(mesh: Mesh, dtype, n: int) -> float:
    """FLOPs per second each device sustains on an (n, n) x (n, n) matmul, all devices
    at once."""
    devices = mesh.devices.size
    spec = NamedSharding(mesh, P(("hosts", "local")))
    x = ones((devices * n, n), dtype, spec)
    y = ones((n, n), dtype, NamedSharding(mesh, P()))
    seconds = _timed(jax.jit(lambda a, b: a @ b, out_shardings=spec), x, y)
    return 2 * n ** 3 / seconds


def _link(mesh: Mesh, axis: str, dtype) -> Link | None:
    """The alpha-beta link of an all-reduce over ``axis``, from two sizes; None when the
    axis holds one device."""
    n = mesh.shape[axis]
    if n < 2:
        return None
    itemsize = jnp.dtype(dtype).itemsize

    def reduce(size: int) -> float:
        spec = P(mesh.axis_names)
        x = ones((mesh.devices.size, size // itemsize), dtype, NamedSharding(mesh, spec))
        summed = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axis), mesh=mesh,
                                       in_specs=spec, out_specs=spec))
        return _timed(summed, x)

    small, large = reduce(SMALL), reduce(LARGE)
    share = 2 * (n - 1) / n
    bandwidth = share * (LARGE - SMALL) / max(large - small, 1e-9)
    latency = max(0.0, (small - share * SMALL / bandwidth) / (2 * (n - 1)))
    return Link(bandwidth, latency)


def _memory_rate(mesh: Mesh, dtype, elements: int) -> float:
    """Bytes per second each device's elementwise kernels read and write: ``v * 2 + 1``
    over ``elements`` per device (larger than the caches), all devices at once."""
    spec = NamedSharding(mesh, P(("hosts", "local")))
    x = ones((mesh.devices.size, elements), dtype, spec)
    seconds = _timed(jax.jit(lambda v: v * 2 + 1, out_shardings=spec), x)
    return 2 * elements * jnp.dtype(dtype).itemsize / seconds


def _overhead(mesh: Mesh) -> float:
    """Seconds one small program costs to dispatch and run on every device."""
    x = ones((mesh.devices.size, 8), jnp.float32, NamedSharding(mesh, P(("hosts", "local"))))
    return _timed(jax.jit(lambda v: v + 1), x)


# Device kinds (as JAX names them, lower case) -> the preset that gives their peak; the
# first that matches wins ("tpu v5 lite" is a v5e, a plain "tpu v5" a v5p).
KINDS = {"h100": "h100", "h200": "h200", "a100": "a100", "l4": "l4", "v5 lite": "tpu-v5e",
         "v5e": "tpu-v5e", "v5p": "tpu-v5p", "tpu v5": "tpu-v5p", "v6 lite": "tpu-v6e",
         "v6e": "tpu-v6e"}


def _like(device) -> Hardware | None:
    """The preset of a device's kind (its peak FLOPs), if one matches."""
    if device.platform == "cpu":
        return PRESETS["cpu"]
    kind = device.device_kind.lower()
    return next((PRESETS[key] for part, key in KINDS.items() if part in kind), None)


def cluster_key() -> str:
    d = jax.devices()[0]
    slices = len(device_slices(jax.devices()))
    return (f"{d.platform}-{d.device_kind}-{jax.device_count()}-devices-"
            f"{jax.process_count()}-hosts" + (f"-{slices}-slices" if slices > 1 else "")
            ).replace(" ", "_").replace("/", "_")


def probe(cache: str | None = None) -> Hardware:
    """The ``Hardware`` of the devices this runtime sees (see the module docstring).

    Args:
      cache: a folder where the numbers are kept per cluster; read if there, else
        measured and written (by process 0).
    """
    key = cluster_key()
    path = None if cache is None else os.path.join(cache, f"{key}.json")
    if path is not None and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        saved.setdefault("platform", jax.devices()[0].platform)  # kept before it was
        return Hardware.from_dict({**saved, "live": True})
    if key not in _MEASURED:
        _MEASURED[key] = _measure()
    hardware = _MEASURED[key]
    if path is not None and jax.process_index() == 0:
        os.makedirs(cache, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(hardware), f, indent=1)
        os.replace(path + ".tmp", path)
    return hardware


# This process's measurements, per cluster: every Trainer made here plans from the same
# numbers (no second probe, no plan changed by the probe's noise).
_MEASURED: dict[str, Hardware] = {}


def _measure() -> Hardware:
    mesh = _grid()
    device = jax.devices()[0]
    like = _like(device)
    accelerated = device.platform != "cpu"
    dtype = jnp.bfloat16 if accelerated else jnp.float32
    by_slice = device_slices(jax.devices())
    # several slices: the hosts' link is measured inside a slice, the slices' across them
    sliced = _slice_grid(by_slice) if len(by_slice) > 1 else None
    hosts_mesh = sliced or mesh
    numbers = np.array([
        _matmul_rate(mesh, dtype, 4096 if accelerated else 512),
        *_flat(_link(mesh, "local", dtype)), *_flat(_link(hosts_mesh, "hosts", dtype)),
        *_flat(None if sliced is None else _link(sliced, "slices", dtype)),
        _overhead(mesh), device_memory(device),
        _memory_rate(mesh, dtype, (1 << 27) if accelerated else (1 << 20))], np.float64)
    numbers = from_process_zero(numbers)  # every host plans from process 0's numbers
    (rate, intra_bw, intra_lat, inter_bw, inter_lat, dcn_bw, dcn_lat, overhead, memory,
     bandwidth) = numbers.tolist()
    base = like or dataclasses.replace(PRESETS["h100"], intra=UNMEASURED, inter=UNMEASURED)
    intra = Link(intra_bw, intra_lat) if intra_bw > 0 else base.intra
    inter = Link(inter_bw, inter_lat) if inter_bw > 0 else (intra if jax.process_count() == 1
                                                            else base.inter)
    dcn = Link(dcn_bw, dcn_lat) if dcn_bw > 0 else base.dcn
    slices = (f"{len(by_slice)} slices measured across" if dcn_bw > 0
              else "one slice: across slices the preset's figure, not measured")
    return Hardware(
        f"probed: {jax.process_count()} host(s) x {jax.local_device_count()} "
        f"{device.device_kind}", rate, max(rate, like.peak_flops if like else rate),
        memory, jax.local_device_count(), intra, inter,
        overlap=1.0 if accelerated else 0.0, reduce_scatter=accelerated,
        micro_batch_overhead=overhead, live=True, platform=device.platform,
        memory_bandwidth=bandwidth,
        attention_flops=(like.attention_flops * rate / like.matmul_flops
                         if like and like.attention_flops else 0.0),
        slice_devices=jax.device_count() // len(by_slice) if dcn_bw > 0 else 0, dcn=dcn,
        source=f"measured by redray's probe on {time.strftime('%Y-%m-%d %H:%M')} ({slices}); "
               f"peak from {like.name if like else 'the measured rate'}")


def _flat(link: Link | None) -> tuple[float, float]:
    return (0.0, 0.0) if link is None else (link.bandwidth, link.latency)
