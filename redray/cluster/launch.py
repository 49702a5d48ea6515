"""``redray.fit`` and ``redray.run``: work on every host of a Ray cluster, one worker per host."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

from redray.cluster.config import ClusterConfig
from redray.cluster.console import DriverView, Watcher
from redray.cluster.job import CallCode, CallTask, FitCode, FitTask, HostJob, free_for
from redray.cluster.run_lock import RunLock
from redray.data.ray_local import join, on_driver_node, quiet_ray_logs, start_local
from redray.verbosity import ADVICE_ENV, VERBOSE_ENV, verbose


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
    """User code failed on a host; the message holds that host's traceback, without the
    frames of redray's own machinery (``redray.models`` frames are kept).

    Attributes:
      host: the host that failed.
      full_traceback: its whole traceback, redray's frames included.
      ray_error: what Ray Train raised for the worker group (for debugging Ray itself).
    """

    def __init__(self, message: str, host: int | None = None, full_traceback: str | None = None,
                 ray_error: BaseException | None = None):
        super().__init__(message)
        self.host, self.full_traceback, self.ray_error = host, full_traceback, ray_error


def _results_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Results:
        def __init__(self):
            self.value, self.failures, self.hosts = None, [], {}
            self.regrouping = 0
            # host 0's messages and progress for the driver's console, numbered from 0;
            # kept until the driver has read them (a run may log for days)
            self.news, self.first_news = [], 0

        def tell(self, event):
            self.news.append(event)

        def read(self, since):
            """The number of the next piece of news, and those from number ``since`` on
            (the driver has shown the ones before: they are forgotten)."""
            del self.news[:since - self.first_news]
            self.first_news = since
            return since + len(self.news), list(self.news)

        def put(self, value):
            self.value = value

        def join(self, rank, actor):
            self.hosts[rank] = actor

        def fail(self, rank, text, full):
            self.failures.append((rank, text, full))
            # Every host stops now, before a peer waiting in a collective for the failed
            # one is aborted by JAX (a C++ dump on the driver's screen). Ray Train sees
            # its workers gone and ends (or restarts, with max_failures) the group.
            for actor in self.hosts.values():
                ray.kill(actor)
            self.hosts.clear()

        def regroup(self, hosts):
            """Host 0: the group ends to regroup on ``hosts`` hosts (no value)."""
            self.regrouping = hosts

        def take_regroup(self):
            regrouping, self.regrouping = self.regrouping, 0
            self.hosts.clear()
            return regrouping

        def get(self):
            return self.value, self.failures

    return Results.options(scheduling_strategy=on_driver_node()).remote()


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to ``address`` (or ``RAY_ADDRESS``), else starts a local Ray cluster.

    A ``ray://host:10001`` address connects through Ray Client (e.g. from a laptop).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith("ray://"):
        _connect_client(address)
    elif address:
        join(address)
    else:
        start_local(num_cpus)


def _connect_client(address: str) -> None:
    """Ray Client: the port first (unreachable: say so at once), then the token (Ray
    2.60 clusters want one; without it Ray Client retries for minutes and then blames
    the port), then the connection, retried while the head starts this client's
    server process."""
    import socket

    from redray.cluster.auth import TOKEN_HELP, use_token

    host, _, port = address[len("ray://"):].partition(":")
    port = int(port.split("/")[0] or 10001)
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError as error:
        raise ConnectionError(f"cannot reach the Ray client server at {address} ({error}): "
                              "check that the cluster is up and its client port (default "
                              "10001) is reachable from here") from None
    token = use_token()
    if token is None and os.environ.get("RAY_AUTH_MODE") != "disabled":
        raise ConnectionError(
            f"the Ray client server at {address} is reachable, but no auth token was found: "
            f"a Ray 2.60 cluster accepts only clients with its token; {TOKEN_HELP} (redray "
            "then sets RAY_AUTH_MODE=token), or set RAY_AUTH_MODE=disabled for a cluster "
            "started without auth")
    # The client server starts a process per client; on a busy head that can outlast
    # Ray Client's own few quick retries.
    for attempt in range(CLIENT_ATTEMPTS):
        try:
            join(address)
            return
        except ConnectionError as error:
            if attempt == CLIENT_ATTEMPTS - 1:
                raise ConnectionError(
                    f"connecting to the Ray client server at {address} failed ({error}); the "
                    f"port is reachable: if the cluster rejected the token, {TOKEN_HELP}"
                ) from None
            time.sleep(5)


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


def run(fn: Callable, *args, cluster: ClusterConfig | None = None, **kwargs) -> RunResult:
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
      *args, **kwargs: its arguments; keywords that name a ``ClusterConfig`` field
        (``hosts``, ``devices_per_host``, ``use_gpu``, ``use_tpu``, ``address``, ``name``,
        ``storage_path``, ``max_failures``, ``checkpoint``, ``resume``,
        ``tracking_uri``, ``experiment``, ``tracking``, ``compile_cache``, ``verbose``)
        configure the run instead.
        ``checkpoint`` is the main Trainer's ``redray.CheckpointConfig`` (its directory
        defaults to ``<storage_path>/<name>/checkpoints``); ``False``: none.
      cluster: a ``redray.ClusterConfig`` (keywords above override its fields).

    Returns:
      A ``RunResult``: host 0's return value, where the run is tracked and checkpointed.

    Raises:
      HostError: ``fn`` raised on a host; the message holds that host's traceback.
    """
    if not callable(fn):
        raise TypeError(f"redray.run needs a function to run on every host, got {fn!r}")
    config, kwargs = ClusterConfig.split(kwargs, cluster)
    out = _launch(config, CallTask, {"function": getattr(fn, "__qualname__", repr(fn))},
                  CallCode(fn=fn, args=args, kwargs=kwargs))
    return RunResult(**out)


