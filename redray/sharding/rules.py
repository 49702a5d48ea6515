"""PartitionSpecs for every parameter: the paper's two rules, from the real dataflow.

Rule 1 (dense layers): a layer fed by nothing split is *column* parallel (its output
dimension is split over ``model``); a layer fed only by column-parallel layers is
*row* parallel (its input dimension is split), so each column/row pair costs one
all-reduce. A layer fed by a column layer is row even when replicated values were added
on the way (a position bias added to attention scores): adding them keeps the split. A
layer whose output reaches a layer and also, around it, that layer's successors writes a
residual stream (OPT-350m's ``project_in``): it stays replicated, so the stream is whole.
Rule 2 (attention) follows from the same dataflow: Q, K and V read the (replicated)
residual stream, so they are column parallel along their output (head)
dimension; the output projection reads only what Q, K and V produced, so it is row
parallel along its input dimension. Embedding tables (parameters indexed by a lookup)
and LM heads (column layers at the end of the graph) split along the vocabulary; a
lookup added to a larger one (position embeddings added to token embeddings) stays
whole, as in Megatron-LM; a lookup whose rows are added to split values (T5's relative
position bias per head, added to head-split scores) splits its entries (heads) instead.

Which dimension: of a column layer's output dimensions, one the next layer contracts
(a stacked expert kernel's (experts, hidden, inner) gate and up split on ``inner``,
which their down projection contracts, not on the experts it takes as a batch); then
the first one that divides by the axis size, in the parameter's own order (heads
before head_dim), skipping the dimensions the layer's output is sliced along (a fused
QKV kernel (hidden, 3, heads, head_dim) keeps its size-3 axis whole, so Q, K and V of
a head stay on one device); if none divides, the parameter is replicated
and the layers after it see an unsplit input. A column layer at the end of the graph
whose output is smaller than its input (a classifier head) stays replicated: splitting
it would only add an all-reduce of its input gradient.

A router (a layer whose output a top-k, argmax or sort reads: a mixture of experts
picking experts) stays whole, as in Megatron-LM: its output is small and every device
needs all of it to route its tokens. So does a low-rank down-projection (a layer whose
output is narrower than its input and read only by layers that widen it again:
DeepSeek's ``q_a_proj``, a LoRA's A): as a column layer it would make its reader a row
layer whose wide output needs a forward all-reduce; whole, its reader is column
parallel and the backward reduces the narrow cotangent (Megatron-LM's latent attention).

Biases and norm scales that are added to or multiply a column layer's output split
with that output. The ``fsdp`` axis then shards the largest remaining divisible
dimension of every floating-point matrix (ZeRO-3); vectors (biases, norm scales) stay
whole unless they are large: each sharded array costs an all-gather of its own in the
forward and the backward pass, and a vector's bytes are too few to pay that latency
(DeepSpeed keeps small parameters whole for the same reason). A large array that no rule
split over ``model`` (an embedding whose vocabulary divides by nothing) is sharded over
``model`` too, as an extra FSDP axis, so no big parameter sits whole on every device.
User rules, an ordered list of (regex on the parameter path, spec), win over all of this.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import Any, Iterable, Iterator, Sequence

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from redray.sharding.dataflow import Trace

# Only used for parameters the trace never reached (or when no trace is possible).
_EMBED_NAME = re.compile(r"(^|/)(embed\w*|wte|wpe|shared|embedding|word_embeddings)(/|$)", re.I)


def _first_divisible(dims: Iterable[int], shape: Sequence[int], n: int) -> int | None:
    for d in sorted(dims):
        if shape[d] % n == 0 and shape[d] >= n:
            return d
    return None


@dataclasses.dataclass(frozen=True)
class Whole:
    """A layer's parameter the rules leave whole over ``model``: why, and the fix.

    Attributes:
      path: the parameter's path.
      shape: its shape.
      reason: why no split was chosen.
      fix: what would split it (empty when whole is the right layout).
      by_design: whole is what Megatron-LM does too (a position table added to the
        token table, a small classifier head, a layer writing the residual stream);
        False when it costs memory and compute that a split would save.
    """
    path: str
    shape: tuple[int, ...]
    reason: str
    fix: str
    by_design: bool


def _sizes(dims, shape) -> str:
    return ", ".join(str(shape[d]) for d in sorted(dims))


def tensor_parallel_dims(shapes: Sequence[tuple[int, ...]], trace: Trace | None,
                         model_size: int, paths: Sequence[str] = (),
                         why: dict | None = None) -> list[int | None]:
    """For each parameter, the dimension split over ``model`` (or None).

    Args:
      shapes: parameter shapes, indexed like the trace.
      trace: the model's dataflow (``dataflow.trace``); None falls back to names.
      model_size: size of the ``model`` axis.
      paths: parameter paths, for the name fallback.
      why: if given, filled with parameter index -> (reason, fix, by_design) for every
        layer parameter (a matmul or lookup operand) left unsplit.
    """
    n = len(shapes)
    split: list[int | None] = [None] * n
    if model_size <= 1:
        return split
    why = {} if why is None else why
    name = (lambda q: paths[q]) if paths else (lambda q: f"parameter #{q}")
    role: dict[int, str] = {}
    uses = trace.uses if trace is not None else {}
    cut = trace.cut if trace is not None else {}
    graph = _LayerGraph(uses)
    structural = sorted((p for p in uses if any(u.kind != "elementwise" for u in uses[p])),
                        key=lambda p: uses[p][0].order)
    added = _added_lookups(uses, shapes)
    for p in structural:
        shape = shapes[p]
        gathers = [u for u in uses[p] if u.kind == "gather"]
        dots = [u for u in uses[p] if u.kind == "dot"]
        if gathers:  # an embedding table: split the vocabulary, or replicate
            split[p] = _lookup_split(p, gathers[0], shape, p in added, model_size, why)
            role[p] = "lookup"
            continue
        if trace is not None and p in trace.routers:
            role[p] = "replicated"
            why[p] = ("a router (its output picks experts): kept whole, as in Megatron-LM",
                      "", True)
            continue
        preds = frozenset().union(*(u.preds for u in dots))
        # A split activation stays split when replicated values (a position bias,
        # the residual stream) are added to it, so one column predecessor makes a row.
        whole = cut.get(p, set())
        if any(role.get(q) == "column" for q in preds):
            split[p] = _first_divisible(set(dots[0].in_dims) - whole, shape, model_size)
            role[p] = "row" if split[p] is not None else "replicated"
            if split[p] is None:
                why[p] = _indivisible("input", set(dots[0].in_dims) - whole, shape,
                                      model_size)
            continue
        out_size = math.prod(shape[d] for d in dots[0].out_dims)
        in_size = math.prod(shape[d] for d in dots[0].in_dims)
        if not graph.consumers(p) and out_size < in_size:
            role[p] = "replicated"
            why[p] = (f"a last layer whose output ({out_size}) is smaller than its input "
                      f"({in_size}): a split would only add an all-reduce", "", True)
            continue
        low_rank = _bottleneck(p, out_size, in_size, graph, uses, shapes)
        if low_rank is not None:
            role[p], why[p] = "replicated", low_rank
            continue
        if graph.writes_residual(p):
            role[p] = "replicated"
            failed = sorted(q for q in preds if q in why and not why[q][2])
            if failed:
                why[p] = (f"it reads {name(failed[0])}, which is left whole, and writes the "
                          "residual stream", f"split {name(failed[0])} (see there)", False)
            else:
                why[p] = ("it writes the residual stream (its output reaches a layer and, "
                          "around it, that layer's successors): split, it would flip every "
                          "later layer", "", True)
            continue
        fed = trace.fed.get(p, set()) if trace is not None else set()
        split[p] = _column_split(p, dots[0], shape, whole, fed, model_size, why)
        role[p] = "column" if split[p] is not None else "replicated"
    _split_the_rest(shapes, trace, model_size, paths, uses, role, split)
    return split


def _bottleneck(p: int, out_size: int, in_size: int, graph, uses: dict,
                shapes) -> tuple[str, str, bool] | None:
    """Why layer ``p`` stays whole if it is a low-rank down-projection (its output
    narrower than its input, and every layer reading it contracts exactly that output
    into a wider one: DeepSeek's q_a_proj before q_b_proj, a LoRA's A before its B),
    else None. As a column/row pair it would cost a forward all-reduce of the wide
    output; whole, its reader splits that output and the backward reduces the narrow
    cotangent."""
    readers = graph.consumers(p)
    if not readers or out_size >= in_size:
        return None
    for q in readers:
        dots = [u for u in uses[q] if u.kind == "dot"]
        if len(dots) != 1 or dots[0].preds != {p}:
            return None
        reads = math.prod(shapes[q][d] for d in dots[0].in_dims)
        makes = math.prod(shapes[q][d] for d in dots[0].out_dims)
        if reads != out_size or makes <= out_size:
            return None
    return (f"a low-rank down-projection (output {out_size} < input {in_size}) that the "
            "layer after it widens again: kept whole, so that layer splits its wide output "
            "and the pair costs a backward all-reduce of the narrow one (Megatron-LM's "
            "latent attention keeps its down projections whole)", "", True)


def _lookup_split(p: int, gather, shape: tuple[int, ...], added: bool, model_size: int,
                  why: dict) -> int | None:
    """The dimension an embedding table ``p`` (read by ``gather``) splits over the model
    axis: its vocabulary's, or None (a lookup ``added`` to a larger one, or rows that
    do not divide), the reason filed in ``why``."""
    if added:
        why[p] = ("a lookup added to a larger one (positions beside tokens): kept "
                  "whole, as in Megatron-LM", "", True)
        return None
    split = _first_divisible(gather.in_dims, shape, model_size)
    if split is None:
        rows = _sizes(gather.in_dims, shape)
        why[p] = (f"its rows ({rows}) do not divide by the model axis {model_size}",
                  f"pad the table to a multiple of {model_size} rows", False)
    return split


def _column_split(p: int, dot, shape: tuple[int, ...], whole: set, fed: set,
                  model_size: int, why: dict) -> int | None:
    """The output dimension a column layer ``p`` (its matmul ``dot``) splits over the
    model axis, or None with the reason filed in ``why``: ``whole`` its dimensions the
    output is sliced along, ``fed`` those the next layer contracts."""
    outs = set(dot.out_dims) - whole
    # of several output dimensions, one the next layer contracts (an expert's inner
    # width, not the expert index a stacked down projection takes as a batch)
    split = _first_divisible(outs & fed, shape, model_size)
    if split is None:
        split = _first_divisible(outs, shape, model_size)
    if split is not None:
        return split
    sliced = _first_divisible(set(dot.out_dims) & whole, shape, model_size)
    if sliced is not None:
        why[p] = (f"its output is sliced along dimension {sliced} (size "
                  f"{shape[sliced]}) into parts, as one kernel holding q|k|v side by "
                  "side: a split there would put one head's q, k and v on different "
                  "devices",
                  "lay the kernel out per head, e.g. (hidden, 3, heads, head_dim) "
                  "sliced on the 3-axis, or use separate q, k and v projections",
                  False)
    else:
        why[p] = _indivisible("output", outs, shape, model_size)
    return None


def _split_the_rest(shapes, trace, model_size: int, paths, uses: dict, role: dict,
                    split: list) -> None:
    """After the layers: the tables of biases for split values, the parameters that
    follow a split layer's output or heads, and (no trace) embeddings by name."""
    for p in _lookups_beside_columns(uses, role):
        # A table of biases for split values (T5's relative position bias per head, added
        # to head-split attention scores) splits its entries, not its rows: a row split
        # would leave partial sums to all-reduce.
        gather = next(u for u in uses[p] if u.kind == "gather")
        split[p] = _first_divisible(gather.out_dims, shapes[p], model_size)
    for p, pu in uses.items():
        if p in role:
            continue
        split[p] = _follow_column_output(shapes, p, pu, role, split, uses,
                                         trace.scanned.get(p, set()) if trace else set())
        if split[p] is None and trace is not None:
            split[p] = _follow_heads(shapes, p, trace.aligned.get(p, ()), role, split,
                                     model_size)
        role[p] = "follows"
    for p, path in enumerate(paths):
        if p not in role and len(shapes[p]) == 2 and _EMBED_NAME.search(path):
            split[p] = _first_divisible([0], shapes[p], model_size)


