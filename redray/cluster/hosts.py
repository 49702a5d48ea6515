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
run, 16-22 s on 2 cores before the hosts ran redray's code (docs/performance/start-up.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import ray

from redray.cluster.job import ENDS, HostFailure, Room, shown_resources
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
        from redray.processes.jax_runtime import served_at

        return served_at(ray.util.get_node_ip_address())

    def join(self, address: str, world: int, rank: int, env: dict | None = None) -> None:
        """Joins the group's runtime as host ``rank`` of ``world``, first setting ``env``
        (a value None: removed) in this process: what the runtime reads as it starts
        (a TPU host's multislice variables, ``redray.cluster.tpu.host_env``)."""
        import os

        from redray.processes.jax_runtime import join_jax

        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        join_jax(address, world, rank)
        self.rank = rank

    def run(self, job):
        """Runs ``job`` (a ``redray.cluster.job.HostJob``) as this host's part; returns
        what ``worker.run_job`` does."""
        from redray.cluster.worker import run_job

        return run_job(job, self.rank)

    def ready(self) -> tuple[str, str]:
        """This host's node: its id and address."""
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address()


@dataclasses.dataclass(frozen=True)
class Shape:
    """What makes two groups interchangeable: the hosts, what each reserves and what
    stays free beside them (``Room``), their processes' environment and the placement
    strategy."""
    hosts: int
    room: Room
    env: tuple[tuple[str, str], ...]
    strategy: str

    @classmethod
    def of(cls, hosts: int, room: Room | dict, env: dict, strategy: str) -> "Shape":
        room = room if isinstance(room, Room) else Room.of(room)
        return cls(hosts, room, tuple(sorted(env.items())), strategy)

    def holds(self, other: "Shape") -> bool:
        """Whether a group of this shape can run what ``other`` asks for: the same hosts
        (what is kept free beside them matters only while a group is placed)."""
        return dataclasses.replace(self, room=Room(self.room.host, other.room.spare)) == other

    def actor_options(self) -> dict:
        resources = dict(self.room.host)
        return dict(num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0),
                    resources=resources, runtime_env={"env_vars": dict(self.env)})


