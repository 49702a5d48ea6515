"""What every host runs: join the runtime, run the job's task, report to the driver."""

from __future__ import annotations

import os
import traceback

from redray.cluster.console import DriverConsole
from redray.cluster.job import HostJob, free_for
from redray.cluster.tracker import CHECKPOINT_KEY, TrackerHook
from redray.engine.hooks import Adoption, Hook, trainer_scope
from redray.engine.watchdog import Stall, Watchdog


def train_loop(job: HostJob) -> None:
    """Ray Train's ``train_loop_per_worker``: one call per host."""
    import logging

    import ray
    from ray import cloudpickle

    from redray.cluster import distributed

    _quiet_ray_train(logging)
    rank, _ = distributed.initialize()
    if job.compile_cache is not None:
        from redray.engine import compile_cache

        compile_cache.enable(job.compile_cache)
    watchdog = None
    try:
        ray.get(job.results.join.remote(rank, ray.get_runtime_context().current_actor))
        if job.hang_timeout is not None:
            watchdog = Watchdog(job.hang_timeout, lambda stall: _stuck(job, rank, stall)).start()
        code = cloudpickle.loads(job.code)  # after JAX's runtime is up
        host_run = HostRun(job, rank, watchdog)
        try:
            with trainer_scope(host_run):
                value = job.task.run(code, rank)
        except Regroup as regroup:  # every host, at one checkpoint: a larger group goes on
            if rank == 0:
                ray.get(job.results.regroup.remote(regroup.hosts))
            return
        if rank == 0:
            ray.get(job.results.put.remote(host_run.result(value)))
    except BaseException as error:
        # First thing: tell the driver what failed here; the results actor then stops every
        # host. Left alone, the others would wait in a collective for this one until JAX's
        # coordination service aborts them (a C++ dump), and Ray would report their deaths
        # (suggesting the OOM killer) instead of this error.
        _drop_ray_train_error_log(logging)
        ray.get(job.results.fail.remote(rank, user_traceback(error), traceback.format_exc()))
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        distributed.shutdown()


def _stuck(job: HostJob, rank: int, stall: Stall) -> None:
    """The watchdog's verdict: this host made no progress for ``hang_timeout``. Tells
    the driver (whose results actor stops every host; Ray Train restarts the group if
    ``max_failures`` allows, resuming from the last checkpoint), then ends this process:
    its training thread may be blocked inside C++, where nothing else reaches it."""
    import sys

    import ray

    text = (f"host {rank} made no progress for {stall.seconds:.0f} s "
            f"(hang_timeout={job.hang_timeout:g} s): its last progress was {stall.last}. "
            "A stuck collective (a peer that never arrives) or user code that never "
            "returns (collate, loss, a data read) stops a host this way. With "
            "max_failures=N the run restarts from its last checkpoint; if a step, an "
            "evaluation or a checkpoint legitimately takes longer, raise hang_timeout.\n"
            f"Where this host waits:\n{stall.threads}")
    print(f"redray: {text}", file=sys.stderr, flush=True)
    try:
        ray.get(job.results.fail.remote(rank, text, text), timeout=60)
    finally:
        os._exit(1)


# Where a host's traceback starts to be the user's: frames in these parts of redray are
# the machinery between a host's entry and the user's functions (redray.models is model
# code a user calls, so its frames stay).
_REDRAY = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODEL_CODE = os.path.join(_REDRAY, "models") + os.sep


def _machinery(frame: traceback.FrameSummary) -> bool:
    path = os.path.abspath(frame.filename)
    return path.startswith(_REDRAY) and not path.startswith(_MODEL_CODE)


def user_traceback(error: BaseException) -> str:
    """``error``'s traceback (and its chained causes') without redray's own frames.

    A chain link raised inside redray itself (no frame of the user's) keeps its innermost
    frame: where redray raised it.
    """
    shown = traceback.TracebackException.from_exception(error)
    seen, todo = set(), [shown]
    while todo:
        link = todo.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        frames = [f for f in link.stack if not _machinery(f)] or list(link.stack)[-1:]
        link.stack = traceback.StackSummary.from_list(frames)
        todo += [e for e in (link.__cause__, link.__context__) if e is not None]
        todo += getattr(link, "exceptions", None) or []  # an ExceptionGroup's members
    return "".join(shown.format())