def _indivisible(side: str, dims, shape, model_size: int) -> tuple[str, str, bool]:
    if not dims:
        return f"it has no {side} dimension to split", "", True
    big = max(dims, key=lambda d: shape[d])
    if math.prod(shape[d] for d in dims) < model_size:  # a gate of one unit per token
        return (f"its {side} ({_sizes(dims, shape)}) is smaller than the model axis "
                f"{model_size}: nothing to split", "", True)
    return (f"no {side} dimension ({_sizes(dims, shape)}) divides by the model axis "
            f"{model_size}",
            f"make a size divisible by {model_size} (e.g. "
            f"{_round_up(shape[big], model_size)} for {shape[big]}), or a smaller model axis",
            False)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _added_lookups(uses: dict, shapes) -> set[int]:
    """Lookup tables whose rows are added to a larger table's (GPT-2's positions to its
    tokens): they stay whole, as in Megatron-LM.

    A vocabulary-split lookup yields partial sums that cost one all-reduce; XLA reduces
    each table's partial sums on its own rather than adding them first, so every split
    table beside the largest would cost another activation-sized all-reduce per step.
    """
    lookups = {p for p, us in uses.items() if any(u.kind == "gather" for u in us)}
    whole: set[int] = set()
    for us in uses.values():
        for u in us:
            together = sorted(u.preds & lookups, key=lambda q: (-math.prod(shapes[q]), q))
            whole.update(together[1:])
    return whole


