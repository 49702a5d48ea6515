import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for one test module (e.g. where Ray Data reads a stream).
    Modules that define their own ``local_ray`` use theirs. Every test's Ray is a new
    local one (``address="local"``): never a cluster ``ray start`` left on the machine
    (a head killed without ``ray stop`` leaves its address in
    /tmp/ray/ray_current_cluster, which a bare ``ray.init()`` would try to join)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind():
    """A module that leaves a Ray instance up (e.g. a redray.Stream read outside a
    ``local_ray`` fixture starts one) would make every later module's ``ray.init``
    fail: it is shut down at the module's end, after the module's own fixtures."""
    yield
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
