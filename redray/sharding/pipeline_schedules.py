"""Pipeline schedules' parts that know no model: micro-batches cut from the rows and put
back, and the 1F1B schedule, given a model cut into the stages' layers and the tail
(``redray/engine/one_f_one_b.py`` cuts a user's loss; ``redray/models/staged_layers.py`` runs
GPipe's schedule inside the model's forward)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax._src.interpreters import partial_eval as pe

from redray.sharding.tracing import loop_unroll
from redray.sharding.parallelism import STAGE, role_size


def rows_flags(tree, rows: int) -> list[bool]:
    """Which leaves of ``tree`` hold rows (a leading axis of ``rows``); an
    ``AttentionMask``'s query slots and window are not rows, whatever their length."""
    def holds_rows(path, x):
        name = getattr(path[-1], "name", None) if path else None
        return bool(getattr(x, "ndim", 0)) and x.shape[0] == rows \
            and name not in ("q_slots", "layer_window")

    return [holds_rows(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def split_micro(x, micro: int, ways: int):
    """(rows, ...) -> (micro, rows / micro, ...), for rows split ``ways`` ways over the
    batch axes: each of those shards cut into ``micro`` consecutive parts, micro-batch
    ``m`` taking part ``m`` of every shard (so it keeps the batch's split: no data
    moves)."""
    rows = x.shape[0]
    parts = x.reshape(ways, micro, rows // (ways * micro), *x.shape[1:]).swapaxes(0, 1)
    return parts.reshape(micro, rows // micro, *x.shape[1:])


def merge_micro(x, ways: int):
    """``split_micro``'s inverse. Micro-batches split over ``stage`` (consecutive ones on
    a stage) become rows split over the batch axes and then ``stage``, with no data
    moved."""
    micro, part = x.shape[:2]
    rows = x.reshape(micro, ways, part // ways, *x.shape[2:]).swapaxes(0, 1)
    return rows.reshape(micro * part, *x.shape[2:])


# The columns of ``Schedule.table``: per tick and stage, what the stage does.
_COLUMNS = ("forward", "f_repeat", "f_micro", "f_slot", "store", "tail_slot",
            "backward", "b_repeat", "b_micro", "b_slot", "b_grad", "store_grad", "f_kept",
            "b_kept")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The 1F1B schedule of ``S`` stages, ``M`` micro-batches and ``R`` repeats, tick by
    tick (``one_f_one_b_table``).

    Attributes:
      ticks: the schedule's length; each tick a stage runs at most one chunk's forward
        and one chunk's backward.
      slots: the stage inputs a stage holds at once, from their arrival to their
        backward (the ring ``one_f_one_b`` keeps).
      grad_slots: the output gradients a stage holds at once, from their arrival to
        their backward.
      kept_slots: the chunks' saved activations (their backward's residuals) a stage
        holds at once, from their forward to their backward (``2 (S - s) - 1`` on
        stage ``s`` without repeats; Megatron-LM's 1F1B, whose forward takes a third
        of a tick, keeps ``S - s``).
      table: (ticks, S, len(_COLUMNS)) ints: ``forward``/``backward`` 1 where the stage
        runs one, the repeat (chunk) and micro-batch of each, the slot its input is in
        (``f_slot``, ``b_slot``) and the gradient slot its backward reads
        (``b_grad``); ``store``/``store_grad``: the slot where the input and the
        gradient that arrived from the neighbours at the end of the tick before are
        kept (-1: nothing for this stage); ``tail_slot``: on the last chunk's forward,
        where the loss's gradient goes (-1 elsewhere); ``f_kept``/``b_kept``: the slot
        a forward's saved activations go to, and the one a backward reads them from.
    """
    ticks: int
    slots: int
    grad_slots: int
    table: np.ndarray
    kept_slots: int = 1

    def column(self, name: str) -> np.ndarray:
        return self.table[..., _COLUMNS.index(name)]

    @property
    def passes(self) -> float:
        """The schedule's length in ticks of one chunk's forward and backward, the
        bubble's included: each tick lasts its busiest stage's work, a forward a third
        and a backward two thirds of such a tick. ``M + S - 1`` without repeats, and
        ``M R + S - 1`` with ``M`` a multiple of ``S`` (Megatron-LM's interleaved
        bubble, ``(S - 1) / (M R)`` of the work)."""
        work = self.column("forward") + 2 * self.column("backward")
        return float(work.max(axis=1).sum()) / 3


def _orders(stages: int, micro: int, repeats: int):
    """Each stage's forward and backward order of (chunk, micro-batch): the
    micro-batches in groups of ``S``, each group through the stage's chunks in turn
    (the backward: in reverse), as Megatron-LM interleaves its virtual stages."""
    groups = [range(g, min(micro, g + stages)) for g in range(0, micro, stages)]
    forward = [[(r * stages + s, m) for ms in groups for r in range(repeats) for m in ms]
               for s in range(stages)]
    backward = [[(r * stages + s, m) for ms in groups for r in reversed(range(repeats))
                 for m in ms] for s in range(stages)]
    return forward, backward


def _slots(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for (start, end, key) lifetimes (ticks, both included), fewest first:
    key -> slot, and the number of slots."""
    free, busy, out, count = [], [], {}, 0  # busy: (end, slot)
    for start, end, key in sorted(intervals, key=lambda i: i[:2]):
        busy.sort()
        while busy and busy[0][0] < start:
            free.append(busy.pop(0)[1])
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, count = count, count + 1
        out[key] = slot
        busy.append((end, slot))
    return out, count


@functools.lru_cache(maxsize=256)
def one_f_one_b_table(stages: int, micro: int, repeats: int = 1) -> Schedule:
    """The 1F1B schedule (``one_f_one_b``), interleaved with ``repeats`` > 1.

    Chunk ``v`` of the ``S R`` (``k = L / (S R)`` layers each, held as
    ``parallelism.layer_order`` holds them) runs on stage ``v mod S``. Each stage takes
    its forwards and backwards in a fixed order (``_orders``) and, at every tick, runs
    the next forward whose input is there (the previous chunk's output, passed at the
    end of an earlier tick; chunk 0: the micro-batch) and the next backward whose
    output gradient is there (the next chunk's input gradient; the last chunk's: the
    loss's, in the tick of its forward). Without repeats this is the 1F1B schedule:
    stage ``s`` runs micro-batch ``m``'s forward at tick ``m + s`` and its backward at
    ``m + 2 (S - 1) - s``: ``M + 2 (S - 1)`` ticks, a ring of ``2 S - 1`` inputs. With
    ``R`` repeats a tick runs ``1 / R`` of a stage's layers and the bubble shrinks
    about ``R`` times, for ``R`` times the passes between stages and more inputs held
    (``slots``)."""
    S, M, R = stages, micro, repeats
    V = S * R
    forward, backward = _orders(S, M, R)
    f_at, b_at = {}, {}  # (chunk, micro-batch) -> the tick of its forward, backward
    f_next, b_next = [0] * S, [0] * S
    never = 1 << 30
    t = 0
    while any(b_next[s] < len(backward[s]) for s in range(S)):
        if t > 4 * (M * R + V) + 8:
            raise RuntimeError(f"the 1F1B schedule of {S} stages, {M} micro-batches and "
                               f"{R} repeats does not end")
        for s in range(S):
            if f_next[s] < len(forward[s]):
                v, m = forward[s][f_next[s]]
                if v == 0 or f_at.get((v - 1, m), never) < t:
                    f_at[(v, m)] = t
                    f_next[s] += 1
        for s in range(S):
            if b_next[s] < len(backward[s]):
                v, m = backward[s][b_next[s]]
                if (f_at.get((v, m), never) <= t if v == V - 1
                        else b_at.get((v + 1, m), never) < t):
                    b_at[(v, m)] = t
                    b_next[s] += 1
        t += 1
    col = _COLUMNS.index
    table = np.full((t, S, len(_COLUMNS)), -1, np.int32)  # a slot of -1: none
    for at, names in ((f_at, ("forward", "f_repeat", "f_micro")),
                      (b_at, ("backward", "b_repeat", "b_micro"))):
        cols = [col(n) for n in names]
        table[..., cols] = 0  # nothing to run: chunk 0, micro-batch 0 (never read)
        for (v, m), tick in at.items():
            table[tick, v % S, cols] = (1, v // S, m)
    slots = grad_slots = kept_slots = 1
    for s in range(S):
        mine = [(v, m) for v, m in f_at if v % S == s]
        kept, n = _slots([(f_at[(v, m)], b_at[(v, m)], (v, m)) for v, m in mine])
        kept_slots = max(kept_slots, n)
        for (v, m), slot in kept.items():
            table[f_at[(v, m)], s, col("f_kept")] = slot
            table[b_at[(v, m)], s, col("b_kept")] = slot
        # an input is kept from its arrival (chunk 0's: its forward) to its backward
        inputs, n = _slots([(f_at[(v - 1, m)] + 1 if v else f_at[(v, m)], b_at[(v, m)], (v, m))
                            for v, m in mine])
        slots = max(slots, n)
        grads, n = _slots([(f_at[(v, m)] if v == V - 1 else b_at[(v + 1, m)] + 1,
                            b_at[(v, m)], (v, m)) for v, m in mine])
        grad_slots = max(grad_slots, n)
        for (v, m), slot in inputs.items():
            table[f_at[(v, m)], s, col("f_slot")] = slot
            table[b_at[(v, m)], s, col("b_slot")] = slot
            if v:
                table[f_at[(v - 1, m)] + 1, s, col("store")] = slot
        for (v, m), slot in grads.items():
            table[b_at[(v, m)], s, col("b_grad")] = slot
            if v == V - 1:
                table[f_at[(v, m)], s, col("tail_slot")] = slot
            else:
                table[b_at[(v + 1, m)] + 1, s, col("store_grad")] = slot
    return Schedule(t, slots, grad_slots, table, kept_slots)


def one_f_one_b_schedule(stages: int, micro: int, repeats: int = 1) -> tuple[int, int]:
    """(ticks, stage inputs held) of ``one_f_one_b`` on ``S`` stages over ``M``
    micro-batches (``one_f_one_b_table``): without repeats ``M + 2 (S - 1)`` ticks and
    a ring of ``2 S - 1`` inputs, whatever ``M``."""
    schedule = one_f_one_b_table(stages, micro, repeats)
    return schedule.ticks, schedule.slots


def _pick(tree, r, repeats: int):
    """Chunk ``r`` of a stage's chunks in ``tree`` (their leading axis); without repeats
    the tree itself."""
    if repeats == 1:
        return tree
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), tree)


def _as_held(h, slot, lead: int = 0):
    """Hidden states ``h`` as the 1F1B schedule holds them: laid out as ``slot`` after
    their first ``lead`` dimensions (``slot`` None: as XLA chooses)."""
    if slot is None:
        return h
    return jax.lax.with_sharding_constraint(h, jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), P(*(None,) * lead, *slot)))


def _when(in_step: bool, mine, anyone, fn, otherwise):
    """``fn()`` where this stage runs it, else ``otherwise()``; in step, every stage runs
    it where any does and keeps its own result."""
    if not in_step:
        return jax.lax.cond(mine, fn, otherwise)
    return jax.lax.cond(anyone, lambda: jax.tree.map(
        lambda a, b: jnp.where(mine, a, b), fn(), otherwise()), otherwise)


def _neighbours(stages: int, repeats: int) -> tuple[list, list]:
    """The ``ppermute`` pairs of the 1F1B schedule: (each stage's output to the next
    stage, each stage's input gradient to the previous one)."""
    # without repeats nothing goes round: the last stage sends nothing to the first
    S = stages
    ahead = [(i, (i + 1) % S) for i in range(S if repeats > 1 else S - 1)]
    behind = [((i + 1) % S, i) for i in range(S if repeats > 1 else S - 1)]
    return ahead, behind


def _zero_metrics(tail_fn, tail_params, x_m, consts):
    """Zeros (float32) shaped as ``tail_fn``'s metrics: where their sums over the
    micro-batches start."""
    metrics_shape = jax.eval_shape(lambda *a: tail_fn(*a)[1], tail_params, x_m[0], 0, consts)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), metrics_shape)