def _lookups_beside_columns(uses: dict, role: dict) -> list[int]:
    """Lookup tables whose rows meet a column layer's (split) output before any layer
    reads them: the layer reading them has a column layer among its inputs too."""
    found = []
    for p, us in uses.items():
        if role.get(p) != "lookup" or any(u.kind == "dot" for u in us):
            continue
        readers = [u for q in uses for u in uses[q] if u.kind == "dot" and p in u.preds]
        if any(role.get(q) == "column" for u in readers for q in u.preds):
            found.append(p)
    return found


class _LayerGraph:
    """Which layer feeds which: the matmul/lookup uses of a trace as a graph."""

    def __init__(self, uses: dict):
        self.preds = {q: frozenset().union(*(u.preds for u in us if u.kind in ("dot", "gather")))
                      for q, us in uses.items()}
        self._consumers: dict[int, set] = {}
        for q, ps in self.preds.items():
            for p in ps:
                self._consumers.setdefault(p, set()).add(q)
        self._ancestors: dict[int, frozenset] = {}

    def consumers(self, p) -> set:
        """Layers that take ``p``'s output as input."""
        return self._consumers.get(p, set())

    def ancestors(self, q) -> frozenset:
        """Every layer whose output reaches ``q``, directly or through other layers."""
        if q not in self._ancestors:
            self._ancestors[q] = frozenset()  # cycles (scan carries) end here
            out = set(self.preds.get(q, ()))
            for p in self.preds.get(q, ()):
                out |= self.ancestors(p)
            self._ancestors[q] = frozenset(out)
        return self._ancestors[q]

    def writes_residual(self, p) -> bool:
        """``p``'s output reaches a layer and, around it, that layer's successors.

        That is a residual stream (e.g. OPT's ``project_in``): split, it would stay
        split through every block and flip all their roles, so it stays whole.
        """
        readers = self.consumers(p)
        return any(a in self.ancestors(b) for a in readers for b in readers if a != b)


