"""Tracking from one place, in the background, never in the training step's way.

``QueuedLogger`` owns one tracker's run: ``MlflowLogger`` here, TensorBoard's and
Weights & Biases' in ``redray.trackers``. Every call only queues; a thread talks to the
store. A store that fails (server down, disk full, bad URI) produces ONE warning
naming the store and the reason; what could not be logged is retried while the run goes
on and counted as dropped if it still cannot be logged at the end (or if the queue
overflows). Training never waits on a tracker and never fails because of it.

One value per metric and step, always: a resumed run trains again the steps between
its checkpoint and the last logged step, and those replayed rows are not logged a
second time. Each session (``new_session``: a new worker group, or a new logger on a
resumed run, whose mark comes from the store) marks the newest step logged so far for
every metric; rows at or below the mark are replays and are left out (counted in
``replayed``). Rows within a session are never filtered.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from redray.storage import CACHE_ENV, SQLITE, RunFolders, sqlite_file

log = logging.getLogger("redray.tracking")

DEFAULT_EXPERIMENT = "redray"
RUN_PATH_TAG = "redray.run_path"
MAX_QUEUED = 100_000


class TrackingWarning(UserWarning):
    """The tracking store failed; training went on."""


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on ``uri``."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {uri}"


class QueuedLogger:
    """One tracker's run (MLflow's, TensorBoard's, W&B's), logged from a background
    thread: every call only queues; the thread opens the store (``_open``) and sends
    what is queued (``_send``), retrying while the run goes on. One value per metric and
    step across sessions: ``_open`` sets ``_newest`` from what the store already holds,
    and ``_metric_rows`` leaves out the rows at or below the session's mark.

    Subclasses set ``kind`` (the tracker's name, for messages), pass ``where`` (its
    store) and implement ``_open``, ``_write`` (metric rows) and ``_apply`` (every other
    item)."""

    kind = "tracking"

    def __init__(self, where: str):
        self.where = where
        self.run_id: str | None = None
        self.failure: str | None = None
        self.dropped = 0
        self.logged_metrics = 0
        self.replayed = 0  # metric values left out as replays of logged steps
        self._newest: dict[str, int] = {}  # per metric: the newest step logged
        self._mark: dict[str, int] = {}  # per metric: the newest step before this session
        self._queue: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"redray-{self.kind}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ what callers use
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if values:
            self._put(("metrics", int(step), values, int(time.time() * 1000)))

    def new_session(self) -> None:
        """A resumed part of the run starts (a restarted worker group): the steps it
        trains again, up to the newest logged one, are not logged twice."""
        self._put(("session",))

    def log_params(self, params: dict[str, Any]) -> None:
        self._put(("params", _flat(params)))

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._put(("tags", {k: str(v) for k, v in tags.items()}))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._put(("text", text, artifact_file))

    def log_artifacts(self, folder: str, artifact_path: str) -> None:
        """The files under ``folder`` as the run's artifact folder ``artifact_path``."""
        self._put(("artifacts", folder, artifact_path))

    def finish(self, status: str = "FINISHED", timeout: float = 60.0) -> dict:
        """Ends the run; waits up to ``timeout`` s for the queue. Returns a report:
        ``run_id``, ``failure`` (the first error, or None), ``dropped`` (values lost),
        ``uri`` (where the run is)."""
        self._put(("end", status))
        self._done.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.dropped += self._queue.qsize()
        return {"run_id": self.run_id, "failure": self.failure, "dropped": self.dropped,
                "uri": self.where}

    # ------------------------------------------------------------ the thread
    def _put(self, item) -> None:
        if self._queue.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.put(item)

    def _work(self) -> None:
        client, backlog, delay = None, [], 1.0
        while True:
            ending = self._done.is_set()
            try:
                while True:
                    backlog.append(self._queue.get(timeout=0.2 if not backlog else 0.0))
            except queue.Empty:
                pass
            if not backlog:
                if ending:
                    return
                continue
            try:
                if client is None:
                    client = self._open()
                    self._mark = dict(self._newest)
                backlog = self._send(client, backlog)
                delay = 1.0
            except Exception as error:  # noqa: BLE001 - the store's fault, never training's
                if self.failure is None:
                    self.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" \
                        if str(error) else type(error).__name__
                    log.warning("%s tracking at %s failed (%s); training goes on and "
                                "logging is retried", self.kind, self.where, self.failure)
                if ending:  # one last try failed: what is left is lost
                    self.dropped += sum(_values(item) for item in backlog)
                    return
                self._done.wait(delay)
                delay = min(delay * 2, 30.0)

    def _metric_rows(self, backlog: list, most: int = 900) -> tuple[list, dict, int]:
        """The queued metric rows at the head of ``backlog`` (up to ``most`` values), as
        (step, stamp, values) without the replays of this session's mark; the newest
        steps they make; how many items they were. ``backlog`` is left as it was: the
        caller commits (``_commit``) once they are sent."""
        rows, newest, taken, count = [], dict(self._newest), 0, 0
        while taken < len(backlog) and backlog[taken][0] == "metrics" and count < most:
            _, step, values, stamp = backlog[taken]
            kept = {}
            for k, v in values.items():
                if step <= self._mark.get(k, -1):
                    continue
                kept[k] = v
                newest[k] = max(step, newest.get(k, step))
            rows.append((step, stamp, kept, len(values) - len(kept)))
            count += len(kept)
            taken += 1
        return rows, newest, taken

    def _commit(self, backlog: list, rows: list, newest: dict, taken: int) -> None:
        """The rows of ``_metric_rows`` were sent: the replays counted, the marks moved."""
        self.replayed += sum(r[3] for r in rows)
        self.logged_metrics += sum(len(r[2]) for r in rows)
        self._newest = newest
        del backlog[:taken]

    def _send(self, client, backlog: list) -> list:
        """Sends queued items in order, each taken off ``backlog`` once sent; returns
        what is left (nothing, or raises: what failed stays queued)."""
        while backlog:
            kind = backlog[0][0]
            if kind == "metrics":
                rows, newest, taken = self._metric_rows(backlog)
                self._write(client, rows)
                self._commit(backlog, rows, newest, taken)
                continue
            if kind == "session":
                self._mark = dict(self._newest)
            else:
                self._apply(client, backlog[0])
            backlog.pop(0)
        return backlog

    def _open(self):
        """Opens (or continues) the run; sets ``run_id`` and ``_newest`` from what the
        store holds; returns what ``_write`` and ``_apply`` get."""
        raise NotImplementedError

    def _write(self, client, rows: list) -> None:
        """Sends metric rows, (step, stamp in ms, values, replays left out)."""
        raise NotImplementedError

    def _apply(self, client, item: tuple) -> None:
        """Sends one queued item: params, tags, text, artifacts or the end."""
        raise NotImplementedError


