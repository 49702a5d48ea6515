"""Specs and shardings for whole pytrees (NNX state, Linen params, optimizer state)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from redray.sharding import dataflow
from redray.sharding.parallelism import Parallelism
from redray.sharding.rules import SpecPass, partition_specs


def path_str(path) -> str:
    """A pytree key path as "a/b/0/kernel" (NNX's trailing ``.value`` dropped)."""
    parts = []
    for k in path:
        if isinstance(k, DictKey):
            parts.append(str(k.key))
        elif isinstance(k, GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, (SequenceKey, FlattenedIndexKey)):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def flatten(tree) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) of a pytree.

    A tuple at the top is a group of trees (the engine's ``(params, extra)``): its
    members' paths carry no index, so user rules match "layer/kernel", not "0/layer/kernel".
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    group = isinstance(tree, tuple)
    return ([path_str(p[1:] if group else p) for p, _ in with_path],
            [leaf for _, leaf in with_path], treedef)


def derive_specs(tree, mesh: Mesh | AbstractMesh, fn: Callable | None = None, args=(),
                 rules=(), whole: list | None = None, passes: Sequence[SpecPass] | None = None,
                 stacked: dict | None = None):
    """PartitionSpecs for every array of ``tree`` (same structure as ``tree``).

    Args:
      tree: parameters (and other model state): arrays or ``jax.ShapeDtypeStruct``.
      mesh: the mesh; its axis sizes decide the splits.
      fn: ``fn(tree, *args)`` runs the model (e.g. the loss on a batch). It is traced
        once on abstract values to find which layer feeds which. Without it, only
        parameter names guide the split (embeddings), everything else is replicated
        over ``model``.
      args: the inputs ``fn`` needs besides ``tree`` (arrays or ShapeDtypeStructs).
      rules: ordered (regex on the "/"-joined path, PartitionSpec) overrides.
      whole: if given, a list that receives a ``rules.Whole`` (path, reason, fix) for
        every layer parameter left unsplit over ``model``.
      passes: the spec passes to run (default: ``Parallelism.spec_passes`` with
        ``rules``).
      stacked: if given, a dict that receives, for every array of scanned layers found
        by the trace, its path -> the layers it stacks (``fn`` is then traced whatever
        the plan; nothing without ``fn``).
    """
    if passes is None:
        passes = Parallelism.of(rules=rules).spec_passes()
    elif rules:
        raise ValueError("give the rules inside the passes (UserRules), not beside them")
    paths, leaves, treedef = flatten(tree)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    trace = None
    needed = fn is not None and any(p.traces(dict(mesh.shape)) for p in passes)
    if needed or (fn is not None and stacked is not None):
        trace = trace_tree(tree, fn, args)
    if stacked is not None and trace is not None:
        stacked.update(_stacked_in(trace, paths, abstract))
    specs = partition_specs(passes, paths, [a.shape for a in abstract],
                            [a.dtype for a in abstract], dict(mesh.shape),
                            trace if needed else None, whole)
    return jax.tree.unflatten(treedef, specs)


def stacked_arrays(tree, fn: Callable, args=()) -> dict:
    """The arrays of ``tree`` that stack layers a scan steps over ("/"-joined path ->
    the layers they stack), from the dataflow of ``fn(tree, *args)``."""
    paths, leaves, _ = flatten(tree)
    return _stacked_in(trace_tree(tree, fn, args), paths, leaves)


def _stacked_in(trace, paths: list, leaves: list) -> dict:
    """path -> layers of each array a scan of ``trace`` steps over."""
    return {paths[i]: leaves[i].shape[min(dims)] for i, dims in trace.scanned.items() if dims}


def trace_tree(tree, fn: Callable, args=()) -> dataflow.Trace:
    """The dataflow of ``fn(tree, *args)`` over ``tree``'s arrays (in ``flatten``'s
    order), traced once on abstract values."""
    _, leaves, treedef = flatten(tree)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    return dataflow.trace(lambda ls, *a: fn(jax.tree.unflatten(treedef, ls), *a),
                          abstract, *args)


def follow_specs(tree, reference, reference_specs):
    """Specs for a tree whose arrays mirror ``reference`` (e.g. Adam's moments).

    A leaf whose path ends with a reference path and has the same shape takes that
    parameter's spec; everything else (step counts, scalars) is replicated.
    """
    ref_paths, ref_leaves, _ = flatten(reference)
    _, ref_specs, _ = flatten(jax.tree.map(lambda s: _Box(s), reference_specs,
                                           is_leaf=lambda x: isinstance(x, P)))
    by_path = {p: (x.shape, s.spec) for p, x, s in zip(ref_paths, ref_leaves, ref_specs)}
    paths, leaves, treedef = flatten(tree)
    out = []
    for path, leaf in zip(paths, leaves):
        spec = P()
        parts = path.split("/")
        for k in range(len(parts)):
            hit = by_path.get("/".join(parts[k:]))
            if hit is not None and tuple(hit[0]) == tuple(getattr(leaf, "shape", ())):
                spec = hit[1]
                break
        out.append(spec)
    return jax.tree.unflatten(treedef, out)


class _Box:
    """Keeps a PartitionSpec (a tuple) a single leaf while flattening."""

    def __init__(self, spec):
        self.spec = spec


def shardings(mesh: Mesh, specs):
    """NamedShardings for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))
