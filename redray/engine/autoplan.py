"""The plan chosen for a Trainer (``parallelism="auto"``): the planner's facts of the
user's own model and loss, and the choice on this runtime's devices.

The facts come from abstract traces of the loss on the first batch's shapes: its
dataflow (which layers' outputs cross the tensor-parallel split), its FLOPs (XLA's cost
analysis of the lowered gradient on one example) and the residuals its backward pass
keeps (on 1 and 2 examples, extrapolated). The optimizer's state is counted at its
bytes over the trained parameters' (Adam: 2), following the parameters' specs.
A user's model keeps its own remat: the planner chooses the axis sizes and the
micro-batch.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import jax
import jax.numpy as jnp

from redray.engine.program import activation_bytes
from redray.engine.runtime import ModelRuntime, abstract_batch
from redray.engine.steps import model_loss
from redray.sharding import FSDP, MODEL, Parallelism, flatten
from redray.sharding.hardware import Hardware
from redray.sharding.memory import GATHERED_LAYERS, layer_gather_bytes, totals
from redray.sharding.planner import Ranking, rank
from redray.sharding.specs import trace_tree


class RuntimeFacts:
    """The planner's facts (``redray.sharding.planner.ModelFacts``) of a Trainer's model
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
        self._flops: float | None = None
        self._residuals: dict = {}

    def flops(self, remat: str) -> float:
        if self._flops is None:
            params, extra = self.runtime.abstract
            loss_of = model_loss(self.runtime.apply, self.loss)

            def value(params, batch):
                return loss_of(params, None, extra, batch, jax.random.key(0))[0]

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
        acts = activation_bytes(self.runtime, self.loss, params_abs, None, extra, self.batch,
                                per_device_batch, rows, parallelism.size(MODEL),
                                self._residuals)
        return totals({"parameters": params, "optimizer": int(self.optimizer_ratio * trained),
                       "gradients": trained, "compute_copies": copies,
                       "fsdp_gathered": gathered, "activations": acts}, None)


def choose(facts: RuntimeFacts, batch_size: int, hardware: Hardware, pinned: dict,
           rules=()) -> Ranking:
    """The ranked plans of ``facts`` on every device of this runtime (``rank``)."""
    return rank(facts, jax.device_count(), jax.process_count(), batch_size, hardware, pinned,
                rules)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def _value(out):
    return out[0] if isinstance(out, tuple) else out
