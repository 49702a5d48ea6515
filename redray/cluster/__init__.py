"""Ray Train worker group: one worker per host, one jax.distributed runtime."""

from redray.cluster.config import ClusterConfig
from redray.cluster.flags import add_cluster_args, cluster_options
from redray.cluster.launch import FitResult, HostError, RunResult, connect, fit, run
from redray.cluster.run_lock import RunLockedError

__all__ = ["ClusterConfig", "FitResult", "HostError", "RunLockedError", "RunResult",
           "add_cluster_args", "cluster_options", "connect", "fit", "run"]
