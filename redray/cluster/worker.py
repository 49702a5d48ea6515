"""What every host runs: join the runtime, run the job's function, report to the driver."""

from __future__ import annotations

import traceback


def train_loop(job: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: one call per host."""
    import logging

    import ray
    from ray import cloudpickle

    from redray.cluster import distributed
    from redray.engine.trainer import set_host_run

    _quiet_ray_train(logging)
    rank, _ = distributed.initialize()
    try:
        job = {**job, **cloudpickle.loads(job["user"])}  # after JAX's runtime is up
        host_run = HostRun(job, rank)
        set_host_run(host_run)
        value = job["host_fn"](job, rank)
        if rank == 0:
            ray.get(job["results"].put.remote(host_run.result(value)))
    except BaseException:
        # First thing: tell the driver what failed here. The other hosts die next (their
        # collectives lose a peer) and Ray may report one of them instead.
        ray.get(job["results"].fail.remote(rank, traceback.format_exc()))
        raise
    finally:
        set_host_run(None)
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
    """Wires every Trainer made on this host into the cluster run.

    Each Trainer's logged rows go to Ray Train (and from there to MLflow), its
    checkpoints are registered with Ray Train, and host 0 describes it to the tracker.
    The first Trainer that leaves ``checkpoint`` at its default saves into (and resumes
    from) the run's checkpoint folder; that Trainer is the run's "main" one, whose
    resume step and last checkpoint the driver gets back.
    """

    def __init__(self, job: dict, rank: int):
        self.job, self.rank = job, rank
        self.main = None
        self.flushes: list = []

    def claim(self, trainer, default_checkpoint: bool) -> None:
        from redray.cluster.tracker import describe_run, worker_hooks

        if default_checkpoint and self.job["checkpoint"] is not None:
            if self.main is not None:
                raise ValueError(
                    "a second Trainer in this run would share the run's checkpoint folder "
                    f"({self.job['checkpoint'].directory}) with the first: give it its own, "
                    "Trainer(..., checkpoint='/abs/other/folder'), or checkpoint=False")
            trainer.checkpoint_config = self.job["checkpoint"]
        if self.main is None:
            self.main = trainer
        trainer.config = {**self.job["config"], **trainer.config}
        trainer.on_checkpoint = _register_checkpoint
        self.flushes.append(worker_hooks(trainer, self.job["tracker"], self.rank))
        if self.rank == 0:
            trainer.on_init = lambda: describe_run(trainer, self.job["tracker"])

    def result(self, value) -> dict:
        """What host 0 sends the driver: the function's value and the main Trainer's
        resume step and newest checkpoint (once every logged row reached the tracker)."""
        for flush in self.flushes:
            flush()
        main = self.main
        resumed = None if main is None else (main.resumed_from or {}).get("step")
        checkpoint = None
        if main is not None and main.checkpointer is not None:
            # a run resumed with nothing left to train wrote none: its newest is the one
            # it resumed from
            checkpoint = main.checkpointer.last_saved or (
                None if resumed is None else main.checkpointer.step_path(resumed))
        return {"value": value, "resumed_from_step": resumed, "checkpoint": checkpoint}


def fit_on_host(job: dict, rank: int) -> dict:
    """``redray.fit``'s work on one host: the Core engine's Trainer over the row sources."""
    from redray.engine import Trainer

    trainer = Trainer(job["model"], job["collate"], job["loss"], job["optimizer"], job["predict"],
                      progress=job["progress"] and rank == 0, **job["trainer"])
    trainer.init(job["train"])
    history = trainer.fit(job["train"], epochs=job["epochs"], eval_data=job["eval"],
                          eval_metric=job["eval_metric"], max_steps=job["max_steps"],
                          eval_at_start=job["eval_at_start"])
    predictions = None
    if job["predict_data"] is not None:
        predictions = trainer.predictor().predict(job["predict_data"])
    return {"history": history, "predictions": predictions}


def call_on_host(job: dict, rank: int):
    """``redray.run``'s work on one host: the user's function."""
    return job["fn"](*job["args"], **job["kwargs"])


def _register_checkpoint(step: int, path: str, meta: dict) -> None:
    """Tells Ray Train about a complete checkpoint (already written to the run's storage).

    Ray gets a pointer (a small JSON naming the Orbax folder), not the checkpoint:
    Ray's run snapshot must only reference folders that stay, while redray's retention
    deletes old checkpoints. ``ray.train.report`` is a barrier: every host calls this
    for every checkpoint.
    """
    import json
    import tempfile

    import ray.train
    from ray.train import Checkpoint

    from redray.cluster.tracker import CHECKPOINT_KEY

    metrics = {"step": step, CHECKPOINT_KEY: path}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/{POINTER}", "w") as f:
            json.dump({"path": path, "step": step, "epoch": meta["epoch"]}, f)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


POINTER = "redray_checkpoint.json"
