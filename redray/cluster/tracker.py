"""The run's one tracking writer: an actor on the driver's node.

Host 0 sends every logged row and every complete checkpoint to the tracker actor
without waiting (the other hosts send nothing), and the actor logs it from a background
thread per tracker (MLflow, TensorBoard, Weights & Biases: ``redray.trackers``): each
value reaches each tracker once, whatever the number of hosts, and the training step
never waits on one. The actor's process imports Ray and the trackers, not redray's
engine (no JAX): it starts beside the hosts, not after them; the driver keeps it for
its next run (``redray/cluster/kept.py``), MLflow imported.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import ray

from redray.cluster.kept import Kept, answers
from redray.tracking import MlflowLogger, TrackingWarning, git_commit

log = logging.getLogger("redray.tracking")

# The trackers' run ids in a checkpoint's meta["run"]: a resumed run logs into those runs.
RUN_ID_KEY = "mlflow_run_id"
WANDB_ID_KEY = "wandb_run_id"
FINISH_TIMEOUT_S = 60


@ray.remote(num_cpus=0, max_concurrency=8)
class Tracker:
    """Owns one run's loggers at a time, one per tracker (``start`` ... ``finish``);
    every method returns at once."""

    def __init__(self, *run):
        self.loggers: dict = {}
        if run:
            self.start(*run)

    def start(self, uri, run_name, run_path, experiment, resume, run_ids, params, tags,
              names=("mlflow",), wandb_env=None):
        from redray.trackers import TensorBoardLogger, WandbLogger

        # the driver's WANDB_* settings (mode, key, entity), this run's only
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            del os.environ[key]
        os.environ.update(wandb_env or {})
        made = {"mlflow": lambda: MlflowLogger(uri, run_name, run_path, experiment, resume,
                                               run_ids.get(RUN_ID_KEY)),
                "tensorboard": lambda: TensorBoardLogger(os.path.join(run_path, "tensorboard")),
                "wandb": lambda: WandbLogger(run_path, experiment, run_name, resume,
                                             run_ids.get(WANDB_ID_KEY))}
        self.loggers = {name: made[name]() for name in names}
        for logger in self.loggers.values():
            logger.log_params(params)
            logger.set_tags(tags)

    def ready(self) -> bool:
        return True

    def new_session(self) -> None:
        for logger in self.loggers.values():
            logger.new_session()

    def log(self, row: dict) -> None:
        if any(k.startswith("eval_") for k in row):  # its epoch is the train rows'
            row = {k: v for k, v in row.items() if k != "epoch"}
        for logger in self.loggers.values():
            logger.log_metrics(row, row.get("step", 0))

    def describe(self, tags: dict, placement: str, plan: dict) -> None:
        """The run's shape as tags, what each device holds (``placement.txt``) and the
        plan (params ``plan.*``; ``plan.json``, what ``plan=`` takes back)."""
        for logger in self.loggers.values():
            logger.set_tags(tags)
            logger.log_params({"plan": plan})
            logger.log_text(placement, "placement.txt")
            logger.log_text(json.dumps(plan, indent=2), "plan.json")

    def artifacts(self, folder: str, artifact_path: str) -> None:
        for logger in self.loggers.values():
            logger.log_artifacts(folder, artifact_path)

    def checkpoint(self, path: str) -> None:
        for logger in self.loggers.values():
            logger.set_tags({"redray.last_checkpoint": path})

    def run_ids(self) -> tuple[dict, bool]:
        """The trackers' run ids known so far, by their checkpoint keys, and whether
        every tracker has opened its run (or failed to)."""
        ids = {RUN_ID_KEY: getattr(self.loggers.get("mlflow"), "run_id", None),
               WANDB_ID_KEY: getattr(self.loggers.get("wandb"), "run_id", None)}
        opened = all(logger.run_id or logger.failure for logger in self.loggers.values())
        return {k: v for k, v in ids.items() if v}, opened

    def finish(self, status: str, checkpoint: str | None):
        """Ends every tracker's run; returns their reports by name."""
        reports = {}
        for name, logger in self.loggers.items():
            if checkpoint:
                logger.set_tags({"redray.last_checkpoint": checkpoint})
            reports[name] = logger.finish(status, timeout=FINISH_TIMEOUT_S)
        self.loggers = {}
        return reports


_KEPT = Kept()


def start_tracker(folders, experiment: str, resume: bool, checkpoint_config, config: dict,
                  names=("mlflow",)):
    """Starts the tracker actor on this (the driver's) node, where a SQLite store lives.

    Args:
      folders: the run's ``redray.storage.RunFolders``: its name, run folder and MLflow
        store.
      experiment: the MLflow experiment (W&B's project).
      resume: log into the trackers' runs the newest checkpoint names, if any.
      checkpoint_config: the run's ``CheckpointConfig``, or None (no checkpoints).
      config: the run's settings, logged as params.
      names: the trackers (``redray.trackers.TRACKERS``).
    """
    from redray.checkpoint import latest_meta
    from redray.processes.ray_local import on_driver_node
    from redray.version import __version__

    run_ids = {}
    if resume and checkpoint_config is not None:
        meta = latest_meta(checkpoint_config.directory) or {}
        run_ids = {k: v for k, v in meta.get("run", {}).items()
                   if k in (RUN_ID_KEY, WANDB_ID_KEY)}
    tags = {"redray.version": __version__, "redray.run_name": folders.name}
    commit = git_commit()
    if commit:
        tags["redray.git_commit"] = commit
    wandb_env = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
    run = (folders.tracking_uri, folders.name, folders.run, experiment, resume, run_ids,
           config, tags, tuple(names), wandb_env)
    tracker = _KEPT.take(answers)
    if tracker is None:  # a new one starts its run as it starts: before any host's call
        return Tracker.options(scheduling_strategy=on_driver_node()).remote(*run)
    ray.get(tracker.start.remote(*run))  # started before this returns, as a new one is
    return tracker


def finish_tracker(tracker, status: str, checkpoint: str | None = None) -> dict | None:
    """Ends the trackers' runs; warns (once per tracker) where one failed. Returns
    MLflow's report (``run_id``, ``uri``, ``failure``, ``dropped``; None without
    MLflow), with every tracker's under ``trackers``. Never raises."""
    if tracker is None:
        return None
    try:
        reports = ray.get(tracker.finish.remote(status, checkpoint),
                          timeout=FINISH_TIMEOUT_S + 30)
    except Exception as error:  # noqa: BLE001 - tracking never fails a run
        ray.kill(tracker)
        warnings.warn(f"tracking could not be finished ({error})", TrackingWarning,
                      stacklevel=3)
        return None
    _KEPT.keep(tracker, ray.kill)  # for the driver's next run, MLflow imported
    for name, report in reports.items():
        if report["failure"]:
            fix = ("Check the tracking URI (tracking_uri=... or MLFLOW_TRACKING_URI) and "
                   "that the store is reachable" if name == "mlflow" else
                   f"Check that {report['uri']} can be written"
                   + (" and WANDB_MODE (offline needs no network)" if name == "wandb" else ""))
            warnings.warn(
                f"{_SHOWN[name]} tracking at {report['uri']} failed ({report['failure']}); "
                f"training completed; {report['dropped']} values could not be logged. {fix}",
                TrackingWarning, stacklevel=3)
    mlflow = reports.get("mlflow")
    return {**(mlflow or {"run_id": None, "uri": None, "failure": None, "dropped": 0}),
            "trackers": reports} if reports else None


_SHOWN = {"mlflow": "MLflow", "tensorboard": "TensorBoard", "wandb": "W&B"}
