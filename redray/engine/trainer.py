"""The Trainer: one jitted, sharded, donated train step over all of a process's devices.

``fit`` is a loop over optimizer steps (``loop.training_steps``) whose events go to hooks
(``redray/engine/hooks.py``): the log window, the progress bar, evaluation and
checkpoints are hooks (``redray/engine/fit_hooks.py``), and so are the cluster's.
The program it runs (layout, jitted steps, the state a run starts from) is a
``TrainProgram`` (``redray/engine/program.py``), built in ``init``.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from redray import startup
from redray.checkpoint import CheckpointConfig, Checkpointer, CheckpointMismatch
from redray.engine.batches import collate_checked, each_batch, first_examples, to_global
from redray.engine.console import Console
from redray.engine.fit_hooks import Checkpoints, Evaluation, LogWindow, Recorder
from redray.engine.hooks import EpochEnd, Hook, Position, StepInfo, current_scope
from redray.engine.loop import TrainingData, tokens_per_example, training_steps
from redray.engine.plan_choice import PlanChoice
from redray.engine.nonfinite import (NonFiniteError, NonFiniteGuard, RolledBack, zero_flag,
                                     message as nonfinite_message)
from redray.engine.program import TrainProgram
from redray.engine.runtime import ModelRuntime
from redray.engine.schedule import follow_budget
from redray.engine import watchdog
from redray.engine.state import CHECKPOINT_ITEMS, TrainState
from redray.engine.steps import NONFINITE_POLICIES
from redray.functions import WEIGHT, UserFunctions, UserFunctionError
from redray.rngs import KeyStream, stream_key
from redray.sharding import Parallelism, placement
from redray.sharding.activations import AttentionKernels, attention_kernels
from redray.sharding.plan import Plan
from redray.planning.planner import pins
from redray.planning.memory import memory_text

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
      micro_batch_size: examples per device in one micro-batch: the global batch is
        cut into micro-batches that run one after the other (gradient accumulation)
        or, with pipeline stages (``stage_axis``), through the pipeline in one pass.
        Default: no accumulation; with stages, at least 4 micro-batches per stage
        (``parallelism.default_micro_batches``).
      stage_repeats: circular pipeline repeats (with ``stage_axis`` > 1): the layers cut
        into ``stage_axis x stage_repeats`` chunks, chunk ``c`` on stage ``c mod S``,
        so each micro-batch goes round the stages that many times. The bubble shrinks
        from ``S - 1`` of ``M + S - 1`` ticks to ``S - 1`` of ``M R + S - 1`` (ticks
        ``R`` times shorter); the hidden states cross between stages ``R`` times as
        often. 1 (default): GPipe's schedule. Micro-batches go round in groups of
        ``S``: make their count a multiple of the stage axis, or the rest are bubbles.
      pipeline_schedule: with ``stage_axis`` > 1, ``"gpipe"`` (the default, and under
        ``parallelism="auto"`` the planner's choice: the pipeline inside the model's
        forward, every micro-batch's activations kept until the backward pass) or
        ``"1f1b"``: each stage alternates one micro-batch's forward
        and an earlier one's backward and keeps at most ``2 stage_axis - 1``
        micro-batches' inputs whatever their count, recomputing a stage's forward in
        its backward (``redray/engine/one_f_one_b.py``). 1F1B cuts the loss at the model's
        stacked layers (one stack: no encoder-decoder), averages it over the
        micro-batches as accumulation does, and does not yet take circular repeats,
        ``trainable=`` or ``grad_fn=``.
      eval_batch_size: examples per evaluation step (default: ``batch_size``).
      parallelism: ``"auto"`` (the default when no mesh and no axis size is given):
        the planner chooses the axis sizes and the micro-batch at ``init`` from the
        model, the loss and the first batch (``redray/planning/live.py``), keeping
        the axis sizes and ``micro_batch_size`` given beside it; ``plan_ranking`` then
        holds every plan it weighed. Or a ``redray.Parallelism`` (axis sizes, rules,
        mesh in one value); or give a mesh or the axis sizes (and rules) instead, and
        that plan is used as it is (an axis not given takes its default).
      hardware: what ``"auto"`` plans on: a ``redray.planning.hardware.Hardware``, a
        preset name (``"h100"``, ``"h100+ethernet"``...), or None: the devices probed
        (``redray/planning/probe.py``; inside ``redray.fit`` kept per cluster in the
        storage folder).
      plan_timing: whether ``"auto"`` times the model's pass on the live devices
        (compiling and running it at two micro-batches, seconds on a small machine)
        and costs the plans on those timings rather than the hardware's rates. None
        (default): timed unless ``fit``'s run is predicted to take under
        ``redray.planning.live.TIMED_RUN_S`` (30 s), or ``init`` is called before
        ``fit``, where it is timed; True: always; False: never.
      mesh: a mesh from ``redray.make_mesh``; or give the axis sizes.
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
      trainable: a regex on parameter paths (as ``placement()`` shows them, ``re.search``):
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
      **axes: the mesh's axis sizes by keyword (ints, or "auto" for what the others
        leave; None: not given): ``data_axis`` (default "auto"), ``fsdp_axis`` and
        ``model_axis`` (default 1), one per axis of ``redray.sharding.AXES``. Giving
        any of them (without ``parallelism="auto"``) fixes the plan.
    """

    def __init__(self, model: Any, collate: Callable, loss: Callable,
                 optimizer: optax.GradientTransformation, predict: Callable | None = None, *,
                 batch_size: int, micro_batch_size: int | None = None,
                 eval_batch_size: int | None = None, parallelism: Parallelism | None = None,
                 mesh: Mesh | None = None, compute_dtype=None, rules=(),
                 learning_rate=None, seed: int = 0, log_every: int = 10, progress: bool = True,
                 prefetch: int = 2, checkpoint=None, config: dict | None = None,
                 trainable: str | None = None, grad_fn: Callable | None = None,
                 hooks: Sequence[Hook] = (), on_nonfinite: str = "stop", hardware=None,
                 plan_timing: bool | None = None,
                 stage_repeats: int = 1, pipeline_schedule: str | None = None, **axes):
        self.functions = UserFunctions(collate, loss, predict)
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use one of "
                             f"{', '.join(map(repr, NONFINITE_POLICIES))}")
        self.on_nonfinite = on_nonfinite
        self._guard: NonFiniteGuard | None = None
        self._schedule_meta: list | None = None  # a Schedule's segments, as checkpoints keep them
        if grad_fn is not None and not callable(grad_fn):
            raise TypeError(f"grad_fn must be a function (loss_fn, params, batch, rng) -> "
                            f"(loss, metrics, grads), got {grad_fn!r}")
        self.grad_fn, self.trainable = grad_fn, trainable
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation "
                            f"(e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._batch_size = batch_size  # the global batch asked for (a plan's geometry's)
        if plan_timing not in (None, True, False):
            raise ValueError(f"plan_timing={plan_timing!r}: use None (timed unless the run is "
                             "short), True or False")
        # the planner's choice under "auto" (None: the user gave the plan)
        self._choice: PlanChoice | None = None
        axes = {k: v for k, v in axes.items() if v is not None}  # None: not given
        if parallelism is None and mesh is None and not axes:
            parallelism = "auto"  # nothing of the plan given: the planner chooses it
        if parallelism == "auto":
            if mesh is not None:
                raise ValueError("give either parallelism='auto' or a mesh, not both: the "
                                 "planner builds the mesh")
            Parallelism.of(caller="Trainer", **axes)  # an unknown keyword fails as such
            self._choice = PlanChoice(pins(micro_batch_size=micro_batch_size,
                                           pipeline_schedule=pipeline_schedule, **axes),
                                      tuple(rules or ()), hardware, plan_timing, None)
            # what the user fixed of the plan; the rest is chosen at init
            plan = Plan(pipeline_schedule=pipeline_schedule or "gpipe",
                        stage_repeats=stage_repeats)
        else:
            built = Parallelism.resolve(parallelism, mesh, rules, axes, "Trainer")
            plan = Plan.of(built, built.geometry(batch_size, micro_batch_size),
                           pipeline_schedule=pipeline_schedule or "gpipe",
                           stage_repeats=stage_repeats)
        if pipeline_schedule == "1f1b" and (stage_repeats > 1 or grad_fn or trainable):
            given = "stage_repeats > 1" if stage_repeats > 1 else \
                "grad_fn" if grad_fn else "trainable"
            raise ValueError(f"pipeline_schedule='1f1b' does not take {given} yet: use "
                             "pipeline_schedule='gpipe' (the default)")
        self.eval_batch_size = eval_batch_size or batch_size
        # the plan, one value: the runtime holds it (``runtime.plan``)
        self.runtime = ModelRuntime(model, plan, compute_dtype, seed)
        self._learning_rate = learning_rate
        self.budget: int | None = None  # the run's total steps, as the last fit asked
        self.seed = seed
        self.log_every = max(1, int(log_every))
        self.progress = progress
        self.prefetch = prefetch
        self.state: TrainState | None = None
        self._compiled = False  # whether the training step ran once (compiled)
        self.program: TrainProgram | None = None
        # the attention kernels the step's model computes with (after init)
        self.attention: AttentionKernels | None = None
        self._checkpoint_config = CheckpointConfig.of(checkpoint)
        self._checkpointer: Checkpointer | None = None
        self.config = dict(config or {})
        self._position = Position()
        self._resumed_from: dict | None = None
        # Tokens in one example (the width of the batch's first 2-D integer array, e.g.
        # input_ids), learned from fit's first batch; 0: the batch has no tokens.
        self._tokens = 0
        self.hooks: list[Hook] = []
        for hook in hooks:
            self.add_hook(hook)
        self._fit_hooks: list[Hook] = []
        self._summarized = False
        self._predictors: dict = {}
        self._console = Console()  # process 0's messages and progress: this terminal
        scope = current_scope()
        if scope is not None:  # inside redray.run/redray.fit: the run's defaults and hooks
            adopted = scope.adopt(self, default_checkpoint=checkpoint is None)
            if adopted.checkpoint is not None:
                self._checkpoint_config = adopted.checkpoint
            self.config = {**adopted.config, **self.config}
            if adopted.console is not None:  # the run's driver shows them
                self._console = adopted.console
            if self._choice is not None:
                self._choice.probe_cache = adopted.probe_cache
            for hook in adopted.hooks:
                self.add_hook(hook)

    @property
    def plan(self) -> Plan:
        """The plan this Trainer runs, one frozen value (``redray.sharding.plan.Plan``:
        axes, batch geometry, pipeline, remat; ``.describe()`` in one line). Under
        "auto" its axes are chosen at ``init``; what each device then holds is
        ``placement()``."""
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

    @property
    def batch_size(self) -> int:
        """Examples per optimizer update (the global batch)."""
        return self._batch_size

    @property
    def plan_ranking(self):
        """Every plan the planner weighed (``redray.planning.planner.Ranking``), under
        "auto" once ``init`` chose one; None when the plan was given or kept."""
        return None if self._choice is None else self._choice.ranking

    # What hooks and the cluster layer read of the run: read-only (the Trainer and its
    # loop change them; tests/test_architecture.py checks that hooks read nothing else).
    learning_rate = property(lambda self: self._learning_rate,
                             doc="The schedule (or float) given as ``learning_rate=``, logged.")
    tokens_per_example = property(
        lambda self: self._tokens, doc="Tokens in one example (the width of the batch's first "
        "2-D integer array), learned from fit's first batch; 0: the batch has no tokens.")
    checkpoint_config = property(lambda self: self._checkpoint_config,
                                 doc="When and where checkpoints are saved (None: never).")
    checkpointer = property(lambda self: self._checkpointer,
                            doc="The checkpoints' writer and reader, after ``init`` (None "
                                "without checkpoints).")
    position = property(lambda self: self._position,
                        doc="Where training stands in the data (epoch, batch, epoch done).")
    console = property(lambda self: self._console, doc="Process 0's messages and progress.")

    @property
    def resumed_from(self):
        """The meta of the checkpoint this run resumed from (read-only), or None."""
        return None if self._resumed_from is None else MappingProxyType(self._resumed_from)

    @property
    def nonfinite_step(self) -> int:
        """The first step since the last check whose loss or gradient norm was not
        finite (0: none); read from the devices."""
        self._require_init("nonfinite_step")
        return int(jax.device_get(self.state.nonfinite_step))

    @property
    def saving_step(self) -> int | None:
        """The step whose checkpoint is being written, if one is."""
        return None if self._checkpointer is None else self._checkpointer.saving

    def wait_for_checkpoints(self) -> None:
        """Returns once every checkpoint started has been written."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def newest_checkpoint(self) -> str | None:
        """The newest complete checkpoint's path (a save in flight waited for), this run's
        or the one it resumed from; None if there is none."""
        if self._checkpointer is None:
            return None
        self._checkpointer.wait()
        saved = self._checkpointer.last_saved
        if saved is None and self._resumed_from is not None:
            saved = self._checkpointer.step_path(self._resumed_from["step"])
        return saved

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
        """Checks the user's functions on the first batch, derives specs and creates the
        state (restored from the newest checkpoint, if there is one).

        Called by ``fit`` and ``evaluate`` when needed; call it yourself to inspect
        ``placement()`` before training.
        """
        if self.state is not None:
            return
        self._init(examples)
        for hook in self.hooks:
            hook.on_init(self)

    def _init(self, examples: Sequence) -> None:
        if not len(examples):
            raise ValueError("init needs at least one example to learn the batch's shapes")
        with startup.phase("first_batch"):
            sample = collate_checked(self.functions.collate,
                                     first_examples(examples, self.batch_size))
        if self.parallelism is None:
            self._take_plan(sample)
        with startup.phase("build"), attention_kernels() as kernels:
            self.program = TrainProgram.build(
                self.runtime, self.functions, self.optimizer, sample,
                seed=self.seed, trainable=self.trainable, grad_fn=self.grad_fn,
                on_nonfinite=self.on_nonfinite)
        self.attention = kernels
        if kernels.why and self.progress and jax.process_index() == 0:
            self._console.say(f"attention: {kernels.describe()}")
        items = None
        if self._checkpoint_config is not None:
            with startup.phase("restore"):
                self._checkpointer = Checkpointer(self._checkpoint_config, CHECKPOINT_ITEMS)
                found = self._restore_latest() if self._checkpoint_config.resume else None
            if found is not None:
                items, meta = found
                self._resumed_from = meta
                self._position = Position(meta["epoch"], meta["batch"], meta["epoch_done"])
        with startup.phase("init"):
            self.state = self.program.initial_state(items)
        self._compiled = False
        if items is not None:
            meta = self._resumed_from
            path = self._checkpointer.step_path(meta["step"])
            if self.progress and jax.process_index() == 0:
                self._console.say(f"resumed from {path} (step {meta['step']}, epoch "
                                 f"{meta['epoch']}, batch {meta['batch']})")
            for hook in self.hooks:
                hook.on_restore(self, int(meta["step"]), path, meta)

    def _take_plan(self, sample: dict) -> None:
        """Under "auto": the plan of the checkpoint a run resumes on the same devices, or
        the planner's pick on this model, loss and batch."""
        choice = self._choice
        kept = choice.kept(self._checkpoint_config, self.batch_size)
        if kept is not None:
            best, context = kept, None
        else:
            best, context = choice.choose(self.runtime, self.functions, self.optimizer, sample,
                                          self.trainable, self.grad_fn, self.batch_size)
        self.runtime.use(choice.plan(best, self.batch_size, self.runtime.plan, context))
        if self.progress and jax.process_index() == 0:
            self._console.say(f"plan: {choice.meta['chosen']}, kept from the checkpoint this "
                              "run resumes (the same devices)" if kept is not None
                              else choice.ranking.why())

    def _restore_latest(self):
        """(items, meta) of the newest complete checkpoint, restored onto this plan's
        shardings, or None."""
        return self._checkpointer.restore_latest(self.program.layout.checkpoint_targets(),
                                                check=self._check_trainable,
                                                required=POSITION_META)

    def _check_trainable(self, meta: dict) -> None:
        if meta.get("trainable") != self.trainable:
            raise CheckpointMismatch(
                f"the checkpoint in {self._checkpointer.directory} trained "
                f"trainable={meta.get('trainable')!r}, this run trains "
                f"trainable={self.trainable!r}: its saved parameters do not fit. Use the same "
                "trainable, or start a new run (another name or directory, or resume=False)")

    def placement(self, memory: bool = False, device_gib: float | None = None) -> str:
        """What each device holds: every parameter's path, shape, spec and bytes per
        device (after ``init``).

        With ``memory=True`` (or ``device_gib``) it adds what one training step holds
        per device, by part, beside what XLA compiled for this backend
        (``Trainer.memory``), and with ``device_gib`` whether that fits."""
        self._require_init("placement")
        text = self.runtime.placement_text()
        if memory or device_gib is not None:
            text += "\n\n" + "\n".join(memory_text(self.memory(device_gib),
                                                     self.parallelism.shape))
        return text

    def memory(self, device_gib: float | None = None) -> dict:
        """What one training step holds per device (after ``init``), in bytes.

        ``parts``: parameters, optimizer state, gradients (one per trained parameter,
        sharded like it), compute-dtype copies, FSDP gather buffers (the largest
        layer, twice), activations: the residuals JAX saves for the backward pass of
        your loss on one device's micro-batch (traced, under the model's own remat),
        1/model for those split over ``model``, and where the plan has them, the expert
        exchange and the pipeline's parts: the planner's count, part for part
        (``redray.planning.memory.step_parts``). ``total`` is their sum; ``compiled``:
        XLA's own figures for the compiled step on this backend (``arguments``,
        ``temporaries``, ``outputs``, ``aliased``, ``peak`` = arguments + temporaries +
        outputs - aliased), which also hold XLA's fusion outputs and collectives'
        buffers. With ``device_gib``: ``fits`` (the larger of total and peak).
        """
        self._require_init("memory")
        from redray.engine.facts import RuntimeFacts

        batch = self.program.global_batch
        facts = RuntimeFacts(self.runtime.unplanned(), self.functions.loss, self.optimizer,
                             batch, self.trainable, tokens_per_example(batch))
        return self.program.memory(self.state, facts, device_gib)

    def describe(self) -> dict:
        """The run's shape: hosts, devices, mesh, the plan in one line (``layout``:
        ``Plan.describe``), parameter count, bytes per device, batch sizes, accumulation
        steps (or pipeline micro-batches), circular pipeline repeats where there are any
        (after ``init``)."""
        self._require_init("describe")
        rows = placement(self.runtime.abstract[0], self.runtime.specs[0], self.mesh)
        opt = sum(x.nbytes for x in jax.tree.leaves(self.state.opt_state)
                  if hasattr(x, "nbytes")) // max(self.parallelism.devices, 1)
        return {"hosts": jax.process_count(), "devices": self.parallelism.devices,
                "mesh": self.parallelism.shape,
                "parameters": int(sum(np.prod(r.shape) for r in rows)),
                "trainable_parameters": int(sum(np.prod(x.shape) for x in
                                                jax.tree.leaves(self.state.params))),
                "param_bytes_per_device": int(sum(r.bytes_per_device for r in rows)),
                "optimizer_bytes_per_device_approx": int(opt),
                "layout": self.runtime.plan.describe(),
                "batch_size": self.batch_size,
                "micro_batch_size": self.geometry.micro_batch_size,
                "accumulation_steps": self.geometry.accumulation,
                **({"stage_repeats": self.runtime.stage_repeats}
                   if self.runtime.stage_repeats > 1 else {}),
                **({"attention": self.attention.describe()}
                   if self.attention is not None and self.attention.why else {}),
                **({} if self.plan_ranking is None else {"plan": self._choice.facts()})}

    def _print_summary(self) -> None:
        d = self.describe()
        trained = "" if d["trainable_parameters"] == d["parameters"] else \
            f" ({d['trainable_parameters']:,} trained)"
        self._console.say(
            f"redray: {d['hosts']} host(s), {d['devices']} devices; plan {d['layout']}; "
            f"{d['parameters']:,} parameters{trained}, {d['param_bytes_per_device']:,} "
            f"parameter bytes per device")

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
        return self._step(self._place(batch))

    def _place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        mine = self.geometry.process_rows
        rows = next(iter(batch.values())).shape[0]
        if rows != mine.stop - mine.start:
            raise UserFunctionError(
                f"the batch has {rows} rows but this process feeds {mine.stop - mine.start} of "
                f"batch_size={self.batch_size}: collate must return one row per example")
        if self.attention is not None:
            self.attention.check(batch)  # a fused kernel's bounds (documents per row)
        return to_global(batch, self.parallelism.batch_sharding(), self.batch_size)

    def _step(self, placed: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self._require_init("train_step")
        if self._compiled:
            self.state, metrics = self.program.train_step()(self.state, placed)
        else:  # the first call traces and compiles the step, then dispatches it
            startup.RECORDER.enter("compile")
            start = time.time()
            self.state, metrics = self.program.train_step()(self.state, placed)
            startup.RECORDER.add("compile", start)
            with startup.phase("first_step"):
                jax.block_until_ready(metrics)
            startup.RECORDER.enter("steps")
            self._compiled = True
        watchdog.progress("a training step")
        return metrics

    # ---------------------------------------------------------------- loops
    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Mean loss and metrics over every example exactly once.

        Each batch's values are summed times its weight (the loss's ``weight`` metric,
        e.g. its real tokens; else its examples) and divided once by the total weight,
        so a token-level metric is the mean over every token, whatever the batches hold.
        Full batches run split over the devices; a final partial batch runs at its
        exact size (split if it divides, replicated otherwise), so no padding enters
        the mean. ``examples``: a list, or a row source (``len`` + ``take_rows``).
        """
        if not len(examples):
            raise ValueError("evaluate got no examples")
        self.init(examples)
        program, rng = self.program.eval_step(), stream_key(self.seed, KeyStream.EVAL)
        pending = each_batch(
            examples, self.eval_batch_size, self.parallelism, self.functions.collate,
            lambda batch, start: program(self.state.whole_params, self.state.extra, batch, rng),
            pad_last=False)
        totals: dict[str, float] = {}
        weight = 0.0
        for _, metrics in pending:
            metrics = jax.device_get(metrics)
            w = float(metrics.pop(WEIGHT))
            weight += w
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * w
        return {k: v / weight for k, v in totals.items()}

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
        ckpt = self._checkpoint_config
        if ckpt is not None and ckpt.best_metric and eval_data is None:
            raise ValueError(f"best_metric={ckpt.best_metric!r} needs eval_data: the best "
                             "checkpoint is chosen by the evaluation after each epoch")
        if self.state is None and self._choice is not None:  # the planner weighs its timing
            self._choice.planned_steps = run_steps(len(train) // self.batch_size, epochs,
                                                   max_steps)
        self.init(train)
        data = self.training_data(train, shuffle)
        data.check_resume(self._resumed_from, self._checkpointer and self._checkpointer.directory)
        per_epoch = data.steps_per_epoch()
        if not per_epoch:
            raise ValueError(f"{train!r} gives no full batch of {self.batch_size} examples per "
                             "epoch: lower batch_size or add data")
        self._set_budget(run_steps(per_epoch, epochs, max_steps))
        shown = self.progress and jax.process_index() == 0
        if shown and not self._summarized:
            self._print_summary()  # once: a custom loop may call fit many times
            self._summarized = True
        self._tokens = 0
        recorder = Recorder()
        evaluation = None if eval_data is None else Evaluation(
            eval_data, eval_metric, self._console if shown else None)
        # First: a non-finite step is caught before its window is logged or a save starts.
        self._guard = NonFiniteGuard(self.on_nonfinite, self.log_every, per_epoch)
        self._fit_hooks = [hook for hook in (
            self._guard, recorder, LogWindow(self.log_every),
            self._console.progress(self, self.budget) if shown else None, evaluation,
            None if ckpt is None else Checkpoints(self, data.settings())) if hook is not None]
        begun = time.time()
        try:
            first_epoch, _ = self._position.resume_point()
            if (eval_at_start and evaluation is not None and first_epoch < epochs
                    and (max_steps is None or self.step < max_steps)):
                evaluation.run(self, self.step, first_epoch)
            while True:
                steps = training_steps(
                    data, epochs, max_steps, position=self._position, done=self.step,
                    geometry=self.geometry, sharding=self.parallelism.batch_sharding(),
                    collate=self.functions.collate, step=self._step, depth=self.prefetch,
                    first_batch=self._learn_tokens)
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
            startup.RECORDER.fill("steps", begun)
        return recorder.rows

    def _learn_tokens(self, batch: dict) -> None:
        self._tokens = tokens_per_example(batch)

    def _dispatch(self, event) -> None:
        if isinstance(event, (StepInfo, EpochEnd)) and event.position is not None:
            self._position = event.position
        for hook in self._listening():
            if isinstance(event, StepInfo):
                hook.on_step(self, event)
            elif isinstance(event, EpochEnd):
                hook.on_epoch_end(self, event)
            else:
                hook.on_epoch_start(self, *event)

    def roll_back(self, bad_step: int, position: Position) -> int | None:
        """Restores the newest checkpoint's state, keeps counting steps from
        ``bad_step`` and continues after that step's batch (``position``). Returns the
        checkpoint's step, or None when there is no checkpoint to go back to."""
        if self._checkpointer is None:
            return None
        self._checkpointer.wait()
        found = self._restore_latest()
        if found is None:
            return None
        items, meta = found
        shardings = self.program.layout.shardings
        restored = self.program.from_checkpoint(items, self.state.frozen)
        step = jax.jit(lambda: jnp.asarray(bad_step, jnp.int32),
                       out_shardings=shardings.step)()
        self.state = restored.replace(step=step,
                                      nonfinite_step=zero_flag(shardings.nonfinite_step))
        self._position = Position(position.epoch, position.batch, False)
        self.record({"step": bad_step, "rolled_back_to_step": int(meta["step"])})
        return int(meta["step"])

    def _set_budget(self, budget: int) -> None:
        """Gives the learning rate the run's budget (``schedule.follow_budget``)."""
        resumed = self._resumed_from or {}
        before = self.budget if self.budget is not None else resumed.get("budget")
        self.budget = budget
        saved = self._schedule_meta if self._schedule_meta is not None else \
            resumed.get("schedule")  # this Trainer's earlier fit, else its checkpoint's
        changed, meta = follow_budget(self._learning_rate, budget, self.step, before, saved)
        if changed:
            self.program.retrace()  # the schedule is traced into the step
        if meta is not None:
            self._schedule_meta = meta

    def training_data(self, train: Sequence, shuffle: bool = True) -> TrainingData:
        """``train`` as this run reads it (its order, batch size and streams; a resumed
        run's streams are its checkpoint's): what ``fit`` trains on."""
        return TrainingData.of(train, self.seed, shuffle, self.geometry, self._resumed_from)

    def save_checkpoint(self, data_settings: dict, metrics: dict | None = None,
                        position: Position | None = None) -> None:
        """Starts saving the state at the current step and ``position`` (default: where
        training stands; ``fit``'s ``Checkpoints`` hook calls it); hooks hear
        ``on_checkpoint`` once complete."""
        if self._guard is not None:
            self._guard.check(self)  # never save a state past a non-finite step
        position = position or self._position
        meta = {"step": self.step, "epoch": position.epoch, "batch": position.batch,
                "epoch_done": position.epoch_done, **data_settings, "metrics": metrics or {},
                "config": self.config, "trainable": self.trainable, "run": self._run_meta(),
                "budget": self.budget, "schedule": self._schedule_meta,
                "plan": self._choice and self._choice.meta, "time": time.time()}

        def committed(step, path, meta):
            for hook in self._listening():
                hook.on_checkpoint(self, step, path, meta)

        self._checkpointer.save(self.program.checkpoint_items(self.state), meta,
                               on_commit=committed)

    def _run_meta(self) -> dict:
        """A checkpoint's ``run``: what the checkpoint resumed from kept there, updated
        by every hook's ``run_meta``."""
        out = dict((self._resumed_from or {}).get("run", {}))
        for hook in self._listening():
            out.update(hook.run_meta(self))
        return out

    def log(self, metrics: dict) -> dict:
        """Logs your own metrics (e.g. an RL return) at the current step.

        They reach MLflow like ``fit``'s rows when the Trainer runs inside ``redray.run``
        or ``redray.fit``: host 0 sends them (no collective; the other hosts' calls send
        nothing, so one loop on every host is fine). Returns the logged row.
        """
        self._require_init("log")
        bad = self.nonfinite_step
        if bad and self.on_nonfinite != "skip":  # a loop of train_step calls, outside fit
            raise NonFiniteError(nonfinite_message(self, bad, None, None))
        row = {"step": self.step, **{k: float(v) for k, v in metrics.items()}}
        self.record(row)
        return row

    def record(self, row: dict) -> None:
        """Sends a logged row to every hook's ``on_log`` (what ``fit``'s log windows and
        evaluations do; ``log`` checks and converts your metrics first)."""
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


def run_steps(per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """The optimizer steps ``fit`` runs in all: ``epochs`` of ``per_epoch``, at most
    ``max_steps``."""
    return per_epoch * epochs if max_steps is None else min(max_steps, per_epoch * epochs)
