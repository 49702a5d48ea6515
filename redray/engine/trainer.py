"""The Trainer: one jitted, sharded, donated train step over all of a process's devices.

``fit`` is a loop over optimizer steps (``_training_steps``) whose events go to hooks
(``redray/engine/hooks.py``): the log window, the progress bar, evaluation and
checkpoints are hooks (``redray/engine/fit_hooks.py``), and so are the cluster's.
The step itself is ``redray.engine.steps.train_step``, jitted here, once.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redray.checkpoint import CheckpointConfig, Checkpointer, CheckpointMismatch
from redray.engine.batches import (InFlight, collate_checked, data_groups, each_batch,
                                   epoch_batches, first_examples, is_stream, prefetch,
                                   process_rows, steps_per_epoch, to_global)
from redray.engine.console import Console
from redray.engine.fit_hooks import Checkpoints, Evaluation, LogWindow, Recorder
from redray.engine.hooks import EpochEnd, Hook, Position, StepInfo, current_scope
from redray.engine.model import split_trainable
from redray.engine.nonfinite import (NonFiniteError, NonFiniteGuard, RolledBack, zero_flag,
                                     message as nonfinite_message)
from redray.engine.runtime import ModelRuntime, abstract_batch, resolve_mesh
from redray.engine.schedule import Schedule
from redray.engine import watchdog
from redray.engine.state import CHECKPOINT_ITEMS, StateLayout, TrainState, counters
from redray.engine.steps import (NONFINITE_POLICIES, eval_step, microbatched, model_gradients,
                                 model_loss, train_step, user_loss_fn)
from redray.functions import UserFunctions, UserFunctionError, split_loss_output
from redray.rngs import KeyStream, stream_key
from redray.sharding import BATCH_AXES, batch_sharding, data_parallel_size, placement
from redray.sharding.memory import (GATHERED_LAYERS, compiled_memory, layer_gather_bytes,
                                    memory_text, saved_residuals, split_residual_bytes,
                                    split_sizes, totals)

# What a Trainer's checkpoint meta holds beyond the step (and reads back on resume): the
# position in the data. A meta without them is an unreadable checkpoint.
POSITION_META = {"epoch": int, "batch": int, "epoch_done": bool}


class Trainer:
    """Trains a model with the user's ``collate`` and ``loss`` on every local device.

    Parameters are created directly sharded, every step is one ``jax.jit`` program
    with explicit in/out shardings and donated state, micro-batches accumulate into
    the global batch inside that program, and learning-rate schedules count optimizer
    updates (one per global batch), never micro-batches.

    Args:
      model: a function building a ``flax.nnx.Module`` (it may take an ``nnx.Rngs``);
        a built ``nnx.Module`` to start from its weights (e.g. ``from_pretrained``;
        they are copied onto the derived shardings, the module stays usable);
        or a ``redray.LinenModel``.
      collate: list of examples -> dict of numpy arrays.
      loss: (model, batch, rng, train) -> scalar or (scalar, dict of metrics).
      optimizer: an ``optax.GradientTransformation``.
      predict: optional (model, batch, rng) -> batch-major pytree.
      batch_size: examples per optimizer update (the global batch).
      micro_batch_size: examples per device per forward/backward; the rest of the
        global batch is gradient accumulation. Default: no accumulation.
      eval_batch_size: examples per evaluation step (default: ``batch_size``).
      mesh: a mesh from ``redray.make_mesh``; or give the axis sizes below.
      data_axis, fsdp_axis, model_axis: mesh sizes (ints or "auto").
      compute_dtype: dtype of the forward/backward (e.g. ``jnp.bfloat16``); parameters
        and optimizer state stay float32.
      rules: ordered (regex on parameter path, PartitionSpec) overriding automatic specs.
      learning_rate: the schedule (or float) given to the optimizer, to log it.
      seed: seeds initialization, data order and the ``rng`` given to ``loss``.
      log_every: steps between metric fetches from the devices (no sync in between).
      progress: show the run's summary, progress and evaluations (on process 0).
      prefetch: batches collated and placed ahead, in a background thread (0: none).
      checkpoint: a folder (or URI), or a ``redray.CheckpointConfig``: save the full
        state there (per epoch, every ``save_every`` steps, at the end) and, by default,
        resume from the last complete checkpoint found there. False: no checkpoints.
        None (default): none, except inside ``redray.run``, where the first Trainer
        made uses the run's checkpoint folder.
      config: the run's settings (JSON-able) stored in every checkpoint.
      trainable: a regex on parameter paths (as ``plan()`` shows them, ``re.search``):
        only matching parameters are trained, hold optimizer state and are saved in
        checkpoints; the rest stay as the model built them (e.g. LoRA adapters on a
        frozen base: ``trainable=r"lora_"``). None: every parameter is trained.
      grad_fn: a custom gradient step, for algorithms that change how a batch's
        gradient is formed (per-example clipping and noise for DP-SGD, ...):
        ``grad_fn(loss_fn, params, batch, rng) -> (loss, metrics, grads)``, where
        ``loss_fn(params, batch, rng) -> (loss, metrics)`` runs the user's ``loss``
        on the model bound to ``params`` (the trainable ones), for a batch of any
        size, and ``grads`` has the structure of ``params``. It runs once per
        micro-batch, inside the jitted step; the optimizer then applies ``grads``.
        The model's other state (e.g. batch statistics) is not updated under it.
        Default: ``jax.value_and_grad`` of the loss.
      hooks: ``redray.Hook`` objects run beside training (``on_log``
        gets every logged row, ``on_checkpoint`` every complete checkpoint, ...).
        Inside ``redray.run``/``redray.fit`` the cluster adds its own (MLflow, Ray
        Train) the same way.
      on_nonfinite: what a NaN or infinite loss or gradient norm does. No such update
        ever reaches the state, and no checkpoint is saved past it. ``"stop"``
        (default): ``redray.NonFiniteError`` naming the step and its batch;
        ``"skip"``: leave that update out and go on (the metric ``skipped``);
        ``"rollback"``: back to the newest checkpoint, going on after the failing
        batch (``redray/engine/nonfinite.py``). Checked inside the step; the host
        reads the result only on the log cadence and before saves.
    """

    def __init__(self, model: Any, collate: Callable, loss: Callable,
                 optimizer: optax.GradientTransformation, predict: Callable | None = None, *,
                 batch_size: int, micro_batch_size: int | None = None,
                 eval_batch_size: int | None = None, mesh: Mesh | None = None,
                 data_axis="auto", fsdp_axis=1, model_axis=1, compute_dtype=None, rules=(),
                 learning_rate=None, seed: int = 0, log_every: int = 10, progress: bool = True,
                 prefetch: int = 2, checkpoint=None, config: dict | None = None,
                 trainable: str | None = None, grad_fn: Callable | None = None,
                 hooks: Sequence[Hook] = (), on_nonfinite: str = "stop"):
        self.functions = UserFunctions(collate, loss, predict)
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use one of "
                             f"{', '.join(map(repr, NONFINITE_POLICIES))}")
        self.on_nonfinite = on_nonfinite
        self._guard: NonFiniteGuard | None = None
        self._streams: int | None = None  # a streamed training source's parallel streams
        self._schedule_meta: list | None = None  # a Schedule's segments, as checkpoints keep them
        if grad_fn is not None and not callable(grad_fn):
            raise TypeError(f"grad_fn must be a function (loss_fn, params, batch, rng) -> "
                            f"(loss, metrics, grads), got {grad_fn!r}")
        self.grad_fn, self.trainable = grad_fn, trainable
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation "
                            f"(e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.mesh = resolve_mesh(mesh, data_axis, fsdp_axis, model_axis)
        self.dp = data_parallel_size(self.mesh)
        self.batch_size, self.accum, self.micro = _batch_layout(batch_size, micro_batch_size,
                                                                self.dp)
        self.eval_batch_size = eval_batch_size or batch_size
        self.runtime = ModelRuntime(model, self.mesh, compute_dtype, rules, seed)
        self.learning_rate = learning_rate
        self.budget: int | None = None  # the run's total steps, as the last fit asked
        self.seed = seed
        self.log_every = max(1, int(log_every))
        self.progress = progress
        self.prefetch = prefetch
        self.state: TrainState | None = None
        self.layout: StateLayout | None = None
        self._steps: dict = {}
        self.checkpoint_config = CheckpointConfig.of(checkpoint)
        self.checkpointer: Checkpointer | None = None
        self.config = dict(config or {})
        # Kept in every checkpoint and restored with it (e.g. the tracker's run id).
        self.run_meta: dict = {}
        self.position = Position()
        self.resumed_from: dict | None = None
        # Tokens in one example (the width of the batch's first 2-D integer array, e.g.
        # input_ids), learned from fit's first batch; 0: the batch has no tokens.
        self.tokens_per_example = 0
        self.hooks: list[Hook] = []
        for hook in hooks:
            self.add_hook(hook)
        self._fit_hooks: list[Hook] = []
        self._summarized = False
        self._predictors: dict = {}
        self.console = Console()  # process 0's messages and progress: this terminal
        scope = current_scope()
        if scope is not None:  # inside redray.run/redray.fit: the run's defaults and hooks
            adopted = scope.adopt(self, default_checkpoint=checkpoint is None)
            if adopted.checkpoint is not None:
                self.checkpoint_config = adopted.checkpoint
            self.config = {**adopted.config, **self.config}
            if adopted.console is not None:  # the run's driver shows them
                self.console = adopted.console
            for hook in adopted.hooks:
                self.add_hook(hook)

    def add_hook(self, hook: Hook) -> None:
        """Runs ``hook`` beside training from now on (see ``redray.Hook``)."""
        if not isinstance(hook, Hook):
            raise TypeError(f"a hook must be a redray.Hook (subclass it and override the on_* "
                            f"methods you need), got {type(hook).__name__}")
        self.hooks.append(hook)

    def _listening(self) -> list[Hook]:
        """The hooks events go to: this fit call's own, then the Trainer's."""
        return self._fit_hooks + self.hooks

    # ---------------------------------------------------------------- set-up
    def init(self, examples: Sequence) -> None:
        """Validates the pipeline on the first batch, derives specs and creates the state.

        Called by ``fit`` and ``evaluate`` when needed; call it yourself to inspect
        ``plan()`` before training.
        """
        if self.state is not None:
            return
        self._init(examples)
        for hook in self.hooks:
            hook.on_init(self)

    def _init(self, examples: Sequence) -> None:
        if not len(examples):
            raise ValueError("init needs at least one example to learn the batch's shapes")
        sample = collate_checked(self.functions.collate, first_examples(examples, self.batch_size))
        abstract = abstract_batch(sample, self.micro * self.dp)
        self._global_batch = abstract_batch(sample, self.batch_size)
        self._metric_names = self._check_loss(abstract)
        loss = self.functions.loss
        self.runtime.derive(
            lambda model, batch: _loss_value(loss(model, batch, jax.random.key(0), True)), abstract)
        self._warn_whole()
        params, extra = self.runtime.abstract
        param_specs = self.runtime.specs[0]
        params_sh, extra_sh = self.runtime.shardings
        frozen_sh = None
        if self.trainable is not None:
            params, _ = split_trainable(params, self.trainable)
            param_specs, _ = split_trainable(param_specs, self.trainable)
            _, frozen_sh = split_trainable(params_sh, self.trainable)
        if self.grad_fn is not None:
            self._check_grad_fn(abstract)
        self.layout = StateLayout.build(self.mesh, self.seed, self.optimizer, params, param_specs,
                                        extra, extra_sh, frozen_sh)

        # Frozen parameters are never saved: they always come from the model as built.
        params = extra = frozen = None
        if frozen_sh is not None:
            params, extra = self.runtime.init()
            params, frozen = split_trainable(params, self.trainable)
        if self.checkpoint_config is not None:
            self.checkpointer = Checkpointer(self.checkpoint_config, CHECKPOINT_ITEMS)
            if self.checkpoint_config.resume and self._restore(frozen):
                # never saved: a saved state is finite
                self.state = self.state.replace(
                    nonfinite_step=zero_flag(self.layout.shardings.nonfinite_step))
                return
        if params is None:
            params, extra = self.runtime.init()
        shardings = self.layout.shardings
        step, rng, nonfinite_step = jax.jit(
            lambda: counters(self.seed),
            out_shardings=(shardings.step, shardings.rng, shardings.nonfinite_step))()
        opt_state = jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params)
        self.state = TrainState(step=step, rng=rng, params=params, extra=extra,
                                opt_state=opt_state, frozen=frozen, nonfinite_step=nonfinite_step)

    def _warn_whole(self) -> None:
        """Names the large layer parameters tensor parallelism could not split: every
        device then holds and computes them whole, which the user should know."""
        costly = self.runtime.costly_whole()
        if not costly or jax.process_index() != 0:  # once per run, not once per host
            return
        model_size = self.mesh.shape["model"]
        lines = [f"{w.path} {w.shape}: {w.reason}; fix: {w.fix}" for w in costly]
        warnings.warn(
            f"{len(costly)} large layer parameter(s) are not split over the model axis "
            f"({model_size}): every device holds and computes them whole.\n  "
            + "\n  ".join(lines) + "\nTrainer.plan() lists every parameter and its split; "
            "a rule (regex, PartitionSpec) in rules= sets one by hand.", stacklevel=4)

    def _restore(self, frozen) -> bool:
        """Loads the last complete checkpoint onto this mesh, if one exists."""
        found = self.checkpointer.restore_latest(self.layout.checkpoint_targets(),
                                                 check=self._check_trainable,
                                                 required=POSITION_META)
        if found is None:
            return False
        items, meta = found
        self.state = TrainState.from_checkpoint_items(items, frozen)
        self.resumed_from = meta
        self.run_meta = dict(meta.get("run", {}))
        self.position = Position(meta["epoch"], meta["batch"], meta["epoch_done"])
        if self.progress and jax.process_index() == 0:
            self.console.say(f"resumed from {self.checkpointer.step_path(meta['step'])} (step "
                             f"{meta['step']}, epoch {meta['epoch']}, batch {meta['batch']})")
        return True

    def _check_trainable(self, meta: dict) -> None:
        if meta.get("trainable") != self.trainable:
            raise CheckpointMismatch(
                f"the checkpoint in {self.checkpointer.directory} trained "
                f"trainable={meta.get('trainable')!r}, this run trains "
                f"trainable={self.trainable!r}: its saved parameters do not fit. Use the same "
                "trainable, or start a new run (another name or directory, or resume=False)")

    def _check_grad_fn(self, abstract_batch_) -> None:
        """Runs ``grad_fn`` on abstract values: its output must be (loss, metrics, grads)
        with grads shaped like the trained parameters."""
        rt, loss, grad_fn = self.runtime, self.functions.loss, self.grad_fn
        params, frozen = rt.abstract[0], None
        if self.trainable is not None:
            params, frozen = split_trainable(params, self.trainable)

        def run(params, extra, batch):
            loss_fn = user_loss_fn(model_loss(rt.apply, loss), frozen, extra)
            return grad_fn(loss_fn, params, batch, jax.random.key(0))

        out = jax.eval_shape(run, params, rt.abstract[1], abstract_batch_)
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

    def _check_loss(self, abstract):
        rt, loss = self.runtime, self.functions.loss
        out, _ = jax.eval_shape(
            lambda p, e, b: rt.apply(lambda m, bb: loss(m, bb, jax.random.key(0), True), p, e,
                                     jax.random.key(0), b),
            *rt.abstract, abstract)
        return sorted(split_loss_output(out)[1])

    def plan(self, memory: bool = False, device_gib: float | None = None) -> str:
        """The sharding plan (path, shape, spec, bytes per device); after ``init``.

        With ``memory=True`` (or ``device_gib``) it adds what one training step holds
        per device, by part, beside what XLA compiled for this backend
        (``Trainer.memory``), and with ``device_gib`` whether that fits."""
        self._require_init("plan")
        text = self.runtime.placement_text()
        if memory or device_gib is not None:
            text += "\n\n" + "\n".join(memory_text(self.memory(device_gib), dict(self.mesh.shape)))
        return text

    def memory(self, device_gib: float | None = None) -> dict:
        """What one training step holds per device (after ``init``), in bytes.

        ``parts``: parameters, optimizer state, gradients (one per trained parameter,
        sharded like it), compute-dtype copies, FSDP gather buffers (the largest
        layer, twice) and activations: the residuals JAX saves for the backward pass of
        your loss on one device's micro-batch (traced, under the model's own remat),
        1/model for those split over ``model``. ``total`` is their sum; ``compiled``:
        XLA's own figures for the compiled step on this backend (``arguments``,
        ``temporaries``, ``outputs``, ``aliased``, ``peak`` = arguments + temporaries +
        outputs - aliased), which also hold XLA's fusion outputs and collectives'
        buffers. With ``device_gib``: ``fits`` (the larger of total and peak).
        """
        self._require_init("memory")
        state, cd = self.state, self.runtime.compute_dtype

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
        rows = placement(self.runtime.abstract[0], self.runtime.specs[0], self.mesh)
        fsdp = self.mesh.shape.get("fsdp", 1)
        gathered = 0
        if fsdp > 1:
            item = jnp.dtype(cd).itemsize if cd is not None else 4
            gathered = GATHERED_LAYERS * layer_gather_bytes(rows, fsdp) * item // 4
        parts = {"parameters": params + frozen, "optimizer": per_device(state.opt_state),
                 "gradients": params, "compute_copies": copies, "fsdp_gathered": gathered,
                 "activations": self._activation_bytes(rows)}
        out = totals(parts, device_gib)
        compiled = compiled_memory(self.compiled_step().memory_analysis())
        out["compiled"] = {**compiled, "platform": self.mesh.devices.flat[0].platform}
        out["per_device_batch"] = self.micro
        if device_gib is not None:
            out["fits"] = max(out["total"], compiled["peak"]) <= out["device_bytes"]
        return out

    def _activation_bytes(self, rows) -> int:
        """Residual bytes per device of the loss's backward pass on one device's micro
        batch (see ``redray.sharding.memory``)."""
        cd = self.runtime.compute_dtype

        def abstract(x):
            dtype = cd if cd is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
            return jax.ShapeDtypeStruct(x.shape, dtype)

        params, frozen = (jax.tree.map(abstract, t) for t in (self.state.params,
                                                              self.state.frozen))
        extra = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state.extra)
        rng = jax.eval_shape(lambda: jax.random.key(0))
        loss_of = model_loss(self.runtime.apply, self.functions.loss)

        def loss(params, frozen, extra, batch, rng):
            return loss_of(params, frozen, extra, batch, rng)[0]

        def batch(rows):
            return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype)
                    for k, v in self._global_batch.items()}

        real = saved_residuals(loss, params, frozen, extra, batch(self.micro), rng)
        probe = saved_residuals(loss, params, frozen, extra, batch(1), rng)
        lengths = {d + k for v in self._global_batch.values() for d in v.shape[1:]
                   for k in (-1, 0)}
        return split_residual_bytes(real, probe, split_sizes(rows),
                                    self.mesh.shape.get("model", 1), frozenset(lengths))

    def describe(self) -> dict:
        """The run's shape: hosts, devices, mesh, parameter count, bytes per device,
        batch sizes, accumulation steps (after ``init``)."""
        self._require_init("describe")
        rows = placement(self.runtime.abstract[0], self.runtime.specs[0], self.mesh)
        opt = sum(x.nbytes for x in jax.tree.leaves(self.state.opt_state)
                  if hasattr(x, "nbytes")) // max(self.mesh.size, 1)
        return {"hosts": jax.process_count(), "devices": self.mesh.size,
                "mesh": dict(self.mesh.shape),
                "parameters": int(sum(np.prod(r.shape) for r in rows)),
                "trainable_parameters": int(sum(np.prod(x.shape) for x in
                                                jax.tree.leaves(self.state.params))),
                "param_bytes_per_device": int(sum(r.bytes_per_device for r in rows)),
                "optimizer_bytes_per_device_approx": int(opt),
                "batch_size": self.batch_size, "micro_batch_size": self.micro,
                "accumulation_steps": self.accum}

    def _print_summary(self) -> None:
        d = self.describe()
        mesh = " x ".join(f"{k}={v}" for k, v in d["mesh"].items())
        trained = "" if d["trainable_parameters"] == d["parameters"] else \
            f" ({d['trainable_parameters']:,} trained)"
        self.console.say(
            f"redray: {d['hosts']} host(s), {d['devices']} devices, mesh {mesh}; "
            f"{d['parameters']:,} parameters{trained}, {d['param_bytes_per_device']:,} "
            f"parameter bytes per device; batch {d['batch_size']} (micro "
            f"{d['micro_batch_size']} per device x {d['accumulation_steps']} accumulation steps)")

    @property
    def model(self):
        """The trained model as the user's object (NNX module or bound Linen module)."""
        self._require_init("model")
        return self.runtime.bound(self.state.whole_params, self.state.extra)

    @property
    def step(self) -> int:
        """Optimizer updates done so far (after ``init``; a resumed run counts from its
        checkpoint), e.g. to continue a custom loop where it stopped."""
        self._require_init("step")
        return int(jax.device_get(self.state.step))

    def _require_init(self, what):
        if self.state is None:
            raise RuntimeError(f"Trainer.{what} needs the model: call trainer.init(examples) "
                               "or trainer.fit(...) first")

    # ---------------------------------------------------------------- steps
    def _train_program(self):
        """The jitted training step, built once: ``steps.train_step`` bound to this
        model, loss and optimizer, with the state's shardings and the state donated."""
        if "train" not in self._steps:
            gradients = microbatched(
                model_gradients(model_loss(self.runtime.train_apply, self.functions.loss),
                                self.grad_fn),
                self.accum, self.micro * self.dp, NamedSharding(self.mesh, P(None, BATCH_AXES)),
                self._metric_names)
            self._steps["train"] = jax.jit(
                functools.partial(train_step, gradients=gradients, optimizer=self.optimizer,
                                  on_nonfinite=self.on_nonfinite),
                in_shardings=(self.layout.shardings, batch_sharding(self.mesh)),
                out_shardings=(self.layout.shardings, self.runtime.replicated()),
                donate_argnums=0)
        return self._steps["train"]

    def compiled_step(self):
        """The training step as XLA compiled it for this mesh and batch (after ``init``):
        ``.as_text()`` shows its collectives, ``.memory_analysis()`` its bytes per
        device, ``.cost_analysis()`` its FLOPs. The same program ``fit`` runs."""
        self._require_init("compiled_step")
        return self._train_program().lower(self.state, self._global_batch).compile()

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """One optimizer update; ``batch`` is this process's rows of the global batch
        (all of it on one host). Metrics stay on the device."""
        return self._step(self._place(batch))

    def _place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        sharding = batch_sharding(self.mesh)
        mine = process_rows(sharding, self.batch_size)
        rows = next(iter(batch.values())).shape[0]
        if rows != mine.stop - mine.start:
            raise UserFunctionError(
                f"the batch has {rows} rows but this process feeds {mine.stop - mine.start} of "
                f"batch_size={self.batch_size}: collate must return one row per example")
        return to_global(batch, sharding, self.batch_size)

    def _step(self, placed: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self._require_init("train_step")
        self.state, metrics = self._train_program()(self.state, placed)
        watchdog.progress("a training step", training=True)
        return metrics

    # ---------------------------------------------------------------- loops
    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Mean loss and metrics over every example exactly once.

        Full batches run split over the devices; a final partial batch runs at its
        exact size (split if it divides, replicated otherwise), so no padding enters
        the mean. ``examples``: a list, or a row source (``len`` + ``take_rows``).
        """
        if not len(examples):
            raise ValueError("evaluate got no examples")
        self.init(examples)
        if "eval" not in self._steps:
            self._steps["eval"] = jax.jit(
                functools.partial(eval_step, apply=self.runtime.apply, loss=self.functions.loss),
                out_shardings=self.runtime.replicated())
        program, rng = self._steps["eval"], stream_key(self.seed, KeyStream.EVAL)
        pending = each_batch(
            examples, self.eval_batch_size, self.mesh, self.functions.collate,
            lambda batch, start: program(self.state.whole_params, self.state.extra, batch, rng),
            pad_last=False)
        totals: dict[str, float] = {}
        for n, metrics in pending:
            for k, v in jax.device_get(metrics).items():
                totals[k] = totals.get(k, 0.0) + float(v) * n
        return {k: v / len(examples) for k, v in totals.items()}

    def fit(self, train: Sequence, epochs: int = 1, eval_data: Sequence | None = None,
            eval_metric: Callable | None = None, max_steps: int | None = None,
            shuffle: bool = True, eval_at_start: bool = False) -> list[dict]:
        """Trains until ``epochs`` passes over ``train`` (or ``max_steps`` updates) are done.

        Both counts are totals for the run: a trainer resumed from a checkpoint, or
        called again, continues from where it stands (its epoch, its position inside
        the epoch, its step) and trains only what is left.

        Args:
          train: the training examples (anything ``collate`` accepts), in a list or a
            row source (``len`` + ``take_rows(indices)``, e.g. from a Ray Dataset).
          epochs: passes over the data; each drops its last partial batch.
          eval_data: examples evaluated (loss and metrics) after every epoch.
          eval_metric: ``fn(examples, predictions) -> dict``; with ``predict`` given,
            runs the Predictor on ``eval_data`` after every epoch and logs the result.
          max_steps: stop after this many optimizer updates in total.
          shuffle: shuffle each epoch by (seed, epoch).
          eval_at_start: also evaluate ``eval_data`` before training (when there is
            training left to do), e.g. to show the perplexity before and after.

        Returns:
          The rows logged by this call: one dict per ``log_every`` window (``step``,
          ``epoch``, mean ``loss`` and metrics, ``learning_rate`` when known,
          ``steps_per_s``, ``examples_per_s``) and one per evaluation (keys prefixed
          ``eval_``).
        """
        if eval_metric is not None and (eval_data is None or self.functions.predict is None):
            raise ValueError("eval_metric needs eval_data and a predict function: pass "
                             "predict=... to Trainer and eval_data=... to fit")
        if len(train) < self.batch_size:
            raise ValueError(f"{len(train)} training examples are fewer than batch_size="
                             f"{self.batch_size}: lower batch_size or add data")
        ckpt = self.checkpoint_config
        if ckpt is not None and ckpt.best_metric and eval_data is None:
            raise ValueError(f"best_metric={ckpt.best_metric!r} needs eval_data: the best "
                             "checkpoint is chosen by the evaluation after each epoch")
        self.init(train)
        settings = self._data_settings(train, shuffle)
        self._check_resume(settings)
        per_epoch = self._steps_per_epoch(train)
        if not per_epoch:
            raise ValueError(f"{train!r} gives no full batch of {self.batch_size} examples per "
                             "epoch: lower batch_size or add data")
        self._set_budget(per_epoch * epochs if max_steps is None
                         else min(max_steps, per_epoch * epochs))
        shown = self.progress and jax.process_index() == 0
        if shown and not self._summarized:
            self._print_summary()  # once: a custom loop may call fit many times
            self._summarized = True
        self.tokens_per_example = 0
        recorder = Recorder()
        evaluation = None if eval_data is None else Evaluation(
            eval_data, eval_metric, self.console if shown else None)
        # First: a non-finite step is caught before its window is logged or a save starts.
        self._guard = NonFiniteGuard(self.on_nonfinite, self.log_every, per_epoch)
        self._fit_hooks = [hook for hook in (
            self._guard, recorder, LogWindow(self.log_every),
            self.console.progress(self, self.budget) if shown else None, evaluation,
            None if ckpt is None else Checkpoints(self, settings)) if hook is not None]
        try:
            first_epoch, _ = self.position.resume_point()
            if (eval_at_start and evaluation is not None and first_epoch < epochs
                    and (max_steps is None or self.step < max_steps)):
                evaluation.run(self, self.step, first_epoch)
            while True:
                steps = self._training_steps(train, epochs, max_steps, shuffle)
                try:
                    for event in steps:
                        self._dispatch(event)
                    break
                except RolledBack:  # the state and position are the checkpoint's: go on
                    steps.close()
            for hook in self._listening():
                hook.on_fit_end(self)
        finally:
            self._fit_hooks, self._guard = [], None
        return recorder.rows

    def _dispatch(self, event) -> None:
        for hook in self._listening():
            if isinstance(event, StepInfo):
                hook.on_step(self, event)
            elif isinstance(event, EpochEnd):
                hook.on_epoch_end(self, event)
            else:
                hook.on_epoch_start(self, *event)

    def _roll_back(self, bad_step: int, position: Position) -> int | None:
        """Restores the newest checkpoint's state, keeps counting steps from
        ``bad_step`` and continues after that step's batch (``position``). Returns the
        checkpoint's step, or None when there is no checkpoint to go back to."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()
        found = self.checkpointer.restore_latest(self.layout.checkpoint_targets(),
                                                 check=self._check_trainable,
                                                 required=POSITION_META)
        if found is None:
            return None
        items, meta = found
        shardings = self.layout.shardings
        restored = TrainState.from_checkpoint_items(items, self.state.frozen)
        step = jax.jit(lambda: jnp.asarray(bad_step, jnp.int32),
                       out_shardings=shardings.step)()
        self.state = restored.replace(step=step,
                                      nonfinite_step=zero_flag(shardings.nonfinite_step))
        self.position = Position(position.epoch, position.batch, False)
        self._log({"step": bad_step, "rolled_back_to_step": int(meta["step"])})
        return int(meta["step"])

    def _training_steps(self, train: Sequence, epochs: int, max_steps: int | None,
                        shuffle: bool) -> Iterator:
        """Runs the steps the budget leaves, from ``self.position``; yields
        ``(epoch, first batch)`` as an epoch starts, a ``StepInfo`` after each step
        and an ``EpochEnd`` after an epoch's last step."""
        per_epoch = self._steps_per_epoch(train)
        sharding = batch_sharding(self.mesh)
        mine = process_rows(sharding, self.batch_size)
        first_epoch, first_batch = self.position.resume_point()
        done = self.step
        for epoch in range(first_epoch, epochs):
            if max_steps is not None and done >= max_steps:
                return
            start = first_batch if epoch == first_epoch else 0
            stop = per_epoch if max_steps is None else min(per_epoch, start + max_steps - done)
            yield epoch, start

            def make(examples):
                batch = collate_checked(self.functions.collate, examples)
                if not self.tokens_per_example:
                    self.tokens_per_example = _tokens_per_example(batch)
                return to_global(batch, sharding, self.batch_size)

            batches = epoch_batches(train, epoch, self.seed, shuffle, self.batch_size, mine,
                                    start, stop, self._streams)
            in_flight = InFlight()
            for i, placed in zip(range(start, stop), prefetch(batches, make, self.prefetch)):
                metrics = self._step(placed)
                in_flight.add(metrics)
                done += 1
                self.position = Position(epoch, i + 1, False)
                yield StepInfo(done, self.position, metrics, i == per_epoch - 1)
            complete = stop == per_epoch
            if complete:
                self.position = Position(epoch, per_epoch, True)
            yield EpochEnd(epoch, done, complete)
            if not complete:  # max_steps ended the run inside this epoch
                return

    def _set_budget(self, budget: int) -> None:
        """Gives a ``redray.Schedule`` the run's budget (a resumed run's schedule grows
        as ``redray/engine/schedule.py`` defines); warns when a plain schedule function
        cannot follow a budget that changed."""
        before = self.budget if self.budget is not None else (self.resumed_from or {}).get(
            "budget")
        self.budget = budget
        lr, step = self.learning_rate, self.step
        if isinstance(lr, Schedule):
            saved = None  # a fresh run: one segment
            if step > 0:  # this Trainer's earlier fit, else the checkpoint it resumed
                saved = self._schedule_meta if self._schedule_meta is not None else \
                    (self.resumed_from or {}).get("schedule")
            segments = lr.with_budget(budget, step, saved)
            if segments != lr.segments:
                lr.segments = segments
                self._steps.pop("train", None)  # its schedule is traced into the step
            self._schedule_meta = lr.as_meta()
        elif callable(lr) and step > 0 and before is not None and before != budget \
                and jax.process_index() == 0:
            warnings.warn(
                f"the run's budget changed from {before} to {budget} steps at step {step}, "
                "but learning_rate is a plain function built for one budget: its value at "
                f"step {step} may jump (a sawtooth). Use redray.Schedule(peak, warmup=...) for "
                "the optimizer and learning_rate: it continues smoothly when the budget grows",
                stacklevel=3)

    def _steps_per_epoch(self, train) -> int:
        return steps_per_epoch(train, self.batch_size, self._streams)

    def _data_settings(self, train: Sequence, shuffle: bool) -> dict:
        """What decides the batches: a run resumes only with the same (kept in meta).

        A stream's count of parallel streams is the checkpoint's when resuming (so a
        resume on another number of hosts reads the same batches), else its own."""
        settings = {"examples": len(train), "seed": self.seed, "batch_size": self.batch_size,
                    "shuffle": shuffle}
        self._streams = None
        if is_stream(train):
            saved = ((self.resumed_from or {}).get("stream") or {}).get("streams")
            groups = data_groups(self.batch_size,
                                 process_rows(batch_sharding(self.mesh), self.batch_size))
            self._streams = train.resolve_streams(saved, groups, self.batch_size)
            settings["stream"] = train.settings(self._streams)
        return settings

    def _check_resume(self, settings: dict) -> None:
        """Refuses to resume a run on other data or another order: that would silently
        train on different batches than the run it continues."""
        meta = self.resumed_from
        if meta is None:
            return
        changed = [f"{k}: checkpoint {meta.get(k)!r}, now {v!r}" for k, v in settings.items()
                   if meta.get(k) != v]
        if changed:
            raise CheckpointMismatch(
                f"the checkpoint in {self.checkpointer.directory} was written by a run with "
                f"other data settings ({'; '.join(changed)}): resuming would train on "
                "different batches. Use the same settings, or start a new run (another "
                "name or directory, or resume=False)")

    def save_checkpoint(self, data_settings: dict, metrics: dict | None = None) -> None:
        """Starts saving the state at the current step and position (``fit``'s
        ``Checkpoints`` hook calls it); hooks hear ``on_checkpoint`` once complete."""
        if self._guard is not None:
            self._guard.check(self)  # never save a state past a non-finite step
        position = self.position
        meta = {"step": self.step, "epoch": position.epoch, "batch": position.batch,
                "epoch_done": position.epoch_done, **data_settings, "metrics": metrics or {},
                "config": self.config, "trainable": self.trainable, "run": self.run_meta,
                "budget": self.budget, "schedule": self._schedule_meta, "time": time.time()}

        def committed(step, path, meta):
            for hook in self._listening():
                hook.on_checkpoint(self, step, path, meta)

        self.checkpointer.save(self.state.checkpoint_items(), meta, on_commit=committed)

    def log(self, metrics: dict) -> dict:
        """Logs your own metrics (e.g. an RL return) at the current step.

        They reach MLflow like ``fit``'s rows when the Trainer runs inside ``redray.run``
        or ``redray.fit``: host 0 sends them (no collective; the other hosts' calls send
        nothing, so one loop on every host is fine). Returns the logged row.
        """
        self._require_init("log")
        bad = int(jax.device_get(self.state.nonfinite_step))
        if bad and self.on_nonfinite != "skip":  # a loop of train_step calls, outside fit
            raise NonFiniteError(nonfinite_message(self, bad, None, None))
        row = {"step": self.step, **{k: float(v) for k, v in metrics.items()}}
        self._log(row)
        return row

    def _log(self, row: dict) -> None:
        for hook in self._listening():
            hook.on_log(self, row)

    def predictor(self, batch_size: int | None = None):
        """A Predictor that always uses this trainer's latest parameters (no copy).

        The same one for the same batch size: a loop that predicts every iteration
        compiles once, and its default ``rng`` keeps changing between calls.
        """
        from redray.engine.predictor import Predictor

        self._require_init("predictor")
        if self.functions.predict is None:
            raise UserFunctionError("this Trainer has no predict function: pass predict=... to "
                                    "Trainer")
        size = batch_size or self.eval_batch_size
        if size not in self._predictors:
            self._predictors[size] = Predictor._from_runtime(
                self.runtime, self.functions.collate, self.functions.predict,
                lambda: (self.state.whole_params, self.state.extra), size, self.seed)
        return self._predictors[size]


def _tokens_per_example(batch) -> int:
    """Tokens in one example: the width of the batch's first 2-D integer array (e.g.
    ``input_ids``), or 0 when the batch has no tokens."""
    for key in sorted(batch):
        value = np.asarray(batch[key])
        if value.ndim == 2 and np.issubdtype(value.dtype, np.integer):
            return int(value.shape[1])
    return 0


def _loss_value(out):
    return out[0] if isinstance(out, tuple) else out


def _batch_layout(batch_size: int, micro_batch_size: int | None, dp: int) -> tuple[int, int, int]:
    """(global batch, accumulation steps, per-device micro batch), validated."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size % dp:
        raise ValueError(f"batch_size={batch_size} does not split over the {dp} data-parallel "
                         f"devices (data x fsdp axes): use a multiple of {dp}")
    if micro_batch_size is None:
        return batch_size, 1, batch_size // dp
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    if batch_size % (micro_batch_size * dp):
        raise ValueError(
            f"batch_size={batch_size} is not a multiple of micro_batch_size={micro_batch_size} x "
            f"{dp} data-parallel devices = {micro_batch_size * dp}: gradient accumulation needs "
            "whole micro-batches")
    return batch_size, batch_size // (micro_batch_size * dp), micro_batch_size
