"""``redray.fit`` and ``redray.run``: work on every host of a Ray cluster, one actor per host."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

from redray import startup
from redray.cluster.config import ClusterConfig
from redray.cluster.console import DriverView, Watcher
from redray.cluster.job import (REGROUP, TRAINED, CallCode, CallTask, FitCode, FitTask,
                               HostFailure, HostJob, Room, shown_resources)
from redray.cluster.run_lock import RunLock
from redray.processes.ray_local import join_ray, quiet_ray_logs, start_local
from redray.verbosity import ADVICE_ENV, VERBOSE_ENV, verbose


@dataclasses.dataclass(kw_only=True)
class RunResult:
    """What ``redray.run`` returns to the driver (``redray.fit``'s ``FitResult`` too).

    Attributes:
      value: what the function returned on host 0 (``redray.run``).
      name, storage_path: the run's name and storage folder.
      seconds: wall-clock time of the run, from the call to its return.
      startup: where that time went: seconds per phase of ``redray.startup.PHASES``
        (the run's start, its steps, its end); ``REDRAY_VERBOSE=1`` prints them.
      resumed_from_step: the checkpoint step the (last) worker group started from, or
        None for a run that started fresh (of the run's main Trainer: the first one
        made with the default checkpoint).
      checkpoint: the newest checkpoint written (its folder), or None.
      tracking_uri, mlflow_run_id: where the run is tracked in MLflow (None without).
      trackers: every tracker's report by name (``"mlflow"``, ``"tensorboard"``,
        ``"wandb"``): its ``run_id`` (TensorBoard's: its log folder), ``uri`` (where it
        writes), ``failure`` and ``dropped`` values.
    """
    value: Any = None
    name: str
    storage_path: str
    seconds: float
    resumed_from_step: int | None = None
    checkpoint: str | None = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    trackers: dict = dataclasses.field(default_factory=dict)
    startup: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """Where the run's outputs are (checkpoint, MLflow store, the UI command) and
        how to continue it, in a few lines for the end of a script."""
        from redray.tracking import ui_command

        lines = [f"checkpoint:    {self.checkpoint or 'none'}"]
        if self.tracking_uri:
            lines += [f"MLflow store:  {self.tracking_uri} (run {self.mlflow_run_id})",
                      f"MLflow UI:     {ui_command(self.tracking_uri)}"]
        if "tensorboard" in self.trackers:
            lines.append(f"TensorBoard:   tensorboard --logdir "
                         f"{os.path.dirname(self.trackers['tensorboard']['uri'])}")
        if "wandb" in self.trackers:
            found = self.trackers["wandb"]
            lines.append(f"W&B run:       {found['run_id']} in {found['uri']} (offline: "
                         f"wandb sync {found['uri']}/offline-run-*)")
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
      ray_error: what the driver saw of the hosts' end (for debugging Ray itself).
    """

    def __init__(self, message: str, host: int | None = None, full_traceback: str | None = None,
                 ray_error: BaseException | None = None):
        super().__init__(message)
        self.host, self.full_traceback, self.ray_error = host, full_traceback, ray_error


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
        join_ray(address)
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
            join_ray(address)
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
            trainer = redray.Trainer.of(policy, collate, loss, optax.adam(3e-4), ...)
            ...
            return returns

        redray.run(main, 20, hosts=2, devices_per_host=2, name="ppo", storage_path=...)

    Args:
      fn: the function every host runs; it and its arguments must pickle.
      *args, **kwargs: its arguments; keywords that name a ``ClusterConfig`` field
        (``hosts``, ``devices_per_host``, ``use_gpu``, ``use_tpu``, ``address``, ``name``,
        ``storage_path``, ``max_failures``, ``checkpoint``, ``resume``,
        ``tracking_uri``, ``experiment``, ``tracking``, ``compile_cache``, ``keep_hosts``,
        ``verbose``)
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
        ``tracking_uri``, ``experiment``, ``tracking``, ``compile_cache``, ``keep_hosts``,
        ``verbose``),
        which override its fields.
        Defaults: one host, a timestamped run under ``~/redray_runs``, a checkpoint at
        the end of every epoch and of the run (the last 3 kept), resumed when the
        same name runs again, tracked in ``<storage_path>/mlflow.db``.
      **options: the cluster keywords above, and ``Trainer`` keywords (model_axis,
        fsdp_axis, micro_batch_size, compute_dtype, rules, seed, log_every,
        learning_rate, trainable, grad_fn, hooks, ...). ``plan=``: a whole plan to run
        as it is, as the Trainer takes it (a ``redray.Plan``, its JSON, the path of
        ``redray plan --json``'s output, a checkpoint's ``plan``).

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
    from redray.engine.plan_choice import env_plan, plan_parts_given
    from redray.sharding import Parallelism
    from redray.sharding.parallelism import KEYWORDS
    from redray.sharding.plan import load as load_plan

    # redray run --plan: the plan the script's run is pinned to, read here too
    parts = {k: v for k, v in trainer_options.items()
             if k in KEYWORDS or k in ("mesh", "rules", "micro_batch_size",
                                       "pipeline_schedule", "stage_repeats")}
    plan = env_plan(trainer_options.get("plan"), plan_parts_given(**parts))
    if plan is not None and not (isinstance(plan, str) and plan == "auto") \
            and not isinstance(plan, Parallelism):
        # a whole plan, read here (a bad one fails before any host starts); the hosts get
        # its JSON-ready form
        trainer_options["plan"] = load_plan(plan).to_dict()

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
    # the plan reaches MLflow as the hosts run it (``plan.*``, ``plan.json``)
    settings = {k: v for k, v in trainer_options.items() if k != "plan"}
    out = _launch(config, task, dict(epochs=epochs, max_steps=max_steps, batch_size=batch_size,
                                     **settings), code)
    value = out.pop("value")
    return FitResult(history=value["history"], predictions=value["predictions"], **out)


