"""This process's Ray: joined or started here, and quiet.

Ray Data starts a local Ray by itself, counting the machine's cores as its CPUs. A run
started later on that instance (``redray.fit``) reserves one CPU per host, and Ray
Data's reads and transforms then find none free and wait forever. So the data layer
starts the local instance itself, with logical CPUs to spare for hosts (a logical CPU
is a scheduling token: XLA and the reads still share the real cores), and keeps Ray
Data to the real cores: on this driver, and in the hosts of a run, to which the driver
hands its DataContext (``HostJob.data_context``).

A local instance is always a new one (``address="local"``): by default Ray would join
a ``ray start`` cluster running on this machine instead, and then refuse ``num_cpus``.

Unless verbose (``redray/verbosity.py``), what every Ray session prints that tells a
user nothing is dropped (``NOISE``): the set-up chatter of Ray, Gloo, JAX, MLflow and
transformers, on the driver and in what the cluster's processes stream to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

from redray.verbosity import verbose

SPARE_CPUS = 8


def ensure_ray() -> None:
    """Connects to ``RAY_ADDRESS`` if set, else starts a local Ray with the machine's
    cores plus ``SPARE_CPUS`` logical CPUs; does nothing when Ray is running."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        join_ray(os.environ["RAY_ADDRESS"])
    else:
        start_local((os.cpu_count() or 1) + SPARE_CPUS)


def start_local(num_cpus: int | None) -> None:
    """Starts a new Ray instance on this machine, without the dashboard (nothing of a
    run needs it, and it took 2 of the 7 s ``ray.init`` takes on 2 cores; start Ray
    yourself, ``ray.init()``, to have it: a run joins the Ray this process runs) and
    without idle workers started ahead: Ray starts one per CPU, each importing Ray,
    and a run's hosts take none of them (their environment is their own), so on 2
    cores they only slowed the hosts' start (a tiny run: 2-3 s of its 25)."""
    import ray

    with _quiet_start():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=True, logging_level=_ray_log_level(),
                 _system_config={"enable_worker_prestart": False})
    quiet_ray_logs()
    limit_data_to_cores()


def on_driver_node():
    """The scheduling strategy that keeps a driver's actor (results, tracker) on the
    driver's own node: a worker node may leave mid-run, the driver's node lives as long as
    the driver. Hard affinity: a soft one was seen placed on a worker node (CI, an elastic
    run whose head node has no CPUs), which the node's loss then took down."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def limit_data_to_cores() -> None:
    """Ray Data on this driver runs at most a task per core of the machine, not one per
    logical CPU of the local instance (which counts more: see above). Each task beyond
    starts another worker process that loads the user's transform again, on the same
    cores: the demo's corpus took 29.6 s to prepare on 2 cores instead of 10.6 s."""
    from ray.data import DataContext

    options = DataContext.get_current().execution_options
    options.resource_limits = options.resource_limits.copy(cpu=os.cpu_count() or 1)


def join_ray(address: str) -> None:
    """Joins the Ray cluster at ``address`` (``host:port`` or ``ray://host:port``)."""
    import ray

    # (Ray Client hands a non-default logging level on to the cluster's side)
    level = {} if address.startswith("ray://") else {"logging_level": _ray_log_level()}
    with _quiet_start():
        ray.init(address=address, log_to_driver=True, **level)
    quiet_ray_logs()


def _ray_log_level() -> int:
    """Ray's driver log level: its INFO lines ("Started a local Ray instance") only when
    verbose."""
    return logging.INFO if verbose() else logging.WARNING


@contextlib.contextmanager
def _quiet_start():
    quiet_loggers()
    with warnings.catch_warnings():
        # Ray starts its processes by fork and exec: JAX's warning (when JAX ran first)
        # that a fork deadlocks multithreaded code is about forks that go on running.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
        yield


# What every run prints that tells a user nothing (each with where it comes from).
NOISE = tuple(re.compile(p) for p in (
    r"(Starting|Connecting to) JAX distributed service on",  # jax.distributed
    r"Progress bars disabled\. To enable",  # Ray Data (redray turns its bars off)
    r"PYTHON worker processes have been started on node",  # the raylet, as actors start
    r"INFO mlflow\.store\.db\.utils|INFO  \[alembic",  # MLflow creating its SQLite tables
    r"PyTorch was not found\. Models won't be available",  # transformers without torch
    r"Token authentication is enabled for this Ray cluster",  # Ray 2.60's token auth
    r"os\.fork\(\) was called\. os\.fork\(\) is incompatible",  # JAX, when Ray forks
    r"INFO job_manager\.py:\d+ -- Runtime env is setting up",  # a Ray job's log
    r"is now ignored by default when packaging the working directory",  # a job's upload
    # Ray Client, as it connects (its server's driver runs in a thread)
    r"Passing the following kwargs to ray\.init\(\) on the server",
    r"SIGTERM handler is not set because current thread is not the main thread",
))
# A Python warning's first line (``file.py:12: SomeWarning: text``); the indented lines
# after it (the source line) belong to it.
WARNING_LINE = re.compile(r"^\S.*:\d+: \w+: ")


# Gloo, at each collective's set-up: "[Gloo] Rank R is connected to N peer ranks.
# Expected number of connected peer ranks is : N", written a piece at a time by several
# threads at once, so the pieces of two such lines interleave, and one line's end (its
# last number, or only its newline) may come alone on the next line.
GLOO_PIECES = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|"
                         r"Expected number of connected peer ranks is :")
GLOO_START = "[Gloo] Rank"
DIGITS = "0123456789 \t"  # what else a Gloo line holds