class MlflowLogger(QueuedLogger):
    """One MLflow run, logged from a background thread (``QueuedLogger``).

    Args:
      uri: the tracking URI.
      run_name: the run's name in MLflow (redray's run name).
      run_path: identifies the run across restarts (``<storage>/<name>``); stored as the
        tag ``redray.run_path``.
      experiment: MLflow experiment name.
      resume: continue the MLflow run of ``run_path`` (or ``run_id``) if there is one.
      run_id: the run to continue (e.g. read from a checkpoint), tried first.
    """

    kind = "MLflow"

    def __init__(self, uri: str, run_name: str, run_path: str,
                 experiment: str = DEFAULT_EXPERIMENT, resume: bool = True,
                 run_id: str | None = None):
        # MLflow's HTTP client retries for minutes by default; the queue retries instead.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri, self.run_name, self.run_path = uri, run_name, run_path
        self.experiment, self.resume = experiment, resume
        self._wanted_run_id = run_id
        super().__init__(uri)

    def _open(self):
        from mlflow.tracking import MlflowClient

        database = sqlite_file(self.uri)
        if database is not None:
            os.makedirs(os.path.dirname(database), exist_ok=True)
            if not os.path.exists(database):
                new_store(database)
        client = MlflowClient(self.uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif database is not None:
            # artifacts next to the database, not in the process's working directory
            folder = os.path.dirname(database)
            experiment_id = client.create_experiment(
                self.experiment, artifact_location=f"{folder}/mlartifacts")
        else:
            experiment_id = client.create_experiment(self.experiment)
        run = None
        if self.resume and self._wanted_run_id:
            try:
                run = client.get_run(self._wanted_run_id)
            except Exception:  # noqa: BLE001 - not in this store: look it up by path
                run = None
        if self.resume and run is None:
            found = client.search_runs([experiment_id],
                                       filter_string=f"tags.`{RUN_PATH_TAG}` = '{self.run_path}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
            run = found[0] if found else None
        if run is None:
            run = client.create_run(experiment_id, run_name=self.run_name,
                                    tags={RUN_PATH_TAG: self.run_path})
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self._existing_params = dict(run.data.params)
        self._params_changed = run.data.tags.get(PARAMS_CHANGED, "")
        self.run_id = run.info.run_id
        for key in run.data.metrics:  # a resumed run: what earlier sessions logged
            steps = [m.step for m in client.get_metric_history(self.run_id, key)]
            if steps:
                self._newest[key] = max(steps)
        return client

    def _write(self, client, rows: list) -> None:
        from mlflow.entities import Metric

        batch = [Metric(k, v, stamp, step) for step, stamp, values, _ in rows
                 for k, v in values.items()]
        if batch:
            client.log_batch(self.run_id, metrics=batch)

    def _apply(self, client, item: tuple) -> None:
        from mlflow.entities import Param, RunTag

        kind = item[0]
        if kind == "params":
            new = {k: v for k, v in item[1].items() if k not in self._existing_params}
            changed = {k: v for k, v in item[1].items()
                       if k in self._existing_params and self._existing_params[k] != v}
            if new:
                client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()])
                self._existing_params.update(new)
            if changed:
                self._change_params(client, changed)
        elif kind == "tags":
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in item[1].items()])
        elif kind == "text":
            client.log_text(self.run_id, item[1], item[2])
        elif kind == "artifacts":
            client.log_artifacts(self.run_id, item[1], item[2])
        elif kind == "end":
            client.set_terminated(self.run_id, status=item[1])

    def _change_params(self, client, changed: dict[str, str]) -> None:
        """A resumed run with other settings (a larger ``max_steps``): its params must
        say what it runs with now. MLflow's API refuses to change a param; in a SQL store
        (SQLite, the default) redray rewrites the values in place. Every change is also
        appended to the tag ``redray.params_changed``; where the store cannot be
        rewritten (an MLflow server), that tag holds the current values, with a warning."""
        from mlflow.entities import RunTag

        line = ", ".join(f"{k}: {self._existing_params[k]} -> {v}" for k, v in changed.items())
        rewritten = _rewrite_params(client, self.run_id, changed)
        if not rewritten:
            log.warning("MLflow at %s cannot change the params of a run; the resumed run's "
                        "new settings (%s) are in its tag %s", self.uri, line, PARAMS_CHANGED)
        self._params_changed = "\n".join(filter(None, [
            getattr(self, "_params_changed", ""), f"resumed with {line}"]))[-5000:]
        client.log_batch(self.run_id, tags=[RunTag(PARAMS_CHANGED, self._params_changed)])
        self._existing_params.update(changed)