def _follow_column_output(shapes, p, pu, role, split, uses, stacked=frozenset()) -> int | None:
    """A bias or scale applied to exactly one column layer's output splits with it
    (``stacked``: its layer dimensions, when its layers are stacked, which the
    output's shape does not have)."""
    real = [d for d, s in enumerate(shapes[p]) if s != 1 and d not in stacked]
    for u in pu:
        if len(u.preds) != 1:
            continue
        (k,) = u.preds
        if role.get(k) != "column":
            continue
        out_dims = uses[k][0].out_dims if uses[k][0].kind == "dot" else ()
        kernel_out = tuple(shapes[k][d] for d in out_dims)
        if tuple(shapes[p][d] for d in real) == kernel_out and split[k] in out_dims:
            return real[out_dims.index(split[k])]
    return None


def _follow_heads(shapes, p, aligned, role, split, model_size: int) -> int | None:
    """A parameter met elementwise along a column layer's split output dimension (a
    per-head decay, norm scale or convolution kernel meeting head-split values:
    ``Trace.aligned``) splits its own dimension there, where that divides: each device
    then holds its heads' entries."""
    for d, k, kd in sorted(aligned):
        if role.get(k) == "column" and split[k] == kd and shapes[p][d] % model_size == 0 \
                and shapes[p][d] >= model_size:
            return d
    return None


def fsdp_dim(shape: Sequence[int], taken: Iterable[int], size: int,
             skip: Iterable[int] = ()) -> int | None:
    """The largest dimension (first on ties) not ``taken`` by another axis, nor in
    ``skip`` (a stacked layer axis), that divides by ``size``."""
    best = None
    skip = set(skip) | set(taken)
    for d, s in enumerate(shape):
        if d not in skip and s % size == 0 and s >= size:
            if best is None or s > shape[best]:
                best = d
    return best


