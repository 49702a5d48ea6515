"""The Trainer: one jitted, sharded, donated train step over all of a process's devices.

``fit`` is a loop over optimizer steps (``loop.training_steps``) whose events go to hooks
(``redray/engine/hooks.py``): the log window, the progress bar, evaluation and
checkpoints are hooks (``redray/engine/fit_hooks.py``), and so are the cluster's.
The program it runs (layout, jitted steps, the state a run starts from) is a
``TrainProgram`` (``redray/engine/program.py``), built in ``init``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from redray import startup
from redray.checkpoint import CheckpointConfig
from redray.engine import fitting, report, watchdog
from redray.engine.batches import collate_checked, first_examples, this_process_rows
from redray.engine.console import Console
from redray.engine.fitting import Fit, check_arguments, run_steps, shown
from redray.engine.hooks import Adoption, Hook, Hooks, Position, Progress, current_scope
from redray.engine.loop import TrainingData
from redray.engine.nonfinite import NonFiniteError, message as nonfinite_message
from redray.engine.plan_choice import asked_plan
from redray.engine.predictor import TrainerPredictors
from redray.engine.profile import Profile
from redray.engine.program import TrainProgram
from redray.engine.run_checkpoints import RunCheckpoints
from redray.engine.run_view import RunView
from redray.engine.runtime import ModelRuntime
from redray.engine.schedule import RunBudget
from redray.engine.settings import (DataSettings, PlanSettings, ReportSettings, StepSettings,
                                    from_flat)
from redray.engine.state import TrainState
from redray.engine.steps import check_step_arguments
from redray.functions import UserFunctions
from redray.sharding.tracing import AttentionKernels, attention_kernels
from redray.sharding.plan import Plan


class Trainer:
    """Trains a model with the user's ``collate`` and ``loss`` on every local device.

    Parameters are created sharded; a step is one jitted program with donated state,
    accumulating micro-batches inside it; learning-rate schedules count optimizer
    updates. The guides say more of each argument: docs/parallelism.md,
    docs/custom-loops.md (``grad_fn``, ``trainable``, hooks), docs/fault-tolerance.md.

    Args:
      model: a function building a ``flax.nnx.Module`` (it may take an ``nnx.Rngs``);
        a built ``nnx.Module`` to start from its weights (e.g. ``from_pretrained``;
        copied onto the derived shardings); or a ``redray.LinenModel``.
      collate: list of examples -> dict of numpy arrays.
      loss: (model, batch, rng, train) -> scalar or (scalar, dict of metrics).
      optimizer: an ``optax.GradientTransformation``.
      predict: optional (model, batch, rng) -> batch-major pytree.
      batch_size: examples per optimizer update (the global batch).
      plan: a ``redray.PlanSettings``: how the plan is chosen or given; or what its
        ``plan`` takes alone ("auto", the default; a ``redray.Plan``, its JSON or a file
        of it; a ``redray.Parallelism``). ``plan_ranking`` holds what "auto" weighed.
      step: a ``redray.StepSettings``: compute dtype, what is trained, a custom
        gradient, what a NaN does, the learning rate (logged).
      data: a ``redray.DataSettings``: the evaluation batch, batches prefetched.
      report: a ``redray.ReportSettings``: the log window, the progress, a profile.
      checkpoint: a folder (or URI), or a ``redray.CheckpointConfig``: save the full
        state there and, by default, resume from the last complete checkpoint there.
        False: none. None (default): none, except inside ``redray.run``, where the
        first Trainer made uses the run's checkpoint folder.
      hooks: ``redray.Hook`` objects run beside training (inside ``redray.run`` the
        cluster adds its own, MLflow's and Ray Train's).
      config: the run's settings (JSON-able) stored in every checkpoint.
      seed: seeds initialization, data order and the ``rng`` given to ``loss``.

    ``Trainer.of`` takes the same as flat keywords (``model_axis=2, log_every=1``), as
    ``redray.fit`` does (``redray.engine.settings.FLAT``).
    """

    def __init__(self, model: Any, collate: Callable, loss: Callable,
                 optimizer: optax.GradientTransformation, predict: Callable | None = None, *,
                 batch_size: int, plan=None, step: StepSettings | None = None,
                 data: DataSettings | None = None, report: ReportSettings | None = None,
                 checkpoint=None, hooks: Sequence[Hook] = (), config: dict | None = None,
                 seed: int = 0):
        self.functions = UserFunctions(collate, loss, predict)
        plan, step = PlanSettings.of(plan), step or StepSettings()
        data, report = data or DataSettings(), report or ReportSettings()
        check_step_arguments(optimizer, step.grad_fn, step.on_nonfinite)
        self.on_nonfinite, self.grad_fn, self.trainable = (step.on_nonfinite, step.grad_fn,
                                                           step.trainable)
        self.optimizer = optimizer
        self._batch_size = batch_size  # the global batch asked for (a plan's geometry's)
        # the plan asked for, and the planner's choice under "auto" (None: the plan given)
        asked, self._choice = asked_plan(plan, batch_size, step.grad_fn, step.trainable)
        self.eval_batch_size = data.eval_batch_size or batch_size
        # the plan, one value: the runtime holds it (``runtime.plan``)
        self.runtime = ModelRuntime(model, asked, step.compute_dtype, seed)
        asked_checkpoint = CheckpointConfig.of(checkpoint)
        # inside redray.run/redray.fit: the run's checkpoints, settings, hooks and console
        scope = current_scope()
        adopted = Adoption() if scope is None else scope.adopt(self, checkpoint is None)
        if self._choice is not None:
            self._choice.probe_cache = adopted.probe_cache
        self._budget = RunBudget(step.learning_rate)
        self.seed, self.log_every = seed, max(1, int(report.log_every))
        self.progress, self.prefetch = report.progress, data.prefetch
        self.state: TrainState | None = None
        self.program: TrainProgram | None = None
        # the attention kernels the step's model computes with (after init)
        self.attention: AttentionKernels | None = None
        self._checkpoints = RunCheckpoints(
            asked_checkpoint if adopted.checkpoint is None else adopted.checkpoint,
            step.trainable)
        self.config = {**adopted.config, **(config or {})}
        self._progress = Progress()
        self._hooks = Hooks(RunView(self))  # each event gets the run, read-only
        self._profile = Profile.of(report.profile, report.profile_dir, adopted,
                                   lambda t: self._console.say(t))
        for hook in (*filter(None, [self._profile]), *hooks, *adopted.hooks):
            self.add_hook(hook)
        self._fit: Fit | None = None  # the fit call under way
        self._summarized = False
        self._predictors = TrainerPredictors(
            self.runtime, self.functions, lambda: (self.state.whole_params, self.state.extra),
            self.eval_batch_size, seed)
        # process 0's messages and progress: this terminal, or the run's driver
        self._console = Console() if adopted.console is None else adopted.console

    @classmethod
    def of(cls, model: Any, collate: Callable, loss: Callable,
           optimizer: optax.GradientTransformation, predict: Callable | None = None, *,
           batch_size: int, **flat) -> "Trainer":
        """A Trainer from flat keywords (``model_axis=2, micro_batch_size=4,
        log_every=1``, as ``redray.fit`` takes them): each names a field of the settings
        (``redray.engine.settings.FLAT``) or an axis size."""
        return cls(model, collate, loss, optimizer, predict, batch_size=batch_size,
                   **from_flat(flat, "Trainer"))

    @property
    def plan(self) -> Plan:
        """The plan this Trainer runs, one frozen value (a ``redray.Plan``); under
        "auto", chosen at ``init``."""
        return self.runtime.plan

    # the plan's parts, read-only
    parallelism = property(lambda self: self.runtime.plan.parallelism,
                           doc="The plan's axis sizes, rules and mesh (None under \"auto\" "
                               "before ``init``).")
    mesh = property(lambda self: self.runtime.plan.mesh, doc="The plan's device mesh.")
    geometry = property(lambda self: self.runtime.plan.geometry,
                        doc="The plan's batch geometry (global batch, micro-batch, "
                            "accumulation, this process's rows); None under \"auto\" before "
                            "``init``.")
    batch_size = property(lambda self: self._batch_size,
                          doc="Examples per optimizer update (the global batch).")
    plan_ranking = property(
        lambda self: None if self._choice is None else self._choice.ranking,
        doc="Every plan the planner weighed (``redray.planning.planner.Ranking``), under "
            "\"auto\" once ``init`` chose one; None when the plan was given or kept.")

    # Read-only (the Trainer and its loop change them). Hooks read the run through its
    # view (``RunView``), which reads these and a few of the Trainer's parts.
    learning_rate = property(lambda self: self._budget.learning_rate,
                             doc="The schedule (or float) given as ``learning_rate=``, logged.")
    checkpoint_config = property(lambda self: self._checkpoints.config,
                                 doc="When and where checkpoints are saved (None: never).")
    checkpointer = property(lambda self: self._checkpoints.writer,
                            doc="The checkpoints' writer and reader, after ``init`` (None "
                                "without checkpoints).")
    hooks = property(lambda self: list(self._hooks.own),
                     doc="The hooks added to this Trainer (``add_hook``), in order.")
    position = property(lambda self: self._progress.position,
                        doc="Where training stands in the data (epoch, batch, epoch done).")
    resumed_from = property(lambda self: self._checkpoints.resumed(),
                            doc="The meta of the checkpoint this run resumed from "
                                "(read-only), or None.")

    @property
    def nonfinite_step(self) -> int:
        """The first step since the last check whose loss or gradient norm was not
        finite (0: none); read from the devices."""
        self._require_init("nonfinite_step")
        return int(jax.device_get(self.state.nonfinite_step))

    def add_hook(self, hook: Hook) -> None:
        """Runs ``hook`` beside training from now on (see ``redray.Hook``)."""
        self._hooks.add(hook)

    def _say(self, text: str) -> None:
        if shown(self):
            self._console.say(text)

    # ---------------------------------------------------------------- set-up
    def init(self, examples: Sequence) -> None:
        """Checks the user's functions on the first batch, derives specs and creates the
        state (restored from the newest checkpoint, if there is one). ``fit`` and
        ``evaluate`` call it; call it yourself to see ``placement()`` before training."""
        if self.state is not None:
            return
        self._init(examples)
        self._hooks.send("init")

    def _init(self, examples: Sequence) -> None:
        if not len(examples):
            raise ValueError("init needs at least one example to learn the batch's shapes")
        with startup.phase("first_batch"):
            sample = collate_checked(self.functions.collate,
                                     first_examples(examples, self.batch_size))
        if self.parallelism is None:  # "auto": the kept plan of a resumed run, or the pick
            plan, why = self._choice.pick(self.runtime, self.functions, self.optimizer, sample,
                                          self.trainable, self.grad_fn, self.batch_size,
                                          self.checkpoint_config)
            self.runtime.use(plan)
            self._say(why)
        with startup.phase("build"), attention_kernels() as kernels:
            self.program = TrainProgram.build(
                self.runtime, self.functions, self.optimizer, sample,
                seed=self.seed, trainable=self.trainable, grad_fn=self.grad_fn,
                on_nonfinite=self.on_nonfinite)
        self.attention = kernels
        if kernels.why:
            self._say(f"attention: {kernels.describe()}")
        with startup.phase("restore"):
            items = self._checkpoints.open(self.program.checkpoint_targets())
        with startup.phase("init"):
            self.state = self.program.initial_state(items)
        if items is not None:
            meta, path = self._checkpoints.resumed_from, self._checkpoints.resumed_path()
            self._progress.position = Position(meta["epoch"], meta["batch"], meta["epoch_done"])
            self._say(f"resumed from {path} (step {meta['step']}, epoch {meta['epoch']}, "
                      f"batch {meta['batch']})")
            self._hooks.send("restore", int(meta["step"]), path, meta)

    def placement(self, memory: bool = False, device_gib: float | None = None) -> str:
        """What each device holds: every parameter's path, shape, spec and bytes per
        device (after ``init``); with ``memory=True`` (or ``device_gib``) what one step
        holds by part beside XLA's figures (``memory``), and whether it fits."""
        self._require_init("placement")
        return report.placement_text(self, memory, device_gib)

    def memory(self, device_gib: float | None = None) -> dict:
        """What one training step holds per device (after ``init``), in bytes.

        ``parts``: the planner's memory model, part for part
        (``redray.planning.memory.step_parts``: parameters, optimizer state, gradients,
        compute-dtype copies, FSDP gather buffers, the expert exchange, the pipeline's
        parts), its activations traced from your loss; ``total`` their sum.
        ``compiled``: XLA's figures for the compiled step on this backend (``arguments``,
        ``temporaries``, ``outputs``, ``aliased``, ``peak``). With ``device_gib``:
        ``fits`` (the larger of total and peak)."""
        self._require_init("memory")
        return report.memory(self, device_gib)

    def describe(self) -> dict:
        """The run's shape (after ``init``): hosts, devices, mesh, the plan in one line
        (``layout``) and written out (``plan``, for ``plan=``), parameters, bytes per
        device, batch sizes, accumulation steps (or pipeline micro-batches), circular
        repeats; under "auto" the planner's choice and its grounds (``planner``)."""
        self._require_init("describe")
        return report.describe(self, None if self.plan_ranking is None else self._choice.facts())

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
    def compiled_step(self):
        """The training step as XLA compiled it for this mesh and batch (after ``init``):
        ``.as_text()`` shows its collectives, ``.memory_analysis()`` its bytes per
        device, ``.cost_analysis()`` its FLOPs. The same program ``fit`` runs."""
        self._require_init("compiled_step")
        return self.program.compiled(self.state)

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """One optimizer update; ``batch`` is this process's rows of the global batch
        (all of it on one host). Metrics stay on the device."""
        return self._step(this_process_rows(batch, self.geometry, self.batch_size,
                                            self.parallelism.batch_sharding(), self.attention))

    def _step(self, placed: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self._require_init("train_step")
        self.state, metrics = self.program.run(self.state, placed)
        watchdog.progress("a training step")
        return metrics

    # ---------------------------------------------------------------- loops
    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Mean loss and metrics over every example exactly once (a list, or a row
        source: ``len`` + ``take_rows``), each weighted by the loss's ``weight`` metric
        (e.g. its real tokens; else one per example): a token-level metric is the mean
        over every token. No padding enters the mean (``fitting.evaluate``)."""
        if not len(examples):
            raise ValueError("evaluate got no examples")
        self.init(examples)
        return fitting.evaluate(self, examples)

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
        check_arguments(self, train, eval_data, eval_metric)
        if self.state is None and self._choice is not None:  # the planner weighs its timing
            self._choice.planned_steps = run_steps(len(train) // self.batch_size, epochs,
                                                   max_steps)
        self.init(train)
        # its order, batch size and streams (a resumed run's: its checkpoint's)
        data = TrainingData.of(train, self.seed, shuffle, self.geometry,
                               self._checkpoints.resumed_from)
        data.check_resume(self._checkpoints.resumed_from, self._checkpoints.directory)
        per_epoch = data.steps_per_epoch()
        if self._budget.set(run_steps(per_epoch, epochs, max_steps), self.step,
                            self._checkpoints.resumed_from):
            self.program.retrace()  # the learning rate's schedule is traced into the step
        if not self._summarized:  # once: a custom loop may call fit often
            self._say(report.summary(self.describe()))
            self._summarized = True
        self._fit = Fit(self, self._hooks, self._progress, self._step, data, per_epoch,
                        eval_data, eval_metric, shown(self))
        try:
            return self._fit.run(epochs, max_steps, eval_at_start)
        finally:
            self._fit = None
            if self._profile is not None:
                self._profile.close()

    def roll_back(self, bad_step: int, position: Position) -> int | None:
        """Restores the newest checkpoint's state, keeps counting steps from
        ``bad_step`` and continues after that step's batch (``position``). Returns the
        checkpoint's step, or None when there is no checkpoint to go back to."""
        found = self._checkpoints.restore_newest(self.program.checkpoint_targets())
        if found is None:
            return None
        items, meta = found
        self.state = self.program.rolled_back(items, self.state, bad_step)
        self._progress.position = Position(position.epoch, position.batch, False)
        self.record({"step": bad_step, "rolled_back_to_step": int(meta["step"])})
        return int(meta["step"])

    def save_checkpoint(self, data_settings: dict, metrics: dict | None = None,
                        position: Position | None = None) -> None:
        """Starts saving the state at the current step and ``position`` (default: where
        training stands; ``fit``'s ``Checkpoints`` hook calls it); hooks hear
        ``on_checkpoint`` once complete."""
        if self._fit is not None:
            self._fit.guard.check(self._hooks.run)  # never save a state past a bad step
        self._checkpoints.save(
            self.program.checkpoint_items(self.state), self.step, position or self.position,
            {**data_settings, "metrics": metrics or {}, "config": self.config,
             "run": self._hooks.run_meta(self._checkpoints.kept_run()),
             "budget": self._budget.steps, "lr_segments": self._budget.segments,
             "plan": self.plan.to_dict(), "plan_choice": self._choice and self._choice.meta},
            lambda *done: self._hooks.send("checkpoint", *done),
            stacked=self.program.runtime.stacked_arrays)

    def log(self, metrics: dict) -> dict:
        """Logs your own metrics (e.g. an RL return) at the current step; returns the row.
        Inside ``redray.run`` or ``redray.fit`` they reach MLflow like ``fit``'s rows: host
        0 sends them (no collective: one loop on every host is fine)."""
        self._require_init("log")
        bad = self.nonfinite_step
        if bad and self.on_nonfinite != "skip":  # a loop of train_step calls, outside fit
            raise NonFiniteError(nonfinite_message(self._hooks.run, bad, None, None))
        row = {"step": self.step, **{k: float(v) for k, v in metrics.items()}}
        self.record(row)
        return row

    def record(self, row: dict) -> None:
        """Sends a logged row to every hook's ``on_log`` (what ``fit``'s log windows and
        evaluations do; ``log`` checks and converts your metrics first)."""
        self._hooks.send("log", row)

    def predictor(self, batch_size: int | None = None):
        """A Predictor that always uses this trainer's latest parameters (no copy), the
        same one for the same batch size (default: ``eval_batch_size``): a loop that
        predicts every iteration compiles once."""
        self._require_init("predictor")
        return self._predictors.get(batch_size)