def _tail_pass(tail_fn, tail_params, consts, out, m, at, kept):
    """The tail on micro-batch ``m``'s output ``out`` of the last chunk: ``kept`` (the
    loss, metrics, tail gradients and gradient ring) with its loss, metrics and gradients
    added, and its output's gradient put in the ring's ``tail_slot``."""
    loss, metrics, tail_grads, grad_ring = kept
    # the gradients added where they are kept: no zeros made
    (value, found), (d_tail, d_out) = jax.value_and_grad(
        tail_fn, (0, 1), has_aux=True)(tail_params, out, m, consts)
    return (loss + value.astype(jnp.float32),
            jax.tree.map(lambda a, b: a + jnp.asarray(b, jnp.float32), metrics, found),
            jax.tree.map(jnp.add, tail_grads, d_tail),
            grad_ring.at[at("tail_slot")].set(d_out))


def runs_on_own_rows(shape) -> bool:
    """Whether 1F1B runs a stage's chunks on each device's own rows (``Local``) on a mesh
    of ``shape`` (axis name -> size): its rows split, and no expert axis (its exchange
    spans the rows' devices). A context axis's ring or gather runs inside, over a
    device's own rows. The runtime, the cost model and the memory plan all ask this."""
    return role_size(shape, "rows") > 1 and role_size(shape, "experts") == 1


