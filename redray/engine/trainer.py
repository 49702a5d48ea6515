"""The Trainer: one jitted, sharded, donated train step over all of a process's devices."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from redray.checkpoint import CheckpointConfig, CheckpointMismatch
from redray.engine.batches import (InFlight, collate_checked, epoch_order, prefetch,
                                   process_rows, read_rows, to_global)
from redray.engine.model import merge_trainable, split_trainable
from redray.engine.runtime import ModelRuntime, abstract_batch, resolve_mesh
from redray.pipeline import Pipeline, PipelineError, split_loss_output
from redray.sharding import BATCH_AXES, batch_sharding, data_parallel_size, follow_specs


# Set on every host of a cluster run (``redray.run``/``redray.fit``) by the cluster
# layer: ``claim(trainer)`` fills a new Trainer's defaults and wires it to the run
# (metrics to MLflow, checkpoints registered), without the engine importing Ray.
# ``claim(trainer, default_checkpoint)`` may set ``trainer.checkpoint_config`` when the
# user left ``checkpoint`` at its default.
_host_run = None


def set_host_run(host_run) -> None:
    """Installs (or, with None, removes) this process's cluster-run context."""
    global _host_run
    _host_run = host_run


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
      progress: show a progress bar (on process 0).
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
    """

    def __init__(self, model: Any, collate: Callable, loss: Callable,
                 optimizer: optax.GradientTransformation, predict: Callable | None = None, *,
                 batch_size: int, micro_batch_size: int | None = None,
                 eval_batch_size: int | None = None, mesh: Mesh | None = None,
                 data_axis="auto", fsdp_axis=1, model_axis=1, compute_dtype=None, rules=(),
                 learning_rate=None, seed: int = 0, log_every: int = 10, progress: bool = True,
                 prefetch: int = 2, checkpoint=None, config: dict | None = None,
                 trainable: str | None = None, grad_fn: Callable | None = None):
        self.pipeline = Pipeline(collate, loss, predict)
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
        self.batch_size, self.accum, self.micro = _batch_layout(batch_size, micro_batch_size, self.dp)
        self.eval_batch_size = eval_batch_size or batch_size
        self.runtime = ModelRuntime(model, self.mesh, compute_dtype, rules, seed)
        self.learning_rate = learning_rate
        self.seed = seed
        self.log_every = max(1, int(log_every))
        self.progress = progress
        self.prefetch = prefetch
        self.state = None
        self._steps: dict = {}
        self.checkpoint_config = CheckpointConfig.of(checkpoint)
        self.checkpointer = None
        self.config = dict(config or {})
        # Kept in every checkpoint and restored with it (e.g. the tracker's run id).
        self.run_meta: dict = {}
        # (epoch, batches done in it, whether the epoch's end (eval, save) is done)
        self.position = (0, 0, False)
        self.resumed_from: dict | None = None
        # Called on every process as on_checkpoint(step, path, meta) once a checkpoint
        # is complete (redray.fit registers it with Ray Train there).
        self.on_checkpoint: Callable | None = None
        # Called on every process with each row fit logs (redray.fit reports it to Ray).
        self.on_log: Callable | None = None
        self._summarized = False
        self._predictors: dict = {}
        # Called on every process once the state exists (fresh or restored).
        self.on_init: Callable | None = None
        if _host_run is not None:
            _host_run.claim(self, default_checkpoint=checkpoint is None)

    # ---------------------------------------------------------------- set-up
    def init(self, examples: Sequence) -> None:
        """Validates the pipeline on the first batch, derives specs and creates the state.

        Called by ``fit`` and ``evaluate`` when needed; call it yourself to inspect
        ``plan()`` before training.
        """
        if self.state is not None:
            return
        self._init(examples)
        if self.on_init is not None:
            self.on_init()

    def _init(self, examples: Sequence) -> None:
        if not len(examples):
            raise ValueError("init needs at least one example to learn the batch's shapes")
        sample = collate_checked(self.pipeline.collate,
                                 read_rows(examples, range(min(len(examples), self.batch_size))))
        micro_global = self.micro * self.dp
        abstract = abstract_batch(sample, micro_global)
        self._global_batch = abstract_batch(sample, self.batch_size)
        self._metric_names = self._check_loss(abstract)
        loss = self.pipeline.loss
        self.runtime.derive(lambda model, batch: _loss_value(loss(model, batch, jax.random.key(0), True)),
                            abstract)
        params_sh, extra_sh = self.runtime.shardings
        param_specs = self.runtime.specs[0]
        abstract_params = self.runtime.abstract[0]
        frozen_sh = None
        if self.trainable is not None:
            abstract_params, _ = split_trainable(abstract_params, self.trainable)
            param_specs, _ = split_trainable(param_specs, self.trainable)
            params_sh, frozen_sh = split_trainable(params_sh, self.trainable)
        if self.grad_fn is not None:
            self._check_grad_fn(abstract)
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_specs = follow_specs(abstract_opt, abstract_params, param_specs)
        repl = self.runtime.replicated()
        self.state_shardings = {
            "step": repl, "rng": repl, "params": params_sh, "extra": extra_sh,
            "opt_state": jax.tree.map(lambda s: NamedSharding(self.mesh, s), opt_specs,
                                      is_leaf=lambda x: isinstance(x, P)),
        }
        if frozen_sh is not None:
            self.state_shardings["frozen"] = frozen_sh

        seed = self.seed
        start = lambda: (jnp.zeros((), jnp.int32), jax.random.fold_in(jax.random.key(seed), 1))
        # Frozen parameters are never saved: they always come from the model as built.
        params, extra = self.runtime.init() if frozen_sh is not None else (None, None)
        frozen = None
        if frozen_sh is not None:
            params, frozen = split_trainable(params, self.trainable)
        if self.checkpoint_config is not None and self._restore(start, abstract_params,
                                                                abstract_opt):
            if frozen is not None:
                self.state["frozen"] = frozen
            return
        if params is None:
            params, extra = self.runtime.init()
        step, rng = jax.jit(start, out_shardings=(repl, repl))()
        self.state = {
            "step": step, "rng": rng, "params": params, "extra": extra,
            "opt_state": jax.jit(self.optimizer.init,
                                 out_shardings=self.state_shardings["opt_state"])(params),
        }
        if frozen is not None:
            self.state["frozen"] = frozen

    def _restore(self, start, abstract_params, abstract_opt) -> bool:
        """Loads the last complete checkpoint onto this mesh, if resuming and one exists."""
        from redray.checkpoint import Checkpointer

        self.checkpointer = Checkpointer(self.checkpoint_config)
        if not self.checkpoint_config.resume:
            return False
        step, rng = jax.eval_shape(start)
        abstract = {"step": step, "rng": rng, "params": abstract_params,
                    "extra": self.runtime.abstract[1], "opt_state": abstract_opt}
        found = self.checkpointer.restore_latest(abstract, self.state_shardings,
                                                 check=self._check_trainable)
        if found is None:
            return False
        self.state, meta = found
        self.resumed_from = meta
        self.run_meta = dict(meta.get("run", {}))
        self.position = (meta["epoch"], meta["batch"], meta["epoch_done"])
        if self.progress and jax.process_index() == 0:
            print(f"resumed from {self.checkpointer.step_path(meta['step'])} (step "
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
        rt, loss, grad_fn = self.runtime, self.pipeline.loss, self.grad_fn
        abstract_params = rt.abstract[0]
        params, frozen = abstract_params, None
        if self.trainable is not None:
            params, frozen = split_trainable(abstract_params, self.trainable)

        def run(params, extra, batch):
            loss_fn = _user_loss_fn(_loss_of(rt, loss, frozen), extra)
            return grad_fn(loss_fn, params, batch, jax.random.key(0))

        out = jax.eval_shape(run, params, rt.abstract[1], abstract_batch_)
        if not isinstance(out, tuple) or len(out) != 3:
            raise PipelineError(f"grad_fn returned {type(out).__name__}"
                                f"{' of ' + str(len(out)) if isinstance(out, tuple) else ''}: "
                                "return (loss, metrics, grads)")
        split_loss_output((out[0], out[1]))
        want = jax.tree.map(lambda a: (a.shape, a.dtype), params)
        got = jax.tree.map(lambda a: (a.shape, a.dtype), out[2])
        if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
            raise PipelineError(
                "grad_fn returned grads that do not match the trained parameters (structure, "
                "shapes or dtypes differ): return the gradient of loss_fn with respect to the "
                "params it was given, e.g. jax.grad(lambda p: loss_fn(p, batch, rng)[0])(params)")

    def _check_loss(self, abstract):
        rt, loss = self.runtime, self.pipeline.loss
        out, _ = jax.eval_shape(
            lambda p, e, b: rt.apply(lambda m, bb: loss(m, bb, jax.random.key(0), True), p, e,
                                     jax.random.key(0), b),
            *rt.abstract, abstract)
        return sorted(split_loss_output(out)[1])

    def plan(self) -> str:
        """The sharding plan (path, shape, spec, bytes per device); after ``init``."""
        self._require_init("plan")
        return self.runtime.plan_text()

    def describe(self) -> dict:
        """The run's shape: hosts, devices, mesh, parameter count, bytes per device,
        batch sizes, accumulation steps (after ``init``)."""
        from redray.sharding import plan

        self._require_init("describe")
        rows = plan(self.runtime.abstract[0], self.runtime.specs[0], self.mesh)
        opt = sum(x.nbytes for x in jax.tree.leaves(self.state["opt_state"])
                  if hasattr(x, "nbytes")) // max(self.mesh.size, 1)
        return {"hosts": jax.process_count(), "devices": self.mesh.size,
                "mesh": dict(self.mesh.shape),
                "parameters": int(sum(np.prod(r.shape) for r in rows)),
                "trainable_parameters": int(sum(np.prod(x.shape) for x in
                                                jax.tree.leaves(self.state["params"]))),
                "param_bytes_per_device": int(sum(r.bytes_per_device for r in rows)),
                "optimizer_bytes_per_device_approx": int(opt),
                "batch_size": self.batch_size, "micro_batch_size": self.micro,
                "accumulation_steps": self.accum}

    def _print_summary(self) -> None:
        d = self.describe()
        mesh = " x ".join(f"{k}={v}" for k, v in d["mesh"].items())
        trained = "" if d["trainable_parameters"] == d["parameters"] else \
            f" ({d['trainable_parameters']:,} trained)"
        print(f"redray: {d['hosts']} host(s), {d['devices']} devices, mesh {mesh}; "
              f"{d['parameters']:,} parameters{trained}, {d['param_bytes_per_device']:,} "
              f"parameter bytes per device; batch {d['batch_size']} (micro {d['micro_batch_size']} per device "
              f"x {d['accumulation_steps']} accumulation steps)", flush=True)

    @property
    def model(self):
        """The trained model as the user's object (NNX module or bound Linen module)."""
        self._require_init("model")
        return self.runtime.bound(self._whole_params(), self.state["extra"])

    def _whole_params(self):
        """Every parameter: the trained ones merged with the frozen ones (if any)."""
        params, frozen = self.state["params"], self.state.get("frozen")
        return params if frozen is None else merge_trainable(params, frozen)

    @property
    def step(self) -> int:
        """Optimizer updates done so far (after ``init``; a resumed run counts from its
        checkpoint), e.g. to continue a custom loop where it stopped."""
        self._require_init("step")
        return int(jax.device_get(self.state["step"]))

    def _require_init(self, what):
        if self.state is None:
            raise RuntimeError(f"Trainer.{what} needs the model: call trainer.init(examples) "
                               "or trainer.fit(...) first")

    # ---------------------------------------------------------------- steps
    def _train_step_fn(self):
        rt, loss, tx, custom = self.runtime, self.pipeline.loss, self.optimizer, self.grad_fn
        accum, micro_global = self.accum, self.micro * self.dp
        micro_sharding = NamedSharding(self.mesh, P(None, BATCH_AXES))

        def grads_of(params, extra, frozen, batch, rng):
            """((loss, (metrics, new extra)), grads) of one (micro-)batch."""
            loss_of = _loss_of(rt, loss, frozen)
            if custom is None:
                return jax.value_and_grad(loss_of, has_aux=True)(params, extra, batch, rng)
            value, metrics, grads = custom(_user_loss_fn(loss_of, extra), params, batch, rng)
            return (value, (metrics, extra)), grads

        def step(state, batch):
            rng, step_rng = jax.random.split(state["rng"])
            params, frozen = state["params"], state.get("frozen")
            if accum == 1:
                (value, (metrics, extra)), grads = grads_of(params, state["extra"], frozen, batch,
                                                            step_rng)
            else:
                # Row m*accum + a of the global batch goes to micro-batch a: every
                # micro-batch keeps the batch's split over devices, no data moves.
                micro = jax.tree.map(
                    lambda x: jax.lax.with_sharding_constraint(
                        x.reshape(micro_global, accum, *x.shape[1:]).swapaxes(0, 1),
                        micro_sharding), batch)

                def body(carry, xs):
                    g_sum, v_sum, m_sum, extra = carry
                    mb, i = xs
                    (v, (m, extra)), g = grads_of(params, extra, frozen, mb,
                                                  jax.random.fold_in(step_rng, i))
                    g_sum = jax.tree.map(jnp.add, g_sum, g)
                    m_sum = {k: m_sum[k] + jnp.asarray(m[k], jnp.float32) for k in m_sum}
                    return (g_sum, v_sum + v, m_sum, extra), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                m_zero = {k: jnp.zeros((), jnp.float32) for k in self._metric_names}
                (g_sum, v_sum, m_sum, extra), _ = jax.lax.scan(
                    body, (zeros, jnp.zeros((), jnp.float32), m_zero, state["extra"]),
                    (micro, jnp.arange(accum)))
                grads = jax.tree.map(lambda g: g / accum, g_sum)
                value = v_sum / accum
                metrics = jax.tree.map(lambda m: m / accum, m_sum)
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
            out = {"loss": value.astype(jnp.float32), "grad_norm": optax.tree.norm(grads)}
            out.update({k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()})
            new_state = {"step": state["step"] + 1, "rng": rng, "params": new_params,
                         "extra": extra, "opt_state": opt_state}
            if frozen is not None:
                new_state["frozen"] = frozen
            return new_state, out

        return jax.jit(step, in_shardings=(self.state_shardings, batch_sharding(self.mesh)),
                       out_shardings=(self.state_shardings, self.runtime.replicated()),
                       donate_argnums=0)

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
            raise PipelineError(
                f"the batch has {rows} rows but this process feeds {mine.stop - mine.start} of "
                f"batch_size={self.batch_size}: collate must return one row per example")
        return to_global(batch, sharding, self.batch_size)

    def _step(self, placed: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self._require_init("train_step")
        self.state, metrics = self._train_program()(self.state, placed)
        return metrics

    def _train_program(self):
        """The jitted training step, built once."""
        if "train" not in self._steps:
            self._steps["train"] = self._train_step_fn()
        return self._steps["train"]

    def _eval_step_fn(self):
        rt, loss = self.runtime, self.pipeline.loss

        def step(params, extra, batch, rng):
            out, _ = rt.apply(lambda m, b: loss(m, b, rng, False), params, extra, rng, batch)
            value, metrics = split_loss_output(out)
            return {"loss": value.astype(jnp.float32),
                    **{k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}}

        return jax.jit(step, out_shardings=self.runtime.replicated())

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
            self._steps["eval"] = self._eval_step_fn()
        size = self.eval_batch_size
        rng = jax.random.fold_in(jax.random.key(self.seed), 2)
        totals: dict[str, float] = {}
        pending, in_flight = [], InFlight()
        for start in range(0, len(examples), size):
            n = min(size, len(examples) - start)
            sharding = batch_sharding(self.mesh) if n % self.dp == 0 else self.runtime.replicated()
            mine = process_rows(sharding, n)
            rows = read_rows(examples, range(start + mine.start, start + mine.stop))
            placed = to_global(collate_checked(self.pipeline.collate, rows), sharding, n)
            pending.append((n, self._steps["eval"](self._whole_params(), self.state["extra"],
                                                   placed, rng)))
            in_flight.add(pending[-1][1])
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
        from tqdm.auto import tqdm

        if eval_metric is not None and (eval_data is None or self.pipeline.predict is None):
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
        self._check_resume(train, shuffle)
        if self.progress and jax.process_index() == 0 and not self._summarized:
            self._print_summary()  # once: a custom loop may call fit many times
            self._summarized = True
        self._tokens = None
        steps_per_epoch = len(train) // self.batch_size
        history: list[dict] = []
        done = int(jax.device_get(self.state["step"]))
        saved = done if self.resumed_from is not None else None
        sharding = batch_sharding(self.mesh)
        mine = process_rows(sharding, self.batch_size)
        first_epoch, first_batch, epoch_done = self.position
        if epoch_done:
            first_epoch, first_batch = first_epoch + 1, 0

        def save(epoch, batch, end_of_epoch, metrics=None):
            nonlocal saved
            if self.checkpointer is None or saved == done:
                return
            self.position = (epoch, batch, end_of_epoch)
            self.checkpointer.save(self.state, self._meta(done, train, shuffle, metrics),
                                   on_commit=self.on_checkpoint)
            saved = done

        left = first_epoch < epochs and (max_steps is None or done < max_steps)
        if eval_at_start and eval_data is not None and left:
            self._eval_row(history, done, first_epoch, eval_data, eval_metric)
        for epoch in range(first_epoch, epochs):
            if max_steps is not None and done >= max_steps:
                break
            order = epoch_order(len(train), self.seed, epoch, shuffle)
            start = first_batch if epoch == first_epoch else 0
            stop = steps_per_epoch if max_steps is None else \
                min(steps_per_epoch, start + max_steps - done)
            bar = tqdm(total=steps_per_epoch, initial=start, desc=f"epoch {epoch}", leave=False,
                       disable=not self.progress or jax.process_index() != 0)
            window, t0, in_flight = [], time.perf_counter(), InFlight()

            def make(i, order=order):
                rows = order[i * self.batch_size:(i + 1) * self.batch_size][mine]
                batch = collate_checked(self.pipeline.collate, read_rows(train, rows))
                if self._tokens is None:
                    self._tokens = _tokens_per_example(batch)
                return to_global(batch, sharding, self.batch_size)

            for i, placed in zip(range(start, stop), prefetch(range(start, stop), make,
                                                             self.prefetch)):
                window.append(self._step(placed))
                in_flight.add(window[-1])
                done += 1
                self.position = (epoch, i + 1, False)
                bar.update(1)
                if len(window) == self.log_every or i == steps_per_epoch - 1:
                    row = self._summarize(window, done, epoch, t0)
                    self._log(history, row)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", steps_s=f"{row['steps_per_s']:.2f}",
                                    ex_s=f"{row['examples_per_s']:.0f}")
                    window, t0 = [], time.perf_counter()
                if (ckpt is not None and ckpt.save_every and done % ckpt.save_every == 0
                        and not (ckpt.every_epoch and i == steps_per_epoch - 1)):
                    save(epoch, i + 1, False)
            if window:
                self._log(history, self._summarize(window, done, epoch, t0))
            bar.close()
            row = None
            if eval_data is not None:
                row = self._eval_row(history, done, epoch, eval_data, eval_metric)
            if stop < steps_per_epoch:  # max_steps ended the run inside this epoch
                break
            self.position = (epoch, steps_per_epoch, True)
            if ckpt is not None and ckpt.every_epoch:
                save(epoch, steps_per_epoch, True, self._best_metrics(row))
        if ckpt is not None:
            last = next((r for r in reversed(history) if "eval_loss" in r), None)
            save(*self.position, self._best_metrics(last) if last and last["step"] == done
                 else None)
            self.checkpointer.wait()
        return history

    def _eval_row(self, history, step, epoch, eval_data, eval_metric) -> dict:
        """Evaluates (loss, metrics and, with ``eval_metric``, the Predictor's metric),
        logs the row and prints it."""
        row = {"step": step, "epoch": epoch,
               **{f"eval_{k}": v for k, v in self.evaluate(eval_data).items()}}
        if eval_metric is not None:
            preds = self.predictor().predict(eval_data)
            row.update({f"eval_{k}": float(v) for k, v in eval_metric(
                read_rows(eval_data, range(len(eval_data))), preds).items()})
        self._log(history, row)
        if self.progress and jax.process_index() == 0:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()))
        return row

    def _check_resume(self, train, shuffle) -> None:
        """Refuses to resume a run on other data or another order: that would silently
        train on different batches than the run it continues."""
        meta = self.resumed_from
        if meta is None:
            return
        now = {"examples": len(train), "seed": self.seed, "batch_size": self.batch_size,
               "shuffle": shuffle}
        changed = [f"{k}: checkpoint {meta.get(k)!r}, now {v!r}" for k, v in now.items()
                   if meta.get(k) != v]
        if changed:
            raise CheckpointMismatch(
                f"the checkpoint in {self.checkpointer.directory} was written by a run with "
                f"other data settings ({'; '.join(changed)}): resuming would train on "
                "different batches. Use the same settings, or start a new run (another "
                "name or directory, or resume=False)")

    def _meta(self, step, train, shuffle, metrics) -> dict:
        epoch, batch, epoch_done = self.position
        return {"step": step, "epoch": epoch, "batch": batch, "epoch_done": epoch_done,
                "examples": len(train), "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": shuffle, "metrics": metrics or {}, "config": self.config,
                "trainable": self.trainable,
                "run": self.run_meta, "time": time.time()}

    def _best_metrics(self, row) -> dict:
        metric = self.checkpoint_config.best_metric
        if row is None or not metric:
            return row or {}
        if metric not in row:
            raise ValueError(f"best_metric={metric!r} is not among the evaluation's metrics "
                             f"{sorted(k for k in row if k.startswith('eval_'))}: use one of these")
        return row

    def log(self, metrics: dict) -> dict:
        """Logs your own metrics (e.g. an RL return) at the current step.

        They reach MLflow like ``fit``'s rows when the Trainer runs inside ``redray.run``
        or ``redray.fit``: host 0 sends them (no collective; the other hosts' calls send
        nothing, so one loop on every host is fine). Returns the logged row.
        """
        self._require_init("log")
        row = {"step": self.step, **{k: float(v) for k, v in metrics.items()}}
        self._log([], row)
        return row

    def _log(self, history: list, row: dict) -> None:
        history.append(row)
        if self.on_log is not None:
            self.on_log(row)

    def _summarize(self, window, step, epoch, start) -> dict:
        fetched = jax.device_get(window)
        # Timed once the window's results are here: its steps run asynchronously, up to
        # InFlight's limit behind the loop, so the loop's own time misses most of them.
        seconds = time.perf_counter() - start
        row = {"step": step, "epoch": epoch}
        for k in fetched[0]:
            row[k] = float(np.mean([m[k] for m in fetched]))
        if self.learning_rate is not None:
            lr = self.learning_rate
            row["learning_rate"] = float(lr(step - 1) if callable(lr) else lr)
        row["steps_per_s"] = len(window) / max(seconds, 1e-9)
        row["examples_per_s"] = row["steps_per_s"] * self.batch_size
        row["step_time_s"] = seconds / len(window)
        if getattr(self, "_tokens", None):
            row["tokens_per_s"] = row["examples_per_s"] * self._tokens
        memory = _device_memory()
        if memory is not None:
            row["device_memory_bytes"] = memory
        return row

    def predictor(self, batch_size: int | None = None):
        """A Predictor that always uses this trainer's latest parameters (no copy).

        The same one for the same batch size: a loop that predicts every iteration
        compiles once, and its default ``rng`` keeps changing between calls.
        """
        from redray.engine.predictor import Predictor

        self._require_init("predictor")
        if self.pipeline.predict is None:
            raise PipelineError("this Trainer has no predict function: pass predict=... to Trainer")
        size = batch_size or self.eval_batch_size
        if size not in self._predictors:
            self._predictors[size] = Predictor._from_runtime(
                self.runtime, self.pipeline.collate, self.pipeline.predict,
                lambda: (self._whole_params(), self.state["extra"]), size, self.seed)
        return self._predictors[size]


