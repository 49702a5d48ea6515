"""Placement: what every device holds of each array, computed without allocating anything.

(``Trainer.placement()`` prints it; ``redray plan`` builds on it, in
``redray/planning/from_config.py``.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from redray.sharding.parallelism import describe_shape
from redray.sharding.rules import Whole, axes_of
from redray.sharding.specs import flatten


@dataclasses.dataclass(frozen=True)
class Placement:
    """One array on a mesh: its path, shape, dtype, spec and bytes on each device."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    bytes_per_device: int


def _ways(entry, mesh_shape: dict) -> int:
    """The shards one entry of a PartitionSpec cuts its dimension into."""
    return math.prod(mesh_shape[axis] for axis in axes_of(entry))


def _shards(spec: P, mesh_shape: dict) -> int:
    return math.prod(_ways(entry, mesh_shape) for entry in spec)


def _per_device(shape: tuple, spec: P, mesh_shape: dict) -> int:
    """Elements of an array of ``shape`` that one device holds on ``spec``: each split
    dimension's share rounded up (a stage split of layers it does not divide is held
    padded: ``parallelism.layer_order``)."""
    return math.prod(-(-size // _ways(spec[d] if d < len(spec) else None, mesh_shape))
                     for d, size in enumerate(shape))


def placement(tree, specs, mesh: Mesh) -> list[Placement]:
    """One row per array: path, shape, dtype, spec and bytes held by each device.

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
      specs: the matching tree of PartitionSpecs.
      mesh: the mesh the specs refer to.
    """
    paths, leaves, _ = flatten(tree)
    spec_leaves = _spec_leaves(specs)
    rows = []
    for path, leaf, spec in zip(paths, leaves, spec_leaves):
        rows.append(Placement(path, tuple(leaf.shape), str(leaf.dtype), spec,
                              _per_device(leaf.shape, spec, dict(mesh.shape))
                              * leaf.dtype.itemsize))
    return rows


def _spec_leaves(specs):
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def format_placement(rows: list[Placement], mesh: Mesh) -> str:
    """A readable table of placements, with totals per device."""
    axes = describe_shape(dict(mesh.shape))
    width = max([len(r.path) for r in rows] + [9])
    lines = [f"mesh {axes} ({mesh.size} devices)",
             f"{'parameter':<{width}}  {'shape':<20} {'spec':<28} {'bytes/device':>14}"]
    for r in rows:
        lines.append(f"{r.path:<{width}}  {str(r.shape):<20} {str(tuple(r.spec)):<28} "
                     f"{r.bytes_per_device:>14,}")
    total = sum(r.bytes_per_device for r in rows)
    full = sum(r.bytes_per_device * _shards(r.spec, dict(mesh.shape)) for r in rows)
    lines.append(f"{'total':<{width}}  {'':<20} {'':<28} {total:>14,}  "
                 f"(unsharded {full:,})")
    return "\n".join(lines)


def format_whole(whole: list[Whole], model_size: int) -> str:
    """Layer parameters left whole over ``model``, each with why and the fix."""
    if not whole:
        return f"every layer parameter is split over the model axis ({model_size})"
    lines = [f"left whole over the model axis ({model_size}):"]
    for w in whole:
        fix = f"; fix: {w.fix}" if w.fix else " (as intended)"
        lines.append(f"  {w.path} {w.shape}: {w.reason}{fix}")
    return "\n".join(lines)