PARAMS_CHANGED = "redray.params_changed"


def store_template() -> str:
    """Where this machine keeps an empty MLflow SQLite store of the installed MLflow's
    schema: ``REDRAY_CACHE_DIR`` where set (``redray.storage``), else ``~/.cache/redray``."""
    import mlflow

    folder = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                       "redray")
    return os.path.join(folder, f"mlflow-{mlflow.__version__}-empty.db")


def new_store(database: str) -> None:
    """Creates the SQLite store ``database`` as a copy of the machine's template
    (``store_template``), made once: MLflow creates a new store's tables by running
    every schema migration since its first release, 2.6 s on 2 cores, which every run
    in a new storage folder paid. The template holds no experiment; MLflow adds its
    Default one (pointing next to the new store) when it first opens the copy. Where
    the template cannot be written, MLflow creates the store itself."""
    import shutil
    import tempfile

    template = store_template()
    try:
        if not os.path.exists(template):
            os.makedirs(os.path.dirname(template), exist_ok=True)
            fd, fresh = tempfile.mkstemp(suffix=".db", dir=os.path.dirname(template))
            os.close(fd)
            os.remove(fresh)  # MLflow creates the file; an empty one would not be migrated
            _empty_store(fresh)
            os.replace(fresh, template)
        fd, copy = tempfile.mkstemp(suffix=".db", dir=os.path.dirname(database))
        os.close(fd)
        shutil.copyfile(template, copy)
        os.replace(copy, database)
    except OSError as error:
        log.info("no MLflow store template (%s): MLflow creates %s itself", error, database)


def _empty_store(database: str) -> None:
    """A migrated MLflow SQLite store at ``database`` without its Default experiment."""
    import sqlite3

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"{SQLITE}{database}", os.path.dirname(database))
    store.engine.dispose()
    with sqlite3.connect(database) as connection:
        connection.execute("DELETE FROM experiments")
    connection.close()


def _rewrite_params(client, run_id: str, changed: dict[str, str]) -> bool:
    """Rewrites params of ``run_id`` in a SQL store; False for any other store."""
    try:
        from mlflow.store.tracking.dbmodels.models import SqlParam
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    except ImportError:  # another MLflow layout
        return False
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if not isinstance(store, SqlAlchemyStore):
        return False
    with store.ManagedSessionMaker() as session:
        for key, value in changed.items():
            session.query(SqlParam).filter(SqlParam.run_uuid == run_id,
                                           SqlParam.key == key).update({"value": value})
    return True


def _values(item) -> int:
    return {"metrics": len(item[2]) if item[0] == "metrics" else 0, "end": 0,
            "session": 0}.get(item[0], 1)