@dataclasses.dataclass(frozen=True)
class Local:
    """How 1F1B runs a stage's chunks on each device's own rows (``one_f_one_b``'s
    ``local``): manual over the batch axes ``axes`` (a nested ``shard_map``), the
    chunks gathered whole over them once before the ticks (``gathered``: each chunk
    leaf's spec), each device's gradients summed unreduced over the ticks (a leading
    axis of ``ways``, one entry a device) and reduced once after them.

    Attributes:
      axes: the batch axes (rows) made manual.
      ways: the devices of those axes.
      gathered: one PartitionSpec per chunk leaf (its stage axis removed): the chunk
        as a stage holds it for the schedule, FSDP's axes left out.
      const_rows: a pytree of bools shaped as ``consts``: the leaves that hold the
        micro-batches' rows (micro-batch, rows, ...).
    """
    axes: tuple[str, ...]
    ways: int
    gathered: tuple
    const_rows: object

    def rows(self, lead: int = 0) -> P:
        return P(*(None,) * lead, self.axes)

    def const_specs(self):
        return jax.tree.map(lambda r: self.rows(1) if r else P(), self.const_rows)

    def run(self, fn, *args, in_specs, out_specs):
        """``fn(*args)`` on each device's own rows (manual over ``axes``)."""
        return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                             out_specs=out_specs, axis_names=set(self.axes),
                             check_vma=False)(*args)