def fit(model: Any, collate: Callable, loss: Callable, optimizer, *, train_data,
        batch_size: int, epochs: int = 1, eval_data=None, predict: Callable | None = None,
        eval_metric: Callable | None = None, predict_data=None, max_steps: int | None = None,
        eval_at_start: bool = False, progress: bool = True,
        cluster: ClusterConfig | None = None, **options) -> FitResult:
    """Trains on a Ray cluster: one worker per host, one ``jax.distributed`` runtime.

    Args:
      model, collate, loss, optimizer, predict: as for ``redray.Trainer``.
      train_data, eval_data, predict_data: a list of dicts, a ``datasets.Dataset``, a
        parquet/json/jsonl path or glob, or a ``ray.data.Dataset``.
      batch_size: examples per optimizer update, over all hosts.
      epochs, max_steps, eval_metric, eval_at_start: as for ``Trainer.fit``.
      progress: host 0's messages and progress, on the driver's console (False: none).
      cluster: a ``redray.ClusterConfig``; its fields may also be given as keywords
        here (``hosts``, ``devices_per_host``, ``use_gpu``, ``use_tpu``, ``address``,
        ``name``, ``storage_path``, ``max_failures``, ``checkpoint``, ``resume``,
        ``tracking_uri``, ``experiment``, ``tracking``, ``compile_cache``, ``verbose``),
        which override its fields.
        Defaults: one host, a timestamped run under ``~/redray_runs``, a checkpoint at
        the end of every epoch and of the run (the last 3 kept), resumed when the
        same name runs again, tracked in ``<storage_path>/mlflow.db``.
      **options: the cluster keywords above, and ``Trainer`` keywords (model_axis,
        fsdp_axis, micro_batch_size, compute_dtype, rules, seed, log_every,
        learning_rate, trainable, grad_fn, hooks, ...).

    Returns:
      A ``FitResult`` with the history and the predictions, if asked.

    Raises:
      HostError: user code raised on a host; the message holds that host's traceback.
    """
    from redray.data import RowSource, Stream, to_dataset
    from redray.functions import UserFunctions

    UserFunctions(collate, loss, predict)  # cheap checks on the driver, before any worker
    config, trainer_options = ClusterConfig.split(options, cluster)
    _check_trainer_options(trainer_options)

    def task() -> FitTask:
        # once the run is locked: in-memory data goes into Ray's object store; a stream
        # travels as its list of pieces, and every host reads its own rows from the files
        rows = {key: data if data is None or isinstance(data, Stream)
                else RowSource(to_dataset(data))
                for key, data in (("train", train_data), ("eval", eval_data),
                                  ("predict", predict_data))}
        return FitTask(epochs=epochs, max_steps=max_steps, progress=progress,
                       eval_at_start=eval_at_start, train=rows["train"], eval=rows["eval"],
                       predict=rows["predict"])

    code = FitCode(model=model, collate=collate, loss=loss, optimizer=optimizer,
                   predict=predict, eval_metric=eval_metric,
                   trainer_options=dict(batch_size=batch_size, **trainer_options))
    out = _launch(config, task, dict(epochs=epochs, max_steps=max_steps, batch_size=batch_size,
                                     **trainer_options), code)
    value = out.pop("value")
    return FitResult(history=value["history"], predictions=value["predictions"], **out)