def _flat(params: dict, prefix: str = "") -> dict[str, str]:
    """Params as MLflow strings, nested dicts as dotted keys; never an address that
    changes with every process (``<function f at 0x7f...>``): a function is its module
    and name, an object without its own readable repr its type."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = readable(v)[:6000]
    return out


def readable(value: Any) -> str:
    """``value`` as a param: stable across processes (see ``_flat``)."""
    import functools
    import re

    if isinstance(value, functools.partial):
        return f"partial({readable(value.func)})"
    if callable(value) and hasattr(value, "__qualname__") and not isinstance(value, type):
        return f"function {getattr(value, '__module__', '?')}.{value.__qualname__}"
    text = str(value)
    if re.search(r" at 0x[0-9a-f]+>", text):  # the default repr of an object
        return f"{type(value).__module__}.{type(value).__qualname__}"
    return text


GIT_COMMIT_ENV = "REDRAY_GIT_COMMIT"


def git_commit(path: str = ".") -> str | None:
    """The git commit of ``path``'s working tree (with ``-dirty`` if modified); outside
    a git work tree, what ``redray submit`` sent in ``REDRAY_GIT_COMMIT`` (a submitted
    job runs in a copy of its working directory without ``.git``); else None."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if head.returncode:
            return os.environ.get(GIT_COMMIT_ENV) or None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get(GIT_COMMIT_ENV) or None


# ---------------------------------------------------------------- plots
def find_run(client, run: str, experiment: str = DEFAULT_EXPERIMENT):
    """A run by id, or the newest run of that name (or ``redray.run_path``)."""
    try:
        return client.get_run(run)
    except Exception:  # noqa: BLE001 - not an id: look it up by name
        pass
    exp = client.get_experiment_by_name(experiment)
    ids = [exp.experiment_id] if exp else [e.experiment_id for e in client.search_experiments()]
    for filt in (f"attributes.run_name = '{run}'", f"tags.`{RUN_PATH_TAG}` = '{run}'"):
        found = client.search_runs(ids, filter_string=filt,
                                   order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            return found[0]
    raise LookupError(f"no MLflow run {run!r} in {client.tracking_uri}: give a run id, a run "
                      "name, or the tracking URI the run logged to (--tracking-uri)")


DEFAULT_PLOT = ("loss", "eval_loss", "learning_rate")


def plot(run: str, out: str, tracking_uri: str | None = None, storage_path: str | None = None,
         metrics=None) -> str:
    """Writes a PNG of a run's metric curves against the step; returns its path.

    ``run``: an MLflow run id or a redray run name; ``tracking_uri``: default
    ``MLFLOW_TRACKING_URI``, else the SQLite store of ``storage_path`` (default
    ``~/redray_runs``). ``metrics``: the metrics to draw (default loss, eval loss and
    learning rate, those the run has); losses share a panel, every other metric gets
    its own, each with its axes labelled.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(run, tracking_uri, storage_path, metrics)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_figure(run: str, tracking_uri: str | None = None, storage_path: str | None = None,
                metrics=None):
    """The matplotlib figure ``plot`` writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    uri = RunFolders.of(storage_path, run, tracking_uri).tracking_uri
    database = sqlite_file(uri)
    if database is not None and not os.path.exists(database):
        raise LookupError(f"no MLflow store at {uri}: give the storage folder the run was "
                          "written to (--storage) or its tracking URI (--tracking-uri)")
    client = MlflowClient(uri)
    found = find_run(client, run)
    logged = sorted(found.data.metrics)
    asked = list(metrics) if metrics else [m for m in DEFAULT_PLOT if m in logged]
    unknown = [m for m in asked if m not in logged]
    if unknown or not asked:
        raise LookupError(f"run {run!r} logged no metric {unknown or list(DEFAULT_PLOT)}; it "
                          f"logged: {', '.join(logged) or 'nothing'} (choose with --metric)")
    curves = {m: sorted((p.step, p.value) for p in client.get_metric_history(
        found.info.run_id, m)) for m in asked}
    losses = [m for m in asked if m.endswith("loss")]
    panels = ([losses] if losses else []) + [[m] for m in asked if m not in losses]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), squeeze=False)
    for ax, names in zip(axes[:, 0], panels):
        for name in names:
            steps, values = zip(*curves[name])
            ax.plot(steps, values, label=name, marker="o" if len(steps) < 30 else None)
        ax.set_xlabel("step (optimizer updates)")
        ax.set_ylabel("loss" if names is losses else names[0].replace("_", " "))
        ax.legend()
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(f"{found.info.run_name} ({found.info.run_id[:8]})")
    fig.tight_layout()
    return fig
