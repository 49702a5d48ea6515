"""Which parameter feeds which: the model's real dataflow, read from one trace.

The model (or the user's loss) is traced once on abstract inputs with
``jax.make_jaxpr``. Walking the jaxpr, every value carries three facts:

* ``view``: the value is a parameter seen through layout-only operations (dtype casts,
  transposes, reshapes, slices), with the parameter dimensions each of its dimensions
  comes from;
* ``src``: the parameters whose matmul (or embedding lookup) output reaches the value
  without passing through another parameter's matmul;
* ``out``: the value is a parameter's layer output (the matmul's result, through
  layout-only operations and elementwise ones with a bias or a scale), with the
  parameter dimensions each of its dimensions comes from;
* ``origin``: for each of the value's dimensions, the layers' output dimensions it
  runs along, through anything that keeps dimensions apart: elementwise operations,
  layout, reductions over other dimensions, matmuls between activations (their batch
  dimensions), scans over another dimension. A per-head value deep inside a linear
  attention (a state, a normed readout) still knows its heads came from the q, k and v
  projections' head dimension. Where a reshape merges or splits dimensions, the merged
  dimension follows its major part (heads, not head_dim): a split of that part splits
  it in whole blocks.

A matmul between an activation and a parameter view records a *use*: which parameter
dimensions it contracts (the layer's input) and which it keeps (its output), and the
``src`` of the activation (the layers that feed it). A layer output sliced along a
dimension (a fused QKV kernel's output cut into Q, K and V) records that the parameter
dimension behind it is *cut*: splitting it would put Q, K and V on different devices.
A parameter (or a function of it alone: ``-exp(A_log)``) combined elementwise with an
activation records which of its dimensions run along which layer output dimensions
(``Trace.aligned``): a per-head decay, bias, norm scale or convolution kernel then
splits with the heads it meets, wherever in the layer it meets them. The rules in
``rules.py`` turn these uses into tensor-parallel splits; nothing here depends on
parameter names.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

_EMPTY: frozenset = frozenset()

# Operations that change only the layout or dtype of their first operand.
_IDENTITY_VIEW = {
    "convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint",
    "mesh_cast", "pvary", "slice", "dynamic_slice", "device_put",
}
_ELEMENTWISE = {"add", "sub", "mul", "div", "max", "min", "add_any", "pow", "atan2", "rem"}
# Operations that choose among their operand's entries (a router's top-k experts).
_CHOICE = {"top_k", "argmax", "argmin", "sort"}
# Elementwise operations of one operand (activation functions are made of them).
_UNARY = {"logistic", "tanh", "exp", "exp2", "log", "log1p", "neg", "erf", "erfc", "abs",
          "sign", "sqrt", "rsqrt", "integer_pow", "square", "expm1", "sin", "cos",
          "relu", "gelu", "select_n", "stop_gradient"}
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "remat2",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin",
          "shard_map"}


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a parameter found in the trace.

    Attributes:
      kind: "dot" (matmul or convolution), "gather" (embedding lookup) or
        "elementwise" (added to or multiplied with an activation, like a bias).
      in_dims: parameter dimensions the use contracts (dot) or indexes (gather).
      out_dims: parameter dimensions that survive into the output, in order.
      preds: parameters whose matmul output reaches the other operand.
      order: position of the use in the trace (a topological order).
      rows: positions the use computes for (a matmul's output elements over the
        parameter's own output elements: batch x sequence for a dense layer; a lookup's
        indices), 0 where not counted (elementwise uses).
      times: how often the traced program runs it (the length of the scans around it).
      first: False for a loop body's second reading (what a carry feeds the next
        iteration): the same operation seen again, not run again.
    """
    kind: str
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    preds: frozenset
    order: int
    rows: int = 0
    times: int = 1
    first: bool = True


