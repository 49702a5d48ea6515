"""What every host runs: join the runtime, run the job's task, report to the driver."""

from __future__ import annotations

import traceback

from redray.cluster.job import HostJob
from redray.cluster.tracker import CHECKPOINT_KEY, TrackerHook
from redray.engine.hooks import Adoption, Hook, trainer_scope


def train_loop(job: HostJob) -> None:
    """Ray Train's ``train_loop_per_worker``: one call per host."""
    import logging

    import ray
    from ray import cloudpickle

    from redray.cluster import distributed

    _quiet_ray_train(logging)
    rank, _ = distributed.initialize()
    try:
        code = cloudpickle.loads(job.code)  # after JAX's runtime is up
        host_run = HostRun(job, rank)
        with trainer_scope(host_run):
            value = job.task.run(code, rank)
        if rank == 0:
            ray.get(job.results.put.remote(host_run.result(value)))
    except BaseException:
        # First thing: tell the driver what failed here. The other hosts die next (their
        # collectives lose a peer) and Ray may report one of them instead.
        ray.get(job.results.fail.remote(rank, traceback.format_exc()))
        raise
    finally:
        distributed.shutdown()


def _quiet_ray_train(logging) -> None:
    """Ray Train logs a line per report (a checkpoint) on every host: noise to a user.
    Its execution context names its logger by file path, not by module."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray layout: its lines stay
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


class HostRun:
    """The run on this host, as the scope every Trainer made here is adopted by.

    Each Trainer gets the run's hooks: host 0 sends its logged rows to the MLflow
    tracker and describes it there, and every host registers its complete checkpoints
    with Ray Train. The first Trainer that leaves ``checkpoint`` at its default saves
    into (and resumes from) the run's checkpoint folder; that Trainer is the run's
    "main" one, whose resume step and last checkpoint the driver gets back.
    """

    def __init__(self, job: HostJob, rank: int):
        self.job, self.rank = job, rank
        self.main = None
        self.trackers: list[TrackerHook] = []

    def adopt(self, trainer, default_checkpoint: bool) -> Adoption:
        checkpoint = None
        if default_checkpoint and self.job.checkpoint is not None:
            if self.main is not None:
                raise ValueError(
                    "a second Trainer in this run would share the run's checkpoint folder "
                    f"({self.job.checkpoint.directory}) with the first: give it its own, "
                    "Trainer(..., checkpoint='/abs/other/folder'), or checkpoint=False")
            checkpoint = self.job.checkpoint
        if self.main is None:
            self.main = trainer
        tracker = TrackerHook(self.job.tracker, self.rank)
        self.trackers.append(tracker)
        return Adoption(checkpoint=checkpoint, config=self.job.config,
                        hooks=[tracker, RayTrainCheckpoints()])

    def result(self, value) -> dict:
        """What host 0 sends the driver: the function's value and the main Trainer's
        resume step and newest checkpoint (once every logged row reached the tracker)."""
        for tracker in self.trackers:
            tracker.flush()
        main = self.main
        resumed = None if main is None else (main.resumed_from or {}).get("step")
        checkpoint = None
        if main is not None and main.checkpointer is not None:
            # a run resumed with nothing left to train wrote none: its newest is the one
            # it resumed from
            checkpoint = main.checkpointer.last_saved or (
                None if resumed is None else main.checkpointer.step_path(resumed))
        return {"value": value, "resumed_from_step": resumed, "checkpoint": checkpoint}


class RayTrainCheckpoints(Hook):
    """Tells Ray Train about every complete checkpoint (already in the run's storage).

    Ray gets a pointer (a small JSON naming the Orbax folder), not the checkpoint:
    Ray's run snapshot must only reference folders that stay, while redray's retention
    deletes old checkpoints. ``ray.train.report`` is a barrier: every host calls it
    for every checkpoint.
    """

    def on_checkpoint(self, trainer, step: int, path: str, meta: dict) -> None:
        import json
        import tempfile

        import ray.train
        from ray.train import Checkpoint

        metrics = {"step": step, CHECKPOINT_KEY: path}
        if ray.train.get_context().get_world_rank() != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as folder:
            with open(f"{folder}/{POINTER}", "w") as f:
                json.dump({"path": path, "step": step, "epoch": meta["epoch"]}, f)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


POINTER = "redray_checkpoint.json"
