"""redray: distributed training and inference of JAX models in three functions.

The user writes::

    def collate(examples):               # list of raw examples -> dict of numpy arrays
    def loss(model, batch, rng, train):  # -> scalar, or (scalar, dict of metrics)
    def predict(model, batch, rng):      # -> per-example outputs (batch-major pytree)

and redray does the rest. Public API:

* ``Trainer(model, collate, loss, optimizer, predict=None, batch_size=..., plan=...,
  step=..., data=..., report=..., checkpoint=..., hooks=..., config=..., seed=...)``, its
  settings ``PlanSettings``, ``StepSettings``, ``DataSettings``, ``ReportSettings``; or
  ``Trainer.of(..., model_axis=..., micro_batch_size=..., log_every=...)`` from the
  same as flat keywords, as ``fit`` takes them: ``init``, ``fit``,
  ``evaluate``, ``train_step``, ``log``, ``plan``, ``predictor``, ``model``, ``step``,
  ``add_hook``.
* ``Schedule(peak, warmup=..., decay=...)``: a learning rate over the run's budget, which
  continues smoothly when a resumed run's budget grows.
* ``Hook``: code run beside training (``on_step``, ``on_log``, ``on_checkpoint``, ...).
* ``Predictor(model, collate, predict, params=..., batch_size=...)``: ``predict``.
* ``fit(model, collate, loss, optimizer, train_data=..., hosts=..., devices_per_host=...)``:
  the same engine on every host of a Ray cluster (one worker per host).
* ``ClusterConfig(hosts=..., name=..., storage_path=..., ...)``: the cluster side of a
  run, given to ``fit``/``run`` as ``cluster=`` or as keywords.
* ``add_cluster_args(parser, name=...)`` / ``cluster_options(args)``: a script's
  ``--hosts --devices-per-host --gpu --storage --name`` flags, as a ``ClusterConfig``;
  ``result.summary()``: where a run's checkpoint and MLflow store are.
* ``run(fn, *args, hosts=..., ...)``: your own loop (e.g. reinforcement learning) on
  every host; Trainers made inside are tracked, checkpointed and resumed like ``fit``'s.
* ``CheckpointConfig(directory, save_every=..., keep=..., best_metric=...)``: when and
  where the state is saved; runs resume from it. ``load_params(run, model)`` /
  ``load_model(run, model)``: a trained checkpoint's weights in one call.
* ``LinenModel(module, *example_inputs)``: use a Linen module as ``model``.
* ``Stream(paths, transform=..., shuffle_buffer=...)``: parquet or JSON-lines files
  (local, ``s3://``, ``gs://``...) streamed through Ray Data as training, evaluation or
  prediction data, nothing materialized, resumable at any step.
* ``Parallelism.of(data_axis=..., fsdp_axis=..., model_axis=..., rules=...)``: how a job
  is split over devices (the mesh axes, the batch geometry, the spec passes) in one
  value, given to Predictor or ``from_pretrained`` as ``parallelism=``.
* ``Plan``: the whole plan a Trainer runs (axes, rules, batch cut, pipeline, remat), one
  frozen value that writes itself out (``to_json``) and is given back as ``plan=``
  (``Plan.from_json``, or ``redray plan --json``'s output).
* ``make_mesh(model_axis=..., devices=...)``: the device mesh (an axis keyword each).
* ``derive_specs``, ``placement``, ``format_placement``: automatic sharding of any
  parameter tree, and what each device then holds (no allocation).
* ``UserFunctions``: the three functions, checked; ``UserFunctionError``: what a user
  function returned that cannot be used, and the fix.
* ``NonFiniteError``: a step's loss or gradient norm was NaN/inf (``on_nonfinite="stop"``).
* ``evaluate_tasks(tasks, run=... | model=...)``: lm-evaluation-harness tasks on a
  trained run or a Hugging Face folder, on a plan (``redray eval``).

Beside them, ``redray.models`` (model families, Hugging Face import/export, ``generate``)
and ``redray.post_training`` (``Sampler`` with continuous batching; the SFT, DPO and GRPO
losses).
"""

from redray import verbosity  # noqa: F401 - first: it quiets transformers before its import
from redray.lazy import exports
from redray.version import __version__  # noqa: F401 - public

# Each name is imported from its module when first used: ``import redray`` itself
# imports no JAX, Ray or MLflow, so a process that needs one part (the run's MLflow
# tracker, its results actor) loads only that part, and a script starts at once.
__all__, __getattr__, __dir__ = exports(__name__, {
    "redray.checkpoint": ["CheckpointConfig", "CheckpointMismatch"],
    "redray.cluster": ["ClusterConfig", "FitResult", "RunResult", "add_cluster_args",
                       "cluster_options", "fit", "run"],
    "redray.data": ["Stream"],
    "redray.evaluation": ["evaluate_tasks"],
    "redray.engine": ["DataSettings", "Hook", "LinenModel", "NonFiniteError", "PlanSettings",
                      "Predictor", "ReportSettings", "Schedule", "StepSettings", "Trainer",
                      "load_model", "load_params"],
    "redray.functions": ["UserFunctions", "UserFunctionError"],
    "redray.sharding": ["Parallelism", "Plan", "derive_specs", "format_placement", "make_mesh",
                        "placement"],
}, extra=["__version__"])