@dataclasses.dataclass(frozen=True)
class _Info:
    view: tuple[int, tuple[frozenset, ...]] | None = None  # (param index, dims per value dim)
    src: frozenset = _EMPTY
    out: tuple[int, tuple[frozenset, ...]] | None = None  # (param index, dims per value dim)
    # (param index, dims per value dim) of the layer outputs this value is made of
    # elementwise (an activation function of one, a product of two: a gated MLP's
    # silu(x W_gate) * x W_up), through layout operations: which of their dimensions a
    # later layer contracts
    feeds: tuple = ()
    # per value dimension, the frozenset of (param index, param dimension) layer output
    # dimensions it runs along (the module docstring); () where unknown
    origin: tuple = ()


class Trace:
    """Uses of every parameter, in trace order."""

    def __init__(self, n_params: int):
        self.n_params = n_params
        self.uses: dict[int, list[Use]] = {}
        # parameter -> output dimensions its layer's output is sliced along
        self.cut: dict[int, set[int]] = {}
        # parameter -> dimensions a scan steps over (layers stacked on a leading axis):
        # splitting one would hand each step's slice to a single device
        self.scanned: dict[int, set[int]] = {}
        # parameter -> dimensions that index independent kernels a matmul picks among
        # (a mixture of experts' stacked experts: a grouped matmul's groups, a batch
        # dimension of a matmul with an activation, or the output dimension of a layer
        # that the next layer's matmul takes as such a batch dimension)
        self.grouped: dict[int, set[int]] = {}
        # parameter -> output dimensions of its layer that a later layer contracts (its
        # output reaching that layer's matmul elementwise: an MLP's gate and up reaching
        # its down projection)
        self.fed: dict[int, set[int]] = {}
        # parameters whose layer's output a choice reads (top-k, argmax, sort: a mixture
        # of experts' router picking experts)
        self.routers: set[int] = set()
        # parameter -> {(its dimension, layer parameter, that layer's output dimension)}:
        # the parameter (or a function of it alone) met that layer's output elementwise
        # along those dimensions (a per-head decay multiplying a head-split activation)
        self.aligned: dict[int, set[tuple[int, int, int]]] = {}
        self._counter = itertools.count()
        self._times = 1  # the product of the enclosing scans' lengths
        self._again = 0  # inside a loop body's second reading

    def add(self, param: int, kind: str, in_dims, out_dims, preds, rows: int = 0) -> None:
        self.uses.setdefault(param, []).append(
            Use(kind, tuple(sorted(in_dims)), tuple(sorted(out_dims)), frozenset(preds),
                next(self._counter), rows, self._times, not self._again))

    def runs(self) -> list[tuple[int, Use]]:
        """(parameter, use) of every matmul and lookup as the program runs them: each
        once, loop bodies' second readings left out."""
        return [(p, u) for p, us in self.uses.items() for u in us
                if u.first and u.kind in ("dot", "gather")]


def trace(fn: Callable, leaves: Sequence[Any], *args) -> Trace:
    """Traces ``fn(leaves, *args)`` on abstract values and records parameter uses.

    Args:
      fn: called as ``fn(list_of_param_leaves, *args)``.
      leaves: the parameters (arrays or ``jax.ShapeDtypeStruct``), one per index.
      *args: the other inputs, arrays or ``jax.ShapeDtypeStruct``.
    """
    closed = jax.make_jaxpr(fn)(list(leaves), *args)
    n = len(leaves)
    result = Trace(n)
    infos = []
    for i, var in enumerate(closed.jaxpr.invars):
        if i < n and _shape(var):
            infos.append(_Info(view=(i, tuple(frozenset({d}) for d in range(len(_shape(var)))))))
        else:
            infos.append(_Info())
    _walk(closed.jaxpr, infos, result)
    return result


def _shape(var) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def _size(shape, dims=None) -> int:
    """Elements of ``shape`` (of its ``dims`` only, when given)."""
    n = 1
    for d in (range(len(shape)) if dims is None else dims):
        n *= shape[d]
    return n


