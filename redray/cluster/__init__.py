"""Ray Train worker group: one worker per host, one jax.distributed runtime."""

from redray.cluster.launch import FitResult, HostError, connect, fit

__all__ = ["FitResult", "HostError", "connect", "fit"]
