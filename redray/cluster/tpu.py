"""TPU pod slices for a run's hosts (``ClusterConfig(use_tpu=True)``): whole slices, host 0
on slice 0's worker 0, and the multislice environment of each host.

A multi-host TPU slice is one interconnect (ICI) domain; slices reach each other over the
data-centre network (DCN) only, through the ``MEGASCALE_*`` environment libtpu reads at
start. Ray labels every TPU node with its slice (``ray.io/tpu-slice-name``), its worker id
inside the slice, the slice's topology and pod type (``ray.io/tpu-pod-type``, e.g.
``v5p-16``), from the TPU VM's metadata or GKE's ``TPU_*`` variables.

A run here takes whole slices of one pod type, idle ones: each host's placement bundle
selects its node by slice name and worker id (``bundle_label_selector``), so host ``r`` of
the group runs on worker ``r % h`` of slice ``r // h`` (``h``: hosts per slice), the
process order JAX needs of a multislice run (process id = slice id x hosts per slice +
worker id). Worker 0's bundle also takes the slice's ``TPU-<pod type>-head`` resource,
as Ray's own TPU scheduling does, so that another job cannot start on part of the slice.

Ray's ``ray.util.tpu`` (alpha; Ray is pinned in pyproject.toml) gives a node's slice and
the multislice variables; its ``SlicePlacementGroup`` is not used: its bundles are not
ordered by worker id, and it reserves each slice's head in a placement group of its own
first (up to 100 s per slice), then asks the head for its slice's name.
"""

from __future__ import annotations

import dataclasses

# The multislice variables a host's libtpu reads (``ray.util.tpu.get_tpu_coordinator_env_vars``).
MEGASCALE_KEYS = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT", "MEGASCALE_NUM_SLICES",
                  "MEGASCALE_SLICE_ID")
MEGASCALE_PORT = "8081"

SLICE_LABEL = "ray.io/tpu-slice-name"
WORKER_LABEL = "ray.io/tpu-worker-id"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"


@dataclasses.dataclass(frozen=True)
class Slice:
    """One TPU slice of the cluster as Ray sees it now.

    Attributes:
      name: its name (``ray.io/tpu-slice-name``).
      pod_type: e.g. ``v5p-16`` (TensorCores for v4/v5p, chips for v5e/v6e).
      hosts: the hosts it has when whole (its topology's chips over a host's).
      chips_per_host: the ``TPU`` resource of each of its nodes.
      nodes: its live nodes by worker id: (node id, address).
      idle: every live node's TPUs free, and its head resource.
    """
    name: str
    pod_type: str
    hosts: int
    chips_per_host: float
    nodes: dict
    idle: bool

    @property
    def whole(self) -> bool:
        """Whether every one of its hosts is alive in the cluster."""
        return set(self.nodes) == set(range(self.hosts))

    @property
    def head_resource(self) -> str:
        return f"TPU-{self.pod_type}-head"


@dataclasses.dataclass(frozen=True)
class SliceRequest:
    """What a run takes: whole slices of ``pod_type``, each of ``hosts_per_slice`` hosts
    with ``chips_per_host`` chips."""
    pod_type: str
    hosts_per_slice: int
    chips_per_host: float

    def slices_for(self, hosts: int) -> int:
        return hosts // self.hosts_per_slice

    def describe(self) -> str:
        return (f"{self.pod_type} slices ({self.hosts_per_slice} host(s) of "
                f"{self.chips_per_host:g} chips each)")

    def whole(self) -> list[Slice]:
        """The cluster's whole slices of this type now, by name."""
        return [s for s in cluster_slices() if s.pod_type == self.pod_type and s.whole]

    def idle(self) -> list[Slice]:
        """The whole slices of this type no job holds any part of, by name."""
        return [s for s in self.whole() if s.idle]

    def placement(self, slices: list[Slice]) -> tuple[list[dict], list[dict]]:
        """The bundles and their label selectors of one group on ``slices``, in rank
        order: each slice's workers in order of their id."""
        bundles, selectors = [], []
        for taken in slices:
            for worker in range(self.hosts_per_slice):
                bundle = {"TPU": self.chips_per_host}
                if worker == 0:
                    bundle[taken.head_resource] = 1
                bundles.append(bundle)
                selectors.append({SLICE_LABEL: taken.name, WORKER_LABEL: str(worker)})
        return bundles, selectors


    def placement_group(self, hosts: int):
        """A placement group of ``hosts`` hosts on the first idle whole slices (not yet
        ready: ``ready()`` tells), in rank order; None where too few are idle."""
        from ray.util.placement_group import placement_group

        idle, count = self.idle(), self.slices_for(hosts)
        if len(idle) < count:
            return None
        bundles, selectors = self.placement(idle[:count])
        return placement_group(bundles, strategy="STRICT_SPREAD",
                               bundle_label_selector=selectors)