def _streams(task) -> bool:
    """Whether one of the task's sources is a ``redray.Stream`` (read through Ray Data)."""
    from redray.data import Stream

    return any(isinstance(getattr(task, k, None), Stream) for k in ("train", "eval", "predict"))


def _check_data_cpus(config: ClusterConfig, task) -> None:
    """A streamed source needs a CPU beside the hosts' for Ray Data to read it: without
    one its reads wait forever."""
    import ray

    if not _streams(task):
        return
    reserved = 0 if (config.use_gpu or config.use_tpu) else config.max_hosts
    total = ray.cluster_resources().get("CPU", 0)
    if total - reserved < 1:
        raise ValueError(_no_data_cpu(total, config.max_hosts, reserved))


def _no_data_cpu(total: float, hosts: int, reserved: float) -> str:
    return (f"the Ray cluster has {total:g} CPU(s) and the {hosts} host(s) reserve "
            f"{reserved:g}: none is left for Ray Data to read the stream, which would wait "
            f"forever. Give Ray more CPUs (ray.init(num_cpus={int(reserved) + 2}), or "
            "`ray start --num-cpus`), or use fewer hosts")


def _check_trainer_options(options: dict) -> None:
    """Unknown keywords fail on the driver, before any host starts."""
    from redray.engine.settings import flat_keywords

    known = flat_keywords()
    unknown = sorted(set(options) - set(known))
    if unknown:
        cluster = [f.name for f in dataclasses.fields(ClusterConfig)]
        raise TypeError(f"redray.fit got unknown keyword(s) {unknown}: use Trainer keywords "
                        f"({', '.join(known)}) or cluster "
                        f"keywords ({', '.join(cluster)})")


