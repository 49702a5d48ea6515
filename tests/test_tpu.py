"""TPU pod slices on a real multi-node Ray cluster on one machine: nodes that carry the
resources and labels Ray gives TPU hosts (from the ``TPU_*`` variables GKE sets, read as
each node starts), CPU devices standing in for the chips.

Three v5p-16 slices of 2 hosts (4 chips each) and a spare TPU node without slice labels;
every node was started with stale ``MEGASCALE_*`` values, which no host may keep. Each
node has an address of its own (127.0.0.x), so that the coordinator a host is given
names one node.

What this cannot check without TPUs: that libtpu joins the slices over the data-centre
network with these variables (docs/clusters.md says so).
"""

import json
import os
import threading
import time

import optax
import pytest

import redray
from redray import CheckpointConfig
from tiny import TinyLM, lm_collate, lm_loss, token_data

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")

SLICES, HOSTS_PER_SLICE, CHIPS = 3, 2, 4
STALE = {"MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_NUM_SLICES": "9",
         "MEGASCALE_SLICE_ID": "7", "MEGASCALE_PORT": "1"}
KEYS = sorted(STALE)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = {}
    try:
        for s in range(SLICES):
            for w in range(HOSTS_PER_SLICE):
                os.environ.update(STALE, TPU_NAME=f"slice-{s}", TPU_WORKER_ID=str(w),
                                  TPU_ACCELERATOR_TYPE="v5p-16", TPU_TOPOLOGY="2x2x2",
                                  JAX_PLATFORMS="cpu",
                                  XLA_FLAGS=f"--xla_force_host_platform_device_count={CHIPS}")
                nodes[(f"slice-{s}", w)] = made.add_node(
                    num_cpus=1, resources={"TPU": CHIPS},
                    node_ip_address=f"127.0.0.{10 + 2 * s + w}")
        for key in ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY"):
            os.environ.pop(key)
        nodes["spare"] = made.add_node(num_cpus=1, resources={"TPU": CHIPS},
                                       node_ip_address="127.0.0.30")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    made.wait_for_nodes()
    ray.init(address=made.address, include_dashboard=False, log_to_driver=False)
    yield made, nodes
    redray.cluster.release_hosts()
    ray.shutdown()
    made.shutdown()


def addresses(nodes) -> dict:
    """node id -> (slice, worker) of the TPU nodes."""
    return {node.node_id: where for where, node in nodes.items()}


def report(folder: str):
    """Each host writes what it would pass to JAX: its process id, node and the
    multislice variables."""
    import jax

    here = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "node": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "env": {k: os.environ.get(k) for k in KEYS}}
    with open(os.path.join(folder, f"host-{jax.process_index()}.json"), "w") as f:
        json.dump(here, f)


def reports(folder) -> list:
    return [json.loads(open(os.path.join(folder, f)).read())
            for f in sorted(os.listdir(folder)) if f.startswith("host-")]