# A parameter tensor parallelism cannot split (a vocabulary of 50257 rows, a position
# table of 2050) is sharded over the model axis too, like FSDP, once it is this large
# (elements). Smaller ones stay replicated: gathering them would cost more than they hold.
LARGE = 1 << 20


def compile_rules(rules) -> list[tuple[re.Pattern, P]]:
    """Validates user rules: an ordered list of (regex on the parameter path, spec)."""
    compiled = []
    for i, rule in enumerate(rules or ()):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f"sharding rule #{i} is {rule!r}: each rule must be a pair "
                f"(regex on the parameter path, PartitionSpec), e.g. "
                f"(r'.*/wte/.*', P('model', None))")
        pattern, spec = rule
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"sharding rule #{i}: {pattern!r} is not a valid regex ({e})") from None
        if spec is None:
            spec = P()
        if not isinstance(spec, P):
            spec = P(*spec)
        compiled.append((regex, spec))
    return compiled


def _check_user_spec(path: str, shape, spec: P, mesh_shape: dict, pattern: str) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"sharding rule {pattern!r} gives {path} (shape {tuple(shape)}) the spec "
                         f"{spec}, which has more entries than the array has dimensions")
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        size = 1
        for a in names:
            if a not in mesh_shape:
                raise ValueError(f"sharding rule {pattern!r}: axis {a!r} is not a mesh axis "
                                 f"(axes: {', '.join(mesh_shape)})")
            size *= mesh_shape[a]
        if shape[d] % size:
            raise ValueError(f"sharding rule {pattern!r} splits dimension {d} of {path} "
                             f"(size {shape[d]}) over {size} devices, which does not divide it")


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def without_axis(entry, *axes: str):
    """One entry of a PartitionSpec without ``axes`` (None where nothing is left)."""
    names = tuple(n for n in axes_of(entry) if n not in axes)
    return None if not names else names[0] if len(names) == 1 else names


@dataclasses.dataclass
class SpecDraft:
    """What the spec passes refine, in order: one list of entries per array (None, an
    axis name or a tuple of them per dimension), and what each pass learned.

    Attributes:
      paths, shapes, dtypes: of every array ("/"-joined paths, what user rules match).
      mesh_shape: axis name -> size.
      trace: the model's dataflow (``dataflow.trace``), or None.
      entries: the specs being built.
      fixed: array index -> the spec a user rule gave it: later passes leave it alone.
      whole: array index -> (axis, reason, fix, by_design) for a layer parameter a pass
        could not split over its axis; reported (``Whole``) if no pass split it there.
    """
    paths: Sequence[str]
    shapes: Sequence[tuple[int, ...]]
    dtypes: Sequence[Any]
    mesh_shape: dict
    trace: Trace | None
    entries: list = dataclasses.field(default_factory=list)
    fixed: dict = dataclasses.field(default_factory=dict)
    whole: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.entries:
            self.entries = [[None] * len(s) for s in self.shapes]

    def stacked(self, i: int) -> set[int]:
        """Dimensions of array ``i`` that stack layers (a scanned model's layer axis)."""
        return self.trace.scanned.get(i, set()) if self.trace is not None else set()

    def free(self) -> Iterator[int]:
        """Floating-point arrays no user rule fixed: what automatic passes may split."""
        for i, dtype in enumerate(self.dtypes):
            if i not in self.fixed and jnp.issubdtype(dtype, jnp.floating):
                yield i

    def uses(self, i: int, axis: str) -> bool:
        return any(axis in axes_of(e) for e in self.entries[i])

    def size(self, axis: str) -> int:
        return self.mesh_shape.get(axis, 1)

    def specs(self) -> list[P]:
        out = []
        for i, entries in enumerate(self.entries):
            if i in self.fixed:
                out.append(self.fixed[i])
                continue
            entries = list(entries)
            while entries and entries[-1] is None:
                entries.pop()
            out.append(P(*entries))
        return out

    def left_whole(self) -> list[Whole]:
        """The layer matrices some pass wanted to split and that stayed whole over its axis."""
        found = []
        for i, (axis, reason, fix, by_design) in sorted(self.whole.items()):
            if i not in self.fixed and len(self.shapes[i]) - len(self.stacked(i)) >= 2 \
                    and not self.uses(i, axis):
                found.append(Whole(self.paths[i], tuple(self.shapes[i]), reason, fix, by_design))
        return found