def cluster_slices(nodes: list | None = None, available: dict | None = None) -> list[Slice]:
    """Every TPU slice with a live node in the cluster, by name (``nodes``: ``ray.nodes()``;
    ``available``: free resources by node id). Nodes without a slice label are left out."""
    import ray
    from ray.util.tpu import get_tpu_slice_name_from_node

    if nodes is None:
        nodes = ray.nodes()
    if available is None:
        from ray._private.state import available_resources_per_node

        available = available_resources_per_node()
    found: dict[str, list] = {}
    for node in nodes:
        name = get_tpu_slice_name_from_node(node) if node.get("Alive") else None
        if name and (node.get("Resources") or {}).get("TPU"):
            found.setdefault(name, []).append(node)
    slices = []
    for name, members in sorted(found.items()):
        labels = members[0].get("Labels") or {}
        chips = float(members[0]["Resources"]["TPU"])
        topology = labels.get(TOPOLOGY_LABEL)
        hosts = (max(1, int(round(topology_chips(topology) / chips))) if topology
                 else len(members))
        by_worker = {int((n.get("Labels") or {}).get(WORKER_LABEL, -1)):
                     (n["NodeID"], n.get("NodeManagerAddress", "")) for n in members}
        head = f"TPU-{labels.get(POD_TYPE_LABEL)}-head"
        idle = all(available.get(n["NodeID"], n["Resources"]).get("TPU", 0)
                   >= n["Resources"]["TPU"] for n in members)
        idle = idle and all(available.get(n["NodeID"], n["Resources"]).get(head, 1) >= 1
                            for n in members if head in n["Resources"])
        slices.append(Slice(name, labels.get(POD_TYPE_LABEL) or f"{topology or '?'}",
                            hosts, chips, by_worker, idle))
    return slices


def topology_chips(topology: str) -> int:
    """The chips of a topology (``"2x2x2"``: 8)."""
    chips = 1
    for size in topology.lower().split("x"):
        chips *= int(size)
    return chips


def request(hosts: int | tuple, slices: int | None, pod_type: str | None,
            devices_per_host: int | None) -> tuple[SliceRequest | None, int | tuple]:
    """The slices a TPU run takes on the connected cluster and its hosts: ``hosts`` as
    given (a whole number of slices, elastic bounds included), or ``slices`` times a
    slice's hosts. (None, hosts) where the cluster's TPU nodes carry no slice labels.
    Raises ``ValueError`` naming the slice size where the hosts are not whole slices."""
    found = [s for s in cluster_slices() if pod_type is None or s.pod_type == pod_type]
    types = sorted({s.pod_type for s in found})
    if not types:
        if pod_type is not None or slices is not None:
            what = f"tpu_type={pod_type!r}" if pod_type else f"slices={slices}"
            seen = sorted({s.pod_type for s in cluster_slices()})
            raise ValueError(f"{what}: the cluster has no TPU slice"
                             + (f" of that type (it has {', '.join(seen)})" if seen else
                                " (no node carries Ray's ray.io/tpu-slice-name label)"))
        return None, hosts
    if len(types) > 1:
        raise ValueError(f"the cluster has TPU slices of several types ({', '.join(types)}): "
                         "name the run's with tpu_type=, e.g. "
                         f"tpu_type={types[0]!r}")
    example = found[0]
    wanted = SliceRequest(types[0], example.hosts, example.chips_per_host)
    per = wanted.hosts_per_slice
    if devices_per_host is not None and devices_per_host != example.chips_per_host:
        raise ValueError(f"devices_per_host={devices_per_host}: a host of a {wanted.pod_type} "
                         f"slice takes its node's {example.chips_per_host:g} chips; leave "
                         "devices_per_host out")
    if slices is not None:
        if isinstance(hosts, tuple):
            raise ValueError(f"slices={slices} with hosts={hosts} (elastic): give the bounds "
                             "in hosts, whole slices of "
                             f"{per} host(s) each, and leave slices out")
        if hosts not in (1, slices * per):
            raise ValueError(f"hosts={hosts} with slices={slices}: {slices} "
                             f"{wanted.pod_type} slice(s) have {slices * per} hosts; give "
                             "one of the two")
        return wanted, slices * per
    for bound in (hosts if isinstance(hosts, tuple) else (hosts,)):
        if bound % per:
            fits = ", ".join(f"hosts={n * per} ({n} slice{'s' if n > 1 else ''})"
                             for n in range(1, 4))
            raise ValueError(f"hosts={hosts}: a {wanted.pod_type} slice has {per} hosts "
                             f"({example.chips_per_host:g} chips each) and a TPU run takes "
                             f"whole slices (one interconnect each); give {fits}, or "
                             "slices=N")
    return wanted, hosts


def host_env(rank: int, hosts_per_slice: int, slices: int, coordinator: str) -> dict:
    """The multislice variables of host ``rank`` of a group on ``slices`` slices whose
    slice 0's worker 0 runs at ``coordinator`` (an address); on one slice none (None:
    removed, so that a value a node was started with cannot reach libtpu)."""
    if slices <= 1:
        return dict.fromkeys(MEGASCALE_KEYS)
    from ray.util.tpu import get_tpu_coordinator_env_vars

    return get_tpu_coordinator_env_vars(coordinator, slices, rank // hosts_per_slice,
                                        MEGASCALE_PORT)
