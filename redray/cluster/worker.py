"""What every host runs: join the runtime, train with the Core engine, report."""

from __future__ import annotations

import traceback


def train_loop(job: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: one call per host."""
    import ray

    from redray.cluster import distributed

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
    from redray.engine import Trainer

    trainer = Trainer(job["model"], job["collate"], job["loss"], job["optimizer"], job["predict"],
                      progress=job["progress"] and rank == 0, **job["trainer"])
    history = trainer.fit(job["train"], epochs=job["epochs"], eval_data=job["eval"],
                          eval_metric=job["eval_metric"], max_steps=job["max_steps"])
    predictions = None
    if job["predict_data"] is not None:
        predictions = trainer.predictor().predict(job["predict_data"])
    return {"history": history, "predictions": predictions}
