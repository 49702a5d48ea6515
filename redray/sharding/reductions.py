"""One all-reduce where Megatron-LM has one: fan-outs and fan-ins of tensor-parallel layers.

Two shapes of a transformer cost XLA:CPU more all-reduces than Megatron-LM's ideal when
a model is written the way most models are:

* **fan-out**: column-parallel layers that read one replicated activation (Q, K and V
  written as three projections; a gated MLP's gate and up; GPT-J's attention and MLP
  reading one normed input; T5's cross-attention keys and values of every decoder
  layer reading the encoder output). In the backward pass each gives a partial sum of
  that activation's gradient. XLA's SPMD partitioner all-reduces each where it is made
  and adds the results; GPU and TPU pipelines may merge them afterwards
  (``AllReduceReassociate``), XLA:CPU does not, and that pass only matches when nothing
  stands between the all-reduces and the add.
* **fan-in**: row-parallel layers whose outputs are added (a parallel-residual block's
  attention and MLP outputs, ``x + attn + mlp``). Each output is a partial sum that XLA
  all-reduces before the add; one all-reduce of their sum is enough.

``fuse_reductions`` fixes both where they start, for any model: it traces the function
once, finds the matmuls whose parameter is split over ``model`` (a *column* layer when
the split dimension is an output, a *row* layer when it is contracted) and

* computes each group of two or more column layers reading one activation in one
  ``shard_map`` over ``model`` in which the activation becomes device-varying once: the
  transpose of that one step is one ``psum`` of the summed partial gradients;
* computes each sum that adds two or more row layers' outputs (an ``add`` tree whose
  intermediate values are used nowhere else) in one ``shard_map`` that adds the partial
  outputs and reduces them with one ``psum``; the other terms (the residual, biases) are
  added after it.

Only ``model`` is manual inside those ``shard_map`` s: the other mesh axes (``data``,
``fsdp``) stay automatic. The forward pass computes what it did (the same matmuls on the
same shards; sums reassociated, so float rounding may differ in the last bits).
Everything else in the function is evaluated as traced; calls (``jit``), ``remat`` and
``scan`` bodies are rewritten inside when they hold a group, and left whole otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec as P

from redray.sharding.dataflow import map_view
from redray.sharding.parallelism import MODEL

AXIS = MODEL.name

_INLINE = {"pjit", "jit", "closed_call", "core_call"}
_REMAT = {"remat", "checkpoint", "remat2"}
_ADD = {"add", "add_any"}

View = tuple  # (param index, param dimensions behind each value dimension)


@dataclasses.dataclass(frozen=True)
class _Matmul:
    """A matmul with a weight split over ``model``: which operand is the weight, where
    the split lands in the weight, and in the activation (row) or output (column)."""
    index: int  # the equation's position in its jaxpr
    weight: Any  # the weight operand's var
    weight_is_lhs: bool
    weight_dim: int
    other_dim: int  # column: the output dimension split; row: the activation's contracted

    def activation(self, eqn):
        return eqn.invars[1] if self.weight_is_lhs else eqn.invars[0]


@dataclasses.dataclass(frozen=True)
class _FanIn:
    """An add tree over two or more row layers' outputs."""
    root: int  # the tree's last add
    adds: tuple[int, ...]  # every add of the tree
    rows: tuple[_Matmul, ...]
    others: tuple[Any, ...]  # the other terms (atoms), in the tree's order


def model_split_dims(specs: Sequence[P]) -> list[int | None]:
    """For each parameter spec, the dimension split over ``model`` alone (a tensor-
    parallel split), or None."""
    out = []
    for spec in specs:
        dim = None
        for d, entry in enumerate(spec):
            if entry == AXIS or entry == (AXIS,):
                dim = d
        out.append(dim)
    return out


