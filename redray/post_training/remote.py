"""Samplers on Ray actors of their own: post-training's separate-roles layout.

Colocated, a ``Sampler`` decodes on the trainer's model and devices, the weights shared
in place. A ``SamplerGroup`` puts the sampling on ``replicas`` Ray actors instead: each
a process with devices and a JAX runtime of its own, holding the model (built by the
same function the Trainer builds it with) and a ``Sampler``. The trainer sends its
weights after an update (``update_weights``), cast to the sampler's dtype, to every
replica's devices. Directly where it can (``weights_via="auto"``, the default): the
trainer's process serves its arrays through JAX's transfer server
(``jax.experimental.transfer``) and each replica pulls them onto its devices, laid out
as its Sampler holds them, without the host's numpy copies or Ray's object stores.
Otherwise (a trainer of several hosts, a replica of several, a runtime without the
transfer server) through Ray's object store: gathered to the host, put once and read by
every replica (Ray moves the bytes between nodes). Requests are split over the replicas
in order; a request's randomness is keyed by its id (``Sampler``), so its completion
does not depend on the replica that ran it.

``submit`` returns at once and ``Pending.result()`` waits: a loop may train on one batch
of rollouts while the next is sampled on weights one update older (a bounded staleness
of one update: GRPO's ratio to the sampler's own log-probabilities corrects for it).

On a trainer of several hosts every host calls the same methods (as with the
Trainer): host 0 owns the actors and sends and asks; the completions reach the other
hosts through the JAX runtime.

A replica may span several processes (``hosts_per_replica``: a model one process's
devices cannot hold): its actors join a JAX runtime of their own (the first serves it),
each receives the whole weights and places its shards, and each runs the Sampler's
loop on the same requests (the Sampler on a mesh over several processes); the first
one's completions are the replica's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redray.post_training.sampler import Sampler
from redray.post_training.sampling import Completion, SamplingParams, requests
from redray.processes.jax_runtime import from_process_zero, join_jax, served_at

log = logging.getLogger(__name__)
WEIGHTS_VIA = ("auto", "direct", "object_store")
# the transfer server's sockets per process: parallel streams (on this machine's
# loopback 4 moved 271 MB in 0.15-0.21 s, 1 in 0.23-0.43 s)
STREAMS = 4


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """What one ``update_weights`` moved: bytes (as sent, in the sampler's dtype) and
    seconds, from the trainer's arrays to every replica's devices, acknowledged, and the
    path they took: "direct" (pulled by each replica from the trainer's transfer server)
    or "object_store" (through the host and Ray's object store)."""
    bytes: int
    seconds: float
    path: str = "object_store"

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class _Replica:
    """One sampler process (a Ray actor's class; see ``SamplerGroup``): a replica's only
    process, or one of its ``hosts`` processes, which form a JAX runtime of their own
    (``join_jax``) and run the same Sampler loop on the same requests."""

    def address(self) -> str:
        """Where this process (a replica's first) serves the replica's runtime."""
        import ray

        return served_at(ray.util.get_node_ip_address())

    def join(self, address: str, hosts: int, rank: int) -> None:
        """Joins the replica's runtime (waits until its ``hosts`` processes have)."""
        join_jax(address, hosts, rank)

    def build(self, model_fn, seed: int, sampler_kwargs: dict) -> None:
        from redray.sharding import Parallelism

        model = model_fn(nnx.Rngs(seed))
        if "parallelism" not in sampler_kwargs and jax.device_count() > 1:
            # the slots split over this process's devices
            sampler_kwargs = {**sampler_kwargs,
                              "parallelism": Parallelism.of(data_axis=jax.device_count())}
        self.sampler = Sampler(model, seed=seed, **sampler_kwargs)
        leaves, self.treedef = jax.tree.flatten(nnx.filter_state(self.sampler.state,
                                                                 nnx.Param))
        self.shapes = [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]
        self.shardings = [x.sharding for x in leaves]
        self._server, self._peers = None, {}

    def layout(self) -> list:
        """The (shape, dtype) of every parameter, in the order they are sent."""
        return self.shapes

    def wire(self) -> list | None:
        """How each parameter travels when pulled directly: None where the Sampler holds
        it whole on every device (one copy is pulled, then copied here to the others),
        else its mesh's shape and axis names and its partition spec (the sender lays it
        out alike on as many of its devices, shard for shard). None for the whole list
        where a direct pull cannot run here: a replica of several processes, a runtime
        without JAX's transfer server."""
        if jax.process_count() > 1 or _transfer() is None:
            return None
        wire = []
        for s in self.shardings:
            if s.is_fully_replicated:
                wire.append(None)
            elif isinstance(s, jax.sharding.NamedSharding):
                wire.append((tuple(s.mesh.devices.shape), tuple(s.mesh.axis_names),
                             tuple(s.spec)))
            else:
                return None
        return wire

    def pull(self, address: str, uuid: int, dtypes: list) -> int:
        """Pulls the parameters the trainer's transfer server at ``address`` offers as
        ``uuid`` (in ``dtypes``) onto this replica's devices and decodes with them."""
        if self._server is None:
            import ray

            self._server = _serve(ray.util.get_node_ip_address())
        if address not in self._peers:
            self._peers[address] = self._server.connect(address)
        specs = [jax.ShapeDtypeStruct(shape, jnp.dtype(d), sharding=_first_device(s)
                                      if s.is_fully_replicated else s)
                 for (shape, _), d, s in zip(self.shapes, dtypes, self.shardings)]
        return self.update(self._peers[address].pull(uuid, specs))

    def update(self, leaves: list) -> int:
        params = jax.tree.unflatten(self.treedef, leaves)
        self.sampler.update_weights(nnx.merge_state(self.sampler.state, params))
        jax.block_until_ready(self.sampler.state)
        return sum(x.nbytes for x in leaves)

    def sample(self, prompts, params, request_ids) -> list[Completion]:
        return self.sampler.sample(prompts, params, request_ids)

    def devices(self) -> int:
        return jax.device_count()


def _start(actor, hosts: int, model_fn, seed: int, sampler_kwargs: dict) -> list:
    """One replica's ``hosts`` actors, joined into one runtime where more than one, each
    holding the model and a Sampler."""
    import ray

    ranks = [actor.remote() for _ in range(hosts)]
    if hosts > 1:
        address = ray.get(ranks[0].address.remote())
        ray.get([r.join.remote(address, hosts, i) for i, r in enumerate(ranks)])
    ray.get([r.build.remote(model_fn, seed, sampler_kwargs) for r in ranks])
    return ranks


class Pending:
    """Completions being sampled (``SamplerGroup.submit``); ``result()`` waits."""

    def __init__(self, refs, n: int, longest: int, others=()):
        self._refs, self._n, self._longest, self._done = refs, n, longest, None
        self._others = list(others)  # a replica's other processes' calls (the same)

    def result(self) -> list[Completion]:
        if self._done is None:
            import ray

            ray.get(self._others)
            parts = ray.get(self._refs) if self._refs is not None else []
            self._done = _on_every_host([c for part in parts for c in part], self._n,
                                        self._longest)
        return self._done


class SamplerGroup:
    """``replicas`` Samplers on Ray actors, fed the trainer's weights.

    Args:
      model_fn: builds the model from ``nnx.Rngs`` (the Trainer's model function); each
        replica builds it once (its weights come with the first ``update_weights``).
      replicas: sampler processes; requests are split over them in order.
      devices_per_replica: devices each replica decodes on (CPU devices simulated where
        not ``use_gpu``; GPUs otherwise), its slots split over them data-parallel
        (``parallelism=``, a ``redray.Parallelism``, plans them otherwise).
      hosts_per_replica: processes each replica spans (Ray actors, on any nodes), its
        devices split evenly over them: one JAX runtime per replica, the model and
        cache sharded over all its devices (a model one process's devices cannot hold).
      use_gpu: each replica takes ``devices_per_replica`` GPUs.
      dtype: the dtype the weights are sent and decoded in (default: as the replica's
        model holds them, e.g. its compute dtype where it keeps its weights in it).
      seed: the Sampler's seed (the key of every request's randomness).
      weights_via: how ``update_weights`` sends: "direct" (each replica pulls the
        trainer's arrays from a JAX transfer server in the trainer's process, onto its
        devices), "object_store" (through the host and Ray's object store), or "auto"
        (the default: direct where it can run, the object store otherwise, or where a
        direct send fails once).
      actor_options: more Ray actor options (``resources``, a ``scheduling_strategy``:
        where the replicas run).
      **sampler_kwargs: the ``Sampler``'s (``slots``, ``max_length``, ...).
    """

    def __init__(self, model_fn: Callable, *, replicas: int = 1, devices_per_replica: int = 1,
                 hosts_per_replica: int = 1, use_gpu: bool = False, dtype=None, seed: int = 0,
                 weights_via: str = "auto", actor_options: dict | None = None,
                 **sampler_kwargs):
        if replicas < 1 or devices_per_replica < 1 or hosts_per_replica < 1:
            raise ValueError(f"replicas={replicas}, devices_per_replica={devices_per_replica},"
                             f" hosts_per_replica={hosts_per_replica}: give at least one of "
                             "each")
        if devices_per_replica % hosts_per_replica:
            raise ValueError(f"devices_per_replica={devices_per_replica} does not split over "
                             f"hosts_per_replica={hosts_per_replica}: give a multiple of it")
        if weights_via not in WEIGHTS_VIA:
            raise ValueError(f"weights_via={weights_via!r}: give one of {WEIGHTS_VIA}")
        if "max_length" not in sampler_kwargs:
            raise TypeError("SamplerGroup needs max_length= (the Sampler's: the longest "
                            "prompt plus completion)")
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.replicas = self._layouts = self._wires = None
        self._hosts, self.weights_via, self._server = [], weights_via, None
        self._uuids = itertools.count(random.getrandbits(40) << 20)
        if jax.process_index() != 0:
            return  # host 0 owns the actors
        import ray

        from redray.processes.ray_local import ensure_ray

        ensure_ray()
        per_host = devices_per_replica // hosts_per_replica
        options = {"num_cpus": 1, **(actor_options or {})}
        if use_gpu:
            options["num_gpus"] = per_host
        else:
            options["runtime_env"] = {"env_vars": {
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={per_host}"}}
        actor = ray.remote(_Replica).options(**options)
        # each replica's processes: its first answers, the others run the same loop
        self._hosts = [_start(actor, hosts_per_replica, model_fn, seed, sampler_kwargs)
                       for _ in range(replicas)]
        self.replicas = [ranks[0] for ranks in self._hosts]
        self._layouts = ray.get([r.layout.remote() for r in self.replicas])
        if weights_via != "object_store":
            self._wires = ray.get([r.wire.remote() for r in self.replicas])

    def update_weights(self, model_or_state) -> WeightSync:
        """Sends a model's weights (or its ``nnx.state``) to every replica and waits for
        them to be on its devices. Every host of the trainer calls it (a sharded
        weight is gathered across them first)."""
        start = time.perf_counter()
        state = nnx.filter_state(model_or_state, nnx.Param) \
            if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
        leaves = jax.tree.leaves(state)
        direct = self._direct_reason(leaves) is None
        if not direct:  # every host takes part in gathering a weight sharded over hosts
            leaves = [_host_copy(x) for x in leaves]
        if self.replicas is None:
            return WeightSync(0, time.perf_counter() - start)
        layout = self._layouts[0]
        if len(leaves) != len(layout):
            raise ValueError(f"update_weights got {len(leaves)} parameters, but the "
                             f"sampler's model has {len(layout)}: send the model built by the "
                             "SamplerGroup's model_fn (the Trainer's model)")
        dtypes = []
        for i, (x, (shape, dtype)) in enumerate(zip(leaves, layout)):
            if tuple(x.shape) != shape:
                raise ValueError(f"update_weights: parameter {i} is {tuple(x.shape)}, the "
                                 f"sampler's model holds {shape}: send the model built by "
                                 "the SamplerGroup's model_fn")
            dtypes.append(self.dtype if self.dtype is not None and jnp.issubdtype(
                dtype, jnp.floating) else dtype)
        if direct:
            try:
                return WeightSync(self._send_direct(leaves, dtypes),
                                  time.perf_counter() - start, "direct")
            except Exception as e:  # noqa: BLE001 - the object store still can
                if self.weights_via == "direct":
                    raise
                log.warning("sending the weights directly failed (%s: %s); this "
                            "SamplerGroup sends them through Ray's object store from now "
                            "on", type(e).__name__, e)
                self.weights_via = "object_store"
                leaves = [_host_copy(x) for x in leaves]
        import ray

        ref = ray.put([np.asarray(x, d) for x, d in zip(leaves, dtypes)])
        sizes = ray.get([r.update.remote(ref) for ranks in self._hosts for r in ranks])
        return WeightSync(int(sizes[0]), time.perf_counter() - start)

    def _direct_reason(self, leaves) -> str | None:
        """Why the weights cannot be sent directly (None: they can). The same on every
        host of the trainer."""
        if self.weights_via == "object_store":
            return "weights_via='object_store'"
        why = None
        if not all(isinstance(x, jax.Array) and x.is_fully_addressable for x in leaves):
            why = "the trainer's weights are sharded over several processes"
        elif jax.process_count() > 1:
            why = "the trainer runs on several processes"
        elif _transfer() is None:
            why = "this JAX has no transfer server (jax.experimental.transfer)"
        elif self._wires is not None and any(w is None for w in self._wires):
            why = ("a replica cannot pull directly (one of several processes, or its JAX "
                   "has no transfer server)")
        elif self._wires is not None and any(
                w is not None and int(np.prod(w[0])) > len(jax.local_devices())
                for wire in self._wires for w in wire):
            why = (f"a replica shards its weights over more devices than the trainer's "
                   f"{len(jax.local_devices())}")
        if why is not None and self.weights_via == "direct":
            raise ValueError(f"weights_via='direct' cannot run: {why}; give "
                             "weights_via='auto' (the object store where it cannot)")
        return why

    def _send_direct(self, leaves, dtypes) -> int:
        """Offers the weights on this process's transfer server, laid out as each
        replica holds them, and waits until every replica pulled and placed them."""
        import ray

        if self._server is None:
            self._server = _serve(ray.util.get_node_ip_address())
        address, sent, laid = self._server.address(), [], {}
        names = [str(jnp.dtype(d)) for d in dtypes]
        for replica, wire in zip(self.replicas, self._wires):
            key = tuple(wire)
            if key not in laid:  # replicas laid out alike share the arrays
                laid[key] = [_lay_out(x, d, w) for x, d, w in zip(leaves, dtypes, wire)]
            uuid = next(self._uuids)
            self._server.await_pull(uuid, laid[key])
            sent.append(replica.pull.remote(address, uuid, names))
        return int(ray.get(sent)[0])

    def submit(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams],
               request_ids: Sequence[int] | None = None) -> Pending:
        """Starts sampling ``prompts`` (as ``Sampler.sample``) and returns at once."""
        n = len(prompts)
        params, ids = requests(n, params, request_ids)
        longest = max((p.max_new_tokens for p in params), default=0)
        if self.replicas is None:
            return Pending(None, n, longest)
        cuts = np.linspace(0, n, len(self.replicas) + 1).astype(int)
        refs, others = [], []
        for ranks, a, b in zip(self._hosts, cuts[:-1], cuts[1:]):
            if b > a:
                asked = [r.sample.remote([list(map(int, p)) for p in prompts[a:b]],
                                         params[a:b], ids[a:b]) for r in ranks]
                refs.append(asked[0])
                others.extend(asked[1:])
        return Pending(refs, n, longest, others)

    def sample(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams],
               request_ids: Sequence[int] | None = None) -> list[Completion]:
        """Completes every prompt on the replicas (as ``Sampler.sample``)."""
        return self.submit(prompts, params, request_ids).result()

    def shutdown(self) -> None:
        """Ends the replicas' processes."""
        if self.replicas:
            import ray

            for ranks in self._hosts:
                for r in ranks:
                    ray.kill(r)
        self.replicas = None


def _transfer():
    """JAX's transfer module, or None where this JAX has none."""
    try:
        from jax.experimental import transfer

        return transfer if hasattr(transfer, "start_transfer_server") else None
    except ImportError:
        return None


def _serve(ip: str):
    """A transfer server on this process's JAX client, listening on ``ip``."""
    return _transfer().start_transfer_server(jax.local_devices()[0].client, f"{ip}:0",
                                             [f"{ip}:0"] * STREAMS)


def _first_device(sharding) -> jax.sharding.SingleDeviceSharding:
    """The lowest-numbered device of ``sharding``: where a weight travels whole (both
    ends pick it alike)."""
    return jax.sharding.SingleDeviceSharding(min(sharding.device_set, key=lambda d: d.id))


def _lay_out(x: jax.Array, dtype, wire):
    """A weight in ``dtype`` on this process's devices as a replica pulls it (``wire``:
    whole on one device, or a mesh shape, axis names and spec to match shard for
    shard)."""
    x = x.astype(dtype)
    if wire is None:
        target = _first_device(x.sharding)
    else:
        shape, names, spec = wire
        devices = np.array(jax.local_devices()[:int(np.prod(shape))]).reshape(shape)
        target = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, names),
                                            jax.sharding.PartitionSpec(*spec))
    return jax.device_put(x, target)


def _host_copy(x):
    """A weight as one host array on every host (gathered where the trainer shards it
    over hosts)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _on_every_host(done: list[Completion], n: int, longest: int) -> list[Completion]:
    """Host 0's completions on every host (one host: as they are)."""
    if jax.process_count() == 1:
        return done
    tokens = np.zeros((n, longest), np.int32)
    logprobs = np.zeros((n, longest), np.float32)
    head = np.zeros((n, 3), np.int64)  # request id, length, ended by EOS
    for i, c in enumerate(done):
        tokens[i, :len(c.tokens)], logprobs[i, :len(c.tokens)] = c.tokens, c.logprobs
        head[i] = c.request_id, len(c.tokens), c.finish_reason == "eos"
    tokens, logprobs, head = from_process_zero((tokens, logprobs, head))
    return [Completion(int(h[0]), np.asarray(t[:h[1]]), np.asarray(lp[:h[1]]),
                       "eos" if h[2] else "length")
            for t, lp, h in zip(tokens, logprobs, np.asarray(head))]


__all__ = ["Pending", "SamplerGroup", "WeightSync"]
