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

from redray.cluster.tpu import SliceRequest

# What a host's part of a job ends with (``worker.run_job``, read by the driver): the job
# ran to its end, or its group ends at a checkpoint to regroup (an elastic run with room
# for more hosts).
DONE, REGROUP = "done", "regroup"
# What a host tells the results actor it is doing once its first training step is done
# (before, the start-up phase it is in: ``redray.startup.PHASES``).
TRAINED = "trained"


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
            trainer = Trainer.of(code.model, code.collate, code.loss, code.optimizer,
                                 code.predict, **{**code.trainer_options,
                                                  "progress": self.progress and rank == 0})
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
      room: what one host reserves on its node and what stays free beside the group
        (the room an elastic run looks for to grow).
      data_context: the driver's Ray Data settings (``DataContext``), for the hosts'
        own reads (a stream), or None.
      profile: the steps every Trainer of the run traces when given no ``profile``
        (the driver's ``REDRAY_PROFILE``), or None.
      profile_dir: the run's ``profile`` folder, where its Trainers' traces go.
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
    room: Room | None = None
    data_context: Any = None
    profile: tuple[int, int] | None = None
    profile_dir: str | None = None


class HostFailure(RuntimeError):
    """A host of a group failed or was lost (its process or its node), while the group
    started or ran: the group is ended; a run with restarts left starts another.

    Attributes:
      host: the host that failed or was lost first (by the evidence: a lost node before
        a process that ended without a word before a Python error, which a peer's loss
        can cause).
      ends: how each host's part ended, by rank (``ENDS``' keys), where known.
      lost: whether ``host`` was lost (its node, or its process without a Python error)
        rather than failing with an error of its own.
      group: the group that ended (``redray.cluster.hosts.HostGroup``), where known.
    """

    def __init__(self, message: str, host: int, ends: dict | None = None, group=None):
        super().__init__(message)
        self.host, self.ends, self.group = host, dict(ends or {}), group
        self.lost = self.ends.get(host) in ("node", "died")


# How a host's part of a job ended, in words, by the evidence it gives of the cause.
ENDS = {
    "node": "node lost",
    "died": "process ended without a Python error (killed, out of memory, or node lost)",
    "failed": "failed",
    "silent": "no answer",
    "stopped": "stopped by redray",
    "done": "finished",
}


@dataclasses.dataclass(frozen=True)
class Room:
    """What one group of hosts takes of a Ray cluster: each host's reservation on its
    node (``host``: one CPU, or its GPUs or TPU chips) and what must stay free beside the
    group (``spare``: one CPU for Ray Data to read a stream while the hosts train, where
    the hosts reserve CPUs; else nothing). A group is started, and an elastic run grows,
    only where the spare fits beside it: a group that took the last CPU would wait
    forever for its first batch. A TPU run's hosts come in whole slices (``slices``,
    ``redray.cluster.tpu``): there is room for as many hosts as idle whole slices hold."""
    host: tuple[tuple[str, float], ...]
    spare: tuple[tuple[str, float], ...] = ()
    slices: SliceRequest | None = None

    @classmethod
    def of(cls, host: dict, spare: dict | None = None,
           slices: SliceRequest | None = None) -> "Room":
        return cls(tuple(sorted(host.items())), tuple(sorted((spare or {}).items())), slices)

    @property
    def step(self) -> int:
        """The hosts a group grows or shrinks by: a slice's, else one."""
        return self.slices.hosts_per_slice if self.slices else 1

    def bundles(self, hosts: int) -> list[dict]:
        """The placement bundles of ``hosts`` hosts and the spare."""
        return [dict(self.host)] * hosts + ([dict(self.spare)] if self.spare else [])

    def free_for(self, hosts: int) -> bool:
        """Whether the cluster's free resources cover ``hosts`` hosts and the spare (free
        in sum: the nodes may still not hold them; a placement tells)."""
        import ray

        if self.slices:
            return len(self.slices.idle()) >= self.slices.slices_for(hosts)
        return _covers(ray.available_resources(), self.bundles(hosts))

    def fits_in(self, hosts: int) -> bool:
        """Whether the cluster's resources (free or not) cover ``hosts`` hosts and the
        spare: what a group of that size could hold once the group before ended."""
        import ray

        if self.slices:
            return len(self.slices.whole()) >= self.slices.slices_for(hosts)
        return _covers(ray.cluster_resources(), self.bundles(hosts))

    def placeable(self, hosts: int, timeout: float) -> bool:
        """Whether Ray places ``hosts`` hosts and the spare within ``timeout`` seconds (a
        trial placement group, removed at once: it waits for what a short task holds);
        TPU hosts on idle whole slices."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if self.slices:
            group = self.slices.placement_group(hosts)
            if group is None:
                return False
        else:
            group = placement_group(self.bundles(hosts), strategy="SPREAD")
        try:
            return bool(ray.wait([group.ready()], timeout=timeout)[0])
        finally:
            remove_placement_group(group)

    def describe(self, hosts: int) -> str:
        """E.g. "3 host(s) of {'CPU': 1} and 1 CPU free beside them for Ray Data"."""
        if self.slices:
            return (f"{hosts} host(s) on {self.slices.slices_for(hosts)} whole "
                    f"{self.slices.describe()}")
        text = f"{hosts} host(s) of {dict(self.host)}"
        if self.spare:
            spare = ", ".join(f"{v:g} {k}" for k, v in self.spare)
            text += f" and {spare} free beside them for Ray Data's reads"
        return text


def _covers(resources: dict, bundles: list[dict]) -> bool:
    need: dict = {}
    for bundle in bundles:
        for k, v in bundle.items():
            need[k] = need.get(k, 0) + v
    return all(resources.get(k, 0) >= v for k, v in need.items())


def shown_resources(resources: dict) -> dict:
    """A resource dict as a user reads it: CPUs, GPUs, TPUs (not Ray's internal keys for
    nodes, memory and placement bundles)."""
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU", "TPU")}