def fuse_reductions(fn: Callable, mesh: Mesh, specs: Sequence[P]) -> Callable:
    """``fn(param_leaves, *args)`` with every fan-out of column layers and every fan-in
    of row layers reduced once (see the module docstring); ``fn`` itself when ``model``
    has size 1.

    Args:
      fn: called as ``fn(list_of_param_leaves, *args)``; returns any pytree of arrays.
      mesh: the device mesh (its ``model`` axis is the tensor-parallel one).
      specs: the PartitionSpec of each parameter leaf, in order.
    """
    size = mesh.shape.get(AXIS, 1)
    if size <= 1:
        return fn
    split = model_split_dims(specs)

    def fused(leaves, *args):
        leaves = list(leaves)
        if len(leaves) != len(split):
            raise ValueError(f"fuse_reductions: {len(leaves)} parameters, {len(split)} specs")
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(leaves, *args)
        flat = jax.tree.leaves((leaves, *args))
        views: list[View | None] = [None] * len(flat)
        for i, leaf in enumerate(leaves):
            views[i] = (i, tuple(frozenset({d}) for d in range(len(leaf.shape))))
        shapes = [tuple(leaf.shape) for leaf in leaves]
        rewriter = _Rewriter(mesh, size, split, shapes)
        outs = rewriter.run(closed.jaxpr, closed.consts, flat, views)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return fused


def _shape(atom) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _is_var(atom) -> bool:
    return not isinstance(atom, jcore.Literal)


def _spec(ndim: int, dim: int) -> P:
    return P(*[AXIS if d == dim else None for d in range(ndim)])


