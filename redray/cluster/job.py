"""What the driver sends every host: a typed ``HostJob`` holding a task and the user's code.

The job travels through Ray's own serializer (the row sources' object references and
the actors' handles need it). The user's objects (``FitCode``/``CallCode``: functions,
model, arguments) travel inside it as bytes that each host unpickles only after it
joined the JAX runtime: a built model's device arrays, unpickled earlier, would start
JAX's backend before ``jax.distributed.initialize``, which then refuses to run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

# What a host's part of a job ends with (``worker.run_job``, read by the driver): the job
# ran to its end, or its group ends at a checkpoint to regroup (an elastic run with room
# for more hosts).
DONE, REGROUP = "done", "regroup"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitCode:
    """The user's side of ``redray.fit``."""
    model: Any
    collate: Callable
    loss: Callable
    optimizer: Any
    predict: Callable | None
    eval_metric: Callable | None
    trainer_options: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallCode:
    """The user's side of ``redray.run``: the function and its arguments."""
    fn: Callable
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitTask:
    """``redray.fit``'s work on one host: a Trainer over the row sources."""
    epochs: int
    max_steps: int | None
    progress: bool
    eval_at_start: bool
    train: Any
    eval: Any = None
    predict: Any = None

    def run(self, code: FitCode, rank: int) -> dict:
        from redray import startup
        from redray.engine import Trainer

        with startup.phase("user_code"):
            trainer = Trainer(code.model, code.collate, code.loss, code.optimizer, code.predict,
                              progress=self.progress and rank == 0, **code.trainer_options)
        history = trainer.fit(self.train, epochs=self.epochs, eval_data=self.eval,
                              eval_metric=code.eval_metric, max_steps=self.max_steps,
                              eval_at_start=self.eval_at_start)
        predictions = None
        if self.predict is not None:
            predictions = trainer.predictor().predict(self.predict)
        return {"history": history, "predictions": predictions}


@dataclasses.dataclass(frozen=True)
class CallTask:
    """``redray.run``'s work on one host: the user's function."""

    def run(self, code: CallCode, rank: int):
        return code.fn(*code.args, **code.kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostJob:
    """Everything a host needs to run its part of a run.

    Attributes:
      task: what to run (``FitTask`` or ``CallTask``).
      code: the pickled ``FitCode``/``CallCode`` the task runs.
      results: the driver's actor collecting host 0's value and any host's failure.
      tracker: the run's MLflow tracker actor, or None.
      checkpoint: the run's ``CheckpointConfig`` (for its main Trainer), or None.
      config: the run's settings, stored in every checkpoint.
      hang_timeout: seconds without progress before the host reports itself stuck
        (``ClusterConfig.hang_timeout``), or None.
      compile_cache: the run's compilation cache folder (``RunFolders.compile_cache``),
        or None (``ClusterConfig.compile_cache`` off).
      console: host 0's Trainers show their messages and progress on the driver
        (through ``results``); False (verbose): on the host's own output.
      probe_cache: where the cluster's probed hardware numbers are kept
        (``RunFolders.hardware``), for a Trainer that chooses its plan.
      grow_to: an elastic run's most hosts: a group smaller than that regroups at a
        checkpoint when the cluster has room for another host; None: a fixed group.
      worker_resources: what one host's worker reserves on its node (the room looked
        for).
      data_context: the driver's Ray Data settings (``DataContext``), for the hosts'
        own reads (a stream), or None.
    """
    task: FitTask | CallTask
    code: bytes
    results: Any
    tracker: Any
    checkpoint: Any
    config: dict
    hang_timeout: float | None = None
    compile_cache: str | None = None
    console: bool = True
    probe_cache: str | None = None
    grow_to: int | None = None
    worker_resources: dict | None = None
    data_context: Any = None


def free_for(resources: dict, hosts: int = 1) -> bool:
    """Whether the Ray cluster's free resources cover ``hosts`` workers reserving
    ``resources`` each (free in sum: one node may still not hold one worker)."""
    import ray

    free = ray.available_resources()
    return all(free.get(k, 0) >= v * hosts for k, v in resources.items())