def _launch(config: ClusterConfig, make_task: Callable, settings: dict, code) -> dict:
    """Runs the task ``make_task()`` builds on every host of one group (``hosts.py``),
    holding the run's lock throughout; returns ``RunResult``'s fields (``value``: host 0's
    return value)."""
    start = time.time()
    config = config.resolved()
    # A second run of this name and storage is refused here, before Ray or any host starts.
    with RunLock.acquire(config.folders):
        return _launch_locked(config, make_task, settings, code, start)


def _launch_locked(config: ClusterConfig, make_task: Callable, settings: dict, code,
                   start: float) -> dict:
    spans = startup.Recorder()
    with spans.phase("imports"):
        import ray

        from redray.cluster import hosts, results as results_kept  # noqa: F401 - in this phase
        from redray.cluster.tracker import start_tracker

    connected_here = not ray.is_initialized()
    # Before the data: Ray Data would otherwise start a Ray of its own. A local cluster
    # counts one CPU more per host: each host reserves one, and the machine's cores stay
    # free for Ray Data's reads and transforms (which would wait forever for a CPU).
    with spans.phase("ray"):
        connect(config.address,
                num_cpus=None if config.address else (os.cpu_count() or 1) + config.max_hosts)
    quiet = not verbose(config.verbose)
    view = DriverView()
    quiet_ray_logs(view, quiet)
    slices = None
    if config.use_tpu:  # refused here, before the data is read
        config, slices = _tpu_slices(config, view.write)
    with spans.phase("sources"):
        task = make_task()
        _check_data_cpus(config, task)
        user_code = _user_bytes(code)
    recorded = {**config.settings(), **settings}
    folders = config.folders
    tracker = None
    with spans.phase("actors"):
        results = results_kept.results_actor()
        if config.trackers:
            tracker = start_tracker(folders, config.experiment, config.resume,
                                    config.checkpoint, recorded, config.trackers)
    room = group_room(config, task, slices)
    from redray.engine.profile import PROFILE_ENV, profile_window

    job = HostJob(task=task, code=user_code, results=results, tracker=tracker,
                  checkpoint=config.checkpoint, config=recorded,
                  hang_timeout=config.hang_timeout, console=quiet,
                  compile_cache=folders.compile_cache if config.compile_cache else None,
                  probe_cache=folders.hardware,
                  grow_to=config.max_hosts if config.elastic else None,
                  room=room, data_context=_data_context(task),
                  profile=profile_window(os.environ.get(PROFILE_ENV), PROFILE_ENV),
                  profile_dir=os.path.join(folders.run, "profile"))
    try:
        _run_groups(config, room, quiet, spans, view, job, results, _streams(task))
    except Exception as error:
        _finish_startup(spans, None, start, tracker, quiet, "FAILED")
        _raise_failure(error, results, connected_here)
        raise  # no host said why: the error itself
    out, _ = ray.get(results.get.remote())
    results_kept.keep(results)
    host_spans = out.pop("startup")
    phases, total, report = _finish_startup(spans, host_spans, start, tracker, quiet,
                                            "FINISHED", out["checkpoint"],
                                            out["resumed_from_step"])
    return {**out, "name": folders.name, "storage_path": folders.storage,
            "seconds": total, "startup": phases,
            "tracking_uri": report and report["uri"],
            "mlflow_run_id": report and report["run_id"],
            "trackers": (report or {}).get("trackers", {})}


def _run_groups(config: ClusterConfig, room, quiet: bool, spans, view, job, results,
                streams: bool) -> None:
    """Runs ``job`` on groups of hosts until it ends. A group runs the job to its end; an
    elastic run's group may end itself at a checkpoint when the cluster has room for more
    hosts (``worker.Regrow``), and a failed group (a host's error, or a host lost while
    the group started or ran) is followed by a new one while restarts are left: either
    new group resumes from the last checkpoint."""
    import ray

    from redray.cluster import hosts

    restarts, ended = config.max_failures, None
    while True:
        try:
            group = _group(config, room, quiet, spans, view, ended is not None)
            outcome = _run_on(group, job, results, view, streams, ended)
            ended = None
        except HostFailure as failure:
            ended = failure.group
            if restarts == 0:
                raise
            restarts -= 1
            view.write(f"redray: {failure}; restarting the run from its last checkpoint "
                       f"({config.max_failures - restarts} of max_failures="
                       f"{config.max_failures})")
            continue
        if outcome == REGROUP:
            group.close()
            _await_room(ray.get(results.take_regroup.remote()), room)
            continue
        if config.keep_hosts and not config.elastic:
            hosts.keep(group)
        else:
            group.close()
        return


