"""The planner's facts of a Trainer's own model and loss (``parallelism="auto"``), read
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

import copy
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp

from redray.engine.program import activation_bytes
from redray.engine.runtime import ModelRuntime, abstract_batch
from redray.engine.steps import model_loss
from redray.planning.memory import (GATHERED_LAYERS, expert_exchange_bytes, layer_gather_bytes,
                                    totals)
from redray.sharding import CONTEXT, EXPERT, FSDP, MODEL, Parallelism, flatten
from redray.sharding.activations import BlocksCut, cut_at_blocks, unrolled_loops
from redray.sharding.specs import trace_tree


class RuntimeFacts:
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
        self.trace_examples = 1
        self.tokens_per_example = tokens_per_example or 1
        cd = runtime.compute_dtype
        self.compute_itemsize = jnp.dtype(cd).itemsize if cd is not None else 4
        opt = jax.eval_shape(optimizer.init, params)
        trained = sum(_nbytes(s, d) for s, d, t in zip(self.shapes, self.dtypes, self.trained)
                      if t)
        self.optimizer_ratio = sum(_nbytes(x.shape, x.dtype)
                                   for x in jax.tree.leaves(opt)) / max(trained, 1)
        self.sample, self.optimizer = sample, optimizer
        self._flops: float | None = None
        self._residuals: dict = {}  # with a context axis or not -> rows -> trace
        # the model's pass timed on the live devices (``redray.planning.live``), or None
        self.timing = None
        self.experts = _expert_layers(runtime)
        self.splits_sequences = _splits_sequences(runtime)
        self.one_f_one_b = trainable is None and runtime.stage_repeats == 1 \
            and cuts_at_one_stack(runtime, loss, params, extra, self.batch)

    @property
    def abstract(self):
        """(params, extra) of the model, abstract (shapes and dtypes)."""
        return self.runtime.abstract

    def unplanned_loss(self) -> Callable:
        """``loss(params, extra, batch, rng)``: the user's loss of the model as on one
        device (no plan: no activation constraints), what the planner times."""
        unplanned = copy.copy(self.runtime)
        unplanned.parallelism = unplanned.mesh = None
        loss_of = model_loss(unplanned.apply, self.loss)
        return lambda params, extra, batch, rng: loss_of(params, None, extra, batch, rng)[0]

    def flops(self, remat: str) -> float:
        if self._flops is None:
            params, extra = self.runtime.abstract
            loss_of = model_loss(self.runtime.apply, self.loss)

            def value(params, batch):
                return loss_of(params, None, extra, batch, jax.random.key(0))[0]

            # scanned layers unrolled: XLA's cost analysis counts a loop's body once
            with unrolled_loops():
                lowered = jax.jit(jax.grad(value)).lower(params, self.batch)
            self._flops = float(lowered.cost_analysis()["flops"])
        return self._flops

    def memory(self, parallelism: Parallelism, rows, per_device_batch: int, remat: str) -> dict:
        cd = self.runtime.compute_dtype
        params = sum(r.bytes_per_device for r in rows)
        trained = sum(r.bytes_per_device for r, t in zip(rows, self.trained) if t)
        copies = 0
        if cd is not None:
            copies = sum(r.bytes_per_device // jnp.dtype(r.dtype).itemsize * jnp.dtype(cd).itemsize
                         for r in rows if jnp.issubdtype(r.dtype, jnp.floating)
                         and jnp.dtype(r.dtype) != jnp.dtype(cd))
        gathered, fsdp = 0, parallelism.size(FSDP)
        if fsdp > 1:
            item = self.compute_itemsize
            gathered = GATHERED_LAYERS * layer_gather_bytes(rows, fsdp) * item // 4
        params_abs, extra = self.runtime.abstract
        ways = parallelism.size(CONTEXT)
        acts = activation_bytes(self.runtime, self.loss, params_abs, None, extra, self.batch,
                                per_device_batch, rows, parallelism.size(MODEL),
                                self._residuals.setdefault(ways > 1, {}), ways)
        parts = {"parameters": params, "optimizer": int(self.optimizer_ratio * trained),
                 "gradients": trained, "compute_copies": copies, "fsdp_gathered": gathered,
                 "activations": acts}
        if parallelism.size(EXPERT) > 1:  # the user's model keeps its own remat: none
            parts["expert_exchange"] = expert_exchange_bytes(
                self.experts, parallelism.shape,
                per_device_batch * -(-self.tokens_per_example // ways),
                self.compute_itemsize)
        return totals(parts, None)


def cuts_at_one_stack(runtime: ModelRuntime, loss: Callable, params, extra, batch) -> bool:
    """Whether the loss can be cut at one stack of stacked layers, as the 1F1B schedule
    cuts it (``engine/staged.py``): traced abstractly with the cut."""
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


def _splits_sequences(runtime: ModelRuntime) -> bool:
    """Whether the model is one of redray's decoders, which split a sequence over a
    context axis (a model of the user's own does not: the planner keeps it whole)."""
    from flax import nnx

    graphdef = getattr(runtime.adapter, "graphdef", None)
    return graphdef is not None and getattr(
        type(nnx.merge(graphdef, *runtime.abstract)), "SPLITS_SEQUENCES", False)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def _value(out):
    return out[0] if isinstance(out, tuple) else out