def _hold(tree, specs, lead=()):
    """``tree``'s leaves laid out as ``specs`` (one per leaf) after ``lead``."""
    mesh = jax.sharding.get_abstract_mesh()
    leaves, structure = jax.tree.flatten(tree)
    return structure.unflatten([jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, P(*lead, *spec))) for a, spec in zip(leaves, specs)])


def _vjp_leaves(fn, p, x) -> tuple:
    """(``fn(p, x)``, the leaves of its vjp: what its backward reads, their treedef)."""
    out, vjp = jax.vjp(fn, p, x)
    leaves, tree = jax.tree.flatten(vjp)
    return out, leaves, tree


def _on_input(fn, p, x) -> list[bool]:
    """Which leaves of ``fn``'s vjp at ``(p, x)`` depend on ``x`` (each found by dead-code
    elimination of the others in its jaxpr: a scan's carry followed to its fixpoint)."""
    jaxpr = jax.make_jaxpr(lambda p, x: _vjp_leaves(fn, p, x)[1])(p, x).jaxpr
    first, n = len(jax.tree.leaves(p)), len(jaxpr.outvars)
    return [any(pe.dce_jaxpr(jaxpr, [j == i for j in range(n)])[1][first:])
            for i in range(n)]


class _Kept:
    """A chunk's saved activations from its forward to its backward, as Megatron-LM's
    1F1B keeps them (the backward had recomputed the forward: a third more of the
    layers' work): the leaves of the chunk's vjp that depend on its input, in the
    schedule's ``kept_slots`` slots (with ``local``, each device's, on a leading axis
    over the batch axes), but the input itself, which the schedule's ring holds until
    the backward. The other leaves (the parameters as read or cast, the micro-batch's
    masks) the backward computes again; nothing reads the rest of that forward, which
    XLA leaves out. A remat policy inside the layers keeps what it saves
    and recomputes the rest in the backward, as without stages. With ``recompute`` the
    chunk is one remat block: it keeps nothing, and its backward runs its forward again
    from the ring's input (one chunk's activations at a time)."""

    def __init__(self, run, local: Local | None, consts, own, recompute: bool = False):
        self.run, self.local, self.consts, self.own = run, local, consts, own
        self.recompute = recompute
        self.on_input = None  # set where the chunk's forward is first traced

    def _fn(self, r, m, c, o):
        fn = lambda p, x: self.run(p, r, x, m, c, o)  # noqa: E731
        # recomputed: the chunk saves nothing but its inputs (the parameters, the ring's)
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable) \
            if self.recompute else fn

    def _forward(self, p, r, h, m, c, o):
        fn = self._fn(r, m, c, o)
        out, leaves, _ = _vjp_leaves(fn, p, h)
        if self.on_input is None:  # the input itself is in the schedule's ring already
            self.on_input = [d and a is not h for a, d in zip(leaves, _on_input(fn, p, h))]
        return out, [a for a, d in zip(leaves, self.on_input) if d]

    def forward(self, p, r, h, m):
        """(chunk ``p``'s output on micro-batch ``m``'s input ``h``, what it keeps)."""
        if self.local is None:
            return self._forward(p, r, h, m, self.consts, self.own)
        rows = self.local.rows()

        def on_rows(*a):
            out, kept = self._forward(*a)
            return out, [k[None] for k in kept]

        return self.local.run(on_rows, p, r, h, m, self.consts, self.own,
                              in_specs=(P(), P(), rows, P(), self.local.const_specs(), P()),
                              out_specs=(rows, P(self.local.axes)))

    def backward(self, p, x, g, r, m, c, o, kept):
        """The vjp of chunk ``p`` on input ``x`` at output gradient ``g``, from ``kept``."""
        _, leaves, tree = _vjp_leaves(self._fn(r, m, c, o), p, x)
        kept = iter(kept)
        return tree.unflatten([next(kept) if d else a
                               for a, d in zip(leaves, self.on_input)])(g)

    def empty(self, chunk, x, slots: int) -> tuple[list, list]:
        """(one forward's kept leaves as zeros, ``slots`` of them: the ring), for inputs
        like ``x`` and chunks picked by ``chunk(r)``."""
        shapes = jax.eval_shape(lambda r, h, m: self.forward(chunk(r), r, h, m)[1],
                                jnp.int32(0), x, jnp.int32(0))
        mesh = jax.sharding.get_abstract_mesh()

        def zeros(shape, dtype, lead=()):  # with local: each device's on its own
            z = jnp.zeros(shape, dtype)
            return z if self.local is None else jax.lax.with_sharding_constraint(
                z, NamedSharding(mesh, P(*lead, self.local.axes)))

        return ([zeros(a.shape, a.dtype) for a in shapes],
                [zeros((slots, *a.shape), a.dtype, (None,)) for a in shapes])


