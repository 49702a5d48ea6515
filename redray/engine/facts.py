"""The planner's facts of a Trainer's own model and loss (``plan="auto"``), read
from this runtime: what ``redray.planning.live.choose`` ranks plans of.

The facts come from abstract traces of the loss on the first batch's shapes: its
dataflow (which layers' outputs cross the tensor-parallel split), its FLOPs (XLA's cost
analysis of the lowered gradient on one example) and the residuals its backward pass
keeps (on 1 and 2 examples, extrapolated), counted by the memory model
(``redray.planning.memory``). The optimizer's state is counted at its bytes over the
trained parameters' (Adam: 2), following the parameters' specs. A user's model keeps
its own remat: the planner chooses the axis sizes and the micro-batch.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import jax
import jax.numpy as jnp

from redray.engine.runtime import ModelRuntime, abstract_batch
from redray.engine.steps import model_loss
from redray.planning.memory import (hidden_width, nbytes, saved_residuals,
                                    split_residual_bytes, split_sizes, step_parts, totals)
from redray.planning.planner import ModelFacts, stacked_layers
from redray.sharding import CONTEXT, MODEL, Parallelism, flatten
from redray.sharding.tracing import (BlocksCut, blockwise_attention, cut_at_blocks,
                                         unrolled_loops)
from redray.sharding.specs import trace_tree


class RuntimeFacts(ModelFacts):
    """The planner's facts (``redray.planning.planner.ModelFacts``) of a Trainer's model
    and loss.

    Args:
      runtime: the model (its abstract state and compute dtype; no plan needed).
      loss: the user's loss.
      optimizer: the ``optax.GradientTransformation``.
      sample: a collated batch (host arrays): its shapes, not its values, are read.
      trainable: the regex of trained parameters, or None (all).
      tokens_per_example: tokens in one example (0: count examples).
    """

    remat_policies = ("none",)

    def __init__(self, runtime: ModelRuntime, loss: Callable, optimizer, sample: dict,
                 trainable: str | None, tokens_per_example: int):
        self.runtime, self.loss = runtime, loss
        params, extra = runtime.abstract
        self.paths, leaves, _ = flatten(params)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        self.trained = [trainable is None or bool(re.search(trainable, p)) for p in self.paths]
        self.batch = abstract_batch(sample, 1)
        rng = jax.random.key(0)

        def forward(params, batch):
            return runtime.apply(lambda m, b: _value(loss(m, b, rng, True)), params, extra, rng,
                                 batch)[0]

        self.trace = trace_tree(params, forward, (self.batch,))
        self.hidden = hidden_width(self.shapes, self.trace.scanned if self.trace else {})
        self.tokens_per_example = tokens_per_example or 1
        # what the layers compute on (a next-token loss feeds the model one id fewer
        # than the batch holds): a pipeline's buffers and the expert exchange hold these
        self.sequence = _sequence(self.trace, self.tokens_per_example)
        self.trace_examples = 1
        cd = runtime.compute_dtype
        self.compute_itemsize = jnp.dtype(cd).itemsize if cd is not None else 4
        opt = jax.tree.leaves(jax.eval_shape(optimizer.init, params))
        trained = sum(nbytes(s, d) for s, d, t in zip(self.shapes, self.dtypes, self.trained)
                      if t)
        # the state that follows the trained parameters' specs (Adam's moments: 2 x
        # their bytes), and the scalars every device holds whole (a step count)
        self.optimizer_scalars = sum(nbytes(x.shape, x.dtype) for x in opt if not x.shape)
        self.optimizer_ratio = sum(nbytes(x.shape, x.dtype) for x in opt
                                   if x.shape) / max(trained, 1)
        self.sample, self.optimizer = sample, optimizer
        self._flops: float | None = None
        self._residuals: dict = {}  # with a context axis or not -> rows -> trace
        # the model's pass timed on the live devices (``redray.planning.live``), or None
        self.timing = None
        self.experts = _expert_layers(runtime)
        self.splits_sequences = _splits_sequences(runtime)
        self.linear_layers, self.linear_state = _linear_facts(runtime)
        self.one_f_one_b = trainable is None \
            and cuts_at_one_stack(runtime, loss, params, extra, self.batch)

    @property
    def abstract(self):
        """(params, extra) of the model, abstract (shapes and dtypes)."""
        return self.runtime.abstract

    def unplanned_loss(self) -> Callable:
        """``loss(params, extra, batch, rng)``: the user's loss of the model as on one
        device (no plan: no activation constraints), what the planner times."""
        loss_of = model_loss(self.runtime.unplanned().apply, self.loss)
        return lambda params, extra, batch, rng: loss_of(params, None, extra, batch, rng)[0]

    def flops(self, remat: str) -> float:
        if self._flops is None:
            params, extra = self.runtime.abstract
            loss_of = model_loss(self.runtime.apply, self.loss)

            def value(params, extra, batch):
                return loss_of(params, None, extra, batch, jax.random.key(0))[0]

            # scanned layers unrolled: XLA's cost analysis counts a loop's body once
            with unrolled_loops():
                lowered = jax.jit(jax.grad(value)).lower(params, extra, self.batch)
            self._flops = float(lowered.cost_analysis()["flops"])
        return self._flops

    def memory(self, parallelism: Parallelism, rows, per_device_batch: int, remat: str,
               accumulation: int = 1, schedule: str = "gpipe", repeats: int = 1,
               stage_recompute: bool = False) -> dict:
        """What a step holds per device on ``parallelism`` (``rows``: the parameters'
        placement there), by part (``redray.planning.memory.step_parts``)."""
        cd = self.runtime.compute_dtype
        params = sum(r.bytes_per_device for r in rows)
        trained = sum(r.bytes_per_device for r, t in zip(rows, self.trained) if t)
        copies = 0
        if cd is not None:
            copies = sum(r.bytes_per_device // jnp.dtype(r.dtype).itemsize * jnp.dtype(cd).itemsize
                         for r in rows if jnp.issubdtype(r.dtype, jnp.floating)
                         and jnp.dtype(r.dtype) != jnp.dtype(cd))
        params_abs, extra = self.runtime.abstract
        ways = parallelism.size(CONTEXT)
        acts = loss_activation_bytes(self.runtime, self.loss, params_abs, None, extra,
                                     self.batch, per_device_batch, rows,
                                     parallelism.size(MODEL),
                                     self._residuals.setdefault(ways > 1, {}), ways)
        held = {"parameters": params,
                "optimizer": int(self.optimizer_ratio * trained) + self.optimizer_scalars,
                "gradients": trained, "compute_copies": copies}
        # the user's model keeps its own remat: every expert layer keeps its exchange
        return totals(step_parts(held, rows, parallelism, per_device_batch, accumulation,
                                 self.compute_itemsize, acts, experts=self.experts,
                                 tokens=-(-self.sequence // ways),
                                 hidden=self.hidden, schedule=schedule, repeats=repeats,
                                 layers=stacked_layers(self),
                                 stage_recompute=stage_recompute),
                      None)


def cuts_at_one_stack(runtime: ModelRuntime, loss: Callable, params, extra, batch) -> bool:
    """Whether the loss can be cut at one stack of stacked layers, as the 1F1B schedule
    cuts it (``engine/one_f_one_b.py``): traced abstractly with the cut."""
    rng = jax.random.key(0)
    cut = BlocksCut()

    def head(params, batch):
        def fn(model, b):
            with cut_at_blocks(cut):
                loss(model, b, rng, True)
        runtime.apply(fn, params, extra, rng, batch, planned=False)

    try:
        jax.eval_shape(head, params, batch)
    except ValueError:  # several stacks, or what the cut does not take (aux=True)
        return False
    return cut.found is not None


def _expert_layers(runtime: ModelRuntime) -> list:
    """The model's mixture-of-experts layers (``redray.planning.memory.expert_layers``);
    none for a Linen model."""
    from flax import nnx

    from redray.planning.memory import expert_layers

    graphdef = getattr(runtime.adapter, "graphdef", None)
    if graphdef is None:
        return []
    return expert_layers(nnx.merge(graphdef, *runtime.abstract))


def _linear_facts(runtime: ModelRuntime) -> tuple[int, int]:
    """The model's linear-attention layers and one chunk's state elements
    (``redray.planning.memory.context_states``); none for a Linen model."""
    from flax import nnx

    from redray.planning.memory import context_states

    graphdef = getattr(runtime.adapter, "graphdef", None)
    if graphdef is None:
        return 0, 0
    return context_states(nnx.merge(graphdef, *runtime.abstract))


def _splits_sequences(runtime: ModelRuntime) -> bool:
    """Whether the model is one of redray's decoders, which split a sequence over a
    context axis (a model of the user's own does not: the planner keeps it whole)."""
    from flax import nnx

    graphdef = getattr(runtime.adapter, "graphdef", None)
    return graphdef is not None and getattr(
        type(nnx.merge(graphdef, *runtime.abstract)), "SPLITS_SEQUENCES", False)


def _value(out):
    return out[0] if isinstance(out, tuple) else out


def loss_activation_bytes(runtime: ModelRuntime, loss: Callable, params, frozen, extra,
                          batch: dict, rows_per_device: int, placement_rows, model_axis: int,
                          residuals: dict | None = None, context: int = 1) -> int:
    """Residual bytes per device of ``loss``'s backward pass on ``rows_per_device``
    examples (see ``redray.planning.memory``), under the split ``placement_rows`` show.

    Args:
      runtime: the model on its plan (its compute dtype, its ``apply``).
      loss: the user's loss.
      params, frozen, extra: the state's parts (arrays or abstract).
      batch: a batch's arrays or ShapeDtypeStructs (any rows: only the rest is read).
      rows_per_device: the examples one device computes at once.
      placement_rows: the parameters' ``Placement`` rows on the plan.
      model_axis: the plan's model axis size.
      residuals: a dict kept between calls (the planner's): the traces are reused and
        rows beyond 2 extrapolated from 1 and 2 (the count is linear in the rows).
      context: the plan's context axis size (residuals holding a sequence length count
        1/context).
    """
    cd = runtime.compute_dtype

    def abstract(x):
        dtype = cd if cd is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dtype)

    params, frozen = (jax.tree.map(abstract, t) for t in (params, frozen))
    extra = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), extra)
    rng = jax.eval_shape(lambda: jax.random.key(0))
    loss_of = model_loss(runtime.apply, loss)

    def value(params, frozen, extra, batch, rng):
        return loss_of(params, frozen, extra, batch, rng)[0]

    def traced(rows: int) -> list:
        if residuals is not None and rows in residuals:
            return residuals[rows]
        # on a context axis redray's attention is blockwise (the ring's): what it saves
        with blockwise_attention() if context > 1 else contextlib.nullcontext():
            found = saved_residuals(value, params, frozen, extra,
                                    {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype)
                                     for k, v in batch.items()}, rng)
        if residuals is not None:
            residuals[rows] = found
        return found

    lengths = frozenset(d + k for v in batch.values() for d in v.shape[1:] for k in (-1, 0))
    split = split_sizes(placement_rows)

    def at(rows: int) -> int:
        return split_residual_bytes(traced(rows), traced(1), split, model_axis, lengths,
                                    context)

    if residuals is None or rows_per_device <= 2:
        return at(rows_per_device)
    one, two = at(1), at(2)
    return one + (rows_per_device - 1) * (two - one)


def _sequence(trace, tokens_per_example: int) -> int:
    """Tokens per example the model's layers compute on: the positions its stacked
    layers' matmuls run for on one example (the most common; every matmul's where no
    layer is stacked), else ``tokens_per_example``."""
    from collections import Counter

    if trace is None:
        return tokens_per_example
    runs = [(p, use) for p, use in trace.runs() if use.kind == "dot" and use.rows > 0]
    stacked = [use.rows for p, use in runs if trace.scanned.get(p)]
    rows = Counter(stacked or [use.rows for _, use in runs])
    return rows.most_common(1)[0][0] if rows else tokens_per_example