def _walk(jaxpr, in_infos: Sequence[_Info], out: Trace) -> list[_Info]:
    env: dict[Any, _Info] = {}

    def read(v) -> _Info:
        if isinstance(v, jcore.Literal):
            return _Info()
        return env.get(v, _Info())

    for var, info in zip(jaxpr.invars, in_infos):
        env[var] = info
    for var in jaxpr.constvars:
        env[var] = _Info()
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn(eqn, ins, out)
        if len(outs) == 1 and not outs[0].feeds and any(i.feeds for i in ins):
            feeds = _feeds(eqn, ins)
            if feeds:
                outs = [dataclasses.replace(outs[0], feeds=feeds)]
        if not any(o.origin for o in outs) and any(i.origin or i.view for i in ins):
            origins = _origins(eqn, ins)
            if origins is not None:
                outs = [dataclasses.replace(o, origin=g) for o, g in zip(outs, origins)]
        for var, info in zip(eqn.outvars, outs):
            env[var] = info
    return [read(v) for v in jaxpr.outvars]


def _feeds(eqn, ins: list[_Info]) -> tuple:
    """The layer outputs an elementwise or layout operation's result is made of
    (``_Info.feeds``): the operands' of the result's shape, their dimensions mapped."""
    name = eqn.primitive.name
    shape = _shape(eqn.outvars[0])
    found: dict = {}
    if name in _ELEMENTWISE or name in _UNARY:
        for var, info in zip(eqn.invars, ins):
            if _shape(var) == shape:
                for pidx, dims in info.feeds:
                    found.setdefault(pidx, dims)
    elif ins[0].feeds:
        for pidx, dims in ins[0].feeds:
            mapped = map_view(eqn, dims)
            if mapped is not None:
                found.setdefault(pidx, mapped)
    return tuple(found.items())


def _union_src(infos: Sequence[_Info]) -> frozenset:
    return frozenset().union(*(i.src for i in infos)) if infos else _EMPTY


def _generic(eqn, ins) -> list[_Info]:
    src = _union_src(ins)
    return [_Info(src=src) for _ in eqn.outvars]


