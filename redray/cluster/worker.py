"""What every host runs for a job: the run's task, reporting to the driver.

A host's process (``redray.cluster.hosts.Host``) has joined the group's JAX runtime
already and may run several jobs one after another (a kept group): each job starts
from nothing of the last one's but the imports and the runtime.
"""

from __future__ import annotations

import gc
import os
import time
import traceback

from redray import startup
from redray.cluster.console import DriverConsole
from redray.cluster.job import DONE, REGROUP, TRAINED, HostJob, Room
from redray.cluster.tracker import FINISH_TIMEOUT_S, RUN_ID_KEY, WANDB_ID_KEY
from redray.engine.hooks import Adoption, Hook, trainer_scope
from redray.engine.watchdog import Stall, Watchdog
from redray.sharding.parallelism import describe_shape



def run_job(job: HostJob, rank: int) -> str:
    """This host's part of ``job``: ``DONE`` or ``REGROUP``; a failure is told to the
    driver (through the results actor) and raised."""
    import ray
    from ray import cloudpickle

    startup.begin()
    if job.compile_cache is not None:
        from redray.engine import compile_cache

        compile_cache.enable(job.compile_cache)
    if job.data_context is not None:
        from ray.data import DataContext

        DataContext._set_current(job.data_context)
    watchdog = None
    try:
        ray.get(job.results.join.remote(rank, ray.get_runtime_context().current_actor))
        if job.hang_timeout is not None:
            watchdog = Watchdog(job.hang_timeout, lambda stall: _stuck(job, rank, stall)).start()
        startup.listen(StartTold(job.results, rank, watchdog))
        with startup.phase("user_code"):
            code = cloudpickle.loads(job.code)
        host_run = HostRun(job, rank, watchdog)
        try:
            with trainer_scope(host_run):
                value = job.task.run(code, rank)
        except Regroup as regroup:  # every host, at one checkpoint: a larger group goes on
            if rank == 0:
                ray.get(job.results.regroup.remote(regroup.hosts))
            return REGROUP
        if rank == 0:
            ray.get(job.results.put.remote(host_run.result(value)))
        return DONE
    except BaseException as error:
        # First thing: tell the driver what failed here; the results actor then stops every
        # host. Left alone, the others would wait in a collective for this one until JAX's
        # coordination service aborts them (a C++ dump), and the driver would see their
        # deaths instead of this error.
        ray.get(job.results.fail.remote(rank, user_traceback(error), traceback.format_exc()))
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        # what the job left on the devices goes before the next job of a kept group
        code = host_run = None
        gc.collect()


class StartTold:
    """A host's start, phase by phase (a ``redray.startup`` listener): each phase is
    progress for the watchdog, and the results actor hears where the host stands until
    its first training step is done (``TRAINED``), for the driver to say what a group
    that has not trained yet waits for."""

    def __init__(self, results, rank: int, watchdog: Watchdog | None):
        self.results, self.rank, self.watchdog = results, rank, watchdog
        self.trained = False

    def __call__(self, name: str) -> None:
        if self.watchdog is not None:
            self.watchdog.tick(f"the start-up phase {name!r}")
        if self.trained:
            return
        self.trained = name == "steps"
        self.results.at.remote(self.rank, TRAINED if self.trained else name, time.time())


def _stuck(job: HostJob, rank: int, stall: Stall) -> None:
    """The watchdog's verdict: this host made no progress for ``hang_timeout``. Tells
    the driver (whose results actor stops every host; the driver starts a new group if
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


class HostRun:
    """The run on this host, as the scope every Trainer made here is adopted by.

    Each Trainer gets the run's hooks: host 0 sends its logged rows and complete
    checkpoints to the MLflow tracker and describes it there. The first Trainer that
    leaves ``checkpoint`` at its default saves into (and resumes from) the run's
    checkpoint folder; that Trainer is the run's "main" one, whose resume step and last
    checkpoint the driver gets back.
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
                    "Trainer.of(..., checkpoint='/abs/other/folder'), or checkpoint=False")
            checkpoint = self.job.checkpoint
        tracker = TrackerHook(self.job.tracker, self.rank)
        self.trackers.append(tracker)
        hooks = [tracker]
        if self.main is None:
            self.main = NewestCheckpoint()
            hooks.append(self.main)
        if self.watchdog is not None:
            hooks.append(self.watchdog)
        if self.job.grow_to is not None and checkpoint is not None:
            hooks.append(Regrow(self.job.grow_to, self.job.room))
        console = DriverConsole(self.job.results) if self.job.console and self.rank == 0 \
            else None
        return Adoption(checkpoint=checkpoint, config=self.job.config, hooks=hooks,
                        console=console, probe_cache=self.job.probe_cache,
                        profile=self.job.profile, profile_dir=self.job.profile_dir)

    def result(self, value) -> dict:
        """What host 0 sends the driver: the function's value and the main Trainer's
        resume step and newest checkpoint (once every logged row reached the tracker)."""
        for tracker in self.trackers:
            tracker.flush()
        main = self.main or NewestCheckpoint()
        return {"value": value, "resumed_from_step": main.resumed_from_step,
                "checkpoint": main.path, "startup": list(startup.RECORDER.spans)}


