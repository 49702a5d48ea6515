"""Ray Train worker group: one worker per host, one jax.distributed runtime."""

from redray.cluster.launch import FitResult, HostError, RunResult, connect, fit, run

__all__ = ["FitResult", "HostError", "RunResult", "connect", "fit", "run"]