def _chunk_backward(kept: _Kept, chunks, ring, grad_ring, kept_ring, at, grads, rb, b,
                    repeats: int):
    """Chunk ``rb``'s backward on micro-batch ``b``: from what its forward kept in
    ``kept_ring`` and its output's gradient in ``grad_ring``; (``grads`` with the
    chunk's gradients added, the gradient of its input). With ``kept.local``, on each
    device's own rows: its gradients added unreduced, at its own entry of ``grads``'
    leading axis."""
    local = kept.local
    args = (_pick(chunks, rb, repeats), ring[at("b_slot")], grad_ring[at("b_grad")], rb, b,
            kept.consts, kept.own, [k[at("b_kept")] for k in kept_ring])
    if local is None:
        d_chunk, d_in = kept.backward(*args)
    else:
        rows = local.rows()

        def on_rows(*a):
            d_chunk, d_in = kept.backward(*a[:-1], [k[0] for k in a[-1]])
            return jax.tree.map(lambda t: t[None], d_chunk), d_in

        d_chunk, d_in = local.run(
            on_rows, *args,
            in_specs=(P(), rows, rows, P(), P(), local.const_specs(), P(), P(local.axes)),
            out_specs=(P(local.axes), rows))
    if repeats == 1:
        return jax.tree.map(jnp.add, grads, d_chunk), d_in
    at_chunk = rb if local is None else (slice(None), rb)  # past the devices' axis
    return jax.tree.map(lambda g, d: g.at[at_chunk].add(d), grads, d_chunk), d_in


