"""``redray.fit`` and ``redray.run``: work on every host of a Ray cluster, one worker per host."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Sequence



@dataclasses.dataclass(kw_only=True)
class RunResult:
    """What ``redray.run`` returns to the driver (``redray.fit``'s ``FitResult`` too).

    Attributes:
      value: what the function returned on host 0 (``redray.run``).
      name, storage_path: the Ray Train run.
      seconds: wall-clock time of the run.
      resumed_from_step: the checkpoint step the (last) worker group started from, or
        None for a run that started fresh (of the run's main Trainer: the first one
        made with the default checkpoint).
      checkpoint: the newest checkpoint written (its folder), or None.
      tracking_uri, mlflow_run_id: where the run is tracked (None without tracking).
    """
    value: Any = None
    name: str
    storage_path: str
    seconds: float
    resumed_from_step: int | None = None
    checkpoint: str | None = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None

    def summary(self) -> str:
        """Where the run's outputs are (checkpoint, MLflow store, the UI command) and
        how to continue it, in a few lines for the end of a script."""
        from redray.tracking import ui_command

        lines = [f"checkpoint:    {self.checkpoint or 'none'}"]
        if self.tracking_uri:
            lines += [f"MLflow store:  {self.tracking_uri} (run {self.mlflow_run_id})",
                      f"MLflow UI:     {ui_command(self.tracking_uri)}"]
        lines.append(f"resume / more: the same command (run {self.name!r} in "
                     f"{self.storage_path}) resumes; raise its budget (steps, epochs, "
                     "iterations) to train on")
        return "\n".join(lines)


@dataclasses.dataclass(kw_only=True)
class FitResult(RunResult):
    """What ``redray.fit`` returns: a ``RunResult`` plus

    Attributes:
      history: the logged rows (as ``Trainer.fit`` returns them, from host 0).
      predictions: one output per ``predict_data`` example, in order (or None).
    """
    history: list
    predictions: list | None = None

    def summary(self) -> str:
        if self.history:
            return super().summary()
        return (f"run {self.name!r} was already complete at step {self.resumed_from_step}; "
                "nothing to train.\n" + super().summary())


CLIENT_ATTEMPTS = 4


class HostError(RuntimeError):
    """User code failed on a host; the message holds that host's traceback."""


def _results_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Results:
        def __init__(self):
            self.value, self.failures = None, []

        def put(self, value):
            self.value = value

        def fail(self, rank, text):
            self.failures.append((rank, text))

        def get(self):
            return self.value, self.failures

    return Results.remote()


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to ``address`` (or ``RAY_ADDRESS``), else starts a local Ray cluster.

    A ``ray://host:10001`` address connects through Ray Client (e.g. from a laptop).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith("ray://"):
        # The client server starts a process per client; on a busy head that can outlast
        # Ray Client's own few quick retries.
        for attempt in range(CLIENT_ATTEMPTS):
            try:
                ray.init(address=address, log_to_driver=True)
                return
            except ConnectionError as error:
                if attempt == CLIENT_ATTEMPTS - 1:
                    raise ConnectionError(
                        f"cannot reach the Ray client server at {address} ({error}): check that "
                        "the cluster is up and its client port (default 10001) is reachable"
                    ) from None
                time.sleep(5)
    elif address:
        ray.init(address=address, log_to_driver=True)
    else:
        # With the dashboard: Ray Train's placement-group cleaner asks its state API
        # whether the controller lives, and warns every second when it cannot.
        ray.init(num_cpus=num_cpus, include_dashboard=True, log_to_driver=True)


def _installed(path: str) -> bool:
    """Whether ``path`` belongs to an installed package or the Python installation."""
    return ("site-packages" in path or "dist-packages" in path
            or path.startswith((sys.base_prefix, sys.prefix)))


def _local_paths() -> str:
    """The driver's own import paths (not site-packages), for workers on this machine."""
    keep = [p for p in sys.path if p and os.path.isdir(p) and not _installed(os.path.abspath(p))]
    current = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dict.fromkeys(keep + ([current] if current else [])))


def _pickle_user_code_by_value() -> None:
    """Ships the user's own modules (not installed packages) with the pipeline.

    Ray's controller and workers unpickle the pipeline; a function from a module only
    the driver can import (a script's helper module, a test file) travels by value.
    """
    from ray import cloudpickle  # Ray serializes with its own vendored copy

    roots = [os.path.abspath(p) for p in _local_paths().split(os.pathsep) if p]
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or name.split(".")[0] == "redray":
            continue
        path = os.path.abspath(path)
        if (_installed(path) or path.startswith(package + os.sep)
                or not any(path.startswith(r + os.sep) for r in roots)):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # not importable by name: already pickled by value
            pass