class _Rewriter:
    def __init__(self, mesh: Mesh, size: int, split, shapes):
        self.mesh, self.size, self.split, self.shapes = mesh, size, split, shapes
        self._holds: dict = {}

    # -- analysis (static: shapes and views only) ------------------------------------

    def views(self, jaxpr, in_views) -> dict:
        """Var -> view, for values that are a parameter seen through layout operations."""
        found = {v: w for v, w in zip(jaxpr.invars, in_views) if w is not None}
        for eqn in jaxpr.eqns:
            ins = [found.get(v) if _is_var(v) else None for v in eqn.invars]
            if ins and ins[0] is not None and all(i is None for i in ins[1:]) \
                    and len(eqn.outvars) == 1:
                mapped = map_view(eqn, ins[0][1])
                if mapped is not None:
                    found[eqn.outvars[0]] = (ins[0][0], mapped)
        return found

    def matmul(self, index: int, eqn, views: dict) -> tuple[str, _Matmul] | None:
        """("column" | "row", the matmul) for a matmul of an activation by a weight split
        over ``model`` (whole, along one of its own dimensions), or None."""
        if eqn.primitive.name != "dot_general":
            return None
        lhs, rhs = eqn.invars
        wl = views.get(lhs) if _is_var(lhs) else None
        wr = views.get(rhs) if _is_var(rhs) else None
        if (wl is None) == (wr is None):
            return None
        weight_is_lhs = wl is not None
        weight, act, (pidx, dims) = (lhs, rhs, wl) if weight_is_lhs else (rhs, lhs, wr)
        if not _is_var(act):
            return None
        ps = self.split[pidx]
        if ps is None:
            return None
        behind = [d for d, s in enumerate(dims) if ps in s]
        value_shape = _shape(weight)
        if len(behind) != 1 or dims[behind[0]] != frozenset({ps}) \
                or value_shape[behind[0]] != self.shapes[pidx][ps] \
                or value_shape[behind[0]] % self.size:
            return None  # sliced, merged with another dimension, or not divisible
        wd = behind[0]
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        contract, batch = (lc, lb) if weight_is_lhs else (rc, rb)
        other_contract = rc if weight_is_lhs else lc
        if wd in batch:
            return None
        if wd in contract:
            act_dim = other_contract[list(contract).index(wd)]
            return "row", _Matmul(index, weight, weight_is_lhs, wd, act_dim)
        free = [d for d in range(len(value_shape)) if d not in contract and d not in batch]
        if weight_is_lhs:
            out_dim = len(lb) + free.index(wd)
        else:
            n_lhs_free = len(_shape(lhs)) - len(lc) - len(lb)
            out_dim = len(lb) + n_lhs_free + free.index(wd)
        return "column", _Matmul(index, weight, weight_is_lhs, wd, out_dim)

    def groups(self, jaxpr, views: dict) -> tuple[dict[int, list[_Matmul]], dict[int, _FanIn]]:
        """(first equation of each fan-out -> its column layers, root add of each fan-in
        -> the fan-in)."""
        by_input: dict = {}
        rows: dict[Any, _Matmul] = {}  # output var -> row matmul
        for i, eqn in enumerate(jaxpr.eqns):
            found = self.matmul(i, eqn, views)
            if found is None:
                continue
            kind, m = found
            if kind == "column":
                by_input.setdefault(m.activation(eqn), []).append(m)
            else:
                rows[eqn.outvars[0]] = m
        fanouts = {ms[0].index: ms for ms in by_input.values() if len(ms) > 1}
        return fanouts, self.fan_ins(jaxpr, rows) if len(rows) > 1 else {}

    def fan_ins(self, jaxpr, rows: dict) -> dict[int, _FanIn]:
        uses: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if _is_var(v):
                    uses.setdefault(v, []).append(i)
        for v in jaxpr.outvars:
            if _is_var(v):
                uses.setdefault(v, []).append(-1)
        producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}

        def inner_add(v) -> int | None:
            """The add producing ``v`` when ``v`` is used once, by another add."""
            i = producer.get(v) if _is_var(v) else None
            if i is None or jaxpr.eqns[i].primitive.name not in _ADD:
                return None
            users = uses.get(v, [])
            if len(users) != 1 or users[0] < 0 or jaxpr.eqns[users[0]].primitive.name not in _ADD:
                return None
            return i

        found = {}
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name not in _ADD or inner_add(eqn.outvars[0]) is not None:
                continue  # not an add, or not a tree's root
            adds, terms, stack = [], [], [i]
            while stack:
                k = stack.pop()
                adds.append(k)
                for v in reversed(jaxpr.eqns[k].invars):
                    inner = inner_add(v)
                    if inner is not None:
                        stack.append(inner)
                    else:
                        terms.append(v)
            row_terms = [v for v in terms if _is_var(v) and v in rows and len(uses[v]) == 1]
            if len(row_terms) < 2:
                continue
            found[i] = _FanIn(i, tuple(adds), tuple(rows[v] for v in row_terms),
                              tuple(v for v in terms if v not in row_terms))
        return found

    def holds_group(self, jaxpr, in_views) -> bool:
        """Whether ``jaxpr`` or a body inside it has a group."""
        key = (id(jaxpr), tuple(in_views))
        if key not in self._holds:
            self._holds[key] = False  # recursion guard
            views = self.views(jaxpr, in_views)
            fanouts, fanins = self.groups(jaxpr, views)
            found = bool(fanouts or fanins)
            for eqn in jaxpr.eqns:
                if found:
                    break
                inner = _body(eqn, [views.get(v) if _is_var(v) else None for v in eqn.invars])
                found = inner is not None and self.holds_group(*inner)
            self._holds[key] = found
        return self._holds[key]

    # -- evaluation ------------------------------------------------------------------

    def run(self, jaxpr, consts, args, in_views) -> list:
        views = self.views(jaxpr, in_views)
        fanouts, fanins = self.groups(jaxpr, views)
        skipped = {m.index for ms in fanouts.values() for m in ms}
        for f in fanins.values():
            skipped.update(a for a in f.adds if a != f.root)
            skipped.update(m.index for m in f.rows)
        producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
        env: dict = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        done: set[int] = set()

        def read(atom):
            if not _is_var(atom):
                return atom.val
            if atom not in env:  # a weight needed early by a group: its layout chain
                evaluate(producer[atom])
            return env[atom]

        def evaluate(i: int) -> None:
            if i in done:
                return
            done.add(i)
            eqn = jaxpr.eqns[i]
            if i in fanouts:
                self.run_fanout(jaxpr, fanouts[i], read, env)
                return
            if i in fanins:
                env[eqn.outvars[0]] = self.run_fanin(jaxpr, fanins[i], read)
                return
            if i in skipped:
                return
            ins = [read(v) for v in eqn.invars]
            in_views = [views.get(v) if _is_var(v) else None for v in eqn.invars]
            outs = self.run_eqn(eqn, ins, in_views)
            env.update(zip(eqn.outvars, outs))

        for i in range(len(jaxpr.eqns)):
            evaluate(i)
        return [read(v) for v in jaxpr.outvars]

    def run_fanout(self, jaxpr, members: list[_Matmul], read, env) -> None:
        eqns = [jaxpr.eqns[m.index] for m in members]
        x = read(members[0].activation(eqns[0]))
        weights = [read(m.weight) for m in members]
        in_specs = (P(), *[_spec(len(_shape(m.weight)), m.weight_dim) for m in members])
        out_specs = tuple(_spec(len(_shape(e.outvars[0])), m.other_dim)
                          for m, e in zip(members, eqns))

        def body(x, *ws):
            # varying once: the transpose is one psum of the summed partial gradients
            x = jax.lax.pcast(x, AXIS, to="varying")
            return tuple(_bind_matmul(e, m, w, x) for m, e, w in zip(members, eqns, ws))

        outs = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={AXIS})(x, *weights)
        for e, o in zip(eqns, outs):
            env[e.outvars[0]] = o

    def run_fanin(self, jaxpr, fan: _FanIn, read):
        eqns = [jaxpr.eqns[m.index] for m in fan.rows]
        acts = [read(m.activation(e)) for m, e in zip(fan.rows, eqns)]
        weights = [read(m.weight) for m in fan.rows]
        in_specs = (*[_spec(len(_shape(m.activation(e))), m.other_dim)
                      for m, e in zip(fan.rows, eqns)],
                    *[_spec(len(_shape(m.weight)), m.weight_dim) for m in fan.rows])
        n = len(fan.rows)

        def body(*operands):
            xs, ws = operands[:n], operands[n:]
            parts = [_bind_matmul(e, m, w, x) for m, e, w, x in zip(fan.rows, eqns, ws, xs)]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return jax.lax.psum(total, AXIS)

        out = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=P(),
                            axis_names={AXIS})(*acts, *weights)
        for term in fan.others:
            out = out + read(term)
        return out.astype(jaxpr.eqns[fan.root].outvars[0].aval.dtype)

    def run_eqn(self, eqn, ins: list, in_views: list) -> list:
        inner = _body(eqn, in_views)
        if inner is not None and self.holds_group(*inner):
            return self.rebuild(eqn, ins, in_views, *inner)
        with _context(eqn):
            out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        return list(out) if eqn.primitive.multiple_results else [out]

    def rebuild(self, eqn, ins, in_views, inner, inner_views) -> list:
        """A call, remat or scan whose body holds a group, with the body rewritten."""
        name, p = eqn.primitive.name, eqn.params
        if name in _INLINE:
            closed = p["jaxpr"] if "jaxpr" in p else p["call_jaxpr"]
            consts = getattr(closed, "consts", ())
            return self.run(inner, consts, ins, inner_views)
        if name in _REMAT:
            def rematted(*args):
                return self.run(inner, (), list(args), inner_views)

            return list(jax.checkpoint(rematted, prevent_cse=p.get("prevent_cse", True),
                                       policy=p.get("policy"))(*ins))
        # scan
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        body_consts = p["jaxpr"].consts

        def step(carry, x):
            outs = self.run(inner, body_consts, [*consts, *carry, *x], inner_views)
            return outs[:ncarry], outs[ncarry:]

        carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]


def _bind_matmul(eqn, m: _Matmul, weight, activation):
    operands = (weight, activation) if m.weight_is_lhs else (activation, weight)
    return eqn.primitive.bind(*operands, **eqn.params)


def _body(eqn, in_views) -> tuple | None:
    """(inner jaxpr, views of its inputs) of a call, remat or scan; None otherwise."""
    name, p = eqn.primitive.name, eqn.params
    if name in _INLINE or name in _REMAT:
        j = p.get("jaxpr", p.get("call_jaxpr"))
        if j is None:
            return None
        inner = j if isinstance(j, jcore.Jaxpr) else j.jaxpr
        return (inner, tuple(in_views)) if len(inner.invars) == len(in_views) else None
    if name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
        # a scanned-over parameter (layers stacked on axis 0) is seen one slice at a time
        xs = [(w[0], w[1][1:]) if w is not None else None for w in in_views[nc + ncarry:]]
        carry = [None] * ncarry  # a carry changes between iterations: never a view
        return p["jaxpr"].jaxpr, (*in_views[:nc], *carry, *xs)
    return None


def _context(eqn):
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return contextlib.nullcontext() if manager is None else manager