def _tpu_slices(config: ClusterConfig, view_write) -> tuple[ClusterConfig, object]:
    """A TPU run's slices (``tpu.SliceRequest``) and its config with the hosts they hold;
    refused (``ValueError``) where the hosts are not whole slices. A cluster whose TPU
    nodes carry no slice labels places hosts as any nodes (said once)."""
    from redray.cluster import tpu

    wanted, hosts = tpu.request(config.hosts, config.slices, config.tpu_type,
                                config.devices_per_host)
    if wanted is None:
        view_write("redray: the cluster's TPU nodes carry no slice labels "
                   f"({tpu.SLICE_LABEL}): the hosts are placed on any TPU nodes, "
                   "without slice order or a multislice environment")
        return config, None
    return dataclasses.replace(config, hosts=hosts), wanted


def _raise_failure(error: Exception, results, connected_here: bool) -> None:
    """Raises what a run that failed with ``error`` says to its caller, the failing
    host's traceback (a ``HostError``); returns where no host said one."""
    import ray

    from redray.cluster import hosts, results as results_kept

    _, failures = ray.get(results.get.remote())
    results_kept.keep(results)
    # a host gone without a word (its peers' errors, if any, followed from its loss)
    if isinstance(error, HostFailure) and (error.lost or not failures):
        raise HostError(str(error), error.host, None, error.__cause__) from None
    if not failures:
        return
    host, text, full = failures[-1]
    if connected_here:
        # Ray prints the hosts' streamed output from a thread, and the lines it held
        # back to deduplicate at its shutdown: all of it must come before the error.
        hosts.release_hosts()
        ray.shutdown()
    sys.stdout.flush()  # a redirected stdout holds lines until exit, after the error
    sys.stderr.flush()
    # Ray's own error (the hosts' deaths) would only bury the user's traceback.
    raise HostError(f"host {host} failed:\n{text}", host, full, error) from None


def _data_context(task):
    """The driver's Ray Data settings, for the hosts' own reads of a stream (None for a
    task without one: its hosts need not import Ray Data)."""
    if not _streams(task):
        return None
    from ray.data import DataContext

    return DataContext.get_current()


def _finish_startup(spans: startup.Recorder, host_spans: list | None, start: float, tracker,
                    quiet: bool, status: str, checkpoint: str | None = None,
                    step: int | None = None) -> tuple[dict, float, dict | None]:
    """The run's phases (the driver's, host 0's and the end: from host 0's last phase to
    the tracker's end), logged to MLflow at the step the run started from, the tracker
    ended with ``status``, and, verbose, the table printed. Returns the seconds per phase,
    the call's seconds (what ``RunResult.seconds`` reports, the table's total) and the
    tracker's report."""
    import ray

    from redray.cluster.tracker import finish_tracker

    def timeline(now: float | None = None) -> list:
        spans_now = spans.spans + list(host_spans or [])
        if host_spans:
            spans_now.append(startup.Span("end", max(s.end for s in host_spans),
                                          now or time.time()))
        return spans_now

    if tracker is not None:
        try:  # what the tracker's end adds is not in these (it ends after them)
            ray.get(tracker.log.remote({"step": step or 0,
                                        **startup.metrics(timeline(), time.time() - start)}),
                    timeout=10)
        except Exception:  # noqa: BLE001 - tracking never fails a run
            pass
    report = finish_tracker(tracker, status, checkpoint)
    now = time.time()
    final, total = timeline(now), now - start
    if not quiet:
        print(startup.table(final, total, f"redray: the run took {total:.1f} s"), flush=True)
    return startup.seconds(final), total, report