def run(fn: Callable, *args, hosts: int = 1, devices_per_host: int | None = None,
        use_gpu: bool = False, use_tpu: bool = False, address: str | None = None,
        name: str | None = None, storage_path: str | None = None, max_failures: int = 0,
        checkpoint=None, resume: bool = True, tracking_uri: str | None = None,
        experiment: str = "redray", tracking: bool = True, **kwargs) -> RunResult:
    """Runs ``fn(*args, **kwargs)`` on every host of a Ray cluster, for loops of your own.

    Every host joins one ``jax.distributed`` runtime first, so a ``redray.Trainer`` made
    inside ``fn`` spans all hosts' devices, exactly as in ``redray.fit``; it is wired to
    the run: its metrics (and ``Trainer.log``) reach MLflow once, and the first Trainer
    made with the default ``checkpoint`` saves into the run's checkpoint folder and
    resumes from it when the run is started again (``Trainer.step`` tells a loop where
    it stands). Every host must run the same steps in the same order (the collectives
    and ``Trainer.log`` are collective), e.g. a reinforcement-learning loop that
    collects rollouts with the Predictor and trains on them::

        def main(iterations):
            trainer = redray.Trainer(policy, collate, loss, optax.adam(3e-4), ...)
            ...
            return returns

        redray.run(main, 20, hosts=2, devices_per_host=2, name="ppo", storage_path=...)

    Args:
      fn: the function every host runs; it and its arguments must pickle.
      *args, **kwargs: its arguments.
      hosts, devices_per_host, use_gpu, use_tpu, address, name, storage_path,
      max_failures, resume, tracking_uri, experiment, tracking: as for ``redray.fit``.
      checkpoint: a ``redray.CheckpointConfig`` for the main Trainer (its directory
        defaults to ``<storage_path>/<name>/checkpoints``); ``False``: none.

    Returns:
      A ``RunResult``: host 0's return value, where the run is tracked and checkpointed.

    Raises:
      HostError: ``fn`` raised on a host; the message holds that host's traceback.
    """
    if not callable(fn):
        raise TypeError(f"redray.run needs a function to run on every host, got {fn!r}")
    launch = _Launch(hosts, devices_per_host, use_gpu, use_tpu, address, name, storage_path,
                     max_failures, checkpoint, resume, tracking_uri, experiment, tracking)
    out = launch.start("call_on_host", {}, {"function": getattr(fn, "__qualname__", repr(fn))},
                       user={"fn": fn, "args": args, "kwargs": kwargs})
    return RunResult(**out)