def _zero_grads(chunks, local: Local | None):
    """Where a stage's chunk gradients are summed over the ticks: like ``chunks``, or
    with ``local`` one sum a device (a leading axis over its batch axes), unreduced."""
    if local is None:
        return jax.tree.map(jnp.zeros_like, chunks)
    zeros = jax.tree.map(lambda a: jnp.zeros((local.ways, *a.shape), a.dtype), chunks)
    return _hold(zeros, local.gathered, (local.axes,))


def _stage_program(stage_fn, tail_fn, schedule: Schedule, table, no_metrics, repeats: int,
                   in_step: bool, slot, local: Local | None, recompute: bool, chunks, own,
                   tail_params, x_m, consts):
    """One stage's part of ``one_f_one_b`` (manual over ``stage``): the schedule's ticks
    as one scan; returns (the loss and metrics summed, the gradients of its chunks (with
    the stage axis), of the tail's parameters, of ``x_m`` (with the stage axis))."""
    chunks, own = jax.tree.map(lambda a: a[0], (chunks, own))
    if local is not None:  # gathered once, before the ticks
        chunks = _hold(chunks, local.gathered)
    s = jax.lax.axis_index(STAGE.name)
    ahead, behind = _neighbours(schedule.table.shape[1], repeats)
    zero_h = _as_held(jnp.zeros_like(x_m[0]), slot)

    keeps = _Kept(lambda p, r, h, m, c, o: stage_fn(p, _pick(o, r, repeats), h, m, c), local,
                  consts, own, recompute)
    zero_kept, kept_ring = keeps.empty(lambda r: _pick(chunks, r, repeats), x_m[0],
                                       schedule.kept_slots)

    def tick(carry, t):
        got, got_grad, ring, grad_ring, kept_ring, grads, tail_grads, x_grads, loss, \
            metrics = carry
        row = table[t, s]
        at = lambda name: row[_COLUMNS.index(name)]  # noqa: E731
        # whether any stage does it at this tick (the same on every device)
        anyone = lambda name, low: (table[t, :, _COLUMNS.index(name)] >= low).any()  # noqa: E731
        # what the neighbours passed at the end of the last tick, kept for its turn
        ring = jax.lax.cond(at("store") >= 0, lambda: ring.at[at("store")].set(got),
                            lambda: ring)
        grad_ring = jax.lax.cond(at("store_grad") >= 0,
                                 lambda: grad_ring.at[at("store_grad")].set(got_grad),
                                 lambda: grad_ring)
        # a chunk's forward on its input (chunk 0's: the micro-batch), its input and
        # what its backward reads kept until then
        forward, r, m = at("forward") == 1, at("f_repeat"), at("f_micro")
        h = jnp.where((s == 0) & (r == 0), x_m[m], ring[at("f_slot")])
        out, saved = _when(in_step, forward, anyone("forward", 1),
                           lambda: keeps.forward(_pick(chunks, r, repeats), r, h, m),
                           lambda: (zero_h, zero_kept))
        out = _as_held(out, slot)
        ring, kept_ring = jax.lax.cond(
            forward, lambda: (ring.at[at("f_slot")].set(h),
                              [k.at[at("f_kept")].set(v) for k, v in zip(kept_ring, saved)]),
            lambda: (ring, kept_ring))
        kept = (loss, metrics, tail_grads, grad_ring)
        # every stage runs the tail where the last does, keeping none of it: a loss's
        # collective-permute (a chunked loss's padding over a data axis) spans them all
        loss, metrics, tail_grads, grad_ring = _when(
            True, at("tail_slot") >= 0, anyone("tail_slot", 0),
            lambda: _tail_pass(tail_fn, tail_params, consts, out, m, at, kept), lambda: kept)
        # a chunk's backward: its output's gradient (from the next chunk, or the
        # tail's) through what its forward kept
        backward, rb, b = at("backward") == 1, at("b_repeat"), at("b_micro")
        grads, d_in = _when(
            in_step, backward, anyone("backward", 1),
            lambda: _chunk_backward(keeps, chunks, ring, grad_ring, kept_ring, at, grads, rb,
                                    b, repeats),
            lambda: (grads, zero_h))
        d_in = _as_held(d_in, slot)
        x_grads = jax.lax.cond(backward & (s == 0) & (rb == 0),
                               lambda: x_grads.at[b].set(d_in), lambda: x_grads)
        carry = (jax.lax.ppermute(out, STAGE.name, ahead),
                 jax.lax.ppermute(d_in, STAGE.name, behind),
                 ring, grad_ring, kept_ring, grads, tail_grads, x_grads, loss, metrics)
        return carry, None

    carry = (zero_h, zero_h,
             _as_held(jnp.zeros((schedule.slots, *zero_h.shape), zero_h.dtype), slot, 1),
             _as_held(jnp.zeros((schedule.grad_slots, *zero_h.shape), zero_h.dtype), slot, 1),
             kept_ring, _zero_grads(chunks, local), jax.tree.map(jnp.zeros_like, tail_params),
             _as_held(jnp.zeros_like(x_m), slot, 1), jnp.zeros((), jnp.float32), no_metrics)
    (*_, grads, tail_grads, x_grads, loss, metrics), _ = jax.lax.scan(
        tick, carry, jnp.arange(schedule.ticks), unroll=loop_unroll())
    if local is not None:  # each device's sums reduced, once
        grads = _hold(jax.tree.map(lambda g: g.sum(0), grads), local.gathered)
    # the loss and the tail's gradients live on the last stage, x_m's on the first
    return (jax.lax.psum((loss, metrics), STAGE.name),
            jax.tree.map(lambda a: a[None], grads), jax.lax.psum(tail_grads, STAGE.name),
            x_grads[None])