class TrackerHook(Hook):
    """A host's Trainer hook: host 0 sends every logged row and every complete
    checkpoint to the tracker (the other hosts send nothing), describes the run there
    once the state exists, and keeps the trackers' run ids (MLflow's, W&B's) in the
    Trainer's checkpoints (``run_meta``) so a resume logs into the same runs."""

    def __init__(self, tracker, rank: int):
        self.tracker = tracker if rank == 0 else None
        self.sent: list = []
        self.run_ids: dict = {}  # the trackers' run ids (MLflow's, W&B's), by meta key
        self.ids_known = False  # every tracker has opened its run
        self.profile_sent: str | None = None

    def on_restore(self, run, step: int, path: str, meta: dict) -> None:
        kept = meta.get("run", {})
        self.run_ids.update({k: kept[k] for k in (RUN_ID_KEY, WANDB_ID_KEY) if kept.get(k)})

    def run_meta(self, run) -> dict:
        return dict(self.run_ids)

    def on_init(self, run) -> None:
        if self.tracker is None:
            return
        d = run.describe()
        tags = {"redray.hosts": d["hosts"], "redray.devices": d["devices"],
                "redray.mesh": describe_shape(d["mesh"]),
                "redray.plan": d["layout"],
                "redray.parameters": d["parameters"],
                "redray.param_bytes_per_device": d["param_bytes_per_device"],
                "redray.accumulation_steps": d["accumulation_steps"]}
        if "attention" in d:
            tags["redray.attention"] = d["attention"]
        # a chosen plan: what it is, why, its predicted step and the hardware numbers
        tags.update({f"redray.plan.{k}": v for k, v in d.get("planner", {}).items()})
        self.tracker.describe.remote(tags, run.placement(), d["plan"])

    def on_checkpoint(self, run, step: int, path: str, meta: dict) -> None:
        if self.tracker is not None:
            try:
                self.tracker.checkpoint.remote(path)
            except Exception:  # noqa: BLE001 - tracking never fails a run
                pass

    def on_fit_end(self, run) -> None:
        self._send_profile(run)

    def _send_profile(self, run) -> None:
        """Host 0's complete profiler trace, once, to the tracker (an MLflow artifact)."""
        trace = run.profile_trace
        if self.tracker is None or trace is None or trace == self.profile_sent:
            return
        self.profile_sent = trace
        try:
            self.sent.append(self.tracker.artifacts.remote(trace, "profile"))
        except Exception:  # noqa: BLE001 - tracking never fails a run
            pass

    def on_log(self, run, row: dict) -> None:
        import ray

        if self.tracker is None:
            return
        self._send_profile(run)
        try:
            self.sent.append(self.tracker.log.remote(row))  # no waiting: the actor queues it
            if len(self.sent) > 100:
                _, pending = ray.wait(self.sent, num_returns=len(self.sent), timeout=0)
                self.sent[:] = pending
        except Exception:  # noqa: BLE001 - tracking never fails a run
            return
        if not self.ids_known:  # until every tracker has opened its run
            try:
                ids, self.ids_known = ray.get(self.tracker.run_ids.remote(), timeout=10)
                self.run_ids.update(ids)
            except Exception:  # noqa: BLE001 - tracking never fails a run
                pass

    def flush(self) -> None:
        """Waits (briefly) until the rows sent so far have reached the tracker: calls
        still in flight when a worker exits could be lost."""
        import ray

        try:
            if self.sent:
                ray.wait(self.sent, num_returns=len(self.sent), timeout=FINISH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - tracking never fails a run
            pass


class NewestCheckpoint(Hook):
    """The run's main Trainer's newest complete checkpoint: the one it resumed from,
    until it saves one (a run resumed with nothing left to train saves none)."""

    def __init__(self):
        self.resumed_from_step: int | None = None
        self.path: str | None = None

    def on_restore(self, run, step: int, path: str, meta: dict) -> None:
        self.resumed_from_step, self.path = step, path

    def on_checkpoint(self, run, step: int, path: str, meta: dict) -> None:
        self.path = path


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
    group is below ``grow_to`` hosts, host 0 asks Ray for room for one more host (a TPU
    run: one more whole slice, ``Room.step``) beside what must stay free (``room``: a
    trial placement group it removes at once); if there
    is, every host waits for that checkpoint to complete and ends the group
    (``Regroup``), losing no step. Each host hears the same checkpoints, so every one
    takes the same decision (host 0's, broadcast)."""

    # how long host 0 waits for Ray to place the trial worker
    WAIT_S = 2.0

    def __init__(self, grow_to: int, room: Room):
        self.grow_to, self.room = grow_to, room

    def on_step(self, run, info) -> None:
        self._check(run, info.step)

    def on_epoch_end(self, run, end) -> None:
        self._check(run, end.step)

    def _check(self, run, step: int) -> None:
        import jax

        if run.saving_step != step or jax.process_count() >= self.grow_to:
            return
        import numpy as np

        from redray.processes.jax_runtime import from_process_zero

        room = jax.process_index() == 0 and self._room(jax.process_count())
        if not bool(from_process_zero(np.int32(room))):  # every host acts on process 0's answer
            return
        run.wait_for_checkpoints()  # this step's checkpoint is complete before the group ends
        if jax.process_index() == 0:
            run.console.say(f"the cluster has room for more hosts: regrouping at step "
                                f"{step} ({jax.process_count()} host(s) now, up to "
                                f"{self.grow_to})")
        raise Regroup(jax.process_count() + self.room.step)

    def _room(self, hosts: int) -> bool:
        """Whether the cluster holds ``Room.step`` hosts more than ``hosts`` beside the
        spare (its resources), and Ray places them and the spare now (waiting up to
        ``WAIT_S`` for what a short task, such as a Ray Data read, holds)."""
        step = self.room.step
        return self.room.fits_in(hosts + step) and self.room.placeable(step, self.WAIT_S)