class SpecPass:
    """One step of spec derivation: refines a ``SpecDraft`` in place.

    A parallelism brings its own pass (``redray.sharding.parallelism`` lists them in
    order); ``traces`` says whether it reads the model's dataflow on this mesh.
    """

    def traces(self, mesh_shape: dict) -> bool:
        return False

    def __call__(self, draft: SpecDraft) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class UserRules(SpecPass):
    """An ordered list of (regex on the parameter path, spec): the first match is the
    array's spec, and no later pass changes it. A rule matching nothing is warned about."""
    rules: tuple = ()

    def __call__(self, draft: SpecDraft) -> None:
        compiled = compile_rules(self.rules)
        used = set()
        for i, (path, shape) in enumerate(zip(draft.paths, draft.shapes)):
            match = next(((k, spec) for k, (rx, spec) in enumerate(compiled) if rx.search(path)),
                         None)
            if match is None:
                continue
            used.add(match[0])
            _check_user_spec(path, shape, match[1], draft.mesh_shape, compiled[match[0]][0].pattern)
            draft.entries[i] = list(match[1]) + [None] * (len(shape) - len(match[1]))
            draft.fixed[i] = match[1]
        for k, (rx, _) in enumerate(compiled):
            if k not in used:
                paths = draft.paths
                warnings.warn(f"sharding rule {rx.pattern!r} matched no parameter path "
                              f"(paths look like {paths[0] if paths else '<none>'!r})",
                              stacklevel=5)


@dataclasses.dataclass(frozen=True)
class TensorParallel(SpecPass):
    """The paper's two rules over ``axis`` (the module docstring): column and row layers
    from the dataflow, lookups over their vocabulary, biases and scales with their
    kernel's output."""
    axis: str

    def traces(self, mesh_shape: dict) -> bool:
        return mesh_shape.get(self.axis, 1) > 1

    def __call__(self, draft: SpecDraft) -> None:
        why: dict = {}
        dims = tensor_parallel_dims(draft.shapes, draft.trace, draft.size(self.axis),
                                    draft.paths, why)
        for i in draft.free():
            if dims[i] is not None:
                draft.entries[i][dims[i]] = self.axis
        for i, note in why.items():
            draft.whole[i] = (self.axis, *note)


@dataclasses.dataclass(frozen=True)
class _OneDimension(SpecPass):
    """Splits over ``axis`` one dimension of the parameters the dataflow names
    (``dims``), where it divides; where it does not, the parameter stays whole over the
    axis and ``note`` says why."""
    axis: str

    def traces(self, mesh_shape: dict) -> bool:
        return mesh_shape.get(self.axis, 1) > 1

    def dims(self, draft: SpecDraft, i: int) -> list[int]:
        raise NotImplementedError

    def note(self, n: int, size: int) -> tuple[str, str]:
        raise NotImplementedError

    def check(self, draft: SpecDraft, size: int) -> None:
        """Raises where the model cannot take the axis at all."""

    def fits(self, n: int, size: int) -> bool:
        """Whether a dimension of ``n`` splits over the axis of ``size``."""
        return n % size == 0

    def __call__(self, draft: SpecDraft) -> None:
        size = draft.size(self.axis)
        if size <= 1 or draft.trace is None:
            return
        self.check(draft, size)
        for i in draft.free():
            dims = self.dims(draft, i)
            if not dims:
                continue
            d, shape = dims[0], draft.shapes[i]
            if draft.entries[i][d] is None and self.fits(shape[d], size):
                draft.entries[i][d] = self.axis
            else:
                draft.whole[i] = (self.axis, *self.note(shape[d], size), False)