def _check_data_cpus(config: ClusterConfig, task) -> None:
    """A streamed source needs a CPU beside the hosts' for Ray Data to read it: without
    one its reads wait forever."""
    import ray

    from redray.data import Stream

    if not any(isinstance(getattr(task, k, None), Stream) for k in ("train", "eval", "predict")):
        return
    reserved = 0 if (config.use_gpu or config.use_tpu) else config.max_hosts
    total = ray.cluster_resources().get("CPU", 0)
    if total - reserved < 1:
        raise ValueError(
            f"the Ray cluster has {total:g} CPU(s) and the {config.max_hosts} host(s) reserve "
            f"{reserved}: none is left for Ray Data to read the stream, which would wait "
            f"forever. Give Ray more CPUs (ray.init(num_cpus={int(reserved) + 2}), or "
            "`ray start --num-cpus`), or use fewer hosts")


def _check_trainer_options(options: dict) -> None:
    """Unknown keywords fail on the driver, before any host starts."""
    import inspect

    from redray.engine import Trainer
    from redray.sharding.parallelism import KEYWORDS

    known = [n for n, p in inspect.signature(Trainer).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY] + list(KEYWORDS)
    unknown = sorted(set(options) - set(known))
    if unknown:
        cluster = [f.name for f in dataclasses.fields(ClusterConfig)]
        raise TypeError(f"redray.fit got unknown keyword(s) {unknown}: use Trainer keywords "
                        f"({', '.join(k for k in known if k != 'batch_size')}) or cluster "
                        f"keywords ({', '.join(cluster)})")


def _launch(config: ClusterConfig, make_task: Callable, settings: dict, code) -> dict:
    """Runs the task ``make_task()`` builds on every host of one Ray Train worker group,
    holding the run's lock throughout; returns ``RunResult``'s fields (``value``: host 0's
    return value)."""
    config = config.resolved()
    # A second run of this name and storage is refused here, before Ray or any host starts.
    with RunLock.acquire(config.folders):
        return _launch_locked(config, make_task, settings, code)