class HostGroup:
    """A started group: its actors (in rank order) and their placement group."""

    def __init__(self, shape: Shape, actors: list, placement, session: str):
        self.shape, self.actors, self.placement, self.session = (shape, actors, placement,
                                                                 session)
        self.nodes: list[tuple[str, str]] = []  # each host's node (id, address), by rank
        self.slices: list[str] = []  # a TPU group's slices, in rank order
        self.closed = False

    def run(self, job) -> list:
        """The job on every host: one object reference per host, in rank order."""
        return [actor.run.remote(job) for actor in self.actors]

    def failure(self, refs: list, first: int, error: BaseException,
                reported: Callable[[], dict]) -> HostFailure:
        """The group's end after host ``first``'s job reference (of ``refs``, by rank)
        raised ``error``: the others' own ends are awaited ``GRACE_S``, the rest stopped,
        and what each one's end says is read (``ENDS``), so that the host named is the
        one whose loss caused the others' where the evidence tells (a host's death breaks
        its peers' collectives within the second). ``reported()``: rank -> the first
        line of the Python error each host that failed reported (the results actor; such a
        host is stopped with the others, so its own reference says no more than theirs)."""
        ends = {first: how_it_ended(error)}
        others = [ref for rank, ref in enumerate(refs) if rank != first]
        ray.wait(others, num_returns=len(others), timeout=GRACE_S)
        self.close()
        ray.wait(others, num_returns=len(others), timeout=VERDICT_S)
        for rank, ref in enumerate(refs):
            if rank in ends:
                continue
            try:
                ray.get(ref, timeout=0)
                ends[rank] = "done"
            except ray.exceptions.GetTimeoutError:
                ends[rank] = "silent"
            except ray.exceptions.RayError as other:
                ends[rank] = how_it_ended(other)
        errors = reported()
        for rank in errors:
            if ends.get(rank) in ("stopped", "silent", None):
                ends[rank] = "failed"
        order = ("node", "died", "failed", "silent")
        host = min(ends, key=lambda r: (order.index(ends[r]) if ends[r] in order
                                        else len(order), r))
        causes: dict[str, list] = {}
        for rank, end in sorted(ends.items()):
            if end != "done":
                causes.setdefault(end, []).append(rank)
        said = []
        for end in sorted(causes, key=lambda e: order.index(e) if e in order else len(order)):
            ranks = causes[end]
            who = f"host {ranks[0]}" if len(ranks) == 1 else f"hosts {ranks}"
            why = f" ({errors[ranks[0]]})" if end == "failed" and ranks[0] in errors else ""
            said.append(f"{who}: {ENDS[end]}{why}")
        return HostFailure(f"the group of {len(refs)} hosts ended ({'; '.join(said)})", host,
                           ends, self)

    def gone(self) -> dict[int, tuple[str, str]]:
        """The hosts whose node has left the cluster (Ray marks a node dead some
        seconds after it stops answering), by rank: their node's (id, address)."""
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        return {rank: node for rank, node in enumerate(self.nodes) if node[0] not in alive}

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
    ``PLACEMENT_NOTICE_S``). Where the room keeps something free beside the hosts, the
    hosts and it are placed together first (a trial, removed at once): the hosts are
    placed only where it still fits. ``spans``: a ``redray.startup.Recorder`` that gets
    the phases ``hosts`` (placed, processes started, the engine imported) and
    ``distributed``. A host lost while the group starts ends it: ``HostFailure``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    begun = time.time()
    waiting = _Waiting(shape, timeout, say)
    while shape.room.spare:
        tried = time.monotonic()
        if shape.room.free_for(shape.hosts) and shape.room.placeable(shape.hosts,
                                                                     waiting.step()):
            break
        if not waiting.longer():
            return None
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tried)))  # a try a second at most
    group = _place(shape, waiting)
    if group is None:
        return None
    actors = [Host.options(**shape.actor_options(),
                           scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
              for i in range(shape.hosts)]
    hosts = HostGroup(shape, actors, group, session())
    try:
        hosts.nodes = _answers(actors, "ready", "start", say)
        if spans is not None:
            spans.add("hosts", begun)
        joined = time.time()
        address = ray.get(actors[0].address.remote())
        envs = _slice_envs(shape, hosts, say)
        _answers([actor.join.remote(address, shape.hosts, rank, envs[rank])
                  for rank, actor in enumerate(actors)], None,
                 f"join JAX's distributed runtime served by host 0 at {address}", say)
        if spans is not None:
            spans.add("distributed", joined)
    except BaseException as error:
        hosts.close()
        if isinstance(error, HostFailure):
            error.group = hosts
        raise
    return hosts


def _place(shape: Shape, waiting: "_Waiting"):
    """The placement group of a new group of ``shape``, ready; None where ``waiting``'s
    timeout passed first. TPU hosts are placed on idle whole slices, each host's bundle on
    its own slice's worker (``tpu.SliceRequest.placement``); slices are chosen anew on
    each try (one may have been taken, or lost, meanwhile)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = shape.room.slices
    if wanted is None:
        group = placement_group([dict(shape.room.host)] * shape.hosts, strategy=shape.strategy)
        while not ray.wait([group.ready()], timeout=waiting.step())[0]:
            if not waiting.longer():
                remove_placement_group(group)
                return None
        return group
    while True:
        group = wanted.placement_group(shape.hosts)
        if group is not None:
            if ray.wait([group.ready()], timeout=min(SLICE_TRY_S, waiting.step()))[0]:
                return group
            remove_placement_group(group)
        if waiting.due() and not waiting.longer():
            return None
        time.sleep(1.0)


# How long a TPU group's placement on the slices chosen may take before they are chosen
# again (Ray places an idle slice's hosts within the second).
SLICE_TRY_S = 10.0


def _slice_envs(shape: Shape, hosts: HostGroup, say) -> list[dict | None]:
    """Each host's environment for its runtime, by rank: on TPU slices the multislice
    variables, computed from this group (its slice 0's worker 0, its slices), never
    inherited from an earlier group or the node."""
    wanted = shape.room.slices
    if wanted is None:
        return [None] * shape.hosts
    from redray.cluster.tpu import SLICE_LABEL, host_env

    per, count = wanted.hosts_per_slice, wanted.slices_for(shape.hosts)
    labels = {node["NodeID"]: node.get("Labels") or {} for node in ray.nodes()}
    hosts.slices = [labels.get(node, {}).get(SLICE_LABEL, "?") for node, _ in hosts.nodes[::per]]
    say(f"redray: {shape.hosts} host(s) on {count} whole {wanted.pod_type} slice(s) "
        f"({', '.join(hosts.slices)}); host 0 on {hosts.slices[0]}'s worker 0 at "
        f"{hosts.nodes[0][1]}")
    return [host_env(rank, per, count, hosts.nodes[0][1]) for rank in range(shape.hosts)]


def how_it_ended(error: BaseException) -> str:
    """``ENDS``' key for a host whose job's reference raised ``error``."""
    text = str(error)
    if isinstance(error, ray.exceptions.RayTaskError):
        return "failed"  # its own Python error (the driver got it from the results actor)
    if "killed by `ray.kill`" in text:
        return "stopped"  # by redray, after another host's end
    if "its node has died" in text:
        return "node"
    return "died"


# After a host's end, how long the driver waits for the others' own ends before it stops
# them (a peer's death often follows within the second: its collective broke), then
# how long for the stopped ones to be reported.
GRACE_S, VERDICT_S = 1.0, 5.0


def _answers(actors_or_refs: list, method: str | None, what: str, say) -> list:
    """Every host's answer (``method`` called on each actor, or the references given),
    saying after ``PLACEMENT_NOTICE_S`` which hosts have not answered yet; a host lost
    or failing meanwhile raises ``HostFailure``."""
    refs = [getattr(a, method).remote() for a in actors_or_refs] if method else actors_or_refs
    pending, told, begun = list(refs), False, time.time()
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=PLACEMENT_NOTICE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                host = refs.index(ref)
                raise HostFailure(f"host {host} was lost while the group's hosts were to "
                                  f"{what} ({_first_line(error)})", host,
                                  {host: how_it_ended(error)}) from error
        if pending and not told:
            told = True
            waiting = sorted(refs.index(ref) for ref in pending)
            say(f"redray: hosts {waiting} have not managed to {what} in "
                f"{time.time() - begun:.0f} s; still waiting")
    return ray.get(refs)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


class _Waiting:
    """The wait for a group's placement: in steps of ``PLACEMENT_NOTICE_S`` (or what is
    left of ``timeout``), saying once what it waits for."""

    def __init__(self, shape: Shape, timeout: float | None, say):
        self.shape, self.timeout, self.say = shape, timeout, say
        self.begun, self.told = time.monotonic(), False

    def due(self) -> bool:
        """Whether ``longer`` is to be asked now: a timeout given, or the wait has lasted
        ``PLACEMENT_NOTICE_S`` (a short retry loop says so no sooner)."""
        return self.timeout is not None or time.monotonic() - self.begun >= PLACEMENT_NOTICE_S

    def step(self) -> float:
        if self.timeout is None:
            return PLACEMENT_NOTICE_S
        return max(0.0, self.timeout - (time.monotonic() - self.begun))

    def longer(self) -> bool:
        """Whether to go on waiting (saying so once); False: the timeout passed."""
        if self.timeout is not None:
            return False if self.step() <= 0 else True
        if not self.told:
            self.told = True
            shape = self.shape
            self.say(f"redray: waiting for Ray to place {shape.room.describe(shape.hosts)} "
                     f"({shape.strategy}) for "
                     f"{time.monotonic() - self.begun:.0f} s; the cluster has "
                     f"{shown_resources(ray.available_resources())} free")
        return True


# The group kept from this driver's last run (``keep``), for the next of its shape.
_KEPT = Kept()


def take(shape: Shape) -> HostGroup | None:
    """The kept group if it has ``shape`` and still runs; a kept group of another shape
    is ended (its resources are this run's to take)."""
    def usable(group: HostGroup) -> bool:
        if group.shape.holds(shape) and group.usable():
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
