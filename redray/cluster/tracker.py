"""The run's one MLflow writer: an actor on the driver's node.

Host 0 sends every logged row to the tracker actor without waiting (the other hosts
send nothing), and the actor logs it from a background thread: each value reaches
MLflow once, whatever the number of hosts, and the training step never waits on MLflow.
Rows do not go through ``ray.train.report``: that is a barrier across hosts and its
results reach the controller only at its polling interval (measured 1.3-2 s per
report on 2 cores), which made every logged row stall training. Checkpoints are still
reported to Ray Train (all hosts alike); the controller's ``CheckpointsToTracker``
callback tells the tracker the newest one.
"""

from __future__ import annotations

import logging
import warnings

from ray.train.v2.api.callback import UserCallback

from redray.engine.hooks import Hook
from redray.sharding.parallelism import describe_shape
from redray.tracking import MlflowLogger, TrackingWarning, git_commit

log = logging.getLogger("redray.tracking")

CHECKPOINT_KEY = "redray_checkpoint"
# The MLflow run id in a checkpoint's meta["run"]: a resumed run logs into that run.
RUN_ID_KEY = "mlflow_run_id"
FINISH_TIMEOUT_S = 60


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=8)
    class Tracker:
        """Owns the MlflowLogger; every method returns at once."""

        def __init__(self, uri, run_name, run_path, experiment, resume, run_id, params, tags):
            self.logger = MlflowLogger(uri, run_name, run_path, experiment, resume, run_id)
            self.logger.log_params(params)
            self.logger.set_tags(tags)

        def new_session(self) -> None:
            self.logger.new_session()

        def log(self, row: dict) -> None:
            if any(k.startswith("eval_") for k in row):  # its epoch is the train rows'
                row = {k: v for k, v in row.items() if k != "epoch"}
            self.logger.log_metrics(row, row.get("step", 0))

        def describe(self, tags: dict, plan: str) -> None:
            self.logger.set_tags(tags)
            self.logger.log_text(plan, "sharding_plan.txt")

        def checkpoint(self, path: str) -> None:
            self.logger.set_tags({"redray.last_checkpoint": path})

        def run_id(self):
            return self.logger.run_id

        def finish(self, status: str, checkpoint: str | None):
            if checkpoint:
                self.logger.set_tags({"redray.last_checkpoint": checkpoint})
            return self.logger.finish(status, timeout=FINISH_TIMEOUT_S)

    return Tracker


def start_tracker(folders, experiment: str, resume: bool, checkpoint_config, config: dict):
    """Starts the tracker actor on this (the driver's) node, where a SQLite store lives.

    Args:
      folders: the run's ``redray.storage.RunFolders``: its name, run folder and MLflow
        store.
      experiment: the MLflow experiment.
      resume: log into the MLflow run the newest checkpoint names, if any.
      checkpoint_config: the run's ``CheckpointConfig``, or None (no checkpoints).
      config: the run's settings, logged as MLflow params.
    """
    from redray.checkpoint import latest_meta
    from redray.data.ray_local import on_driver_node
    from redray.version import __version__

    run_id = None
    if resume and checkpoint_config is not None:
        meta = latest_meta(checkpoint_config.directory) or {}
        run_id = meta.get("run", {}).get(RUN_ID_KEY)
    tags = {"redray.version": __version__, "redray.run_name": folders.name}
    commit = git_commit()
    if commit:
        tags["redray.git_commit"] = commit
    return _actor_class().options(scheduling_strategy=on_driver_node()).remote(
        folders.tracking_uri, folders.name, folders.run, experiment, resume, run_id, config,
        tags)


def finish_tracker(tracker, status: str, checkpoint: str | None = None) -> dict | None:
    """Ends the MLflow run; warns (once) if the store failed. Never raises."""
    if tracker is None:
        return None
    import ray

    try:
        report = ray.get(tracker.finish.remote(status, checkpoint),
                         timeout=FINISH_TIMEOUT_S + 30)
    except Exception as error:  # noqa: BLE001 - tracking never fails a run
        warnings.warn(f"MLflow tracking could not be finished ({error})", TrackingWarning,
                      stacklevel=3)
        return None
    finally:
        ray.kill(tracker)
    if report["failure"]:
        warnings.warn(
            f"MLflow tracking at {report['uri']} failed ({report['failure']}); training "
            f"completed; {report['dropped']} values could not be logged. Check the tracking "
            "URI (tracking_uri=... or MLFLOW_TRACKING_URI) and that the store is reachable",
            TrackingWarning, stacklevel=3)
    return report


class CheckpointsToTracker(UserCallback):
    """Ray Train callback (on the controller): host 0's checkpoint reports become the
    tracker's ``redray.last_checkpoint`` tag. Metrics never pass here (see above)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.failed = False

    def after_report(self, run_context, metrics, checkpoint):
        try:
            row = metrics[0] if metrics else None
            if row and CHECKPOINT_KEY in row:
                self.tracker.checkpoint.remote(row[CHECKPOINT_KEY])
        except Exception as error:  # noqa: BLE001 - an exception here would fail the run
            if not self.failed:
                self.failed = True
                log.warning("could not tell the MLflow tracker about a checkpoint: %s", error)


class TrackerHook(Hook):
    """A host's Trainer hook: host 0 sends every logged row to the tracker (the other
    hosts send nothing), describes the run there once the state exists, and keeps the
    MLflow run id in the Trainer's checkpoints (``run_meta``) so a resume logs into
    the same MLflow run."""

    def __init__(self, tracker, rank: int):
        self.tracker = tracker if rank == 0 else None
        self.sent: list = []
        self.run_id: str | None = None

    def on_restore(self, trainer, step: int, path: str, meta: dict) -> None:
        self.run_id = meta.get("run", {}).get(RUN_ID_KEY) or self.run_id

    def run_meta(self, trainer) -> dict:
        return {RUN_ID_KEY: self.run_id} if self.run_id else {}

    def on_init(self, trainer) -> None:
        if self.tracker is None:
            return
        d = trainer.describe()
        tags = {"redray.hosts": d["hosts"], "redray.devices": d["devices"],
                "redray.mesh": describe_shape(d["mesh"]),
                "redray.parameters": d["parameters"],
                "redray.param_bytes_per_device": d["param_bytes_per_device"],
                "redray.accumulation_steps": d["accumulation_steps"]}
        # a chosen plan: what it is, why, its predicted step and the hardware numbers
        tags.update({f"redray.plan.{k}": v for k, v in d.get("plan", {}).items()})
        self.tracker.describe.remote(tags, trainer.plan())

    def on_log(self, trainer, row: dict) -> None:
        import ray

        if self.tracker is None:
            return
        try:
            self.sent.append(self.tracker.log.remote(row))  # no waiting: the actor queues it
            if len(self.sent) > 100:
                _, pending = ray.wait(self.sent, num_returns=len(self.sent), timeout=0)
                self.sent[:] = pending
        except Exception:  # noqa: BLE001 - tracking never fails a run
            return
        if self.run_id is None:
            try:
                self.run_id = ray.get(self.tracker.run_id.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - tracking never fails a run
                self.run_id = None

    def flush(self) -> None:
        """Waits (briefly) until the rows sent so far have reached the tracker: calls
        still in flight when a worker exits could be lost."""
        import ray

        try:
            if self.sent:
                ray.wait(self.sent, num_returns=len(self.sent), timeout=FINISH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - tracking never fails a run
            pass