def _launch_locked(config: ClusterConfig, make_task: Callable, settings: dict, code) -> dict:
    import ray

    from redray.cluster.tracker import finish_tracker, start_tracker

    connected_here = not ray.is_initialized()
    # Before the data: Ray Data would otherwise start a Ray of its own. A local cluster
    # counts one CPU more per host: each host reserves one, and the machine's cores stay
    # free for Ray Data's reads and transforms (which would wait forever for a CPU).
    connect(config.address,
            num_cpus=None if config.address else (os.cpu_count() or 1) + config.max_hosts)
    task = make_task()
    _check_data_cpus(config, task)
    recorded = {**config.settings(), **settings}
    results = _results_actor()
    quiet = not verbose(config.verbose)
    view = DriverView()
    quiet_ray_logs(view, quiet)
    folders = config.folders
    tracker = None
    if config.tracking:
        tracker = start_tracker(folders, config.experiment, config.resume, config.checkpoint,
                                recorded)
    # Ray Train's controller collects reports (checkpoint registrations, a barrier on
    # every host) only at this interval, 2 s by default: a loop that checkpoints
    # often would stall that long each time. Ray passes it on to the controller.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    job = HostJob(task=task, code=_user_bytes(code), results=results, tracker=tracker,
                  checkpoint=config.checkpoint, config=recorded,
                  hang_timeout=config.hang_timeout, console=quiet,
                  compile_cache=folders.compile_cache if config.compile_cache else None,
                  probe_cache=folders.hardware,
                  grow_to=config.max_hosts if config.elastic else None,
                  worker_resources=worker_resources(config))
    start = time.perf_counter()
    try:
        # An elastic run's group ends itself at a checkpoint when the cluster has room for
        # more hosts (worker.Regrow): then a new group, as large as Ray can make it,
        # resumes from that checkpoint.
        while True:
            hosts = _run_group(config, job, quiet, tracker, results, view)
            if not hosts:
                break
            _await_room(hosts, worker_resources(config))
    except Exception as error:
        finish_tracker(tracker, "FAILED")
        _, failures = ray.get(results.get.remote())
        if not failures:
            raise
        host, text, full = failures[0]
        if connected_here:
            # Ray prints the hosts' streamed output from a thread, and the lines it held
            # back to deduplicate at its shutdown: all of it must come before the error.
            ray.shutdown()
        sys.stdout.flush()  # a redirected stdout holds lines until exit, after the error
        sys.stderr.flush()
        # Ray's own error (the worker group's deaths) would only bury the user's traceback.
        raise HostError(f"host {host} failed:\n{text}", host, full, error) from None
    out, _ = ray.get(results.get.remote())
    report = finish_tracker(tracker, "FINISHED", out["checkpoint"])
    return {**out, "name": folders.name, "storage_path": folders.storage,
            "seconds": time.perf_counter() - start,
            "tracking_uri": report and report["uri"],
            "mlflow_run_id": report and report["run_id"]}


def _run_group(config: ClusterConfig, job: HostJob, quiet: bool, tracker, results,
               view) -> bool:
    """Runs one Ray Train worker group to its end; the hosts to regroup on when it ended
    to regroup, else 0."""
    import ray
    from ray.train import FailureConfig, LoggingConfig, RunConfig
    from ray.train.v2.jax import JaxTrainer

    from redray.cluster.tracker import CheckpointsToTracker

    folders = config.folders
    trainer = JaxTrainer(
        # Ray's own serializer (cloudpickle plus object-ref and actor-handle ownership):
        # the row sources' block references must stay valid on workers.
        _entry, train_loop_config={"job": job}, scaling_config=_scaling(config),
        run_config=RunConfig(name=folders.name, storage_path=folders.storage,
                             failure_config=FailureConfig(max_failures=config.max_failures),
                             worker_runtime_env={"env_vars": _worker_env(config, quiet)},
                             logging_config=LoggingConfig(log_level="WARNING"),
                             callbacks=[] if tracker is None else [CheckpointsToTracker(tracker)]))
    controller_env = _controller_env(config, os.environ)
    os.environ.update(controller_env)  # the driver's: Ray Train hands it to its controller
    try:
        with Watcher(results, view):
            trainer.fit()
    finally:
        for name in controller_env:
            del os.environ[name]
    return ray.get(results.take_regroup.remote())


START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ELASTIC_START_TIMEOUT_S = 10


def _controller_env(config: ClusterConfig, environ) -> dict:
    """What the driver's environment gains for Ray Train's controller while a group runs.

    An elastic group is sized on Ray's view of the free resources, which lags a lost node
    (the autoscaling coordinator reads the nodes every 20 s): a group sized on that view
    waits for a placement that never comes, 60 s by default, before Ray sizes it again
    (a timed-out start is retried, not counted as a failure). In benchmarks/elastic.py
    that wait was most of the 70 s from a node's loss to the next step. A fixed-size
    group waits the default (an autoscaler may be adding its nodes). The user's own
    setting wins."""
    if not config.elastic or START_TIMEOUT_ENV in environ:
        return {}
    return {START_TIMEOUT_ENV: str(ELASTIC_START_TIMEOUT_S)}