class OutputState:
    """What ``drop_noise`` remembers of one process's output between its batches of
    lines: how many Gloo lines began whose end has not come yet."""

    def __init__(self):
        self.gloo_open = 0


def gloo_starts(line: str) -> int | None:
    """How many Gloo lines begin in ``line`` if it holds nothing but Gloo's pieces and
    numbers, else None."""
    rest, pieces = GLOO_PIECES.subn(" ", line)
    if pieces and not rest.strip(DIGITS):
        return line.count(GLOO_START)
    return None


def drop_noise(lines: list[str], stream: OutputState | None = None) -> list[str]:
    """``lines`` without the ``NOISE`` ones (nor a dropped warning's source line) and
    Gloo's lines, torn ones included; ``stream``: the process's earlier lines' state."""
    stream = stream or OutputState()
    kept, dropping = [], False
    for line in lines:
        if dropping and line.startswith((" ", "\t")):
            continue
        dropping = False
        starts = gloo_starts(line)
        if starts is not None:
            stream.gloo_open = max(0, stream.gloo_open + starts - 1)
            continue
        if stream.gloo_open and not line.strip(DIGITS):  # a torn Gloo line's end
            stream.gloo_open -= 1
            continue
        stream.gloo_open = 0
        if any(p.search(line) for p in NOISE):
            dropping = bool(WARNING_LINE.search(line))
            continue
        kept.append(line)
    return kept


class _NoiseFilter(logging.Filter):
    """For this process's own loggers (Ray's token warning at ``ray.init``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _screen.dropping() or bool(drop_noise([record.getMessage()]))


class _Screen:
    """Where the streamed lines go: printed inside ``screen.above()`` when a live
    progress line is on the terminal (``redray/cluster/console.py``); ``quiet``: drop
    the noise (None: unless ``REDRAY_VERBOSE``)."""
    screen = None
    quiet: bool | None = None

    def dropping(self) -> bool:
        return not verbose() if self.quiet is None else self.quiet


_screen = _Screen()


def quiet_ray_logs(screen=None, quiet: bool | None = None) -> None:
    """Filters what the cluster's processes stream to this driver through
    ``drop_noise`` (unless verbose), printing it inside ``screen.above()`` if given;
    ``quiet`` overrides ``REDRAY_VERBOSE`` (a run's ``verbose=``).

    Ray prints the streamed lines from a handler of its private log dispatcher (Ray
    Client: its log client's ``stdstream``); where that is not found (another Ray
    layout) the output stays unfiltered.
    """
    if screen is not None:
        _screen.screen = screen
    _screen.quiet = quiet
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        pass
    else:
        # the streamed lines (the handler holds the function it was given) and the
        # cluster's error messages (which call the module's function by name)
        with dispatcher._lock:
            dispatcher.handlers = [(name, _filtered(handler) if name == "ray_print_logs"
                                    else handler) for name, handler in dispatcher.handlers]
        ray_worker.print_to_stdstream = _filtered(ray_worker.print_to_stdstream)
    _quiet_ray_client()


_FILTER = _NoiseFilter()
# This process's loggers that log noise: Ray's token warning (at ray.init), Ray Data's
# "Progress bars disabled" (at a dataset's first pass), Ray Client's connection line,
# a job's upload (".git" and ".venv" left out).
NOISY_LOGGERS = ("ray._private.authentication.authentication_token_setup",
                 "ray.data._internal.progress", "ray.client_builder",
                 "ray._private.runtime_env.working_dir")


# Ray's job SDK on the client: an INFO line per upload ("already exists, skipping
# upload") and connection. Each module sets its logger's level as it is imported.
JOB_SDK_LOGGERS = ("ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk",
                   "ray._private.runtime_env.packaging")


def quiet_loggers() -> None:
    """Drops the ``NOISE`` that this process's own Ray loggers log (unless verbose)."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)


def quiet_job_sdk() -> None:
    """Quiets a job client (``redray submit``, ``logs``...): the SDK's INFO lines (call
    it once the SDK is imported) and the ``NOISY_LOGGERS``."""
    for name in JOB_SDK_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_loggers()


def _above():
    screen = _screen.screen
    return screen.above() if screen is not None else contextlib.nullcontext()


def _filtered(handler):
    if getattr(handler, "redray_original", None) is not None:
        return handler

    streams: dict = {}  # each process's output (a worker's stdout, its stderr, ...)

    def quiet(data, *args, **kwargs):
        lines = data.get("lines") or []
        if _screen.dropping():
            key = (data.get("ip"), data.get("pid"), data.get("is_err"))
            lines = drop_noise(lines, streams.setdefault(key, OutputState()))
        if lines:
            with _above():
                handler({**data, "lines": lines}, *args, **kwargs)

    quiet.redray_original = handler
    return quiet


def _quiet_ray_client() -> None:
    """The same filter for a Ray Client connection's log stream (text chunks)."""
    try:
        from ray.util.client import ray as client

        logs = client.worker.log_client if client.is_connected() else None
    except Exception:  # noqa: BLE001 - another Ray layout: the output stays unfiltered
        return
    if logs is None or getattr(logs.stdstream, "redray_original", None) is not None:
        return
    original = logs.stdstream
    stream = OutputState()  # the client gets the cluster's output as one text stream

    def stdstream(level: int, msg: str):
        lines = msg.splitlines()
        if _screen.dropping():
            lines = drop_noise(lines, stream)
        if lines:
            with _above():
                original(level=level, msg="\n".join(lines) + "\n")

    stdstream.redray_original = original
    logs.stdstream = stdstream
