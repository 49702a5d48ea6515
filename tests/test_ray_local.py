"""The local Ray the data layer starts when none runs: logical CPUs to spare for hosts,
and Ray Data on the driver kept to the machine's real cores."""

import os

import pytest

from redray.data.ray_local import SPARE_CPUS, ensure_ray

ray = pytest.importorskip("ray")


@pytest.mark.ray
def test_a_local_ray_spares_cpus_for_hosts_and_keeps_ray_data_to_the_cores(monkeypatch):
    from ray.data import DataContext

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    options = DataContext.get_current().execution_options
    before = options.resource_limits
    assert not ray.is_initialized()
    ensure_ray()
    try:
        cores = os.cpu_count()
        assert ray.cluster_resources()["CPU"] == cores + SPARE_CPUS
        assert options.resource_limits.cpu == cores
        ensure_ray()  # running: nothing changes
        assert ray.cluster_resources()["CPU"] == cores + SPARE_CPUS
    finally:
        ray.shutdown()
        options.resource_limits = before
