"""What every host runs: join the runtime, train with the Core engine, report."""

from __future__ import annotations

import traceback


def train_loop(job: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: one call per host."""
    import ray

    from redray.cluster import distributed

    import logging

    logging.getLogger("ray.train").setLevel(logging.WARNING)  # a line per report is noise
    rank, _ = distributed.initialize()
    try:
        result = _run(job, rank)
        if rank == 0:
            ray.get(job["results"].put.remote(result))
    except BaseException:
        # First thing: tell the driver what failed here. The other hosts die next (their
        # collectives lose a peer) and Ray may report one of them instead.
        ray.get(job["results"].fail.remote(rank, traceback.format_exc()))
        raise
    finally:
        distributed.shutdown()


def _run(job: dict, rank: int) -> dict:
    from redray.cluster.tracker import describe_run, worker_hooks
    from redray.engine import Trainer

    trainer = Trainer(job["model"], job["collate"], job["loss"], job["optimizer"], job["predict"],
                      progress=job["progress"] and rank == 0, **job["trainer"])
    trainer.on_checkpoint = _register_checkpoint
    worker_hooks(trainer, job["tracker"], rank)
    trainer.init(job["train"])
    if rank == 0:
        describe_run(trainer, job["tracker"])
    history = trainer.fit(job["train"], epochs=job["epochs"], eval_data=job["eval"],
                          eval_metric=job["eval_metric"], max_steps=job["max_steps"],
                          eval_at_start=job["eval_at_start"])
    predictions = None
    if job["predict_data"] is not None:
        predictions = trainer.predictor().predict(job["predict_data"])
    return {"history": history, "predictions": predictions,
            "resumed_from_step": (trainer.resumed_from or {}).get("step"),
            "checkpoint": trainer.checkpointer.last_saved if trainer.checkpointer else None}


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
