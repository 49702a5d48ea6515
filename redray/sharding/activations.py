"""Where a model's activations live: split over the batch axes, whole on the model axis,
at the points a model marks (``constrain_rows``: redray's models mark the residual
stream between blocks).

Without these marks XLA's SPMD partitioner chooses each activation's sharding from the
parameters around it; with a parameter split over ``fsdp`` on its input dimension and
over ``model`` on the other, it may split the hidden dimension of the residual stream
over ``fsdp`` and then move it back to the batch split by replicating it ("Involuntary
full rematerialization"): traffic no spec asks for. The marks pin the residual stream to
the batch split, so each FSDP parameter is gathered and each tensor-parallel layer's
output all-reduced, as ``redray.planning.cost`` counts them.

The split is set while a step is traced (``ModelRuntime.apply``, on the plan's mesh);
outside it (a model run on its own, abstract traces) ``constrain_rows`` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding.parallelism import BATCH_AXES, CONTEXT, STAGE

_ROWS: contextvars.ContextVar = contextvars.ContextVar("redray_rows", default=None)
_CONTEXT_METHOD: contextvars.ContextVar = contextvars.ContextVar("redray_context_method",
                                                                 default=None)
_UNROLL: contextvars.ContextVar = contextvars.ContextVar("redray_unroll", default=False)
_SPECS: contextvars.ContextVar = contextvars.ContextVar("redray_param_specs", default=None)
_ATTENTION: contextvars.ContextVar = contextvars.ContextVar("redray_attention", default=None)
_KERNELS: contextvars.ContextVar = contextvars.ContextVar("redray_kernels", default=None)
_COUNTED: contextvars.ContextVar = contextvars.ContextVar("redray_counted", default=None)


@contextlib.contextmanager
def blockwise_attention():
    """Within: redray's models compute attention blockwise (``"chunked"``), whatever
    ``REDRAY_ATTENTION`` says: what the memory models trace for a plan with a context
    axis, whose every attention is blockwise (the ring's)."""
    token = _ATTENTION.set("chunked")
    try:
        yield
    finally:
        _ATTENTION.reset(token)


def attention_forced() -> str | None:
    """The attention implementation the trace forces (``blockwise_attention``), or None."""
    return _ATTENTION.get()


@contextlib.contextmanager
def counted_attention():
    """Within: redray's models do not compute attention. Each call appends its geometry
    (``redray.models.attention.AttentionCall``) to the list yielded and returns a
    stand-in of the output's shape that reads the queries, keys and values once (so
    every projection keeps its gradient): what the planner compiles to count a step's
    other work, attention's own costed apart at its kernel's rate
    (``redray.planning.work``)."""
    calls: list = []
    token = _COUNTED.set(calls)
    try:
        yield calls
    finally:
        _COUNTED.reset(token)


def attention_counts() -> list | None:
    """The list ``counted_attention`` collects into, or None outside it."""
    return _COUNTED.get()


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
    token = _KERNELS.set(found)
    try:
        yield found
    finally:
        _KERNELS.reset(token)


def note_attention(kernel: str, why: str, check=None) -> None:
    """An attention of the trace runs on ``kernel`` (and why); ``check(batch)``: what a
    host batch must pass for it (raising a clear error), or None."""
    found = _KERNELS.get()
    if found is None:
        return
    found.why.setdefault(kernel, why)
    if check is not None:
        found.checks.setdefault(kernel, check)


@contextlib.contextmanager
def rows_split(mesh, ways: int, micro_rows: int | None = None, repeats: int = 1,
               context_method=None, layers: tuple = ()):
    """Within: ``constrain_rows`` splits rows over ``mesh``'s batch axes (``ways`` in
    all); ``mesh`` None turns it off. ``micro_rows``: the rows of one pipeline
    micro-batch over all devices (``pipeline``), None: a pass's rows are one.
    ``repeats``: the pipeline's circular repeats (its stacked parameters are then held
    in ``parallelism.layer_order``). ``context_method``: the plan's choice of how
    attention crosses a context axis (``context_choice``). ``layers``: the model's
    stacked layer counts (``stage_layout``: a stack the stages do not divide is held
    padded)."""
    token = _ROWS.set(None if mesh is None else (mesh, ways, micro_rows, repeats, layers))
    chosen = _CONTEXT_METHOD.set(context_method)
    try:
        yield
    finally:
        _CONTEXT_METHOD.reset(chosen)
        _ROWS.reset(token)


def context_choice():
    """The plan's choice of how one layer's attention crosses the context axis:
    ``fn(batch, tokens, ways, heads, kv_heads, head_dim, itemsize)`` -> "ring" or
    "all_gather" (``redray.planning.cost.context_method`` on the run's hardware), or
    None where the step being traced was given none."""
    return _CONTEXT_METHOD.get()


@contextlib.contextmanager
def parameter_specs(specs: dict | None):
    """Within: ``parameter_spec`` finds the plan's spec of each parameter array a model
    is bound to (``specs``: id of the array -> its PartitionSpec; the step's trace
    holds the arrays, so their ids are theirs while it runs)."""
    token = _SPECS.set(specs)
    try:
        yield
    finally:
        _SPECS.reset(token)


def parameter_spec(x) -> P | None:
    """The plan's PartitionSpec of parameter array ``x`` while a step is traced on a
    plan (``ModelRuntime.apply``), else None."""
    specs = _SPECS.get()
    return None if specs is None else specs.get(id(x))


def constrain_rows(x: jax.Array, whole: bool = True) -> jax.Array:
    """``x`` (rows, ...) split over the batch axes, where a step is being traced on a
    plan whose batch axes divide its rows; else ``x``. Its other dimensions whole
    (``whole``: the residual stream), or left to XLA (a layer's inner activation, which
    tensor parallelism splits). On a plan with a context axis, a sequence (rows,
    tokens, features) is split over it on its tokens (``redray/models/context.py``)."""
    active = _ROWS.get()
    if active is None or x.ndim == 0:
        return x
    mesh, ways = active[0], active[1]
    rows = BATCH_AXES if ways > 1 and x.shape[0] % ways == 0 else None
    split = context_split()
    tokens = CONTEXT.name if split and x.ndim >= 3 and x.shape[1] % split[1] == 0 else None
    if rows is None and tokens is None:
        return x
    rest = None if whole else P.UNCONSTRAINED
    dims = (rows,) if tokens is None else (rows, tokens)
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, P(*dims, *(rest,) * (x.ndim - len(dims)))))