@dataclasses.dataclass(frozen=True)
class StageParallel(_OneDimension):
    """Pipeline stages over ``axis``: the layer axis of every stacked (scanned) layer
    parameter (``Trace.scanned``) is split over it in consecutive blocks, stage ``s``
    holding layers ``s * L/S`` to ``(s + 1) * L/S - 1``; where ``S`` does not divide
    ``L`` the run holds the axis padded (``parallelism.layer_order``), the spec the
    same. Every other parameter (the embeddings, the final norm, the head) stays whole
    over it: each stage's devices hold them."""

    def dims(self, draft: SpecDraft, i: int) -> list[int]:
        return sorted(draft.stacked(i))

    def fits(self, n: int, size: int) -> bool:
        return n >= size

    def note(self, n: int, size: int) -> tuple[str, str]:
        return (f"its {n} layers are fewer than its {size} stages",
                f"use a stage axis of at most {n}")

    def check(self, draft: SpecDraft, size: int) -> None:
        if not any(draft.stacked(i) for i in draft.free()):
            raise ValueError(f"{self.axis}_axis={size} needs the layers stacked and scanned "
                             "(pipeline stages split the layer axis): build the model with "
                             "scan=True (redray.models.build, from_pretrained), or use "
                             f"{self.axis}_axis=1")


@dataclasses.dataclass(frozen=True)
class ExpertParallel(_OneDimension):
    """A mixture of experts' experts over ``axis``: the dimension of a parameter that a
    matmul picks independent kernels along (``Trace.grouped``: a grouped matmul's
    groups, a stacked kernel's batch dimension in an einsum) is split over it. Every
    other parameter stays whole over it: for them the axis splits the batch, as data
    parallelism does."""

    def dims(self, draft: SpecDraft, i: int) -> list[int]:
        return sorted(draft.trace.grouped.get(i, set()) - draft.stacked(i))

    def note(self, n: int, size: int) -> tuple[str, str]:
        return (f"its {n} experts do not divide by the expert axis {size}",
                f"use an expert axis that divides {n}")


@dataclasses.dataclass(frozen=True)
class Fsdp(SpecPass):
    """ZeRO-3 over ``axis``: the largest remaining divisible dimension of every
    floating-point matrix, and of vectors of at least ``LARGE`` elements (a small
    vector's all-gather costs more latency than its bytes save)."""
    axis: str

    def __call__(self, draft: SpecDraft) -> None:
        size = draft.size(self.axis)
        if size <= 1:
            return
        for i in draft.free():
            shape, stacked = draft.shapes[i], draft.stacked(i)
            if len(shape) - len(stacked) < 2 and math.prod(shape) < LARGE:
                continue
            taken = [d for d, e in enumerate(draft.entries[i]) if e is not None]
            d = fsdp_dim(shape, taken, size, stacked)
            if d is not None:
                draft.entries[i][d] = self.axis


@dataclasses.dataclass(frozen=True)
class LargeOver(SpecPass):
    """A large array (``LARGE`` elements or more) that no pass split over ``axis`` is
    sharded over it as an extra FSDP axis: beside ``with_axis`` on a dimension both
    divide, else on its own largest free one."""
    axis: str
    with_axis: str

    def __call__(self, draft: SpecDraft) -> None:
        size, beside = draft.size(self.axis), draft.size(self.with_axis)
        if size <= 1:
            return
        for i in draft.free():
            shape, entries = draft.shapes[i], draft.entries[i]
            if draft.uses(i, self.axis) or math.prod(shape) < LARGE:
                continue
            paired = next((d for d, e in enumerate(entries)
                           if e == self.with_axis and shape[d] % (beside * size) == 0), None)
            if paired is not None:
                entries[paired] = (self.with_axis, self.axis)
                continue
            taken = [d for d, e in enumerate(entries) if e is not None][:1]
            d = fsdp_dim(shape, taken, size, draft.stacked(i))
            if d is not None and entries[d] is None:
                entries[d] = self.axis


def partition_specs(passes: Sequence[SpecPass], paths: Sequence[str],
                    shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any], mesh_shape: dict,
                    trace: Trace | None = None, whole: list | None = None) -> list[P]:
    """The PartitionSpec of every array: ``passes`` run in order on one draft.

    Args:
      passes: the spec passes (``Parallelism.spec_passes``: user rules, tensor
        parallel, FSDP, large arrays over the model axis).
      paths: "/"-joined parameter paths (what user regexes match).
      shapes, dtypes: of each array.
      mesh_shape: axis name -> size (``mesh.shape``).
      trace: the dataflow of the model; None uses the name fallback only.
      whole: if given, a list that receives a ``Whole`` for every layer matrix (a
        parameter of two or more dimensions that a matmul or lookup reads) a pass could
        not split over its axis (no user rule gave its spec).
    """
    draft = SpecDraft(paths, shapes, dtypes, dict(mesh_shape), trace)
    for step in passes:
        step(draft)
    if whole is not None:
        whole.extend(draft.left_whole())
    return draft.specs()
