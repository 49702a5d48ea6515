"""A training run's program, built from explicit inputs: the checks of the user's
functions on the first batch, the state's layout on the parallelism plan, the jitted
training and evaluation steps (built once), the compiled step, the one path to the
state a run starts from (fresh or restored), and what a step holds per device.

``Trainer`` builds one in ``init`` and runs it; nothing here knows of hooks, data or
checkpoint folders.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from redray import startup
from redray.engine.model import split_trainable
from redray.engine.nonfinite import zero_flag
from redray.engine.runtime import ModelRuntime, abstract_batch, once_options
from redray.engine.state import StateLayout, TrainState, counters
from redray.engine.one_f_one_b import one_f_one_b_gradients
from redray.engine.steps import (eval_step, microbatched, model_gradients, model_loss,
                                 train_step, user_loss_fn)
from redray.functions import UserFunctionError, UserFunctions, split_loss_output
from redray.sharding import MODEL, BatchGeometry, placement
from redray.planning.memory import compiled_memory, totals


@dataclasses.dataclass
class TrainProgram:
    """The training and evaluation steps of one model, loss and optimizer on one plan.

    Attributes:
      runtime: the model on its plan (``runtime.plan``: its geometry too), its specs
        derived.
      functions: the user's functions.
      optimizer: the ``optax.GradientTransformation``.
      layout: the ``TrainState``'s abstract form and shardings.
      metric_names: the names of the loss's metrics.
      global_batch: the global batch as ``jax.ShapeDtypeStruct`` (what the step takes).
      seed: the run's seed (the start key).
      trainable: the regex of trained parameters, or None (all).
      grad_fn: the user's gradient step, or None (``jax.value_and_grad``).
      on_nonfinite: the non-finite policy the step applies.
      ran: whether the training step ran once (compiled).
    """
    runtime: ModelRuntime
    functions: UserFunctions
    optimizer: optax.GradientTransformation
    layout: StateLayout
    metric_names: list
    global_batch: dict
    seed: int
    trainable: str | None
    grad_fn: Callable | None
    on_nonfinite: str
    jitted: dict = dataclasses.field(default_factory=dict)
    ran: bool = False

    @property
    def geometry(self) -> BatchGeometry:
        """The batch geometry of the runtime's plan (global batch, micro-batch,
        accumulation)."""
        return self.runtime.plan.geometry

    @classmethod
    def build(cls, runtime: ModelRuntime, functions: UserFunctions, optimizer, sample: dict,
              *, seed: int, trainable: str | None, grad_fn: Callable | None,
              on_nonfinite: str) -> "TrainProgram":
        """Checks the user's functions on ``sample`` (a collated batch, traced
        abstractly) on the runtime's plan (its geometry), derives the specs and lays out
        the state."""
        geometry = runtime.plan.geometry
        micro = abstract_batch(sample, geometry.micro_rows)
        metric_names = check_loss(runtime, functions.loss, micro)
        loss = functions.loss
        runtime.derive(
            lambda model, batch: _loss_value(loss(model, batch, jax.random.key(0), True)), micro)
        warn_whole(runtime)
        params, extra = runtime.held
        param_specs = runtime.specs[0]
        params_sh, extra_sh = runtime.shardings
        frozen_sh = None
        if trainable is not None:
            params, _ = split_trainable(params, trainable)
            param_specs, _ = split_trainable(param_specs, trainable)
            _, frozen_sh = split_trainable(params_sh, trainable)
        if grad_fn is not None:
            check_grad_fn(runtime, loss, grad_fn, trainable, micro)
        layout = StateLayout.build(runtime.parallelism, seed, optimizer, params, param_specs,
                                   extra, extra_sh, frozen_sh)
        return cls(runtime, functions, optimizer, layout, metric_names,
                   abstract_batch(sample, geometry.batch_size), seed, trainable, grad_fn,
                   on_nonfinite)

    def initial_state(self, items: dict | None = None) -> TrainState:
        """The state a run starts from, one path for a fresh start and a resume:
        ``items`` (a checkpoint's, restored onto ``layout``) where given, and what a
        checkpoint does not hold made on its shards: the frozen parameters (always the
        model as built), the non-finite flag and, starting fresh, the parameters, the
        counters and the optimizer state (one jitted function)."""
        params = extra = frozen = None
        shardings = self.layout.shardings
        seed, optimizer, runtime = self.seed, self.optimizer, self.runtime
        counted = (shardings.step, shardings.rng, shardings.nonfinite_step, shardings.opt_state)
        if items is None and self.trainable is None and runtime.from_factory:
            # a fresh start: parameters, counters and optimizer state in one program
            def fresh(key):
                params, extra = runtime.fresh(key)
                return params, extra, (*counters(seed), optimizer.init(params))

            params, extra, (step, rng, nonfinite_step, opt_state) = jax.jit(
                fresh, out_shardings=(*runtime.shardings, counted),
                compiler_options=once_options(runtime.mesh))(runtime.init_key)
            return TrainState(step=step, rng=rng, params=params, extra=extra,
                              opt_state=opt_state, frozen=None, nonfinite_step=nonfinite_step)
        if items is None or self.trainable is not None:
            params, extra = runtime.init()
            if self.trainable is not None:
                params, frozen = split_trainable(params, self.trainable)
        if items is not None:
            return self.from_checkpoint(items, frozen).replace(
                nonfinite_step=zero_flag(shardings.nonfinite_step))
        step, rng, nonfinite_step, opt_state = jax.jit(
            lambda p: (*counters(seed), optimizer.init(p)), out_shardings=counted)(params)
        return TrainState(step=step, rng=rng, params=params, extra=extra, opt_state=opt_state,
                          frozen=frozen, nonfinite_step=nonfinite_step)

    def checkpoint_items(self, state: TrainState) -> dict[str, dict]:
        """What a checkpoint of ``state`` stores: its items, the stacked arrays in the
        layers' own order whatever the plan (circular repeats hold them in another), so
        any plan restores them."""
        return self.runtime.reorder(state.checkpoint_items(),
                                    self.layout.shardings.checkpoint_items(), False)

    def checkpoint_targets(self) -> dict[str, dict]:
        """What a checkpoint restores into on this plan: its items as
        ``jax.ShapeDtypeStruct`` in the layers' own order (``checkpoint_items``), laid
        out as this plan's state is but for the stage split of the stacked arrays
        where the plan holds them padded."""
        held = self.layout.shardings.checkpoint_items()
        shapes = jax.eval_shape(lambda t: self.runtime._reordered(t, held, False),
                                self.layout.abstract.checkpoint_items())
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.runtime.saved(held))

    def from_checkpoint(self, items: dict[str, dict], frozen) -> TrainState:
        """``checkpoint_items``' inverse: restored ``items`` as this plan's state."""
        items = self.runtime.reorder(items, self.layout.shardings.checkpoint_items(), True)
        return TrainState.from_checkpoint_items(items, frozen)

    def rolled_back(self, items: dict[str, dict], state: TrainState, step: int) -> TrainState:
        """A rollback's state: restored ``items`` (a checkpoint's) beside ``state``'s frozen
        parameters, counting on from ``step``, its non-finite flag cleared."""
        shardings = self.layout.shardings
        count = jax.jit(lambda: jnp.asarray(step, jnp.int32), out_shardings=shardings.step)()
        return self.from_checkpoint(items, state.frozen).replace(
            step=count, nonfinite_step=zero_flag(shardings.nonfinite_step))

    def train_step(self):
        """The jitted training step, built once: ``steps.train_step`` bound to this
        model, loss and optimizer, with the state's shardings and the state donated."""
        if "train" not in self.jitted:
            rt, g, parallelism = self.runtime, self.geometry, self.runtime.parallelism
            # with pipeline stages the micro-batches are the pipeline's, in one pass
            accumulation = 1 if rt.micro_rows else g.accumulation
            if rt.micro_rows and rt.pipeline_schedule == "1f1b":
                gradients = one_f_one_b_gradients(rt, self.functions.loss)
            else:
                gradients = microbatched(
                    model_gradients(model_loss(rt.train_apply, self.functions.loss),
                                    self.grad_fn),
                    accumulation, g.micro_rows, parallelism.micro_batches_sharding(),
                    self.metric_names)
            self.jitted["train"] = jax.jit(
                functools.partial(train_step, gradients=gradients, optimizer=self.optimizer,
                                  on_nonfinite=self.on_nonfinite,
                                  after_update=rt.after_update),
                in_shardings=(self.layout.shardings, parallelism.batch_sharding()),
                out_shardings=(self.layout.shardings, parallelism.replicated()),
                donate_argnums=0)
        return self.jitted["train"]

    def run(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One training step on the placed ``batch``: (the next state, its metrics, on
        the devices). The first traces and compiles the step (timed as the run's
        ``compile`` and ``first_step``)."""
        if self.ran:
            return self.train_step()(state, batch)
        startup.RECORDER.enter("compile")
        start = time.time()
        state, metrics = self.train_step()(state, batch)
        startup.RECORDER.add("compile", start)
        with startup.phase("first_step"):
            jax.block_until_ready(metrics)
        startup.RECORDER.enter("steps")
        self.ran = True
        return state, metrics

    def retrace(self) -> None:
        """Drops the jitted training step: what it traced in (a schedule's segments)
        changed."""
        self.jitted.pop("train", None)

    def eval_step(self):
        """The jitted evaluation step (``steps.eval_step``), built once."""
        if "eval" not in self.jitted:
            self.jitted["eval"] = jax.jit(
                functools.partial(eval_step, apply=self.runtime.apply, loss=self.functions.loss),
                out_shardings=self.runtime.replicated())
        return self.jitted["eval"]

    def compiled(self, state: TrainState):
        """The training step as XLA compiled it for this plan and batch."""
        return self.train_step().lower(state, self.global_batch).compile()

    def memory(self, state: TrainState, facts, device_gib: float | None = None) -> dict:
        """What one training step holds per device, by part (``Trainer.memory``): the
        planner's count (``facts.memory``, ``facts`` the model's ``RuntimeFacts``) on
        this plan and geometry, with the state's parts as its arrays hold them."""
        cd, parallelism = self.runtime.compute_dtype, self.runtime.parallelism

        def per_device(tree):
            return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
                       if hasattr(x, "addressable_shards"))

        params, frozen = per_device(state.params), per_device(state.frozen)
        copies = 0
        if cd is not None:
            copies = sum(x.addressable_shards[0].data.nbytes // x.dtype.itemsize
                         * jnp.dtype(cd).itemsize
                         for x in jax.tree.leaves((state.params, state.frozen))
                         if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.dtype(cd))
        rows = placement(self.runtime.held[0], self.runtime.specs[0], parallelism.mesh)
        geometry = self.geometry
        counted = facts.memory(parallelism, rows, geometry.micro_batch_size, "none",
                               geometry.accumulation, self.runtime.pipeline_schedule,
                               self.runtime.stage_repeats,
                               self.runtime.stage_recompute)["parts"]
        held = {"parameters": params + frozen, "optimizer": per_device(state.opt_state),
                "gradients": params, "compute_copies": copies}
        out = totals({**counted, **held}, device_gib)
        compiled = compiled_memory(self.compiled(state).memory_analysis())
        out["compiled"] = {**compiled, "platform": parallelism.mesh.devices.flat[0].platform}
        out["per_device_batch"] = geometry.micro_batch_size
        if device_gib is not None:
            out["fits"] = max(out["total"], compiled["peak"]) <= out["device_bytes"]
        return out


