"""Runs on a Ray cluster: the hosts of a run (one Ray actor per host), one jax.distributed
runtime over them, and the driver's side (``fit``, ``run``, the run's actors)."""

from redray.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "redray.cluster.config": ["ClusterConfig"],
    "redray.cluster.flags": ["add_cluster_args", "cluster_options"],
    "redray.cluster.hosts": ["release_hosts"],
    "redray.cluster.launch": ["FitResult", "HostError", "RunResult", "connect", "fit", "run"],
    "redray.cluster.run_lock": ["RunLockedError"],
})