def fit(model: Any, collate: Callable, loss: Callable, optimizer, *, train_data,
        batch_size: int, epochs: int = 1, eval_data=None, predict: Callable | None = None,
        eval_metric: Callable | None = None, predict_data=None, max_steps: int | None = None,
        eval_at_start: bool = False,
        hosts: int = 1, devices_per_host: int | None = None, use_gpu: bool = False,
        use_tpu: bool = False, address: str | None = None, name: str | None = None,
        storage_path: str | None = None, max_failures: int = 0, progress: bool = True,
        checkpoint=None, resume: bool = True, tracking_uri: str | None = None,
        experiment: str = "redray", tracking: bool = True, **trainer_options) -> FitResult:
    """Trains on a Ray cluster: one worker per host, one ``jax.distributed`` runtime.

    Args:
      model, collate, loss, optimizer, predict: as for ``redray.Trainer``.
      train_data, eval_data, predict_data: a list of dicts, a ``datasets.Dataset``, a
        parquet/json/jsonl path or glob, or a ``ray.data.Dataset``.
      batch_size: examples per optimizer update, over all hosts.
      epochs, max_steps, eval_metric, eval_at_start: as for ``Trainer.fit``.
      hosts: worker processes, one per host (on one machine: simulated hosts).
      devices_per_host: CPU devices each host simulates (CPU only; default 1), or the
        GPUs/TPU chips each host takes.
      use_gpu, use_tpu: run on GPUs / TPUs (devices assigned by Ray).
      address: a Ray cluster (``ray://host:10001`` for Ray Client); default
        ``RAY_ADDRESS``, else a local cluster started here.
      name, storage_path: the run's name and where Ray Train keeps it (an absolute path
        or a URI); defaults: a timestamped name under ``~/redray_runs``.
      max_failures: worker-group restarts Ray Train allows before giving up; the
        restarted group resumes from the last complete checkpoint.
      progress: progress bar on host 0.
      checkpoint: a ``redray.CheckpointConfig`` (when and what to save); its directory
        defaults to ``<storage_path>/<name>/checkpoints``. Default: save at the end of
        every epoch and of the run, keep the last 3. ``False``: no checkpoints.
      resume: continue from the last complete checkpoint of the run ``name`` in
        ``storage_path`` (the same step, epoch, position inside it and RNG) and log
        into the same MLflow run.
      tracking_uri: where MLflow logs go; default ``MLFLOW_TRACKING_URI``, else
        ``sqlite:///<storage_path>/mlflow.db``. ``tracking=False``: no MLflow.
      experiment: the MLflow experiment.
      **trainer_options: ``Trainer`` keywords (model_axis, fsdp_axis, micro_batch_size,
        compute_dtype, rules, seed, log_every, learning_rate, trainable, grad_fn, ...).

    Returns:
      A ``FitResult`` with the history and the predictions, if asked.

    Raises:
      HostError: user code raised on a host; the message holds that host's traceback.
    """
    from redray.data import RowSource, to_dataset
    from redray.pipeline import Pipeline

    Pipeline(collate, loss, predict)  # cheap checks on the driver, before any worker
    launch = _Launch(hosts, devices_per_host, use_gpu, use_tpu, address, name, storage_path,
                     max_failures, checkpoint, resume, tracking_uri, experiment, tracking)
    rows = {key: None if data is None else RowSource(to_dataset(data))
            for key, data in (("train", train_data), ("eval", eval_data),
                              ("predict", predict_data))}
    job = {"epochs": epochs, "max_steps": max_steps, "progress": progress,
           "eval_at_start": eval_at_start,
           "train": rows["train"], "eval": rows["eval"], "predict_data": rows["predict"]}
    user = {"model": model, "collate": collate, "loss": loss, "optimizer": optimizer,
            "predict": predict, "eval_metric": eval_metric,
            "trainer": dict(batch_size=batch_size, **trainer_options)}
    out = launch.start("fit_on_host", job, dict(epochs=epochs, max_steps=max_steps,
                                                batch_size=batch_size, **trainer_options),
                       user=user)
    value = out.pop("value")
    return FitResult(history=value["history"], predictions=value["predictions"], **out)