# How long an elastic group of a given size may wait for its placement before a smaller
# one is tried.
ELASTIC_START_TIMEOUT_S = 10


def _group(config: ClusterConfig, room: Room, quiet: bool, spans: startup.Recorder, view,
           restart: bool = False):
    """The hosts for the next group: the kept group of this shape, or a new one (an
    elastic run: as many hosts as the cluster places now beside what stays free, at
    least ``min_hosts``). ``restart``: after a group that failed (the new one says what
    it is, and why)."""
    import ray

    from redray.cluster import hosts

    env = _worker_env(config, quiet)
    if not config.elastic:
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        strategy = "STRICT_SPREAD" if nodes >= config.hosts > 1 or room.slices else "SPREAD"
        shape = hosts.Shape.of(config.hosts, room, env, strategy)
        group = hosts.take(shape) or hosts.start(shape, spans, say=view.write)
        if restart:
            view.write(f"redray: a new group of {config.hosts} host(s) resumes the run")
        return group
    hosts.release_hosts()  # an elastic group is sized anew for each run
    told, tried, begun = False, [], time.monotonic()
    while True:
        for size in range(config.max_hosts, config.min_hosts - 1, -room.step):
            if not room.free_for(size):
                tried.append(f"{size}: not free")
                continue
            group = hosts.start(hosts.Shape.of(size, room, env, "SPREAD"), spans,
                                timeout=ELASTIC_START_TIMEOUT_S, say=view.write)
            if group is not None:
                if restart or size < config.max_hosts:
                    why = f" ({'; '.join(tried)})" if tried else ""
                    view.write(f"redray: a group of {size} host(s) "
                               f"(the run takes {config.min_hosts} to {config.max_hosts}): "
                               f"the most the cluster places now, {room.describe(size)}"
                               f"{why}")
                return group
            tried.append(f"{size}: not placed within {ELASTIC_START_TIMEOUT_S} s")
        if not told and time.monotonic() - begun > ELASTIC_START_TIMEOUT_S:
            told = True  # (not before: a group that just ended frees its resources late)
            view.write(f"redray: waiting for room for {room.describe(config.min_hosts)} "
                       f"(the elastic run's fewest); the cluster has "
                       f"{shown_resources(ray.available_resources())} free of "
                       f"{shown_resources(ray.cluster_resources())}")
        tried = []
        time.sleep(1.0)


def _lost_nodes(ended) -> str | None:
    """Which hosts of a group that failed lost their node (Ray knows some seconds after
    a node stops answering), in a sentence; None while none is known."""
    gone = ended.gone()
    if not gone:
        return None
    said = ", ".join(f"host {rank}'s node {address} ({node[:8]})"
                     for rank, (node, address) in sorted(gone.items()))
    return (f"redray: {said} left the cluster: the last group of {len(ended.actors)} "
            "host(s) ended with it")


# After a group failed, how long the next one's driver watches for its hosts' nodes to be
# known lost (to name them).
LOSS_NOTICE_S = 120.0


# Without a first training step this long after a group started, the driver says what
# each host is doing (and, for a stream, whether Ray Data has a CPU to read with).
START_NOTICE_S = 60.0
POLL_S = 1.0