def _await_room(hosts: int, resources: dict, seconds: float = 60.0) -> None:
    """Waits (at most ``seconds``) until the cluster has room for ``hosts`` workers: the
    group that ended frees its workers' resources asynchronously, and Ray sizes the next
    group from what is free when it starts (a group started early would be the old size,
    and regroup again at its next checkpoint)."""
    import ray

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if free_for(resources, hosts):
            break
        time.sleep(0.2)
    # Ray Train's elastic policy sizes the group from the reservations of Ray's
    # autoscaling coordinator, which reads the cluster's nodes every 20 s (its tick): a
    # node added since would not count. One tick now, as its API allows (recompute).
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)

        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("redray-regroup", recompute=True),
                timeout=30)
    except Exception:  # noqa: BLE001 - another Ray: the next group may start smaller
        pass


def _worker_env(config: ClusterConfig, quiet: bool = True) -> dict:
    # Ray Train's print patch logs every print again after teeing it to the console:
    # each line a host prints would show twice.
    env = {"PYTHONPATH": _local_paths(), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
           VERBOSE_ENV: "0" if quiet else "1"}
    if quiet:
        env[ADVICE_ENV] = "1"
    if not (config.use_gpu or config.use_tpu):
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = " ".join(
            [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
            + [f"--xla_force_host_platform_device_count={config.devices_per_host or 1}"])
    elif config.use_gpu:
        env["XLA_FLAGS"] = gpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
    return env


# XLA's GPU flags redray sets for every host (the ones MaxText's GPU recipes set for
# multi-GPU training): overlap collectives with compute (the latency-hiding scheduler,
# pipelined collectives inside loops) and combine small collectives into large ones.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
)


def gpu_xla_flags(user: str) -> str:
    """``GPU_XLA_FLAGS`` then the user's ``XLA_FLAGS``: a flag the user sets wins (XLA
    takes a flag's last value); the user's flags keep their order."""
    given = {f.split("=", 1)[0] for f in user.split()}
    ours = [f for f in GPU_XLA_FLAGS if f.split("=", 1)[0] not in given]
    return " ".join(ours + user.split())


def _scaling(config: ClusterConfig):
    import ray
    from ray.train import ScalingConfig

    resources = worker_resources(config)
    if config.elastic:
        # Ray's own resize of a running group kills it mid-step: redray grows the group
        # at its checkpoints instead (worker.Regrow), and lets Ray size each new group.
        return ScalingConfig(num_workers=config.hosts, use_gpu=config.use_gpu,
                             use_tpu=config.use_tpu, resources_per_worker=resources,
                             placement_strategy="SPREAD",
                             elastic_resize_monitor_interval_s=NEVER)
    nodes = len([n for n in ray.nodes() if n.get("Alive")])
    return ScalingConfig(num_workers=config.hosts, use_gpu=config.use_gpu,
                         use_tpu=config.use_tpu, resources_per_worker=resources,
                         placement_strategy="STRICT_SPREAD" if nodes >= config.hosts > 1
                         else "SPREAD")


NEVER = 1e12  # seconds


def worker_resources(config: ClusterConfig) -> dict:
    """What one host's worker reserves on its Ray node."""
    if config.use_gpu:
        return {"GPU": config.devices_per_host or 1}
    if config.use_tpu:
        return {"TPU": config.devices_per_host or 4}
    return {"CPU": 1}


def _user_bytes(code) -> bytes:
    """The user's objects, pickled for the hosts (their own modules by value)."""
    from ray import cloudpickle

    _pickle_user_code_by_value()
    try:
        return cloudpickle.dumps(code)
    except Exception as error:  # noqa: BLE001 - any pickling failure: say what to change
        raise TypeError(f"cannot send the model, functions or arguments to the hosts "
                        f"({type(error).__name__}: {error}): they must pickle; define them at "
                        "module level or close over picklable values only") from None


def _entry(config: dict):
    from redray.cluster.worker import train_loop

    train_loop(config["job"])