def check_loss(runtime: ModelRuntime, loss: Callable, abstract: dict) -> list[str]:
    """Runs ``loss`` on abstract values; returns the sorted names of its metrics."""
    out, _ = jax.eval_shape(
        lambda p, e, b: runtime.apply(lambda m, bb: loss(m, bb, jax.random.key(0), True), p, e,
                                      jax.random.key(0), b),
        *runtime.abstract, abstract)
    return sorted(split_loss_output(out)[1])


def check_grad_fn(runtime: ModelRuntime, loss: Callable, grad_fn: Callable,
                  trainable: str | None, abstract: dict) -> None:
    """Runs ``grad_fn`` on abstract values: its output must be (loss, metrics, grads)
    with grads shaped like the trained parameters."""
    params, frozen = runtime.abstract[0], None
    if trainable is not None:
        params, frozen = split_trainable(params, trainable)

    def run(params, extra, batch):
        loss_fn = user_loss_fn(model_loss(runtime.apply, loss), frozen, extra)
        return grad_fn(loss_fn, params, batch, jax.random.key(0))

    out = jax.eval_shape(run, params, runtime.abstract[1], abstract)
    if not isinstance(out, tuple) or len(out) != 3:
        raise UserFunctionError(f"grad_fn returned {type(out).__name__}"
                                f"{' of ' + str(len(out)) if isinstance(out, tuple) else ''}: "
                                "return (loss, metrics, grads)")
    split_loss_output((out[0], out[1]))
    want = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    got = jax.tree.map(lambda a: (a.shape, a.dtype), out[2])
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise UserFunctionError(
            "grad_fn returned grads that do not match the trained parameters (structure, "
            "shapes or dtypes differ): return the gradient of loss_fn with respect to the "
            "params it was given, e.g. jax.grad(lambda p: loss_fn(p, batch, rng)[0])(params)")


def warn_whole(runtime: ModelRuntime) -> None:
    """Names the large layer parameters tensor parallelism could not split: every
    device then holds and computes them whole, which the user should know."""
    costly = runtime.costly_whole()
    if not costly or jax.process_index() != 0:  # once per run, not once per host
        return
    lines = [f"{w.path} {w.shape}: {w.reason}; fix: {w.fix}" for w in costly]
    warnings.warn(
        f"{len(costly)} large layer parameter(s) are not split over the model axis "
        f"({runtime.parallelism.size(MODEL)}): every device holds and computes them whole.\n  "
        + "\n  ".join(lines) + "\nTrainer.placement() lists every parameter and its split; "
        "a rule (regex, PartitionSpec) in rules= sets one by hand.", stacklevel=5)


def _loss_value(out: Any):
    return out[0] if isinstance(out, tuple) else out
