"""What one example's training step computes, in the three kinds of work a device runs
at different rates: matmul FLOPs (at the matmul rate), attention (at its kernel's
rate) and memory-bound work (norms, activations, residual adds, the loss: the bytes its
kernels read and write, at the memory bandwidth).

Counted on XLA's compiled step, not guessed: the model's loss gradient on one example is
compiled for this machine's CPU with attention replaced by a stand-in
(``redray.sharding.tracing.counted_attention``) that records each call's geometry.
In the optimized program, every dot (inside a fusion or not) gives its FLOPs, and every
other top-level kernel (a fusion, a copy, a reduction) the bytes of its operands and
outputs; a fusion holding a dot is the matmul's (its bytes move under the matmul's
time). XLA:GPU fuses elementwise chains as XLA:CPU does (loop and input fusions), so the
count stands for what a GPU's kernels move; tests/test_work.py checks it against the
compiled program's own cost analysis. Attention is costed from the recorded calls:
a block-skipping kernel computes the causal triangle or the window's band
(``AttentionCall.flops``), a materialized mask the whole square.

A model of stacked-alike layers is counted at depth 1 and 2 and the difference is one
layer's work (``StepWork.layer``); the rest (embedding, head, loss) is what depth 1
holds beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp

# Bytes per element of the HLO types a step's buffers take.
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-, %]+)")
_OPCODE = re.compile(r"=\s*(?:\([^=]*?\)|[\w\[\]{},:]+)\s+([\w\-]+)\(")
_METADATA = re.compile(r', metadata=\{[^}]*\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# What moves no bytes of its own, or is accounted by what it calls.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
         "conditional", "after-all", "partition-id", "replica-id", "iota"}
# What only moves an array's elements (a layout, a transposition, a dtype).
_LAYOUT = {"parameter", "copy", "transpose", "bitcast", "reshape", "convert"}
# The forward and backward FLOPs of a fused attention kernel over its forward's: the
# backward recomputes the scores and computes the gradients of the probabilities, the
# values, the queries and the keys (five products of the forward's two sizes).
ATTENTION_BACKWARD = 2.5
# The same over a materialized mask: the gradients of the probabilities, the values,
# the queries and the keys (four products), the scores kept from the forward.
DENSE_BACKWARD = 2.0


@dataclasses.dataclass(frozen=True)
class Work:
    """Work of one example's forward and backward pass (or a part of it).

    Attributes:
      matmul: FLOPs of the matrix products (the model's layers, the head).
      attention: FLOPs a block-skipping attention kernel computes (forward, and
        backward where the pass has one).
      dense_attention: the same over every (query, key) pair (a materialized mask).
      memory: bytes the memory-bound kernels read and write.
      split_memory: the part of ``memory`` over tensors a tensor-parallel model axis
        splits (attention's heads, the MLP's inner width); the rest (the residual
        stream, norms, the loss) runs whole on every device of the axis.
    """
    matmul: float = 0.0
    attention: float = 0.0
    dense_attention: float = 0.0
    memory: float = 0.0
    split_memory: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self),
                                            dataclasses.astuple(other))))

    def __sub__(self, other: "Work") -> "Work":
        return self + other * -1.0

    def __mul__(self, k: float) -> "Work":
        return Work(*(a * k for a in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class StepWork:
    """One example's work: ``layers`` alike layers of ``layer`` each, and ``rest``."""
    layer: Work
    rest: Work
    layers: int

    @property
    def total(self) -> Work:
        return self.rest + self.layer * self.layers


def _size(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[t]
               for t, dims in _SHAPE.findall(shape))


def _instructions(hlo: str) -> dict[str, list[tuple]]:
    """computation -> its instructions as (name, output shape text, opcode, operand
    names, the line)."""
    out: dict[str, list[tuple]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "(" in line and "=" not in line.split("(")[0]:
            current = header.group(1)
            out[current] = []
            continue
        text = line.strip()
        if current is None or "=" not in text or text[:1] not in ("%", "R"):
            continue
        text = _METADATA.sub("", text)
        name, rhs = text.removeprefix("ROOT ").split(" = ", 1)
        opcode = _OPCODE.search("= " + rhs)
        if opcode is None:
            continue
        op = opcode.group(1)
        shape = rhs[:opcode.start(1) - 2]
        args = rhs[opcode.end(1) - 1:]  # after the opening parenthesis
        depth, end = 1, 0
        for end, ch in enumerate(args):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        operands = re.findall(r"%([\w.\-]+)", args[:end])
        out[current].append((name.lstrip("%"), shape, op, operands, text))
    return out


def _dot_flops(shape: str, lhs: str, line: str) -> float:
    """2 x output elements x contracted size of a dot."""
    dims = [int(d) for d in _SHAPE.findall(lhs)[0][1].split(",") if d]
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
    k = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i) \
        if contracting else 1
    return 2.0 * sum(math.prod(int(d) for d in ds.split(",") if d)
                     for _, ds in _SHAPE.findall(shape)) * k


def _elements(shape: str) -> int:
    """Elements of the first array of an HLO shape's text."""
    found = _SHAPE.search(shape)
    return math.prod(int(d) for d in found.group(2).split(",") if d) if found else 0


def compiled_work(hlo: str, relaid: frozenset = frozenset()) -> tuple[float, float]:
    """(matmul FLOPs, memory-bound bytes) of an optimized HLO module's text, each
    computation counted as often as it runs (a loop's body by its known trip count);
    kernels that only lay out, transpose or convert an array of a size in ``relaid``
    (elements) are left out of the bytes (``config_work``: a mixture of experts'
    kernels)."""
    comps = _instructions(hlo)
    entry = next((m.group(1) for m in re.finditer(r"^ENTRY\s+%?([\w.\-]+)", hlo, re.M)), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    with_dot = {name for name, rows in comps.items()
                if any(op in ("dot", "convolution") for _, _, op, _, _ in rows)}
    layout = {name for name, rows in comps.items()
              if all(op in _LAYOUT for _, _, op, _, _ in rows)}
    flops = memory = 0.0
    # computations whose instructions are kernels of their own: the entry and bodies of
    # loops and calls; a fusion's computation is one kernel with its caller
    stack = [(entry, 1.0, True)]
    while stack:
        name, times, top = stack.pop()
        rows = comps.get(name, [])
        shapes = {n: shape for n, shape, _, _, _ in rows}
        for _, shape, op, operands, line in rows:
            called = [c.strip().lstrip("%") for group in _CALLS.findall(line)
                      for c in group.split(",") if c.strip()]
            if op == "dot":
                flops += times * _dot_flops(shape, shapes.get(operands[0], ""), line)
            if op == "fusion":
                stack += [(c, times, False) for c in called]
            elif op == "while":
                trip = _TRIP.search(line)
                body = re.search(r"body=%?([\w.\-]+)", line)
                if body:
                    stack.append((body.group(1), times * (float(trip.group(1)) if trip
                                                          else 1.0), True))
            elif op in ("call", "conditional"):
                stack += [(c, times, top) for c in called]
            if not top or op in _FREE or op in ("dot", "convolution"):
                continue
            if op == "fusion" and any(c in with_dot for c in called):
                continue
            if relaid and _elements(shape) in relaid and (op in _LAYOUT or op == "fusion" and all(
                    c in layout for c in called if c in comps)):
                continue
            memory += times * (_size(shape) + sum(_size(shapes.get(o, "")) for o in operands))
    return flops, memory


def _even_groups(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                 preferred_element_type=None, **_):
    """``jax.lax.ragged_dot_general``'s stand-in in ``grouped_matmuls``: the grouped
    matmul of rows (the lhs's leading dimension) spread evenly over the groups (padded
    to a multiple of them), one batched matmul whose FLOPs, forward and backward, are
    the grouped matmul's whatever its group sizes, and whose kernels' gradient is its
    own output, as the grouped kernel's is."""
    numbers = ragged_dot_dimension_numbers
    (lhs_in, rhs_in), (lhs_batch, _) = numbers.dot_dimension_numbers
    (group,) = numbers.rhs_group_dimensions
    if list(numbers.lhs_ragged_dimensions) != [0] or 0 in lhs_in or lhs_batch:
        raise NotImplementedError("grouped_matmuls stands in for a grouped matmul over its "
                                  "rows (the lhs's leading dimension, not contracted, no "
                                  "batch dimensions) only")
    groups, rows = rhs.shape[group], lhs.shape[0]
    per = -(-rows // groups)
    lhs = jnp.pad(lhs, [(0, per * groups - rows)] + [(0, 0)] * (lhs.ndim - 1))
    out = jax.lax.dot_general(lhs.reshape(groups, per, *lhs.shape[1:]), rhs,
                              ((tuple(d + 1 for d in lhs_in), tuple(rhs_in)), ((0,), (group,))),
                              precision=precision,
                              preferred_element_type=preferred_element_type)
    return out.reshape(groups * per, *out.shape[2:])[:rows]


def _even_groups_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                     **_):
    """``jax.lax.ragged_dot``'s stand-in in ``grouped_matmuls``: (m, k) rows against
    (groups, k, n) kernels, as ``_even_groups``."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return _even_groups(lhs, rhs, group_sizes, numbers, precision, preferred_element_type)


@contextlib.contextmanager
def grouped_matmuls():
    """Within: ``jax.lax.ragged_dot`` and ``ragged_dot_general`` (a mixture of experts'
    grouped matmuls, ``redray.models.moe.dispatch``) trace as the same grouped matmul
    with its rows spread evenly over the groups (``_even_groups``): the FLOPs a GPU's or
    a TPU's grouped matmul computes. XLA:CPU lowers them densely (JAX's fallback: every
    row against every group's kernel, masked), so a count compiled here would be
    ``groups`` times theirs: 256 x DeepSeek-V3's routed experts' FLOPs. For counting
    work only: the stand-in's values are not the grouped matmul's."""
    real = jax.lax.ragged_dot, jax.lax.ragged_dot_general
    jax.lax.ragged_dot, jax.lax.ragged_dot_general = _even_groups_dot, _even_groups
    try:
        yield
    finally:
        jax.lax.ragged_dot, jax.lax.ragged_dot_general = real


def traced_work(fn, *args, backward: bool = True, relaid: frozenset = frozenset()) -> Work:
    """The work of ``fn(*args)`` (abstract arguments are enough), compiled for this
    process's default backend with attention counted apart; ``backward``: ``fn`` runs a
    backward pass (attention's work is then its forward's and its backward's);
    ``relaid``: as for ``compiled_work``."""
    from redray.sharding.tracing import counted_attention

    with counted_attention() as calls:
        lowered = jax.jit(fn).lower(*args)
    flops, memory = compiled_work(lowered.compile().as_text(), relaid)
    fused = 1 + ATTENTION_BACKWARD if backward else 1.0
    dense = 1 + DENSE_BACKWARD if backward else 1.0
    return Work(flops, fused * sum(c.flops for c in calls),
                dense * sum(c.dense_flops for c in calls), memory)


@dataclasses.dataclass(frozen=True)
class ModelWork:
    """A model's work per example: its forward and backward pass (``step``) and its
    forward alone (what rematerialization runs again)."""
    step: StepWork
    forward: StepWork

    def under(self, remat: str) -> StepWork:
        """The step's work under a remat policy: "dots" (and "offload") run the layers'
        forward again but their matmuls, whose outputs they keep; "full" the layers'
        whole forward. A fused attention kernel's output is not a matmul's: every
        policy but "none" runs it again."""
        if remat == "none":
            return self.step
        again = self.forward.layer
        if remat != "full":
            again = dataclasses.replace(again, matmul=0.0)
        return dataclasses.replace(self.step, layer=self.step.layer + again)


_COUNTED: dict = {}


def config_work(fam, config, seq: int, compute_dtype=None, chunk=None,
                experts: Sequence = ()) -> ModelWork:
    """One example's work in ``config``'s model (a ``redray.models`` family): its layers
    as a list at depth 1 and 2, the difference one layer (for encoder-decoders, each
    stack's layers apart, one layer their depth-weighted mean), and the share of a
    layer's memory-bound bytes a model axis splits (``Family.split_widths``). Kept for the
    process: five compilations of a few seconds each.

    ``experts``: its mixture-of-experts layers (``redray.models.moe.ExpertLayers``),
    counted as a GPU or TPU runs them: their grouped matmuls as such
    (``grouped_matmuls``), and without the copies XLA:CPU makes of their kernels to
    transpose or convert them for its matmuls, in each example's pass (a grouped
    matmul reads the kernels as they are stored; counted per example, DeepSeek-V3's 256
    experts' copies were 80% of a layer's bytes); () (a dense model, or planned for
    XLA:CPU): as XLA:CPU computes it."""
    relaid = frozenset(e.experts * e.hidden * e.inner * n for e in experts for n in (1, 2))
    key = (config.to_json_string(), seq, str(compute_dtype), chunk, relaid)
    if key not in _COUNTED:
        with grouped_matmuls() if experts else contextlib.nullcontext():
            _COUNTED[key] = _config_work(fam, config, seq, compute_dtype, chunk, relaid)
    return _COUNTED[key]


def _config_work(fam, config, seq: int, compute_dtype, chunk, relaid) -> ModelWork:
    from redray.planning.memory import _abstract_loss, _fresh_state, _with_layers, layer_depth

    fields, depth = layer_depth(config)
    # traced in float32 and its elements counted at the compute dtype's size: XLA:CPU
    # computes bfloat16 in float32, with conversions around each kernel that a GPU's
    # kernels do not make
    scale = jnp.dtype(compute_dtype or jnp.float32).itemsize / 4

    def at(counts, backward: bool = True, model=config) -> Work:
        loss, params, extra, inputs = _abstract_loss(
            fam, _with_layers(model, fields, counts), 1, seq, "none", None, chunk,
            scan=False)

        def fresh(params, extra, inputs):
            # the model's other state (dropout's key counts) made in the trace that
            # advances it
            return loss(params, jax.tree.map(_fresh_state, extra), inputs)

        work = traced_work(jax.grad(fresh) if backward else fresh, params, extra,
                           inputs, backward=backward, relaid=relaid)
        return dataclasses.replace(work, memory=work.memory * scale)

    def stepwork(backward: bool) -> tuple[StepWork, Work]:
        base = at([1] * len(fields), backward)
        deltas = [at([2 if j == i else 1 for j in range(len(fields))], backward) - base
                  for i in range(len(fields))]
        layers = sum(depth)
        layer = sum((d * n for d, n in zip(deltas, depth)), Work()) * (1 / layers)
        return StepWork(layer, base - layer * len(fields), layers), base

    (step, base), (forward, _) = stepwork(True), stepwork(False)
    narrow = _narrowed(config)
    if narrow is not None:
        # a layer's bytes are a part that grows with the heads and the inner width and
        # a part that does not: halving those widths (in each stack's one layer at
        # depth 1; the rest unchanged) takes half the first away
        halved = base.memory - at([1] * len(fields), True, narrow).memory
        share = min(1.0, max(0.0, 2 * halved / len(fields) / step.layer.memory))
        step, forward = (dataclasses.replace(w, layer=dataclasses.replace(
            w.layer, split_memory=share * w.layer.memory)) for w in (step, forward))
    return ModelWork(step, forward)


def _narrowed(config):
    """``config`` with its heads and inner width halved (the head size kept), or None
    where its family names none (``Family.split_widths``: a family without them counts
    its memory-bound work whole on every device of a model axis) or a width is odd."""
    from redray.models.families import lookup

    fields = lookup(config.model_type).split_widths
    if not fields or any(getattr(config, f, 1) % 2 for f in fields):
        return None
    narrow = config.__class__.from_dict(config.to_dict())
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for f in fields:
        setattr(narrow, f, getattr(config, f) // 2)
    narrow.head_dim = dim
    return narrow
