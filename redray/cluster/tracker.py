"""The run's one MLflow writer: an actor on the driver's node.

Host 0 sends every logged row and every complete checkpoint to the tracker actor
without waiting (the other hosts send nothing), and the actor logs it from a background
thread: each value reaches MLflow once, whatever the number of hosts, and the training
step never waits on MLflow. The actor's process imports Ray and MLflow, not redray's
engine (no JAX): it starts beside the hosts, not after them; the driver keeps it for
its next run (``redray/cluster/kept.py``), MLflow imported.
"""

from __future__ import annotations

import logging
import warnings

import ray

from redray.cluster.kept import Kept, answers
from redray.tracking import MlflowLogger, TrackingWarning, git_commit

log = logging.getLogger("redray.tracking")

# The MLflow run id in a checkpoint's meta["run"]: a resumed run logs into that run.
RUN_ID_KEY = "mlflow_run_id"
FINISH_TIMEOUT_S = 60


@ray.remote(num_cpus=0, max_concurrency=8)
class Tracker:
    """Owns one run's MlflowLogger at a time (``start`` ... ``finish``); every method
    returns at once."""

    def __init__(self, *run):
        self.logger = None
        if run:
            self.start(*run)

    def start(self, uri, run_name, run_path, experiment, resume, run_id, params, tags):
        self.logger = MlflowLogger(uri, run_name, run_path, experiment, resume, run_id)
        self.logger.log_params(params)
        self.logger.set_tags(tags)

    def ready(self) -> bool:
        return True

    def new_session(self) -> None:
        self.logger.new_session()

    def log(self, row: dict) -> None:
        if any(k.startswith("eval_") for k in row):  # its epoch is the train rows'
            row = {k: v for k, v in row.items() if k != "epoch"}
        self.logger.log_metrics(row, row.get("step", 0))

    def describe(self, tags: dict, plan: str) -> None:
        self.logger.set_tags(tags)
        self.logger.log_text(plan, "sharding_plan.txt")

    def artifacts(self, folder: str, artifact_path: str) -> None:
        self.logger.log_artifacts(folder, artifact_path)

    def checkpoint(self, path: str) -> None:
        self.logger.set_tags({"redray.last_checkpoint": path})

    def run_id(self):
        return self.logger.run_id

    def finish(self, status: str, checkpoint: str | None):
        if checkpoint:
            self.logger.set_tags({"redray.last_checkpoint": checkpoint})
        report, self.logger = self.logger.finish(status, timeout=FINISH_TIMEOUT_S), None
        return report


_KEPT = Kept()


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
    from redray.processes.ray_local import on_driver_node
    from redray.version import __version__

    run_id = None
    if resume and checkpoint_config is not None:
        meta = latest_meta(checkpoint_config.directory) or {}
        run_id = meta.get("run", {}).get(RUN_ID_KEY)
    tags = {"redray.version": __version__, "redray.run_name": folders.name}
    commit = git_commit()
    if commit:
        tags["redray.git_commit"] = commit
    run = (folders.tracking_uri, folders.name, folders.run, experiment, resume, run_id, config,
           tags)
    tracker = _KEPT.take(answers)
    if tracker is None:  # a new one starts its run as it starts: before any host's call
        return Tracker.options(scheduling_strategy=on_driver_node()).remote(*run)
    ray.get(tracker.start.remote(*run))  # started before this returns, as a new one is
    return tracker


def finish_tracker(tracker, status: str, checkpoint: str | None = None) -> dict | None:
    """Ends the MLflow run; warns (once) if the store failed. Never raises."""
    if tracker is None:
        return None
    try:
        report = ray.get(tracker.finish.remote(status, checkpoint),
                         timeout=FINISH_TIMEOUT_S + 30)
    except Exception as error:  # noqa: BLE001 - tracking never fails a run
        ray.kill(tracker)
        warnings.warn(f"MLflow tracking could not be finished ({error})", TrackingWarning,
                      stacklevel=3)
        return None
    _KEPT.keep(tracker, ray.kill)  # for the driver's next run, MLflow imported
    if report["failure"]:
        warnings.warn(
            f"MLflow tracking at {report['uri']} failed ({report['failure']}); training "
            f"completed; {report['dropped']} values could not be logged. Check the tracking "
            "URI (tracking_uri=... or MLFLOW_TRACKING_URI) and that the store is reachable",
            TrackingWarning, stacklevel=3)
    return report