def context_split() -> tuple | None:
    """(mesh, ways) of the context axis where a step is being traced on a plan whose
    context axis is larger than 1; else None."""
    active = _ROWS.get()
    if active is None:
        return None
    ways = active[0].shape.get(CONTEXT.name, 1)
    return (active[0], ways) if ways > 1 else None


def gathered_features(table: jax.Array) -> jax.Array:
    """An embedding table (entries, features) whole on its features where a step is
    being traced on a plan (its entries' split, over the model axis, kept): FSDP's
    gather of the table before the lookup. XLA's partitioner otherwise looks up rows in
    a table split on its features over ``fsdp`` and then cannot move the result to the
    batch split but by replicating it."""
    active = _ROWS.get()
    if active is None or active[1] <= 1:
        return table
    mesh = active[0]
    return jax.lax.with_sharding_constraint(
        table, NamedSharding(mesh, P(P.UNCONSTRAINED, *(None,) * (table.ndim - 1))))


def traced_mesh(rows: int):
    """The plan's mesh where a step is being traced on one whose batch axes divide
    ``rows``; else None (a model run on its own, an abstract trace, a short batch)."""
    active = _ROWS.get()
    if active is None or rows % active[1]:
        return None
    return active[0]


def pipeline_stages(rows: int) -> tuple | None:
    """(mesh, stages, micro-batches, repeats) where a step is being traced on a plan
    with a stage axis larger than 1 and batch axes that divide ``rows``: the ``rows``
    are cut into micro-batches of the plan's ``micro_rows`` (one micro-batch where those
    do not divide them: an evaluation's short batch); else None."""
    active = _ROWS.get()
    if active is None or rows % active[1]:
        return None
    mesh, ways, micro_rows, repeats = active[:4]
    stages = mesh.shape.get(STAGE.name, 1)
    if stages <= 1:
        return None
    micro_rows = micro_rows or rows
    return mesh, stages, rows // micro_rows if rows % micro_rows == 0 else 1, repeats


def stage_layout() -> tuple[int, int, tuple]:
    """(stages, circular repeats, the model's stacked layer counts) of the plan a step
    is being traced on ((1, 1, ()): none): how its stacked parameters are ordered and
    padded (``parallelism.layer_order``), whether or not this pass is pipelined."""
    active = _ROWS.get()
    if active is None:
        return 1, 1, ()
    return active[0].shape.get(STAGE.name, 1), active[3], active[4]


@contextlib.contextmanager
def unrolled_loops():
    """Within: the scan over a model's stacked layers and a pipeline's ticks are traced
    unrolled (``loop_unroll``). XLA's cost analysis counts a loop's body once, whatever
    its trip count: a program's FLOPs are read from its unrolled form
    (``benchmarks/pipeline.py``)."""
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def loop_unroll() -> int | bool:
    """What the layer and tick scans pass as ``unroll``: True within
    ``unrolled_loops``, else 1."""
    return True if _UNROLL.get() else 1


_CUT: contextvars.ContextVar = contextvars.ContextVar("redray_cut", default=None)


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
    token = _CUT.set(cut)
    try:
        yield cut
    finally:
        _CUT.reset(token)


def blocks_cut() -> BlocksCut | None:
    """The ``BlocksCut`` a pass is traced within, or None."""
    return _CUT.get()