def one_f_one_b(stage_fn, tail_fn, stage_params, tail_params, x_m, consts, mesh,
                stage_consts=(), repeats: int = 1, in_step: bool = False, slot=None,
                local: Local | None = None, recompute: bool = False):
    """One pipelined gradient step in the 1F1B order: each stage alternates one
    micro-batch's forward and an earlier one's backward, so a stage holds a bounded
    number of micro-batches' inputs (``one_f_one_b_table``), where GPipe keeps every
    tick's activations until its backward pass starts after the last forward. With
    ``repeats`` > 1 the schedule is interleaved: each stage holds ``R`` chunks of its
    layers (``parallelism.layer_order``), a micro-batch passes the stages ``R`` times,
    and the bubble is about ``R`` times shorter.

    One SPMD program as GPipe's (``redray.models.staged_layers.run_stages``), but manual
    over ``stage`` (``shard_map``; the other mesh axes stay XLA's to partition inside a
    stage): at every tick a stage runs its forward and its backward only where it has
    one (``lax.cond``: a bubble computes nothing), then passes its output to the next
    stage and its input gradient to the previous one (two ``ppermute``; with repeats
    round a ring, the last stage's output going back to the first). What arrives is
    kept in the slot the schedule's table names until its turn. A chunk's forward keeps
    what its backward reads (``_Kept``: its saved activations, as a remat policy inside
    the layers leaves them) in the schedule's ``kept_slots`` until that backward. The
    last stage runs the loss's ``tail_fn`` on each micro-batch as it
    leaves the last chunk and may start that micro-batch's backward in the same tick.

    Args:
      stage_fn: ``stage_fn(chunk, own, h, m, consts) -> h``: one chunk's layers on
        micro-batch ``m``'s activations ``h``; ``chunk`` and ``own`` are this chunk's
        parts of ``stage_params`` and ``stage_consts`` (their leading stage axis, and
        with repeats the chunk axis, removed).
      tail_fn: ``tail_fn(tail_params, h, m, consts) -> (loss, metrics)``: micro-batch
        ``m``'s loss (a scalar) from the last stage's output, and a dict of scalars
        summed over the micro-batches as the loss is.
      stage_params: a pytree whose leaves have a leading axis of ``S`` (the stages),
        split over the ``stage`` mesh axis; with repeats a second axis of ``R`` (the
        stage's chunks: chunk ``r`` of stage ``s`` runs ``r S + s``-th).
      tail_params: the tail's parameters (the same on every stage).
      x_m: (M, ...): every micro-batch's input to the first stage.
      consts: what both functions read (a micro-batch's labels, masks: they pick
        micro-batch ``m``'s part themselves); no gradient flows into them.
      mesh: the device mesh, with a ``stage`` axis of ``S``.
      stage_consts: like ``stage_params`` (leading axes of ``S`` and, with repeats,
        ``R``), without gradients: each chunk's share of what its layers read (their
        other state, per-layer inputs).
      repeats: the chunks per stage (``R``).
      in_step: every stage runs a forward, a backward or the tail at a tick where any
        stage runs one, and keeps its result only where it is its own: for functions
        whose collectives span the stages (a ring over a context axis: a
        collective-permute, which XLA runs as one exchange among every device, would
        wait for ever on the stages that skip it). Such a tick lasts its busiest stage's
        work either way.
      slot: the PartitionSpec of one micro-batch's hidden states (over the axes other
        than ``stage``) that the schedule holds and passes: the slots its rings keep,
        what goes to the neighbours (None: XLA's choice).
      local: run the chunks on each device's own rows (``Local``): a stage's chunks
        gathered once before the ticks and their gradients summed unreduced and reduced
        once after them, as Megatron-LM's and torchtitan's pipelines keep an FSDP
        stage's parameters and gradients; None: XLA partitions each tick's chunk,
        gathering it over FSDP and reducing its gradient over the batch axes at every
        tick.
      recompute: each chunk's backward recomputes its forward from its input (``_Kept``).

    Returns:
      (the micro-batches' losses summed, their metrics summed, the gradients of
      ``stage_params`` (their layout), of ``tail_params``, and of ``x_m``).
    """
    stages = mesh.shape[STAGE.name]
    micro = x_m.shape[0]
    if jax.tree.leaves(stage_params)[0].shape[0] != stages:
        raise ValueError(f"stage_params lead with {jax.tree.leaves(stage_params)[0].shape[0]} "
                         f"entries; the mesh has {stages} stages")
    schedule = one_f_one_b_table(stages, micro, repeats)
    table = jnp.asarray(schedule.table)
    no_metrics = _zero_metrics(tail_fn, tail_params, x_m, consts)
    program = functools.partial(_stage_program, stage_fn, tail_fn, schedule, table,
                                no_metrics, repeats, in_step, slot, local, recompute)
    staged, whole = P(STAGE.name), P()
    (loss, metrics), grads, tail_grads, x_grads = jax.shard_map(
        program, mesh=mesh, in_specs=(staged, staged, whole, whole, whole),
        out_specs=(whole, staged, whole, staged), axis_names={STAGE.name},
        check_vma=False)(stage_params, stage_consts, tail_params, x_m, consts)
    return loss, metrics, grads, tail_grads, x_grads[0]