def _drop_ray_train_error_log(logging) -> None:
    """Ray Train logs a failed training function's traceback on the host, which would
    print it a second time: the driver raises it already."""
    try:
        from ray.train.v2._internal import util
    except ImportError:  # another Ray layout: the duplicate stays
        return
    logging.getLogger(util.__name__).addFilter(
        lambda record: not record.getMessage().startswith("Error in training function"))


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

    def __init__(self, job: HostJob, rank: int, watchdog: Watchdog | None = None):
        self.job, self.rank, self.watchdog = job, rank, watchdog
        if rank == 0 and job.tracker is not None:
            # a restarted group trains again from its checkpoint: the tracker logs only
            # the steps past those already logged (waited for: rows must come after)
            import ray

            try:
                ray.get(job.tracker.new_session.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - tracking never fails a run
                pass
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
        tracker = TrackerHook(self.job.tracker, self.rank)
        self.trackers.append(tracker)
        hooks = [tracker, RayTrainCheckpoints()]
        if self.main is None:
            self.main = NewestCheckpoint()
            hooks.append(self.main)
        if self.watchdog is not None:
            hooks.append(self.watchdog)
        if self.job.grow_to is not None and checkpoint is not None:
            hooks.append(Regrow(self.job.grow_to, self.job.worker_resources))
        console = DriverConsole(self.job.results) if self.job.console and self.rank == 0 \
            else None
        return Adoption(checkpoint=checkpoint, config=self.job.config, hooks=hooks,
                        console=console, probe_cache=self.job.probe_cache)

    def result(self, value) -> dict:
        """What host 0 sends the driver: the function's value and the main Trainer's
        resume step and newest checkpoint (once every logged row reached the tracker)."""
        for tracker in self.trackers:
            tracker.flush()
        main = self.main or NewestCheckpoint()
        return {"value": value, "resumed_from_step": main.resumed_from_step,
                "checkpoint": main.path}


class NewestCheckpoint(Hook):
    """The run's main Trainer's newest complete checkpoint: the one it resumed from,
    until it saves one (a run resumed with nothing left to train saves none)."""

    def __init__(self):
        self.resumed_from_step: int | None = None
        self.path: str | None = None

    def on_restore(self, trainer, step: int, path: str, meta: dict) -> None:
        self.resumed_from_step, self.path = step, path

    def on_checkpoint(self, trainer, step: int, path: str, meta: dict) -> None:
        self.path = path


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


class Regroup(BaseException):
    """Raised on every host of an elastic run at a complete checkpoint, when the cluster
    has room for more hosts: the group ends there and a larger one (``hosts``) resumes
    from that checkpoint. A ``BaseException``: user code catching ``Exception`` lets it
    through."""

    def __init__(self, hosts: int):
        super().__init__(hosts)
        self.hosts = hosts


class Regrow(Hook):
    """An elastic run's growth: at each checkpoint the run's main Trainer saves while its
    group is below ``grow_to`` hosts, host 0 asks Ray for room for one more host's
    worker (``resources``, a placement group it removes at once); if there is, every host
    waits for that checkpoint to complete and ends the group (``Regroup``), losing no
    step. Each host hears the same checkpoints, so every one takes the same decision
    (host 0's, broadcast)."""

    # how long host 0 waits for Ray to place the trial worker
    WAIT_S = 2.0

    def __init__(self, grow_to: int, resources: dict):
        self.grow_to, self.resources = grow_to, dict(resources)

    def on_step(self, trainer, info) -> None:
        self._check(trainer, info.step)

    def on_epoch_end(self, trainer, end) -> None:
        self._check(trainer, end.step)

    def _check(self, trainer, step: int) -> None:
        import jax

        checkpointer = trainer.checkpointer
        if (checkpointer is None or checkpointer.saving != step
                or jax.process_count() >= self.grow_to):
            return
        import numpy as np

        from redray.sharding.hosts import from_process_zero

        room = self._room() if jax.process_index() == 0 else False
        if not bool(from_process_zero(np.int32(room))):  # every host acts on process 0's answer
            return
        checkpointer.wait()  # the checkpoint of this step is complete before the group ends
        if jax.process_index() == 0:
            trainer.console.say(f"the cluster has room for more hosts: regrouping at step "
                                f"{step} ({jax.process_count()} host(s) now, up to "
                                f"{self.grow_to})")
        raise Regroup(jax.process_count() + 1)

    def _room(self) -> bool:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if not free_for(self.resources):
            return False
        group = placement_group([self.resources])
        try:
            ray.get(group.ready(), timeout=self.WAIT_S)
            return True
        except Exception:  # noqa: BLE001 - not placed in time: no room
            return False
        finally:
            remove_placement_group(group)
