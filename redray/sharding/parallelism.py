"""The parallelism plan: the named mesh axes, the mesh, the batch geometry and the spec
passes, in one value.

A ``Parallelism`` says how a job is split over devices. Each mesh axis is an ``Axis``
entry of ``AXES``: its name, whether it splits the batch, where it lies across hosts,
and the keyword users size it with (``model_axis=2``). From the sizes it builds the
device mesh (hybrid across hosts: the axes that must stay inside a host do), the batch
geometry (``BatchGeometry``: global batch, micro-batch, accumulation, this process's
rows) and the ordered spec passes that give every parameter its ``PartitionSpec``
(user rules, tensor parallel from the dataflow, FSDP, large arrays over the model
axis; ``redray/sharding/rules.py``).

An axis is its entry in ``AXES``: the cost model, the memory model, the planner and the
layers read it by its roles (``ROLES``: what of the activations it splits) and flags,
never by its name. One that splits parameters has a pass in ``Parallelism.spec_passes``;
docs/architecture.md walks through adding one.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from redray.sharding.rules import (ExpertParallel, Fsdp, LargeOver, SpecPass, StageParallel,
                                   TensorParallel, UserRules, axes_of, without_axis)

# Where an axis lies when the mesh spans hosts.
INSIDE = "inside"  # within one host: its collectives stay on the fast link (NVLink, ICI)
PREFER_INSIDE = "prefer inside"  # within a host as far as it fits, the rest across hosts
ACROSS = "across"  # what the others leave: across hosts
OUTER = "outer"  # across hosts before any other axis: inside a host only where room is left


@dataclasses.dataclass(frozen=True)
class Axis:
    """One named axis of the device mesh.

    Attributes:
      name: the mesh axis name (what PartitionSpecs and user rules name).
      keyword: the friendly keyword that sizes it (``Trainer.of(model_axis=2)``).
      default: that keyword's default: a size, or "auto" (what the other axes leave).
      splits_batch: the batch's leading dimension is split over it.
      splits_parameters: parameters are split over it (else each device of the axis
        holds them whole, as data parallelism does by design).
      hosts: ``INSIDE``, ``PREFER_INSIDE``, ``ACROSS`` or ``OUTER``: where it lies on
        several hosts.
      doc: what it does, in a line.
      shown_at_one: named in a plan's description when its size is 1 (an axis only some
        models use, as experts, is named only where it splits something).
      roles: what of a model's activations it splits (``ROLES``): the layers read
        roles while they trace (``redray.sharding.tracing``), and the cost model, the
        memory model and the planner price an axis by its roles and the flags above,
        never by its name.
      gathers: a parameter split over it is all-gathered before each use and its
        gradient reduced onto the shards (ZeRO-3): the cost model prices those
        collectives, the memory model the gathered layers.
      passes: the spec passes that split parameters over it, each ``(precedence,
        make)``: ``make(name)`` builds the ``SpecPass`` (``redray/sharding/rules.py``),
        and ``Parallelism.spec_passes`` runs every axis's passes by precedence, after
        the user's rules (a lower one first: it claims its dimensions before the next).
    """
    name: str
    keyword: str
    default: int | str
    splits_batch: bool
    splits_parameters: bool
    hosts: str
    doc: str
    shown_at_one: bool = True
    roles: tuple[str, ...] = ()
    gathers: bool = False
    passes: tuple[tuple[int, Callable[[str], SpecPass]], ...] = ()


# What of a model's activations a mesh axis may split (``Axis.roles``): a batch's rows,
# a sequence's tokens, the stacked layers, a layer's heads and inner features, the
# experts of a mixture.
ROLES = ("rows", "sequence", "layers", "heads", "experts")

STAGE = Axis("stage", "stage_axis", 1, False, True, OUTER,
             "pipeline parallelism: the scanned layers split into stages, micro-batches "
             "passed from stage to stage (only activations cross it)",
             shown_at_one=False, roles=("layers",), passes=((0, StageParallel),))
DATA = Axis("data", "data_axis", "auto", True, False, ACROSS,
            "data parallelism: each device a replica of the model, a part of the batch",
            roles=("rows",))
FSDP = Axis("fsdp", "fsdp_axis", 1, True, True, PREFER_INSIDE,
            "data parallelism whose parameters and optimizer state are sharded too (ZeRO-3)",
            roles=("rows",), gathers=True, passes=((3, Fsdp),))
EXPERT = Axis("expert", "expert_axis", 1, True, True, INSIDE,
              "expert parallelism: a mixture of experts' experts split, tokens sent to "
              "theirs by all-to-all; data parallelism for the other layers",
              shown_at_one=False, roles=("rows", "experts"), passes=((2, ExpertParallel),))
CONTEXT = Axis("context", "context_axis", 1, False, False, PREFER_INSIDE,
               "context parallelism: each sequence split over it, attention passing keys "
               "and values around (long sequences whose activations one device cannot hold)",
               shown_at_one=False, roles=("sequence",))
MODEL = Axis("model", "model_axis", 1, False, True, INSIDE,
             "tensor parallelism: layers split, one all-reduce per column/row pair",
             roles=("heads",),
             # last, what no pass split and is large: over it too, beside FSDP's split
             passes=((1, TensorParallel),
                     (4, lambda name: LargeOver(name, with_axis=GATHERING[0]))))

# In mesh order: the last is innermost, its peers neighbours in the device order.
AXES: tuple[Axis, ...] = (STAGE, DATA, FSDP, EXPERT, CONTEXT, MODEL)
BATCH_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.splits_batch)


def role_axes(role: str) -> tuple[str, ...]:
    """The names of the axes that play ``role`` (``ROLES``), in mesh order."""
    if role not in ROLES:
        raise ValueError(f"{role!r} is not a role of the mesh: use one of {', '.join(ROLES)}")
    return tuple(a.name for a in AXES if role in a.roles)


def role_keywords(role: str) -> tuple[str, ...]:
    """The keywords of the axes that play ``role``, in mesh order."""
    return tuple(a.keyword for a in AXES if a.name in role_axes(role))


def role_size(shape: Mapping[str, int], role: str) -> int:
    """How many ways the axes that play ``role`` split it on a mesh of ``shape`` (axis
    name -> size): 1 where no axis does."""
    return math.prod(shape.get(a, 1) for a in role_axes(role))


# The axes whose split parameters are gathered before each use (``Axis.gathers``).
GATHERING: tuple[str, ...] = tuple(a.name for a in AXES if a.gathers)
KEYWORDS: tuple[str, ...] = tuple(a.keyword for a in AXES)
# The axes that split parameters, innermost first.
PARAMETER_AXES: tuple[Axis, ...] = tuple(a for a in reversed(AXES) if a.splits_parameters)


def describe_shape(shape: Mapping[str, int]) -> str:
    """``data=2 x fsdp=1 x model=2``: a mesh's axis sizes by name (an axis of size 1
    that is not ``shown_at_one`` left out)."""
    quiet = {a.name for a in AXES if not a.shown_at_one}
    return " x ".join(f"{k}={v}" for k, v in shape.items() if not (v == 1 and k in quiet))


def axis_defaults() -> dict[str, int | str]:
    """keyword -> default size of every axis (``{"data_axis": "auto", ...}``)."""
    return {a.keyword: a.default for a in AXES}


def _axis_size(keyword: str, value, n_devices: int) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{keyword}={value!r} is not a valid axis size: use a positive int or "
                         "'auto'")
    if n_devices % value:
        raise ValueError(
            f"{keyword}={value} does not divide the {n_devices} devices: choose a divisor of "
            f"{n_devices} ({', '.join(str(d) for d in _divisors(n_devices))})")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_sizes(sizes: Mapping[str, int | str], n_devices: int) -> tuple[int, ...]:
    """Every axis's size over ``n_devices`` (in ``AXES`` order), the one "auto" axis
    taking what the others leave; ``sizes`` by keyword (missing: the axis's default)."""
    given = {a.keyword: _axis_size(a.keyword, sizes.get(a.keyword, a.default), n_devices)
             for a in AXES}
    auto = [k for k, v in given.items() if v is None]
    if len(auto) > 1:
        raise ValueError(f"only one axis may be 'auto', got {auto}: give the others a size")
    fixed = math.prod(v for v in given.values() if v is not None)
    if n_devices % fixed:
        raise ValueError(
            f"axis sizes {({k: v for k, v in given.items() if v})} multiply to {fixed}, "
            f"which does not divide the {n_devices} devices")
    if auto:
        given[auto[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ValueError(
            f"axis sizes multiply to {fixed} but there are {n_devices} devices: make one axis "
            f"'auto' or pass devices=jax.devices()[:{fixed}]")
    return tuple(given[a.keyword] for a in AXES)


# The order in which axes take the room inside a host: the last is the first to cross
# hosts (pipeline stages: only activations cross them).
HOST_FILL = (INSIDE, PREFER_INSIDE, ACROSS, OUTER)
# Inside a slice: the data axis is the first to cross slices (its one gradient
# reduction per micro-batch over the data-centre network), as MaxText's
# ``dcn_data_parallelism`` takes what the other DCN axes leave; stages only where no
# data axis is left to cross.
SLICE_FILL = (INSIDE, PREFER_INSIDE, OUTER, ACROSS)


def hybrid_shapes(shape: Sequence[int], processes: int, local: int,
                  fill: Sequence[str] = HOST_FILL) -> tuple[tuple, tuple] | None:
    """(across hosts, inside a host) shapes of a mesh of ``shape`` (``AXES`` order) over
    ``processes`` hosts of ``local`` devices: ``INSIDE`` axes wholly inside a host (their
    collectives on the fast interconnect), ``PREFER_INSIDE`` ones inside as far as
    they fit (the innermost first), ``ACROSS`` ones take the rest, and ``OUTER`` ones
    (pipeline stages) are the first to cross hosts; None when an ``INSIDE`` axis needs
    more devices than a host has. ``fill``: the order in which the axes take a host's
    room (``SLICE_FILL`` for slices in place of hosts: ``network_shapes``)."""
    if len(shape) != len(AXES):
        raise ValueError(f"a mesh shape of {len(shape)} sizes: give one per axis of AXES "
                         f"({', '.join(a.name for a in AXES)})")
    inside = [1] * len(AXES)
    room = local
    for where in fill:
        # the innermost first among those that prefer a host: the context ring's step
        # per layer before FSDP's gathers
        order = list(enumerate(AXES))
        for k, axis in reversed(order) if where == PREFER_INSIDE else order:
            if axis.hosts != where:
                continue
            inside[k] = math.gcd(shape[k], room)
            if where == INSIDE and inside[k] != shape[k]:
                return None
            room //= inside[k]
    if room != 1:
        return None
    across = tuple(s // i for s, i in zip(shape, inside))
    if math.prod(across) != processes:
        return None
    return across, tuple(inside)


def network_shapes(shape: Sequence[int], slices: int, hosts: int,
                   local: int) -> tuple[tuple, tuple, tuple] | None:
    """(across slices, across the hosts of a slice, inside a host) shapes of a mesh of
    ``shape`` (``AXES`` order) over ``slices`` slices of ``hosts / slices`` hosts of
    ``local`` devices each, as ``device_grid`` lays it out: the slices first
    (``SLICE_FILL``: the data axis crosses them first), then each slice's share over its
    hosts (``hybrid_shapes``); None where it cannot be placed. One slice:
    ``hybrid_shapes`` with nothing across slices."""
    ones = (1,) * len(shape)
    if slices <= 1:
        split = hybrid_shapes(shape, hosts, local) if hosts > 1 else (ones, tuple(shape))
        return None if split is None else (ones, *split)
    if hosts % slices:
        return None
    outer = hybrid_shapes(shape, slices, hosts // slices * local, SLICE_FILL)
    if outer is None:
        return None
    inner = network_shapes(outer[1], 1, hosts // slices, local)
    return None if inner is None else (outer[0], *inner[1:])


def device_grid(devices: Sequence[jax.Device], shape: Sequence[int]) -> np.ndarray:
    """``devices`` arranged as ``shape`` (``AXES`` order): on several slices (TPU
    multislice) the slices line up along the axes that cross them, the data axis first
    (``network_shapes``: as ``create_hybrid_device_mesh`` with the slice as granule),
    each slice laid out as follows; on several hosts each host's devices hold whole
    groups of the axes that stay inside it, hosts line up along the others (JAX's
    hybrid mesh); on one host, JAX's device mesh (the physical topology on TPU, the
    device order elsewhere)."""
    from jax.experimental import mesh_utils

    shape = tuple(shape)
    by_slice = device_slices(devices)
    if len(by_slice) > 1:
        grid = _slices_grid(by_slice, shape)
        if grid is not None:
            return grid
        warnings.warn(f"the mesh {describe_shape(dict(zip((a.name for a in AXES), shape)))} "
                      f"does not split over {len(by_slice)} slices of equal size: its "
                      "collectives cross slices where the device order puts them",
                      stacklevel=4)
    hosts: dict[int, int] = {}
    for d in devices:
        hosts[d.process_index] = hosts.get(d.process_index, 0) + 1
    if len(hosts) > 1 and len(set(hosts.values())) == 1:
        local = next(iter(hosts.values()))
        split = hybrid_shapes(shape, len(hosts), local)
        if split is not None:
            return mesh_utils.create_hybrid_device_mesh(split[1], split[0], devices,
                                                        process_is_granule=True)
        too_big = [f"{a.keyword}={s}" for a, s in zip(AXES, shape)
                   if a.hosts == INSIDE and local % s]
        warnings.warn(f"{', '.join(too_big)} is larger than a host's {local} devices: its "
                      "collectives cross hosts (the slow network); within a host is faster",
                      stacklevel=4)
    elif len(hosts) == 1:
        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # a subset of a TPU slice, say: the given order
    # Peers of the innermost axis stay neighbours in the device order.
    return np.array(devices, dtype=object).reshape(shape)


def device_slices(devices: Sequence[jax.Device]) -> dict[int, list]:
    """slice -> its devices, in order: a TPU device's ``slice_index``; elsewhere (CPU
    devices standing in for chips) the slices ``MEGASCALE_NUM_SLICES`` names, the
    processes in slice order (host 0 on slice 0's worker 0, as the cluster starts
    them); one slice where neither is set."""
    import os

    processes = jax.process_count()
    count = int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1)
    out: dict[int, list] = {}
    for d in devices:
        index = getattr(d, "slice_index", None)
        if index is None:
            index = d.process_index * count // processes if processes % count == 0 else 0
        out.setdefault(index, []).append(d)
    return dict(sorted(out.items()))


def _slices_grid(by_slice: dict[int, list], shape: tuple) -> np.ndarray | None:
    """The devices of several slices arranged as ``shape``: the axes across slices as
    ``network_shapes`` splits them (the slice the outer part of each), each slice's
    devices as ``device_grid`` arranges one slice's (over its hosts); None where the
    slices differ in size or the mesh does not split over them."""
    sizes = {len(v) for v in by_slice.values()}
    if len(sizes) != 1:
        return None
    split = hybrid_shapes(shape, len(by_slice), sizes.pop(), SLICE_FILL)
    if split is None:
        return None
    across, inside = split
    grids = np.stack([device_grid(v, inside) for v in by_slice.values()])
    n = len(shape)
    grid = grids.reshape(*across, *inside)
    return grid.transpose([k for i in range(n) for k in (i, n + i)]).reshape(shape)


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """How one global batch is cut: over devices, into micro-batches, over processes.

    A micro-batch is what one device runs through the layers at a time. Without pipeline
    stages the micro-batches of an update run one after the other (gradient
    accumulation); with stages they are the pipeline's micro-batches, which the stages
    work on at once (``redray/models/staged_layers.py``). Either way one update sees the
    whole batch and the loss and gradients are the same.

    Attributes:
      batch_size: examples per optimizer update (the global batch).
      data_parallel: how many ways each micro-batch is split (the batch axes' product).
      micro_batch_size: examples per device in one micro-batch.
      accumulation: micro-batches per update (accumulated, or pipelined with stages).
      process_rows: the rows of a global batch this process's devices hold.
    """
    batch_size: int
    data_parallel: int
    micro_batch_size: int
    accumulation: int
    process_rows: slice

    @property
    def micro_rows(self) -> int:
        """Rows of one micro-batch over all devices."""
        return self.micro_batch_size * self.data_parallel

    @property
    def groups(self) -> int:
        """How many distinct parts of a batch the processes feed (hosts holding the same
        rows, as when a batch is replicated across hosts, count once)."""
        return self.batch_size // (self.process_rows.stop - self.process_rows.start)


def default_micro_batches(rows: int, stages: int) -> int:
    """How many micro-batches a batch of ``rows`` per data-parallel group is cut into
    when the user does not say: 1 without stages (no accumulation); with ``S`` stages
    the fewest that are at least ``4 S`` and divide the rows (the bubble, ``S - 1`` of
    ``M + S - 1`` ticks, then under a fifth of the schedule), else one per row."""
    if stages <= 1:
        return 1
    return next((m for m in range(4 * stages, rows + 1) if rows % m == 0), rows)


def pipeline_ticks(stages: int, micro: int, repeats: int = 1) -> tuple[int, int]:
    """(micro-batch slots ``P``, ticks) of the pipeline's schedule
    (``redray/models/staged_layers.py``) on ``S`` stages over ``M`` micro-batches: with
    circular repeats the micro-batches go round in groups of ``S`` (``P``: ``M`` rounded
    up to a multiple of ``S``, the missing ones bubbles), without ``P = M``; ``P R + S
    - 1`` ticks, each running ``1 / (S R)`` of the layers on a stage."""
    padded = micro if repeats == 1 else -(-micro // stages) * stages
    return padded, padded * repeats + stages - 1


def check_stages(layers: int, stages: int, repeats: int = 1) -> None:
    """Raises where ``stages`` x ``repeats`` chunks cannot hold ``layers`` layers: each
    chunk needs at least one. A count the chunks do not divide is held padded
    (``layer_order``)."""
    if layers < stages * repeats:
        what = f"stage_axis={stages}" if repeats == 1 else \
            f"stage_axis={stages} x stage_repeats={repeats} = {stages * repeats} chunks"
        raise ValueError(f"{what} is more than the model's {layers} layers (each stage's "
                         f"chunk needs one): use at most {layers} in all")


def held_layers(layers: int, stages: int, repeats: int = 1) -> int:
    """How many layers' rows a plan with ``stages`` x ``repeats`` chunks holds for a
    stack of ``layers``: every chunk as large as the largest, ``ceil(L / (S R))``, so
    the layer axis splits evenly over ``stage`` (the rows past ``layers`` are pads,
    identity layers: ``layer_order``)."""
    chunks = stages * repeats
    return -(-layers // chunks) * chunks


def chunk_sizes(layers: int, stages: int, repeats: int = 1) -> list[int]:
    """The real layers of each of the ``S R`` chunks, in the order a micro-batch runs
    them: ``ceil(L / (S R))``, one fewer in each of the last ``held - L`` chunks (where
    the chunks do not divide the layers; at most one pad a chunk, so no stage runs more
    than one layer of padding a pass)."""
    check_stages(layers, stages, repeats)
    chunks = stages * repeats
    k = -(-layers // chunks)
    pads = k * chunks - layers
    return [k - (c >= chunks - pads) for c in range(chunks)]


def layer_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """The order in which a plan with stages holds stacked parameters: position ``p``
    of the layer axis (``held_layers`` long) holds layer ``order[p]``, or a pad where
    ``order[p] == layers`` (an identity layer: ``staged_layers.run_stages`` keeps its
    input; its parameters are zeros, their gradients zero).

    The layers form ``S R`` chunks (``chunk_sizes``: consecutive layers, ``k =
    ceil(L / (S R))`` slots each) and chunk ``c`` runs on stage ``c mod S``: with ``R``
    circular repeats a micro-batch passes the stages ``R`` times. The layer axis is
    split over ``stage`` in consecutive blocks, so stage ``s``'s block holds its chunks
    ``s, S + s, ..., (R - 1) S + s`` in turn. Without repeats and pads the order is the
    layers' own. The state (and its optimizer moments) keeps this order for the whole
    run, so no parameter moves between stages; checkpoints and the model a user reads
    hold the layers' own order, pads dropped (``reorder``, ``ModelRuntime.reorder``)."""
    sizes = chunk_sizes(layers, stages, repeats)
    k, start = sizes[0], 0
    order = np.full((stages, repeats, k), layers)
    for c, n in enumerate(sizes):
        order[c % stages, c // stages, :n] = np.arange(start, start + n)
        start += n
    return order.reshape(-1)


def layer_positions(layers: int, stages: int, repeats: int) -> np.ndarray:
    """Where ``layer_order`` holds each layer: layer ``i`` at position ``positions[i]``."""
    return np.argsort(layer_order(layers, stages, repeats), kind="stable")[:layers]


def in_held_order(a, layers: int, stages: int, repeats: int):
    """``a`` (one entry per layer, in the layers' own order: a stack's other state, a
    per-layer input) in ``layer_order``, a pad's entry the last layer's (its output
    unused); ``a`` itself where that order is the layers' own."""
    order = layer_order(layers, stages, repeats)
    if len(order) == layers and repeats == 1:
        return a
    return jnp.take(a, order, axis=0, mode="clip")


def held_whole(spec) -> tuple:
    """The entries of a stacked parameter's ``spec`` after its layers' dimension, as a
    pipeline stage holds it for the whole step: FSDP's axes left out (gathered once,
    before the ticks), the model and expert axes' splits kept (the layers compute on
    those shards inside the stages)."""
    return tuple(without_axis(entry, *GATHERING) for entry in tuple(spec)[1:])


def is_staged(sharding) -> bool:
    """Whether ``sharding`` (a NamedSharding, or a PartitionSpec) splits an array's
    leading axis over ``stage``: a stacked layer array on a plan with stages."""
    spec = getattr(sharding, "spec", sharding)
    return bool(spec) and STAGE.name in axes_of(spec[0])


def unstaged(sharding):
    """``sharding`` with ``stage`` taken off its leading axis: how a stacked array is
    laid out in the layers' own order, which ``stage`` may not divide (a checkpoint's,
    the model a user reads); anything else as it is."""
    if not is_staged(sharding):
        return sharding
    return NamedSharding(sharding.mesh, P(without_axis(sharding.spec[0], STAGE.name),
                                          *sharding.spec[1:]))


def reorder(tree, shardings, stages: int, repeats: int, to_plan: bool, layers=()):
    """``tree``'s stacked arrays (those whose ``shardings`` split their leading axis over
    ``stage``: parameters and what follows them, as optimizer moments) from the
    layers' own order into ``layer_order`` (``to_plan``: pads of zeros added where the
    chunks do not divide the layers), or back (the pads dropped); every other leaf as it
    is. ``layers``: the model's stacked layer counts (each array's, read from its held
    length going back). Traceable: jit it with ``shardings`` (``to_plan``), or
    ``unstaged`` ones, as the output's."""
    def move(x, sharding):
        if stages <= 1 or not is_staged(sharding):
            return x
        if to_plan:
            count = x.shape[0]
        else:
            count = stacked_count(x.shape[0], layers, stages, repeats)
        held = held_layers(count, stages, repeats)
        if repeats == 1 and held == count:
            return x
        if not to_plan:
            return x[layer_positions(count, stages, repeats)]
        if held > count:
            x = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])
        return x[layer_order(count, stages, repeats)]

    return jax.tree.map(move, tree, shardings)


def stacked_count(held: int, layers, stages: int, repeats: int) -> int:
    """The layer count among ``layers`` (a model's stacks') that a plan holds in
    ``held`` rows; ``held`` itself where none does (no pads)."""
    found = {n for n in layers if held_layers(n, stages, repeats) == held}
    if len(found) > 1:
        raise ValueError(f"stacks of {sorted(found)} layers are both held in {held} rows on "
                         f"stage_axis={stages} x stage_repeats={repeats}: use a stage axis "
                         "that divides each stack's layers")
    return found.pop() if found else held


def _check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def batch_axes_text(shape: Mapping[str, int] | None = None) -> str:
    """``data x fsdp``: the batch axes (of a mesh of ``shape``, those it names: an axis
    that is not ``shown_at_one`` only where it is larger than 1)."""
    quiet = {a.name for a in AXES if not a.shown_at_one}
    return " x ".join(a for a in BATCH_AXES
                      if a not in quiet or (shape is not None and shape.get(a, 1) > 1))


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a job is split over devices: the size of every mesh axis, the user's
    sharding rules, and, once built, the mesh.

    Build one with ``Parallelism.of(model_axis=2, ...)`` (the keywords of ``AXES``, or a
    ``mesh``), then ``build()`` it on the devices (or ``abstract(n)`` to plan without
    any). Trainer, Predictor, ``from_pretrained`` and ``redray plan`` take it as
    ``parallelism=``; their ``*_axis`` keywords build one.

    Attributes:
      sizes: keyword -> size (or "auto") of each axis given; the rest take their defaults.
      rules: ordered (regex on the parameter path, PartitionSpec) overrides: the first
        spec pass.
      mesh: the built mesh (a ``Mesh``, or an ``AbstractMesh`` to plan without devices);
        None until built.
    """
    sizes: Mapping[str, int | str] = dataclasses.field(default_factory=dict)
    rules: tuple = ()
    mesh: Mesh | AbstractMesh | None = None

    @classmethod
    def of(cls, mesh: Mesh | None = None, rules=(), *, caller: str = "Parallelism.of",
           **sizes) -> "Parallelism":
        """A plan from the friendly keywords (``data_axis``, ``fsdp_axis``,
        ``model_axis``: the ``keyword`` of every axis of ``AXES``; "auto" for one of
        them), or from a built ``mesh``. ``caller`` names who was given ``sizes``, for
        the error an unknown keyword gets."""
        unknown = sorted(set(sizes) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"{caller} got unknown keyword(s) {unknown}: neither one of its "
                            f"arguments nor an axis size ({', '.join(KEYWORDS)})")
        rules = tuple(rules or ())
        if mesh is None:
            return cls(dict(sizes), rules)
        if sizes and any(sizes[k] != axis_defaults()[k] for k in sizes):
            raise ValueError("give either mesh= or axis sizes, not both: the mesh fixes them")
        missing = [a.name for a in AXES if a.name not in mesh.shape]
        if missing or len(mesh.shape) != len(AXES):
            raise ValueError(f"the mesh's axes {tuple(mesh.shape)} are not redray's "
                             f"{tuple(a.name for a in AXES)}: build it with redray.make_mesh")
        return cls({a.keyword: mesh.shape[a.name] for a in AXES}, rules, mesh)

    @classmethod
    def resolve(cls, parallelism: "Parallelism | None", mesh: Mesh | None, rules,
                sizes: Mapping[str, int | str], caller: str = "Parallelism.resolve",
                keyword: str = "parallelism") -> "Parallelism":
        """The built plan of a Trainer, Predictor or ``from_pretrained``: ``parallelism``
        as given (built on every device if not yet), else one from ``mesh`` or the axis
        keywords. Giving ``parallelism`` beside a mesh, rules or axis sizes is an error
        (``keyword``: what the caller names it)."""
        if parallelism is None:
            return cls.of(mesh, rules, caller=caller, **sizes).build()
        if not isinstance(parallelism, Parallelism):
            raise TypeError(f"parallelism must be a redray.Parallelism, got "
                            f"{type(parallelism).__name__}")
        cls.of(caller=caller, **sizes)  # an unknown keyword fails as such
        changed = [k for k, v in sizes.items() if v != axis_defaults()[k]]
        if mesh is not None or rules or changed:
            extra = changed + (["mesh"] if mesh is not None else []) + (["rules"] if rules
                                                                       else [])
            raise ValueError(f"give either {keyword}= or {', '.join(extra)}, not both: "
                             "the plan holds its axis sizes, mesh and rules")
        return parallelism.build()

    def shape_over(self, n_devices: int) -> tuple[int, ...]:
        """Each axis's size (``AXES`` order) on ``n_devices``."""
        return resolve_sizes(self.sizes, n_devices)

    def build(self, devices: Sequence[jax.Device] | None = None) -> "Parallelism":
        """This plan on ``devices`` (default: every host's): a copy holding its mesh (a
        plan built already is returned as it is; an abstract one is built on them)."""
        if isinstance(self.mesh, Mesh):
            return self
        devices = list(jax.devices() if devices is None else devices)
        shape = self.shape_over(len(devices))
        mesh = Mesh(device_grid(devices, shape), tuple(a.name for a in AXES))
        return dataclasses.replace(self, sizes=self._sized(shape), mesh=mesh)

    def abstract(self, n_devices: int) -> "Parallelism":
        """This plan on ``n_devices`` that do not exist (an ``AbstractMesh``): specs and
        bytes per device, no allocation."""
        shape = self.shape_over(n_devices)
        mesh = AbstractMesh(shape, tuple(a.name for a in AXES))
        return dataclasses.replace(self, sizes=self._sized(shape), mesh=mesh)

    def _sized(self, shape) -> dict:
        return {a.keyword: s for a, s in zip(AXES, shape)}

    # ------------------------------------------------------------------ built plans
    def _built(self):
        if self.mesh is None:
            raise ValueError("this Parallelism is not built: call .build() (or .abstract(n))")
        return self.mesh

    def size(self, axis: Axis) -> int:
        """The size of ``axis`` in the built mesh."""
        return self._built().shape[axis.name]

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return {a.name: self.size(a) for a in AXES}

    def role_size(self, role: str) -> int:
        """How many ways the axes that play ``role`` (``ROLES``) split it."""
        return role_size(self.shape, role)

    @property
    def devices(self) -> int:
        return math.prod(self.shape.values())

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split (the product of the batch axes)."""
        return math.prod(self.size(a) for a in AXES if a.splits_batch)

    def describe(self) -> str:
        """``data=2 x fsdp=1 x model=2``."""
        return describe_shape(self.shape)

    def batch_sharding(self) -> NamedSharding:
        """A batch-major array: its leading dimension over the batch axes."""
        return NamedSharding(self._built(), P(BATCH_AXES))

    def micro_batches_sharding(self) -> NamedSharding:
        """A stack of micro-batches (accumulation, rows, ...): each split like a batch."""
        return NamedSharding(self._built(), P(None, BATCH_AXES))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self._built(), P())

    def rows_sharding(self, rows: int) -> NamedSharding:
        """A batch of ``rows``: split over the batch axes if it divides, else replicated
        (a short last batch of an evaluation)."""
        return self.batch_sharding() if rows % self.data_parallel == 0 else self.replicated()

    def process_rows(self, rows: int, sharding: NamedSharding | None = None) -> slice:
        """The rows of a ``rows``-long batch that this process's devices hold.

        With the batch split over hosts, each host feeds its block; with it replicated
        (the batch axes inside one host, or a replicated remainder batch), every host
        feeds all.
        """
        sharding = sharding or self.batch_sharding()
        index_map = sharding.addressable_devices_indices_map((rows,))
        starts = [idx[0].start or 0 for idx in index_map.values()]
        stops = [rows if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
        return slice(min(starts), max(stops))

    def geometry(self, batch_size: int, micro_batch_size: int | None = None) -> BatchGeometry:
        """The batch geometry of a global ``batch_size`` with ``micro_batch_size``
        examples per device per pass (None: no accumulation), validated."""
        dp = self.data_parallel
        _check_batch_size(batch_size)
        if batch_size % dp:
            raise ValueError(f"batch_size={batch_size} does not split over the {dp} "
                             f"data-parallel devices ({batch_axes_text(self.shape)} axes): use a "
                             f"multiple of {dp}")
        if micro_batch_size is None:
            micro_batch_size = batch_size // dp // default_micro_batches(
                batch_size // dp, self.size(STAGE))
        elif isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
                or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive int, got "
                             f"{micro_batch_size!r}")
        elif batch_size % (micro_batch_size * dp):
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of micro_batch_size="
                f"{micro_batch_size} x {dp} data-parallel devices = {micro_batch_size * dp}: "
                "gradient accumulation needs whole micro-batches")
        rows = (self.process_rows(batch_size) if isinstance(self.mesh, Mesh)
                else slice(0, batch_size))
        return BatchGeometry(batch_size, dp, micro_batch_size,
                             batch_size // (micro_batch_size * dp), rows)

    def step_geometry(self, batch_size: int, micro_rows: int | None = None) -> BatchGeometry:
        """``geometry`` from a micro-batch counted over all devices (``redray plan``'s
        ``--micro-batch-size``), validated with that reading's messages."""
        micro_rows = micro_rows or batch_size
        dp = self.data_parallel
        if batch_size % micro_rows:
            raise ValueError(f"batch_size {batch_size} is not a multiple of micro_batch_size "
                             f"{micro_rows}")
        if micro_rows % dp:
            raise ValueError(f"micro batch {micro_rows} does not split over "
                             f"{batch_axes_text(self.shape)} = {dp} devices: use a multiple "
                             f"of {dp}")
        return self.geometry(batch_size, micro_rows // dp)

    def spec_passes(self) -> tuple[SpecPass, ...]:
        """The spec passes, in order: the user's rules (they win), then every axis's
        ``Axis.passes`` by precedence: the stacked layers of a scanned model over
        ``stage``, tensor parallelism over ``model`` from the dataflow, the experts of a
        mixture of experts over ``expert``, ZeRO-3 over ``fsdp``, and large arrays no
        rule split over ``model`` sharded over it as well."""
        ordered = sorted((order, k, make, a.name) for k, a in enumerate(AXES)
                         for order, make in a.passes)
        return (UserRules(self.rules), *(make(name) for _, _, make, name in ordered))


def make_mesh(*, devices: Sequence[jax.Device] | None = None, **axes) -> Mesh:
    """Builds the device mesh of every axis of ``AXES`` over ``devices``.

    Args:
      devices: the devices to span; ``jax.devices()`` (every host's) by default.
      **axes: each axis's size by its keyword (``data_axis``, ``fsdp_axis``,
        ``model_axis``, ...: one per entry of ``AXES``, each with its default there);
        "auto" for the one that takes the devices the others leave (by default
        ``data_axis``).

    Returns:
      A ``jax.sharding.Mesh`` whose axis names are the ``AXES``' names, in their order.
    """
    return Parallelism.of(caller="make_mesh", **axes).build(devices).mesh