def test_a_run_takes_whole_slices_host_0_on_slice_0s_worker_0(cluster, tmp_path):
    made, nodes = cluster
    where = addresses(nodes)
    one = tmp_path / "one"
    one.mkdir()
    redray.run(report, str(one), hosts=2, use_tpu=True, storage_path=str(tmp_path),
               name="one", tracking=False, checkpoint=False, keep_hosts=False)
    hosts = sorted(reports(one), key=lambda h: h["process"])
    assert [where[h["node"]][1] for h in hosts] == [0, 1]  # in worker-id order
    assert len({where[h["node"]][0] for h in hosts}) == 1  # one slice, whole
    assert all(h["devices"] == 2 * CHIPS for h in hosts)
    for h in hosts:  # one slice: no multislice variable, the node's stale ones removed
        assert h["env"] == dict.fromkeys(KEYS), h["env"]

    two = tmp_path / "two"
    two.mkdir()
    redray.run(report, str(two), slices=2, use_tpu=True, storage_path=str(tmp_path),
               name="two", tracking=False, checkpoint=False, keep_hosts=False)
    hosts = sorted(reports(two), key=lambda h: h["process"])
    placed = [where[h["node"]] for h in hosts]
    assert [w for _, w in placed] == [0, 1, 0, 1], placed
    slices = [placed[0][0], placed[2][0]]
    assert slices[0] == placed[1][0] and slices[1] == placed[3][0] and len(set(slices)) == 2
    assert "spare" not in placed
    for rank, h in enumerate(hosts):
        assert h["env"] == {"MEGASCALE_COORDINATOR_ADDRESS": hosts[0]["address"],
                            "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_PORT": "8081",
                            "MEGASCALE_SLICE_ID": str(rank // HOSTS_PER_SLICE)}, h


def test_hosts_that_are_not_whole_slices_are_refused(cluster, tmp_path):
    with pytest.raises(ValueError, match=r"hosts=3: a v5p-16 slice has 2 hosts .*hosts=4 "
                                         r"\(2 slices\)"):
        redray.run(report, str(tmp_path), hosts=3, use_tpu=True, storage_path=str(tmp_path),
                   name="three", tracking=False, checkpoint=False)
    with pytest.raises(ValueError, match="tpu_type='v6e-8': the cluster has no TPU slice of "
                                         "that type"):
        redray.run(report, str(tmp_path), slices=1, tpu_type="v6e-8", use_tpu=True,
                   storage_path=str(tmp_path), name="v6e", tracking=False, checkpoint=False)


class Record(redray.Hook):
    """Every host appends its group's view (process, node, multislice variables) as its
    Trainer starts; host 0 appends each logged loss. The first group's hosts, at step 6,
    wait there for their end (host 0 says its node: ``pausing``); a group of 4 hosts, at
    step 7, waits for the test to add a node back (``added``)."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_init(self, run) -> None:
        import jax

        with open(os.path.join(self.folder, "hosts"), "a") as f:
            f.write(json.dumps([os.getpid(), jax.process_index(),
                                ray.get_runtime_context().get_node_id(),
                                ray.util.get_node_ip_address(),
                                {k: os.environ.get(k) for k in KEYS}]) + "\n")

    def on_log(self, run, row: dict) -> None:
        import jax

        if jax.process_index() == 0 and "loss" in row:
            with open(os.path.join(self.folder, "losses"), "a") as f:
                f.write(json.dumps([os.getpid(), row["step"], row["loss"]]) + "\n")

    def on_step(self, run, info) -> None:
        import jax

        marker = os.path.join(self.folder, "pausing")
        if info.step == 6 and not os.path.exists(marker):
            if jax.process_index() == 0:
                with open(marker, "w") as f:
                    f.write(ray.get_runtime_context().get_node_id())
            time.sleep(120)  # the test removes host 0's node meanwhile
        if info.step == 7 and jax.process_count() == 4:
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(self.folder, "added")) \
                    and time.time() < deadline:
                time.sleep(0.1)


def rows(path) -> list:
    """The file's complete lines (the last may be being written), as JSON."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().split("\n")[:-1]]


def wait_for(condition, what: str, driver, seconds: float = 600) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert driver.is_alive() and time.time() < deadline, f"no {what}"
        time.sleep(0.2)


def test_a_lost_slice_ends_the_group_and_the_run_goes_on_on_the_slices_left(cluster,
                                                                           tmp_path):
    """An elastic run on all three slices (6 hosts): slice 0's worker 0 (host 0, which
    serves the runtime) removed without warning mid-run ends the group; a new one forms
    on the two whole slices left (the one that lost a node is not whole), with a new
    coordinator and its own slice ids, and resumes from the last checkpoint to the same
    losses (up to the rounding of 4 hosts' reductions instead of 6). The node comes back:
    at the next checkpoint the run grows by that whole slice, to 6 hosts again."""
    made, nodes = cluster
    where = addresses(nodes)
    folder = str(tmp_path)
    out = {}

    def fit():
        try:
            out["result"] = redray.fit(
                TinyLM, lm_collate, lm_loss, optax.adam(1e-2), train_data=token_data(288),
                hosts=(4, 6), use_tpu=True, batch_size=24, model_axis=4, max_steps=12,
                seed=0, log_every=1, progress=False, name="lost", storage_path=folder,
                tracking=False, hooks=[Record(folder)],
                checkpoint=CheckpointConfig(save_every=4, every_epoch=False))
        except BaseException as error:  # noqa: BLE001 - the test reports it
            out["error"] = error

    driver = threading.Thread(target=fit)
    driver.start()
    marker = os.path.join(folder, "pausing")
    wait_for(lambda: os.path.exists(marker), "pause at step 6", driver)
    time.sleep(0.5)  # the node id is written
    victim = open(marker).read()
    lost, _ = where[victim]
    made.remove_node(next(n for n in nodes.values() if n.node_id == victim),
                     allow_graceful=False)
    hosts = os.path.join(folder, "hosts")
    wait_for(lambda: len(rows(hosts)) >= 10, "group of 4", driver)
    saved = dict(os.environ)
    try:  # the lost host's replacement: the slice's worker 0 again, stale values too
        os.environ.update(STALE, TPU_NAME=lost, TPU_WORKER_ID="0",
                          TPU_ACCELERATOR_TYPE="v5p-16", TPU_TOPOLOGY="2x2x2",
                          JAX_PLATFORMS="cpu",
                          XLA_FLAGS=f"--xla_force_host_platform_device_count={CHIPS}")
        back = made.add_node(num_cpus=1, resources={"TPU": CHIPS}, node_ip_address="127.0.0.40")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    made.wait_for_nodes()
    where[back.node_id] = (lost, 0)
    open(os.path.join(folder, "added"), "w").close()
    driver.join(600)
    assert "result" in out, out.get("error")
    result = out["result"]
    assert result.resumed_from_step == 8  # the regroup's checkpoint

    seen = rows(hosts)
    assert [len(seen[:6]), len(seen[6:10]), len(seen[10:])] == [6, 4, 6], seen
    groups = [seen[:6], seen[6:10], seen[10:]]
    placed = [{r[1]: where[r[2]] for r in g} for g in groups]
    assert [placed[0][r][1] for r in range(6)] == [0, 1] * 3
    assert len({placed[0][r][0] for r in range(6)}) == 3
    assert placed[0][0] == (lost, 0)
    assert all(s != lost for s, _ in placed[1].values()), placed  # not the broken slice
    assert [placed[1][r][1] for r in range(4)] == [0, 1, 0, 1]
    assert [placed[2][r][1] for r in range(6)] == [0, 1] * 3
    assert lost in {s for s, _ in placed[2].values()}  # whole again, and taken
    coordinators = [next(r[3] for r in g if r[1] == 0) for g in groups]
    assert coordinators[1] != coordinators[0]
    for group, slices, coordinator in zip(groups[1:], (2, 3), coordinators[1:]):
        for pid, rank, node, address, env in group:  # fresh values, none stale
            assert env == {"MEGASCALE_COORDINATOR_ADDRESS": coordinator,
                           "MEGASCALE_NUM_SLICES": str(slices), "MEGASCALE_PORT": "8081",
                           "MEGASCALE_SLICE_ID": str(rank // 2)}, env

    by_group = {}
    for pid, step, loss in rows(os.path.join(folder, "losses")):
        by_group.setdefault(pid, {})[step] = loss
    before, after, grown = list(by_group.values())
    assert sorted(after) == [5, 6, 7, 8] and sorted(grown) == [9, 10, 11, 12]
    again = [s for s in before if s in after]
    assert again and all(abs(before[s] - after[s]) <= 1e-4 * abs(before[s]) for s in again), \
        (before, after)