def _eqn(eqn, ins: list[_Info], out: Trace) -> list[_Info]:
    name = eqn.primitive.name
    p = eqn.params
    if name in _CHOICE:
        out.routers.update(pidx for info in ins for pidx, _ in info.feeds)
    if name == "dot_general":
        return [_dot(eqn, ins, out, p["dimension_numbers"])]
    if name == "ragged_dot_general":  # a grouped matmul: the rhs's groups are experts
        numbers = p["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
        return [_dot(eqn, ins[:2], out, ((lc, rc), (lb, (*rb, *numbers.rhs_group_dimensions))))]
    if name == "conv_general_dilated":
        return [_conv(eqn, ins, out)]
    if name == "gather" and ins[0].view is not None:
        pidx, dims = ins[0].view
        indexed = frozenset().union(*(dims[d] for d in p["dimension_numbers"].start_index_map))
        all_dims = frozenset().union(*dims) if dims else _EMPTY
        kept = _size(_shape(eqn.invars[0]), [d for d in range(len(dims))
                                              if not dims[d] & indexed])
        out.add(pidx, "gather", indexed, all_dims - indexed, _EMPTY,
                _size(_shape(eqn.outvars[0])) // max(kept, 1))
        return [_Info(src=frozenset({pidx}))]
    if name in _CALLS:
        inner = _inner_jaxpr(p)
        if inner is not None and len(inner.invars) == len(ins):
            return _walk(inner, ins, out)
    if name == "scan":
        return _scan(eqn, ins, out)
    if name == "while":
        return _while(eqn, ins, out)
    if name == "cond":
        branch_outs = [_walk(b.jaxpr, ins[1:], out) for b in p["branches"]]
        return [_Info(src=_union_src(group)) for group in zip(*branch_outs)]
    view = ins[0].view if ins else None
    if view is not None and all(i.view is None for i in ins[1:]):
        mapped = map_view(eqn, view[1])
        if mapped is not None:
            return [_Info(view=(view[0], mapped), src=_union_src(ins))]
    alone = _of_parameter_alone(eqn, ins)
    if alone is not None:  # exp(A_log), -w, 1 + scale: still the parameter's layout
        return [_Info(view=alone, src=_union_src(ins))]
    if name in _ELEMENTWISE and len(ins) == 2:
        for a, b, var in ((ins[0], ins[1], eqn.invars[1]), (ins[1], ins[0], eqn.invars[0])):
            if a.view is not None and b.view is None:
                pidx, dims = a.view
                all_dims = frozenset().union(*dims) if dims else _EMPTY
                out.add(pidx, "elementwise", _EMPTY, all_dims, b.src)
                if b.origin and len(b.origin) == len(dims):
                    _align(out, pidx, dims, b.origin, _shape(var))
    layer_out = _layer_output(eqn, ins, out)
    return layer_out if layer_out is not None else _generic(eqn, ins)


def _of_parameter_alone(eqn, ins: list[_Info]):
    """The view of an elementwise function of one parameter view alone (its other
    operands scalars no layer computed: ``exp(A_log)``, ``-w``, ``1 + scale``), or None."""
    name = eqn.primitive.name
    if name not in _UNARY and name not in _ELEMENTWISE or len(eqn.outvars) != 1:
        return None
    views = [(v, i) for v, i in zip(eqn.invars, ins) if i.view is not None]
    if len(views) != 1 or _shape(views[0][0]) != _shape(eqn.outvars[0]):
        return None
    others = [(v, i) for v, i in zip(eqn.invars, ins) if i.view is None]
    if any(i.src or i.origin or _shape(v) for v, i in others):
        return None
    return views[0][1].view


def _align(out: Trace, pidx: int, dims, origin, other_shape) -> None:
    """Records the dimensions along which parameter ``pidx`` (``dims``: its view's)
    meets an activation of ``origin`` elementwise: each parameter dimension at the
    major place of its group (the module docstring), each value dimension's origins."""
    for d, (group, found) in enumerate(zip(dims, origin)):
        if not group or not found or other_shape[d] == 1:
            continue
        for q, qd in found:
            if q != pidx:
                out.aligned.setdefault(pidx, set()).add((min(group), q, qd))


# Operations that keep each dimension of their first operand where it is (sizes may
# change): what ``_origins`` maps one to one.
_KEEPS_DIMS = {"pad", "concatenate", "cumsum", "cumprod", "cummax", "cummin",
               "cumlogsumexp", "sort", "rev", "dynamic_update_slice", "clamp"}


def _origins(eqn, ins: list[_Info]) -> list[tuple] | None:
    """The ``origin`` of each of ``eqn``'s outputs, or None where it cannot say."""
    name = eqn.primitive.name
    p = eqn.params
    origin = [_own_origin(i) for i in ins]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lo, ro = origin
        if not lo and not ro:
            return None
        lo = lo or (_EMPTY,) * len(_shape(eqn.invars[0]))
        ro = ro or (_EMPTY,) * len(_shape(eqn.invars[1]))
        batch = [lo[a] | ro[b] for a, b in zip(lb, rb)]
        free_l = [lo[d] for d in range(len(lo)) if d not in lc and d not in lb]
        free_r = [ro[d] for d in range(len(ro)) if d not in rc and d not in rb]
        return [tuple(batch + free_l + free_r)]
    out_shapes = [_shape(v) for v in eqn.outvars]
    if name in _CALLS or name in ("scan", "while", "cond", "ragged_dot_general", "gather",
                                  "scatter", "scatter-add", "conv_general_dilated"):
        return None
    first = origin[0] if origin else ()
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                "argmin", "reduce_and", "reduce_or"):
        axes = set(p.get("axes", ()))
        return [tuple(o for d, o in enumerate(first) if d not in axes)] if first else None
    if name in _IDENTITY_VIEW or name in ("transpose", "squeeze", "broadcast_in_dim",
                                          "reshape", "expand_dims"):
        if not first:
            return None
        if name == "reshape":
            return [_reshape_origin(_shape(eqn.invars[0]), out_shapes[0], first)]
        mapped = map_view(eqn, first)
        return [mapped] if mapped is not None else None
    if name in _KEEPS_DIMS:
        rank = len(out_shapes[0])
        found = [_EMPTY] * rank
        parts = origin if name == "concatenate" else origin[:1]
        for o in parts:
            if len(o) == rank:
                found = [f | g for f, g in zip(found, o)]
        return [tuple(found)] * len(out_shapes) if any(found) else None
    # elementwise: every output the shape of the operands of its rank
    shape = out_shapes[0]
    if any(s != shape for s in out_shapes):
        return None
    found = [_EMPTY] * len(shape)
    for var, o in zip(eqn.invars, origin):
        vs = _shape(var)
        if not vs:
            continue
        if len(vs) != len(shape) or any(a not in (b, 1) for a, b in zip(vs, shape)):
            return None
        for d, g in enumerate(o):
            if vs[d] == shape[d]:
                found[d] |= g
    return [tuple(found)] * len(out_shapes) if any(found) else None


def _own_origin(info: _Info) -> tuple:
    """A value's ``origin``; none for a parameter view (a parameter is not a layer's
    output)."""
    return info.origin if info.view is None else ()


def _reshape_origin(in_shape, out_shape, origin) -> tuple:
    """``origin`` through a reshape: each group of merged or split dimensions (as
    ``_reshape_dims`` groups them) gives its major input dimension's origin to its
    major output dimension; the minor parts run along nothing a split would keep whole."""
    mapped = [_EMPTY] * len(out_shape)
    for group_in, group_out in _reshape_groups(in_shape, out_shape):
        # the major output dimension follows the major input dimension
        mapped[group_out[0]] = origin[group_in[0]]
    return tuple(mapped)


def _layer_output(eqn, ins, out: Trace) -> list[_Info] | None:
    """Follows a layer's output through layout and bias/scale operations, recording the
    dimensions it is sliced along; None when ``eqn`` is not such an operation."""
    if not ins or ins[0].out is None:  # a bias added in front: bias + x W
        if eqn.primitive.name in _ELEMENTWISE and len(ins) == 2 and ins[1].out is not None \
                and _shape(eqn.outvars[0]) == _shape(eqn.invars[1]):
            return [_Info(src=_union_src(ins), out=ins[1].out)]
        return None
    name = eqn.primitive.name
    pidx, dims = ins[0].out
    in_shape, src = _shape(eqn.invars[0]), _union_src(ins)
    if name in ("slice", "dynamic_slice", "split"):
        shapes = [_shape(v) for v in eqn.outvars]
        cut = {d for d in range(len(in_shape)) if any(s[d] < in_shape[d] for s in shapes)}
        for d in cut:
            # A parameter dimension reshaped into several (hidden -> heads, head_dim) is
            # split along its major part: slicing a minor part (half of each head for
            # rotary embeddings) cuts nothing a split would separate.
            major = dims[d] - frozenset().union(*dims[:d])
            out.cut.setdefault(pidx, set()).update(major)
        return [_Info(src=src, out=(pidx, dims)) for _ in eqn.outvars]
    if name in _ELEMENTWISE and len(ins) == 2:
        if ins[1].out is None and _shape(eqn.outvars[0]) == in_shape:
            return [_Info(src=src, out=(pidx, dims))]
        return None
    if len(ins) == 1:
        mapped = map_view(eqn, dims)
        if mapped is not None:
            return [_Info(src=src, out=(pidx, mapped))]
    return None


def _inner_jaxpr(params):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = params.get(key)
        if j is None:
            continue
        return j.jaxpr if hasattr(j, "jaxpr") and not isinstance(j, jcore.Jaxpr) else j
    return None


def _dot(eqn, ins, out: Trace, numbers) -> _Info:
    """A matmul (``numbers``: its contracting and batch dimensions; a grouped matmul's
    rhs groups count as rhs batch dimensions: they leave no output dimension)."""
    (lc, rc), (lb, rb) = numbers
    lhs, rhs = ins
    if (lhs.view is None) == (rhs.view is None):
        if lhs.view is not None:  # parameter times parameter (e.g. a low-rank product)
            srcs = frozenset({lhs.view[0], rhs.view[0]})
            for info, contract in ((lhs, lc), (rhs, rc)):
                _record_dot(out, info, contract, (), _EMPTY)
            return _Info(src=srcs)
        return _Info(src=lhs.src | rhs.src)
    param_is_lhs = lhs.view is not None
    param, contract, batch, act = (lhs, lc, lb, rhs) if param_is_lhs else (rhs, rc, rb, lhs)
    act_contract, act_batch = (rc, rb) if param_is_lhs else (lc, lb)
    for q, qdims in act.feeds:  # which dimensions of the layers feeding it this one takes
        out.fed.setdefault(q, set()).update(*(qdims[d] for d in act_contract))
        if act_batch:
            out.grouped.setdefault(q, set()).update(*(qdims[d] for d in act_batch))
    param_shape = _shape(eqn.invars[0 if param_is_lhs else 1])
    own = _size(param_shape, [d for d in range(len(param_shape))
                              if d not in contract and d not in batch])
    _record_dot(out, param, contract, batch, act.src, _size(_shape(eqn.outvars[0])) // own)
    pidx, dims = param.view
    if batch:
        out.grouped.setdefault(pidx, set()).update(*(dims[d] for d in batch))
    free = [dims[d] for d in range(len(dims)) if d not in contract and d not in batch]
    rank = len(_shape(eqn.outvars[0]))
    if param_is_lhs:  # output: batch dims, the parameter's free dims, the activation's
        out_dims = [_EMPTY] * len(lb) + free + [_EMPTY] * (rank - len(lb) - len(free))
    else:
        out_dims = [_EMPTY] * (rank - len(free)) + free
    act_origin = act.origin or (_EMPTY,) * len(_shape(eqn.invars[1 if param_is_lhs else 0]))
    act_free = [act_origin[d] for d in range(len(act_origin))
                if d not in act_contract and d not in act_batch]
    mine = [frozenset({(pidx, min(g))}) if g else _EMPTY for g in free]
    batch_origin = [frozenset({(pidx, min(dims[d]))}) | act_origin[a] if dims[d]
                    else act_origin[a] for d, a in zip(batch, act_batch)]
    origin = tuple(batch_origin + (mine + act_free if param_is_lhs else act_free + mine))
    return _Info(src=frozenset({pidx}), out=(pidx, tuple(out_dims)),
                 feeds=((pidx, tuple(out_dims)),), origin=origin)


def _record_dot(out: Trace, info: _Info, contract, batch, preds, rows: int = 0) -> None:
    pidx, dims = info.view
    contracted = frozenset().union(*(dims[d] for d in contract)) if contract else _EMPTY
    batched = frozenset().union(*(dims[d] for d in batch)) if batch else _EMPTY
    all_dims = frozenset().union(*dims) if dims else _EMPTY
    out.add(pidx, "dot", contracted, all_dims - contracted - batched, preds, rows)


def _conv(eqn, ins, out: Trace) -> _Info:
    lhs, rhs = ins
    if rhs.view is None:
        return _Info(src=lhs.src | rhs.src)
    pidx, dims = rhs.view
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    out.add(pidx, "dot", dims[rhs_spec[1]], dims[rhs_spec[0]], lhs.src)
    return _Info(src=frozenset({pidx}))


def map_view(eqn, dims: tuple[frozenset, ...]) -> tuple[frozenset, ...] | None:
    """How a layout-only operation maps a parameter view's dimensions, or None."""
    name = eqn.primitive.name
    p = eqn.params
    out_shape = _shape(eqn.outvars[0])
    if name in _IDENTITY_VIEW:
        return dims if len(out_shape) == len(dims) else None
    if name == "transpose":
        return tuple(dims[i] for i in p["permutation"])
    if name == "squeeze":
        drop = {d % len(dims) for d in p["dimensions"]}
        return tuple(d for i, d in enumerate(dims) if i not in drop)
    if name == "broadcast_in_dim":
        in_shape = _shape(eqn.invars[0])
        mapped = [_EMPTY] * len(out_shape)
        for i, o in enumerate(p["broadcast_dimensions"]):
            if in_shape[i] == out_shape[o]:
                mapped[o] = dims[i]
        return tuple(mapped)
    if name == "reshape":
        return _reshape_dims(_shape(eqn.invars[0]), out_shape, dims)
    return None


def _reshape_groups(in_shape, out_shape):
    """The runs of a reshape's input and output dimensions whose sizes multiply equal
    (size-1 dimensions left out): (input dimensions, output dimensions) pairs."""
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [o for o, s in enumerate(out_shape) if s != 1]
    i = o = 0
    while i < len(ins) and o < len(outs):
        group_in, group_out = [ins[i]], [outs[o]]
        a, b = in_shape[ins[i]], out_shape[outs[o]]
        i, o = i + 1, o + 1
        while a != b:
            if a < b:
                a *= in_shape[ins[i]]
                group_in.append(ins[i])
                i += 1
            else:
                b *= out_shape[outs[o]]
                group_out.append(outs[o])
                o += 1
        yield group_in, group_out


def _reshape_dims(in_shape, out_shape, dims) -> tuple[frozenset, ...]:
    """Maps dimensions through a reshape by grouping runs whose sizes multiply equal."""
    mapped = [_EMPTY] * len(out_shape)
    for group_in, group_out in _reshape_groups(in_shape, out_shape):
        union = frozenset().union(*(dims[k] for k in group_in))
        for k in group_out:
            mapped[k] = union
    return tuple(mapped)


def _scan(eqn, ins, out: Trace) -> list[_Info]:
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = p["jaxpr"].jaxpr
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    # A scanned-over parameter (layers stacked on axis 0) is seen one slice at a time.
    for x in xs:
        if x.view is not None and x.view[1]:
            out.scanned.setdefault(x.view[0], set()).update(x.view[1][0])
    xs_inner = [_Info(view=(x.view[0], x.view[1][1:]), src=x.src) if x.view else
                _Info(src=x.src, origin=x.origin[1:]) for x in xs]
    out._times *= p["length"]
    try:
        results = _walk(body, [*consts, *carry, *xs_inner], out)
        # Second pass: what the carry holds after one iteration feeds the next.
        carry2 = [_Info(src=c.src | r.src, origin=_union_origin(c.origin, r.origin))
                  for c, r in zip(carry, results[:ncarry])]
        out._again += 1
        try:
            results = _walk(body, [*consts, *carry2, *xs_inner], out)
        finally:
            out._again -= 1
    finally:
        out._times //= p["length"]
    return [_Info(src=r.src, origin=r.origin) for r in results[:ncarry]] + \
        [_Info(src=r.src, origin=(_EMPTY, *r.origin) if r.origin else ())
         for r in results[ncarry:]]


def _union_origin(a: tuple, b: tuple) -> tuple:
    if not a or not b or len(a) != len(b):
        return a or b
    return tuple(x | y for x, y in zip(a, b))


def _while(eqn, ins, out: Trace) -> list[_Info]:
    p = eqn.params
    nb, ncond = p["body_nconsts"], p["cond_nconsts"]
    body_consts, carry = ins[ncond:ncond + nb], ins[ncond + nb:]
    results = _walk(p["body_jaxpr"].jaxpr, [*body_consts, *carry], out)
    carry2 = [_Info(src=c.src | r.src, origin=_union_origin(c.origin, r.origin))
              for c, r in zip(carry, results)]
    out._again += 1
    try:
        results = _walk(p["body_jaxpr"].jaxpr, [*body_consts, *carry2], out)
    finally:
        out._again -= 1
    return [_Info(src=r.src | c.src, origin=_union_origin(r.origin, c.origin))
            for r, c in zip(results, carry2)]
