"""The local Ray the data layer starts when none runs: logical CPUs to spare for hosts,
Ray Data kept to the machine's real cores, on the driver and (the driver hands its
DataContext to the hosts) in the hosts' processes, and a run beside another Ray
instance on the machine."""

import glob
import os
import subprocess
import sys

import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import redray
from redray.processes.ray_local import SPARE_CPUS, ensure_ray
from tiny import TinyLM, lm_loss, token_data

ray = pytest.importorskip("ray")


def recording_collate(folder):
    def collate(examples):
        from ray.data import DataContext

        limit = DataContext.get_current().execution_options.resource_limits.cpu
        with open(os.path.join(folder, f"host-{os.getpid()}"), "w") as f:
            f.write(str(limit))
        return {"ids": np.stack([e["ids"] for e in examples])}

    return collate


ANOTHER_RAY = ("import sys, ray; ray.init(address='local', num_cpus=1, include_dashboard=False); "
               "print('up', flush=True); sys.stdin.read(); ray.shutdown()")


@pytest.mark.ray
def test_a_local_ray_spares_cpus_keeps_ray_data_to_the_cores_and_knows_its_instance(
        monkeypatch, tmp_path, capfd):
    from ray.data import DataContext

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # another run's Ray on the machine (Ray Train's placement-group cleaner, which redray
    # used before it ran its own hosts, asked the state API without an address, found
    # two instances and died with a traceback)
    other = subprocess.Popen([sys.executable, "-c", ANOTHER_RAY], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert other.stdout.readline().strip() == "up"
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
        # the hosts of a run on it (whose Stream reads are Ray Data's) keep to them too
        folder = tmp_path / "corpus"
        folder.mkdir()
        pq.write_table(pa.table({"ids": [e["ids"].tolist() for e in token_data(32)]}),
                       str(folder / "part-0.parquet"))
        redray.fit(lambda rngs: TinyLM(rngs), recording_collate(str(tmp_path)), lm_loss,
                   optax.adam(1e-2), train_data=redray.Stream(str(folder)), max_steps=1, hosts=2,
                   devices_per_host=1, batch_size=8, storage_path=str(tmp_path / "runs"),
                   progress=False)
        limits = [open(p).read() for p in glob.glob(str(tmp_path / "host-*"))]
        assert limits == [str(cores)] * 2
        shown = capfd.readouterr()
        assert "multiple active Ray instances" not in shown.out + shown.err
        assert "Traceback" not in shown.out + shown.err
    finally:
        ray.shutdown()
        options.resource_limits = before
        other.communicate("", timeout=60)
