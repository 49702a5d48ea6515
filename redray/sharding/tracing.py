"""What a step is traced under: one frozen value, ``Tracing``, derived from the run's
``Plan`` (``ModelRuntime.tracing``) and read by the model's layers while they trace.

Where a model's activations live: split over the batch axes, whole on the model axis,
at the points a model marks (``constrain_rows``: redray's models mark the residual
stream between blocks). Without these marks XLA's SPMD partitioner chooses each
activation's sharding from the parameters around it; with a parameter split over
``fsdp`` on its input dimension and over ``model`` on the other, it may split the hidden
dimension of the residual stream over ``fsdp`` and then move it back to the batch split
by replicating it ("Involuntary full rematerialization"): traffic no spec asks for. The
marks pin the residual stream to the batch split, so each FSDP parameter is gathered and
each tensor-parallel layer's output all-reduced, as ``redray.planning.cost`` counts them.

Beside the split, the value carries what else a trace is asked to do: how attention
crosses a context axis, the pipeline's micro-batches and layout, the plan's spec of
each parameter, an attention implementation forced (blockwise) or counted (the
planner's), the kernels noted, the loops unrolled (cost analysis), a 1F1B cut.

The layers read roles of the mesh (``ROLES``: rows, sequence, layers), never which
axis plays them. Outside a step's trace (a model run on its own, abstract traces) the
value is ``Tracing()``: nothing split, nothing asked.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding.parallelism import role_axes


@dataclasses.dataclass(frozen=True)
class Tracing:
    """How the step being traced runs its layers.

    Attributes:
      mesh: the plan's mesh (the abstract mesh traced in, inside a ``shard_map``);
        None: as on one device, nothing constrained.
      ways: the product of the batch axes (how many ways rows split).
      micro_rows: the rows of one pipeline micro-batch over all devices; None: a
        pass's rows are one.
      repeats: the pipeline's circular repeats (stacked parameters held in
        ``parallelism.layer_order``).
      layers: the model's stacked layer counts (a stack the stages do not divide is
        held padded).
      context_attention: the plan's way across the context axis by name: "ring",
        "all_gather", or "auto" (``context_choice`` per layer).
      expert_exchange: the plan's exchange on an expert axis ("auto", "all_to_all",
        "gather": ``Plan.expert_exchange``).
      context_choice: ``fn(batch, tokens, ways, heads, kv_heads, head_dim, itemsize)``
        -> "ring" or "all_gather": how one layer's attention crosses the context axis
        (the plan's, on its hardware); None: none given (the ring).
      specs: id of a parameter array -> the plan's PartitionSpec of it (the step's
        trace holds the arrays, so their ids are theirs while it runs); None.
      attention: an attention implementation the trace forces ("chunked": the memory
        models' trace of a plan with a context axis), or None.
      kernels: the ``AttentionKernels`` every attention notes its kernel in, or None.
      counted: the list every attention appends its geometry to instead of computing
        (the planner's count of a step's other work), or None.
      unroll: the layer and tick scans traced unrolled (XLA's cost analysis counts a
        loop's body once).
      cut: the ``BlocksCut`` a 1F1B pass is traced within, or None.
      uncounted: the layers run inside pipeline stages, whose training calls count
        nothing into the model's state (a mixture of experts' loads: bubbles would
        count padding, and the counts are not summed across stages yet).
    """
    mesh: Any = None
    ways: int = 1
    micro_rows: int | None = None
    repeats: int = 1
    layers: tuple = ()
    context_attention: str = "auto"
    expert_exchange: str = "auto"
    context_choice: Callable | None = None
    specs: dict | None = dataclasses.field(default=None, repr=False)
    attention: str | None = None
    kernels: "AttentionKernels | None" = None
    counted: list | None = None
    unroll: bool = False
    cut: "BlocksCut | None" = None
    uncounted: bool = False

    def split(self, role: str) -> tuple[str, ...]:
        """The mesh axes larger than 1 that play ``role`` (``ROLES``) in this trace."""
        if self.mesh is None:
            return ()
        return tuple(a for a in role_axes(role) if self.mesh.shape.get(a, 1) > 1)

    def ways_of(self, role: str) -> int:
        """How many ways ``role`` is split in this trace."""
        out = 1
        for a in self.split(role):
            out *= self.mesh.shape[a]
        return out


_NOW: contextvars.ContextVar = contextvars.ContextVar("redray_tracing", default=Tracing())


def tracing() -> Tracing:
    """The value the current trace runs under (``Tracing()`` outside a step's)."""
    return _NOW.get()


@contextlib.contextmanager
def traced(value: Tracing | None = None, **changes):
    """Within: the trace runs under ``value`` (default: the current one) with
    ``changes`` made to it; yields it. Nested uses refine the value outside."""
    now = dataclasses.replace(value if value is not None else _NOW.get(), **changes)
    token = _NOW.set(now)
    try:
        yield now
    finally:
        _NOW.reset(token)


# ------------------------------------------------------------------ what is asked of a trace
@contextlib.contextmanager
def blockwise_attention():
    """Within: redray's models compute attention blockwise (``"chunked"``), whatever
    ``REDRAY_ATTENTION`` says: what the memory models trace for a plan with a context
    axis, whose every attention is blockwise (the ring's)."""
    with traced(attention="chunked"):
        yield


def attention_forced() -> str | None:
    """The attention implementation the trace forces (``blockwise_attention``), or None."""
    return tracing().attention


@contextlib.contextmanager
def counted_attention():
    """Within: redray's models do not compute attention. Each call appends its geometry
    (``redray.models.attention.AttentionCall``) to the list yielded and returns a
    stand-in of the output's shape that reads the queries, keys and values once (so
    every projection keeps its gradient): what the planner compiles to count a step's
    other work, attention's own costed apart at its kernel's rate
    (``redray.planning.work``)."""
    calls: list = []
    with traced(counted=calls):
        yield calls


def attention_counts() -> list | None:
    """The list ``counted_attention`` collects into, or None outside it."""
    return tracing().counted


class AttentionKernels:
    """The attention kernels a trace's model computed with (``note_attention``): each
    kernel and why, and the host checks a batch must pass for them (a fused kernel's
    bounds a batch can exceed, e.g. documents per row)."""

    def __init__(self):
        self.why: dict[str, str] = {}
        self.checks: dict[str, object] = {}

    def describe(self) -> str:
        """E.g. "cudnn (cuDNN, packed layout)"."""
        return "; ".join(f"{kernel} ({why})" for kernel, why in self.why.items())

    def check(self, batch: dict) -> None:
        """Runs every noted check on a host batch (they raise, with the fix)."""
        for check in self.checks.values():
            check(batch)


@contextlib.contextmanager
def attention_kernels():
    """Within: every attention redray's models trace notes its kernel (``note_attention``)
    in the ``AttentionKernels`` yielded."""
    found = AttentionKernels()
    with traced(kernels=found):
        yield found


def note_attention(kernel: str, why: str, check=None) -> None:
    """An attention of the trace runs on ``kernel`` (and why); ``check(batch)``: what a
    host batch must pass for it (raising a clear error), or None."""
    found = tracing().kernels
    if found is None:
        return
    found.why.setdefault(kernel, why)
    if check is not None:
        found.checks.setdefault(kernel, check)


@contextlib.contextmanager
def parameter_specs(specs: dict | None):
    """Within: ``parameter_spec`` finds the plan's spec of each parameter array a model
    is bound to (``specs``: id of the array -> its PartitionSpec)."""
    with traced(specs=specs):
        yield


def parameter_spec(x) -> P | None:
    """The plan's PartitionSpec of parameter array ``x`` while a step is traced on a
    plan (``ModelRuntime.apply``), else None."""
    specs = tracing().specs
    return None if specs is None else specs.get(id(x))


@contextlib.contextmanager
def unrolled_loops():
    """Within: the scan over a model's stacked layers and a pipeline's ticks are traced
    unrolled (``loop_unroll``). XLA's cost analysis counts a loop's body once, whatever
    its trip count: a program's FLOPs are read from its unrolled form
    (``benchmarks/pipeline.py``)."""
    with traced(unroll=True):
        yield


def loop_unroll() -> int | bool:
    """What the layer and tick scans pass as ``unroll``: True within
    ``unrolled_loops``, else 1."""
    return True if tracing().unroll else 1


class BlocksCut:
    """A model's forward cut at its stacked layers, for a 1F1B step
    (``redray/engine/one_f_one_b.py``): within ``cut_at_blocks``, the stacked layers'
    ``run_blocks`` does not run them. A head pass (``output`` None) records what they
    would get (``found``: the blocks module, their input, the inputs every layer gets,
    the per-layer inputs, and ``run(blocks, h, args, per_layer)``, their own scan with
    its remat) and passes the input on; a tail pass returns ``output`` as their output."""

    def __init__(self, output=None):
        self.output = output
        self.found = None
        self.calls = 0


@contextlib.contextmanager
def cut_at_blocks(cut: BlocksCut):
    with traced(cut=cut):
        yield cut


def blocks_cut() -> BlocksCut | None:
    """The ``BlocksCut`` a pass is traced within, or None."""
    return tracing().cut


def context_choice():
    """The plan's choice of how one layer's attention crosses the context axis (see
    ``Tracing.context_choice``), or None where the step being traced was given none."""
    return tracing().context_choice


# ------------------------------------------------------------------ the split, by role
def constrain_rows(x: jax.Array, whole: bool = True) -> jax.Array:
    """``x`` (rows, ...) split over the axes of the rows, where a step is being traced
    on a plan whose row axes divide its rows; else ``x``. Its other dimensions whole
    (``whole``: the residual stream), or left to XLA (a layer's inner activation, which
    tensor parallelism splits). On a plan that splits sequences, a sequence (rows,
    tokens, features) is split on its tokens too (``redray/models/context.py``)."""
    now = tracing()
    if now.mesh is None or x.ndim == 0:
        return x
    rows = role_axes("rows") if now.ways > 1 and x.shape[0] % now.ways == 0 else None
    sequence = now.split("sequence")
    tokens = sequence[0] if len(sequence) == 1 else sequence or None
    if tokens is not None and (x.ndim < 3 or x.shape[1] % now.ways_of("sequence")):
        tokens = None
    if rows is None and tokens is None:
        return x
    rest = None if whole else P.UNCONSTRAINED
    dims = (rows,) if tokens is None else (rows, tokens)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(now.mesh, P(*dims, *(rest,) * (x.ndim - len(dims)))))


def context_split() -> tuple | None:
    """(mesh, ways) of the sequence's split where a step is being traced on a plan that
    splits sequences; else None."""
    now = tracing()
    ways = now.ways_of("sequence")
    return (now.mesh, ways) if ways > 1 else None


def gathered_features(table: jax.Array) -> jax.Array:
    """An embedding table (entries, features) whole on its features where a step is
    being traced on a plan (its entries' split, over the model axis, kept): FSDP's
    gather of the table before the lookup. XLA's partitioner otherwise looks up rows in
    a table split on its features over ``fsdp`` and then cannot move the result to the
    batch split but by replicating it."""
    now = tracing()
    if now.mesh is None or now.ways <= 1:
        return table
    return jax.lax.with_sharding_constraint(
        table, NamedSharding(now.mesh, P(P.UNCONSTRAINED, *(None,) * (table.ndim - 1))))


def traced_mesh(rows: int):
    """The plan's mesh where a step is being traced on one whose row axes divide
    ``rows``; else None (a model run on its own, an abstract trace, a short batch)."""
    now = tracing()
    if now.mesh is None or rows % now.ways:
        return None
    return now.mesh


def pipeline_stages(rows: int) -> tuple | None:
    """(mesh, stages, micro-batches, repeats) where a step is being traced on a plan
    that splits the layers into stages and whose row axes divide ``rows``: the ``rows``
    are cut into micro-batches of the plan's ``micro_rows`` (one micro-batch where those
    do not divide them: an evaluation's short batch); else None."""
    now = tracing()
    if now.mesh is None or rows % now.ways:
        return None
    stages = now.ways_of("layers")
    if stages <= 1:
        return None
    micro_rows = now.micro_rows or rows
    return now.mesh, stages, rows // micro_rows if rows % micro_rows == 0 else 1, now.repeats


def stage_layout() -> tuple[int, int, tuple]:
    """(stages, circular repeats, the model's stacked layer counts) of the plan a step
    is being traced on ((1, 1, ()): none): how its stacked parameters are ordered and
    padded (``parallelism.layer_order``), whether or not this pass is pipelined."""
    now = tracing()
    if now.mesh is None:
        return 1, 1, ()
    return now.ways_of("layers"), now.repeats, now.layers