class _Launch:
    """One Ray Train worker group for ``run`` and ``fit``: settings checked, the Ray
    cluster reached, the run's checkpoint folder and MLflow tracker set up."""

    def __init__(self, hosts, devices_per_host, use_gpu, use_tpu, address, name,
                 storage_path, max_failures, checkpoint, resume, tracking_uri, experiment,
                 tracking):
        from redray.checkpoint import CheckpointConfig

        if hosts < 1:
            raise ValueError(f"hosts={hosts}: need at least one host")
        if use_gpu and use_tpu:
            raise ValueError("use_gpu and use_tpu are exclusive")
        connect(address, num_cpus=None if address else max(os.cpu_count() or 1, hosts))
        self.hosts, self.devices_per_host = hosts, devices_per_host
        self.use_gpu, self.use_tpu, self.max_failures = use_gpu, use_tpu, max_failures
        self.name = name or time.strftime("redray-%Y%m%d-%H%M%S")
        self.storage_path = os.path.abspath(os.path.expanduser(storage_path or "~/redray_runs")) \
            if not (storage_path and "://" in storage_path) else storage_path
        self.checkpoint = None
        if checkpoint is not False:
            ckpt = CheckpointConfig.of(checkpoint) or CheckpointConfig()
            self.checkpoint = dataclasses.replace(
                ckpt, directory=ckpt.directory
                or f"{self.storage_path.rstrip('/')}/{self.name}/checkpoints",
                resume=resume and ckpt.resume)
        self.resume = resume
        self.tracking = (tracking_uri, experiment) if tracking else None

    def start(self, host_fn: str, job: dict, settings: dict, user: dict) -> dict:
        """Runs ``worker.<host_fn>(job, rank)`` on every host; returns ``RunResult``'s
        fields (``value``: host 0's return value).

        ``user`` (the user's functions, model and arguments) travels as bytes that each
        host unpickles only after joining the JAX runtime: a built model's device
        arrays, unpickled earlier, would start JAX's backend before
        ``jax.distributed.initialize``, which then refuses to run. ``job`` travels
        through Ray's own serializer (the row sources' object references need it).
        """
        import ray
        from ray.train import FailureConfig, LoggingConfig, RunConfig
        from ray.train.v2.jax import JaxTrainer

        from redray.cluster import worker
        from redray.cluster.tracker import MetricsToTracker, finish_tracker, start_tracker
        from redray.tracking import resolve_tracking_uri

        config = dict(name=self.name, storage_path=self.storage_path, hosts=self.hosts,
                      devices_per_host=self.devices_per_host, use_gpu=self.use_gpu,
                      use_tpu=self.use_tpu, max_failures=self.max_failures,
                      checkpoint=None if self.checkpoint is None
                      else dataclasses.asdict(self.checkpoint), **settings)
        results = _results_actor()
        tracker = None
        if self.tracking is not None:
            uri, experiment = self.tracking
            tracker = start_tracker(resolve_tracking_uri(uri, self.storage_path), self.name,
                                    f"{self.storage_path.rstrip('/')}/{self.name}", experiment,
                                    self.resume, self.checkpoint, config)
        # Ray Train's controller collects reports (checkpoint registrations, a barrier on
        # every host) only at this interval, 2 s by default: a loop that checkpoints
        # often would stall that long each time. Ray passes it on to the controller.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        job = {**job, "user": _user_bytes(user), "host_fn": getattr(worker, host_fn),
               "results": results,
               "tracker": tracker, "checkpoint": self.checkpoint, "config": config}
        trainer = JaxTrainer(
            # Ray's own serializer (cloudpickle plus object-ref and actor-handle
            # ownership): the row sources' block references must stay valid on workers.
            _entry, train_loop_config=job, scaling_config=self._scaling(),
            run_config=RunConfig(name=self.name, storage_path=self.storage_path,
                                 failure_config=FailureConfig(max_failures=self.max_failures),
                                 worker_runtime_env={"env_vars": self._env()},
                                 logging_config=LoggingConfig(log_level="WARNING"),
                                 callbacks=[] if tracker is None else [MetricsToTracker(tracker)]))
        start = time.perf_counter()
        try:
            trainer.fit()
        except Exception as error:
            finish_tracker(tracker, "FAILED")
            _, failures = ray.get(results.get.remote())
            if failures:
                rank, text = failures[0]
                raise HostError(f"host {rank} failed:\n{text}") from error
            raise
        out, _ = ray.get(results.get.remote())
        report = finish_tracker(tracker, "FINISHED", out["checkpoint"])
        return {**out, "name": self.name, "storage_path": self.storage_path,
                "seconds": time.perf_counter() - start,
                "tracking_uri": report and report["uri"],
                "mlflow_run_id": report and report["run_id"]}

    def _env(self) -> dict:
        # Ray Train's print patch logs every print again after teeing it to the console:
        # each line a host prints would show twice.
        env = {"PYTHONPATH": _local_paths(), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
        if not (self.use_gpu or self.use_tpu):
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = " ".join(
                [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
                + [f"--xla_force_host_platform_device_count={self.devices_per_host or 1}"])
        return env

    def _scaling(self):
        import ray
        from ray.train import ScalingConfig

        if self.use_gpu:
            resources = {"GPU": self.devices_per_host or 1}
        elif self.use_tpu:
            resources = {"TPU": self.devices_per_host or 4}
        else:
            resources = {"CPU": 1}
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        return ScalingConfig(num_workers=self.hosts, use_gpu=self.use_gpu, use_tpu=self.use_tpu,
                             resources_per_worker=resources,
                             placement_strategy="STRICT_SPREAD" if nodes >= self.hosts > 1
                             else "SPREAD")


def _user_bytes(user: dict) -> bytes:
    """The user's objects, pickled for the hosts (their own modules by value)."""
    from ray import cloudpickle

    _pickle_user_code_by_value()
    try:
        return cloudpickle.dumps(user)
    except Exception as error:  # noqa: BLE001 - any pickling failure: say what to change
        raise TypeError(f"cannot send the model, functions or arguments to the hosts "
                        f"({type(error).__name__}: {error}): they must pickle; define them at "
                        "module level or close over picklable values only") from None


def _entry(config):
    from redray.cluster.worker import train_loop

    train_loop(config)
