"""redray.fit over a redray.Stream on a real local Ray cluster: 2 simulated hosts x 2
CPU devices, each host reading its own stream of the files through Ray Data.

The batches are the same as in one process (the plan does not depend on the hosts),
and a run stopped on 2 hosts resumes on 1 host bitwise equal to an uninterrupted run.
"""

import time

import numpy as np
import optax
import pytest

import redray
from redray import CheckpointConfig, load_params
from test_stream import write_parquet
from tiny import TinyLM, assert_same, lm_collate, lm_loss

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

OPTIONS = dict(batch_size=8, model_axis=2, log_every=1, seed=0, progress=False)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def model(rngs):
    return TinyLM(rngs)


def losses(history):
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def test_two_hosts_stream_like_one_process_and_resume_on_one(tmp_path):
    write_parquet(tmp_path / "data", files=2, rows=48, row_group=8)
    stream = redray.Stream(str(tmp_path / "data" / "*.parquet"), shuffle_buffer=20)
    common = dict(train_data=stream, epochs=2, storage_path=str(tmp_path / "runs"),
                  checkpoint=CheckpointConfig(save_every=5), **OPTIONS)
    whole = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), name="whole", hosts=2,
                       devices_per_host=2, **common)
    expected = losses(whole.history)
    assert sorted(expected) == list(range(1, 25))  # (96 rows / 2 streams) / 4 = 12 an epoch

    # one process reads both streams (streams=2: what the 2 hosts chose by default)
    local = redray.Trainer.of(model, lm_collate, lm_loss, optax.adam(1e-2), **OPTIONS)
    alone = local.fit(redray.Stream(str(tmp_path / "data" / "*.parquet"), shuffle_buffer=20,
                                    streams=2), epochs=2)
    np.testing.assert_allclose([losses(alone)[s] for s in sorted(expected)],
                               [expected[s] for s in sorted(expected)], rtol=1e-5)

    first = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), name="moved", hosts=2,
                       devices_per_host=2, max_steps=5, **common)
    assert sorted(losses(first.history)) == [1, 2, 3, 4, 5]
    # the same run on 1 host x 4 devices: it keeps the checkpoint's 2 streams
    rest = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), name="moved", hosts=1,
                      devices_per_host=4, **common)
    assert rest.resumed_from_step == 5
    assert losses(rest.history) == {s: v for s, v in expected.items() if s > 5}
    assert_same(load_params(f"{tmp_path}/runs/moved", model),
                load_params(f"{tmp_path}/runs/whole", model))


def test_a_cluster_without_a_free_cpu_for_ray_data_is_refused(tmp_path):
    from redray.cluster.job import FitTask
    from redray.cluster.launch import _check_data_cpus

    write_parquet(tmp_path, files=1, rows=8)
    task = FitTask(epochs=1, max_steps=None, progress=False, eval_at_start=False,
                   train=redray.Stream(str(tmp_path / "*.parquet")))
    _check_data_cpus(redray.ClusterConfig(hosts=2), task)  # 4 CPUs: 2 left for Ray Data
    with pytest.raises(ValueError, match=r"has 4 CPU\(s\) and the 4 host\(s\) reserve 4: "
                                         r"none is left for Ray Data"):
        _check_data_cpus(redray.ClusterConfig(hosts=4), task)


def test_a_streamed_run_keeps_a_cpu_free_for_ray_data_beside_every_group(tmp_path):
    """Hosts that reserve CPUs leave one free for Ray Data's reads: a group is placed,
    and an elastic run grows, only where it still fits beside them; the driver's word on
    a group that has not trained says when Ray Data has no CPU."""
    import types

    from ray.util.placement_group import placement_group, remove_placement_group

    from redray.cluster import hosts
    from redray.cluster.job import FitTask
    from redray.cluster.launch import _notice_start, group_room
    from redray.cluster.results import Results
    from redray.cluster.worker import Regrow

    redray.cluster.release_hosts()  # the hosts the module's runs kept: all 4 CPUs free
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < 4 and time.time() < deadline:
        time.sleep(0.1)
    write_parquet(tmp_path, files=1, rows=8)
    streamed = FitTask(epochs=1, max_steps=None, progress=False, eval_at_start=False,
                       train=redray.Stream(str(tmp_path / "*.parquet")))
    in_memory = FitTask(epochs=1, max_steps=None, progress=False, eval_at_start=False,
                        train=[1, 2, 3])
    room = group_room(redray.ClusterConfig(hosts=(2, 3)), streamed)
    assert room.bundles(2) == [{"CPU": 1}] * 3  # 2 hosts and the CPU kept free
    assert not group_room(redray.ClusterConfig(hosts=2), in_memory).spare
    assert not group_room(redray.ClusterConfig(hosts=2, use_gpu=True), streamed).spare
    # 4 CPUs: 3 hosts beside the free one, not 4
    assert room.free_for(3) and room.placeable(3, 5.0) and not room.free_for(4)
    assert hosts.start(hosts.Shape.of(4, room, {}, "SPREAD"), timeout=1.0) is None
    # an elastic group of 2 grows to 3 (3 + 1 free fit in 4 CPUs), one of 3 does not
    regrow = Regrow(4, room)
    assert regrow._room(2) and not regrow._room(3)

    taken = placement_group([{"CPU": 1}] * 4)  # every CPU held: Ray Data would wait
    ray.get(taken.ready())
    said = []
    results = Results.remote()
    try:
        group = types.SimpleNamespace(actors=[None, None],
                                      shape=hosts.Shape.of(2, room, {}, "SPREAD"))
        assert _notice_start(group, results, types.SimpleNamespace(write=said.append), True,
                             0.0)
        assert "host 0: its job not started" in said[0]
        assert "Ray Data has no free CPU to read the stream: the Ray cluster has 4 CPU(s)" \
            in said[0], said
        assert "Give Ray more CPUs" in said[0]
    finally:
        remove_placement_group(taken)
        ray.kill(results)