def _tokens_per_example(batch) -> int:
    """Tokens in one example: the width of the batch's first 2-D integer array (e.g.
    ``input_ids``), or 0 when the batch has no tokens."""
    for key in sorted(batch):
        value = np.asarray(batch[key])
        if value.ndim == 2 and np.issubdtype(value.dtype, np.integer):
            return int(value.shape[1])
    return 0


def _device_memory() -> int | None:
    """Bytes in use on this process's first device, where the backend reports it."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has it
        return None
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None


def _loss_of(runtime, loss, frozen):
    """``(params, extra, batch, rng) -> (loss, (metrics, new extra))``: the user's loss on
    the model bound to the trained ``params`` (merged with the frozen ones, if any)."""
    def loss_of(params, extra, batch, rng):
        whole = params if frozen is None else merge_trainable(params, frozen)
        out, new_extra = runtime.apply(lambda m, b: loss(m, b, rng, True), whole, extra, rng,
                                       batch)
        value, metrics = split_loss_output(out)
        return value, (metrics, new_extra)

    return loss_of


def _user_loss_fn(loss_of, extra):
    """What a custom ``grad_fn`` gets: ``loss_fn(params, batch, rng) -> (loss, metrics)``."""
    def loss_fn(params, batch, rng):
        value, (metrics, _) = loss_of(params, extra, batch, rng)
        return value, metrics

    return loss_fn


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
