"""Ray Train worker group: one worker per host, one jax.distributed runtime."""

from redray.cluster.launch import FitResult, connect, fit

__all__ = ["FitResult", "connect", "fit"]
