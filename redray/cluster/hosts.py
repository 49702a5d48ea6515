"""The hosts of a run: one Ray actor per host, joined into one ``jax.distributed``
runtime, kept for the driver's next run of the same shape.

A group reserves its hosts in one placement group (each host its node's share: one
CPU, or its GPUs or TPU chips; every host on a node of its own where the cluster has
enough nodes), starts every ``Host`` actor at once (each imports the engine and JAX in
its own process, side by side), and joins them into one runtime served by host 0. A
run sends its job to every host and waits for all of them; a host that fails (its
error, its process killed, its node lost) ends the group.

A group whose run ended well is kept (``ClusterConfig.keep_hosts``): the next run from
this driver on the same hosts, resources and environment takes it as it is, processes,
imports and runtime included, and starts in a second instead of a fresh group's ten or
more. A run of another shape, or ``release_hosts()``, ends it; so does Ray's shutdown.
Ray Train's JaxTrainer did this before: a controller actor and a new worker group for every
run, 16-22 s on 2 cores before the hosts ran redray's code (BENCHMARKS.md: start-up).
"""

from __future__ import annotations

import dataclasses
import time

import ray

from redray.cluster.kept import Kept, answers, session

# How long a fixed-size group waits for its placement before it says so (then keeps
# waiting: a cluster may be adding nodes).
PLACEMENT_NOTICE_S = 30.0


@ray.remote
class Host:
    """One host's process: the engine imported once, the runtime joined once, then one
    job after another (``run``)."""

    def __init__(self):
        from redray.cluster import worker  # noqa: F401 - the engine and JAX, at start

        self.rank = None

    def address(self) -> str:
        """Where this host (as host 0) serves the runtime: its node's address, a free port."""
        from redray.sharding.hosts import served_at

        return served_at(ray.util.get_node_ip_address())

    def join(self, address: str, world: int, rank: int) -> None:
        from redray.sharding.hosts import join

        join(address, world, rank)
        self.rank = rank

    def run(self, job):
        """Runs ``job`` (a ``redray.cluster.job.HostJob``) as this host's part; returns
        what ``worker.run_job`` does."""
        from redray.cluster.worker import run_job

        return run_job(job, self.rank)

    def ready(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Shape:
    """What makes two groups interchangeable: the hosts, one host's resources, their
    processes' environment and the placement strategy."""
    hosts: int
    resources: tuple[tuple[str, float], ...]
    env: tuple[tuple[str, str], ...]
    strategy: str

    @classmethod
    def of(cls, hosts: int, resources: dict, env: dict, strategy: str) -> "Shape":
        return cls(hosts, tuple(sorted(resources.items())), tuple(sorted(env.items())),
                   strategy)

    def actor_options(self) -> dict:
        resources = dict(self.resources)
        return dict(num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0),
                    resources=resources, runtime_env={"env_vars": dict(self.env)})


class HostGroup:
    """A started group: its actors (in rank order) and their placement group."""

    def __init__(self, shape: Shape, actors: list, placement, session: str):
        self.shape, self.actors, self.placement, self.session = (shape, actors, placement,
                                                                 session)
        self.closed = False

    def run(self, job) -> list:
        """The job on every host: one object reference per host, in rank order."""
        return [actor.run.remote(job) for actor in self.actors]

    def usable(self) -> bool:
        """Whether this group can run a job: not closed, every host answering."""
        return not self.closed and all(answers(actor) for actor in self.actors)

    def close(self) -> None:
        """Ends the hosts' processes and frees their placement."""
        if self.closed:
            return
        self.closed = True
        if self.session != session():
            return  # that Ray is gone, and its actors with it
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
        except Exception:  # noqa: BLE001 - already removed
            pass


def start(shape: Shape, spans=None, timeout: float | None = None,
          say=print) -> HostGroup | None:
    """A new group of ``shape``, its runtime joined; None when ``timeout`` seconds pass
    before Ray places it (None: wait as long as it takes, saying so after
    ``PLACEMENT_NOTICE_S``). ``spans``: a ``redray.startup.Recorder`` that gets the
    phases ``hosts`` (placed, processes started, the engine imported) and
    ``distributed``."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    begun = time.time()
    group = placement_group([dict(shape.resources)] * shape.hosts, strategy=shape.strategy)
    waited, told = 0.0, False
    while True:
        step = PLACEMENT_NOTICE_S if timeout is None else max(0.0, timeout - waited)
        ready, _ = ray.wait([group.ready()], timeout=step)
        if ready:
            break
        waited += step
        if timeout is not None:
            remove_placement_group(group)
            return None
        if not told:
            told = True
            say(f"redray: waiting for Ray to place {shape.hosts} host(s) of "
                f"{dict(shape.resources)} each ({shape.strategy}) for {waited:.0f} s; the "
                f"cluster has {ray.available_resources()} free")
    actors = [Host.options(**shape.actor_options(),
                           scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
              for i in range(shape.hosts)]
    hosts = HostGroup(shape, actors, group, session())
    try:
        ray.get([actor.ready.remote() for actor in actors])
        if spans is not None:
            spans.add("hosts", begun)
        joined = time.time()
        address = ray.get(actors[0].address.remote())
        ray.get([actor.join.remote(address, shape.hosts, rank)
                 for rank, actor in enumerate(actors)])
        if spans is not None:
            spans.add("distributed", joined)
    except BaseException:
        hosts.close()
        raise
    return hosts


# The group kept from this driver's last run (``keep``), for the next of its shape.
_KEPT = Kept()


def take(shape: Shape) -> HostGroup | None:
    """The kept group if it has ``shape`` and still runs; a kept group of another shape
    is ended (its resources are this run's to take)."""
    def usable(group: HostGroup) -> bool:
        if group.shape == shape and group.usable():
            return True
        group.close()
        return False

    return _KEPT.take(usable)


def keep(group: HostGroup) -> None:
    """Keeps ``group`` for this driver's next run."""
    _KEPT.keep(group, HostGroup.close)


def release_hosts() -> None:
    """Ends the group kept from this driver's last run, if any (its processes and their
    resources: ``ClusterConfig.keep_hosts``)."""
    group = _KEPT.take()
    if group is not None:
        group.close()
