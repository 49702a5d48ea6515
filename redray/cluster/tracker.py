"""The run's one MLflow writer: an actor on the driver's node, fed by a Ray Train callback.

Workers report every logged row with ``ray.train.report`` (all hosts alike: it is a
barrier); the controller's ``MetricsToTracker`` callback forwards host 0's copy to the
tracker actor without waiting, and the actor logs it from a background thread. So
each value reaches MLflow once, whatever the number of hosts, and neither the step nor
the controller ever waits on MLflow.
"""

from __future__ import annotations

import logging
import warnings

from ray.train.v2.api.callback import UserCallback

from redray.tracking import MlflowLogger, TrackingWarning, git_commit

log = logging.getLogger("redray.tracking")

CHECKPOINT_KEY = "redray_checkpoint"
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


def start_tracker(uri: str, name: str, run_path: str, experiment: str, resume: bool,
                  checkpoint_config, config: dict):
    """Starts the tracker actor on this (the driver's) node, where a SQLite store lives."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import redray
    from redray.checkpoint import latest_meta

    run_id = None
    if resume and checkpoint_config is not None:
        meta = latest_meta(checkpoint_config.directory) or {}
        run_id = meta.get("run", {}).get("mlflow_run_id")
    tags = {"redray.version": redray.__version__, "redray.run_name": name}
    commit = git_commit()
    if commit:
        tags["redray.git_commit"] = commit
    node = ray.get_runtime_context().get_node_id()
    return _actor_class().options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(
        uri, name, run_path, experiment, resume, run_id, config, tags)


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


class MetricsToTracker(UserCallback):
    """Ray Train callback (on the controller): host 0's reports go to the tracker."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.failed = False

    def after_report(self, run_context, metrics, checkpoint):
        try:
            row = metrics[0] if metrics else None
            if not row:
                return
            if CHECKPOINT_KEY in row:
                self.tracker.checkpoint.remote(row[CHECKPOINT_KEY])
            else:
                self.tracker.log.remote(row)
        except Exception as error:  # noqa: BLE001 - an exception here would fail the run
            if not self.failed:
                self.failed = True
                log.warning("could not forward metrics to the MLflow tracker: %s", error)


def worker_hooks(trainer, tracker, rank: int) -> None:
    """Wires a host's Trainer: rows to Ray Train, run id into checkpoints, plan to MLflow."""
    import ray
    import ray.train

    def on_log(row: dict) -> None:
        ray.train.report(row)  # every host: it is a barrier
        if rank == 0 and tracker is not None and "mlflow_run_id" not in trainer.run_meta:
            try:
                run_id = ray.get(tracker.run_id.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - tracking never fails a run
                run_id = None
            if run_id:
                trainer.run_meta["mlflow_run_id"] = run_id

    trainer.on_log = on_log


def describe_run(trainer, tracker) -> None:
    """Host 0 tells the tracker the run's shape and sharding plan (once per start)."""
    if tracker is None:
        return
    d = trainer.describe()
    tags = {"redray.hosts": d["hosts"], "redray.devices": d["devices"],
            "redray.mesh": " x ".join(f"{k}={v}" for k, v in d["mesh"].items()),
            "redray.parameters": d["parameters"],
            "redray.param_bytes_per_device": d["param_bytes_per_device"],
            "redray.accumulation_steps": d["accumulation_steps"]}
    tracker.describe.remote(tags, trainer.plan())
