"""The Ray instance the data layer uses when none is running yet.

Ray Data starts a local Ray by itself, counting the machine's cores as its CPUs. A run
started later on that instance (``redray.fit``) reserves one CPU per host, and Ray
Data's reads and transforms then find none free and wait forever. So the data layer
starts the local instance itself, with logical CPUs to spare for hosts (a logical CPU
is a scheduling token: XLA and the reads still share the real cores).
"""

from __future__ import annotations

import os

SPARE_CPUS = 8


def ensure_ray() -> None:
    """Connects to ``RAY_ADDRESS`` if set, else starts a local Ray with the machine's
    cores plus ``SPARE_CPUS`` logical CPUs; does nothing when Ray is running."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
    else:
        ray.init(num_cpus=(os.cpu_count() or 1) + SPARE_CPUS, include_dashboard=True,
                 log_to_driver=True)