def _run_on(group, job: HostJob, results, view, streams: bool = False, ended=None) -> str:
    """Runs ``job`` on every host of ``group`` and waits for all; ``DONE`` or
    ``REGROUP``. The first host that fails or is lost ends the group at once (its peers
    would wait for it in a collective): ``HostFailure``, naming the host whose end
    caused the others' where the evidence tells. A group that trains no step within
    ``START_NOTICE_S`` is described once while it goes on: each host's start-up phase,
    and what it needs. ``ended``: the group that failed before this one: which of its
    hosts' nodes left the cluster is said once Ray knows (within ``LOSS_NOTICE_S``)."""
    import ray

    def reported() -> dict:
        _, failures = ray.get(results.get.remote())
        return {rank: (text.strip().splitlines() or [""])[-1][:300]
                for rank, text, _ in failures}

    ray.get(results.new_group.remote())
    refs = group.run(job)
    outcomes = {}
    pending = list(refs)
    begun, told = time.monotonic(), False
    try:
        with Watcher(results, view):
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
                if ended is not None and time.monotonic() - begun < LOSS_NOTICE_S:
                    lost = _lost_nodes(ended)
                    if lost:
                        view.write(lost)
                        ended = None
                if not ready and not told and time.monotonic() - begun > START_NOTICE_S:
                    told = _notice_start(group, results, view, streams, begun)
                for ref in ready:
                    try:
                        outcomes[ref] = ray.get(ref)
                    except ray.exceptions.RayError as error:
                        raise group.failure(refs, refs.index(ref), error,
                                            reported) from error
    except BaseException:  # a host's end, or the driver's (Ctrl-C): no host goes on alone
        group.close()
        raise
    return outcomes[refs[0]]


def _notice_start(group, results, view, streams: bool, begun: float) -> bool:
    """Says what a group that has trained no step yet waits for (each host's start-up
    phase, and for a stream whether Ray Data has a CPU to read with). Returns True: said,
    or nothing to say (a step was trained)."""
    import ray

    doing = ray.get(results.where.remote())
    if any(what == TRAINED for what, _ in doing.values()):
        return True
    now = time.time()
    said = []
    for rank in range(len(group.actors)):
        if rank not in doing:
            said.append(f"host {rank}: its job not started")
            continue
        what, since = doing[rank]
        said.append(f"host {rank}: {startup.PHASES.get(what, what)} (for {now - since:.0f} s)")
    text = (f"redray: the group of {len(group.actors)} host(s) has trained no step "
            f"{time.monotonic() - begun:.0f} s after it started; " + "; ".join(said))
    if streams and "CPU" in dict(group.shape.room.host):
        free = ray.available_resources().get("CPU", 0)
        if free < 1:
            total = ray.cluster_resources().get("CPU", 0)
            text += (". Ray Data has no free CPU to read the stream: "
                     + _no_data_cpu(total, len(group.actors), total - free))
    view.write(text)
    return True


def _await_room(hosts: int, room: Room, seconds: float = 60.0) -> None:
    """Waits (at most ``seconds``) until the cluster has room for ``hosts`` hosts: the
    group that ended frees its workers' resources asynchronously, and the next group is
    sized from what is free when it starts (a group started early would be the old
    size, and regroup again at its next checkpoint)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if room.free_for(hosts):
            break
        time.sleep(0.2)


def _worker_env(config: ClusterConfig, quiet: bool = True) -> dict:
    env = {"PYTHONPATH": _local_paths(), VERBOSE_ENV: "0" if quiet else "1"}
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


def worker_resources(config: ClusterConfig) -> dict:
    """What one host's worker reserves on its Ray node."""
    if config.use_gpu:
        return {"GPU": config.devices_per_host or 1}
    if config.use_tpu:
        return {"TPU": config.devices_per_host or 4}
    return {"CPU": 1}


def group_room(config: ClusterConfig, task=None, slices=None) -> Room:
    """What each group of the run takes of the cluster: each host's reservation, and,
    when the hosts reserve CPUs and the task reads a stream, one CPU kept free beside
    them for Ray Data's reads (a group that took the last CPU would wait forever for its
    first batch; GPU and TPU hosts leave their nodes' CPUs to Ray Data). ``slices``: a
    TPU run's (``tpu.SliceRequest``): each host takes its node's chips."""
    if slices is not None:
        return Room.of({"TPU": slices.chips_per_host}, None, slices)
    host = worker_resources(config)
    spare = {"CPU": 1} if "CPU" in host and task is not None and _streams(task) else None
    return Room.of(host, spare)


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
