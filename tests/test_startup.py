"""Where a run's start goes (``redray/startup.py``): every phase timed, the table adds up
to the call's wall time, MLflow has it; a second run from the same driver takes the
Ray and the hosts the first one started."""

import os

import numpy as np
import optax
import pytest

import redray
from redray import startup
from tiny import TinyLM, lm_loss, token_data

ray = pytest.importorskip("ray")


def test_phases_add_up_fill_the_gaps_and_make_one_table():
    clock = startup.Recorder()
    clock.add("build", 10.0, 11.0)
    clock.add("compile", 12.0, 14.0)
    clock.fill("steps", 9.0)  # around and between the two, up to now
    steps = [s for s in clock.spans if s.name == "steps"]
    assert [(s.start, s.end) for s in steps[:2]] == [(9.0, 10.0), (11.0, 12.0)]
    assert steps[2].start == 14.0 and len(steps) == 3
    clock.add("compile", 20.0, 21.0)
    phases = startup.seconds(clock.spans)
    assert list(phases)[:3] == ["build", "compile", "steps"]  # PHASES order
    assert phases["compile"] == 3.0  # entered twice: added up
    text = startup.table(clock.spans, sum(phases.values()) + 2.0, "the run")
    assert text.splitlines()[0] == "the run" and "unaccounted     2.00" in text
    assert startup.metrics(clock.spans, 30.0)["startup/total_s"] == 30.0
    with pytest.raises(ValueError, match="unknown start-up phase 'warmup'"):
        clock.add("warmup", 0.0, 1.0)


def pid_collate(folder):
    def collate(examples):
        with open(os.path.join(folder, str(os.getpid())), "w"):
            pass
        return {"ids": np.stack([e["ids"] for e in examples])}
    return collate


@pytest.mark.ray
def test_a_run_times_its_start_and_a_second_takes_its_ray_and_hosts(tmp_path, capfd,
                                                                    monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    seen = tmp_path / "pids"
    seen.mkdir()
    fit = dict(train_data=token_data(32), batch_size=8, hosts=2, devices_per_host=2,
               model_axis=2, name="tiny", storage_path=str(tmp_path / "runs"), progress=False,
               verbose=True)
    first = redray.fit(TinyLM, pid_collate(str(seen)), lm_loss, optax.adam(1e-2), max_steps=4,
                       epochs=2, **fit)
    session = ray.get_runtime_context().gcs_address
    first_hosts = set(os.listdir(seen))
    try:
        for name in ("imports", "ray", "sources", "actors", "hosts", "distributed", "user_code",
                     "build", "init", "compile", "first_step", "steps", "end"):
            assert first.startup.get(name, 0) > 0, (name, first.startup)
        assert "restore" not in first.startup or first.startup["restore"] < 1
        # every phase of the call is timed: what no phase covers is under 10% of it
        assert abs(sum(first.startup.values()) - first.seconds) <= 0.1 * first.seconds, \
            first.startup
        assert "redray: the run took" in capfd.readouterr().out  # verbose: the table
        metrics = MlflowClient(first.tracking_uri).get_run(first.mlflow_run_id).data.metrics
        assert metrics["startup/total_s"] == pytest.approx(first.seconds, rel=0.1)
        assert {f"startup/{name}_s" for name in first.startup} <= set(metrics)

        second = redray.fit(TinyLM, pid_collate(str(seen)), lm_loss, optax.adam(1e-2),
                            max_steps=8, epochs=2, **fit)
        assert second.resumed_from_step == 4
        assert ray.get_runtime_context().gcs_address == session  # the Ray the first started
        assert set(os.listdir(seen)) == first_hosts  # the same two host processes
        assert "hosts" not in second.startup and "distributed" not in second.startup
        assert second.startup["ray"] < 0.5 and second.startup["restore"] > 0
        assert abs(sum(second.startup.values()) - second.seconds) <= 0.1 * second.seconds, \
            second.startup
    finally:
        redray.cluster.release_hosts()
        ray.shutdown()


@pytest.mark.ray
def test_a_group_ray_cannot_place_in_time_is_given_up_and_frees_its_reservation():
    """An elastic run tries a smaller group when a size's placement does not come within
    ``ELASTIC_START_TIMEOUT_S`` (Ray may still count a lost node); what it reserved for
    the size given up is freed at once. A host lost while a group starts is a failure."""
    from redray.cluster import hosts

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        too_many = hosts.Shape.of(3, {"CPU": 1}, {}, "SPREAD")
        assert hosts.start(too_many, timeout=1.0) is None
        assert ray.available_resources().get("CPU") == 2
        from ray.util import placement_group_table

        assert all(p["state"] == "REMOVED" for p in placement_group_table().values())

        # a host lost while the group starts (here: its process ends in the call that
        # joins JAX's runtime) fails the start, naming it, as a failure a restart follows
        @ray.remote(num_cpus=0)
        class Joining:
            def join(self, lost):
                if lost:
                    os._exit(1)
                return "joined"

        said = []
        members = [Joining.remote() for _ in range(3)]
        with pytest.raises(hosts.HostFailure) as err:
            hosts._answers([m.join.remote(rank == 1) for rank, m in enumerate(members)],
                           None, "join JAX's distributed runtime", said.append)
        assert err.value.host == 1 and err.value.lost, err.value.ends
        assert "host 1 was lost while the group's hosts were to join JAX's" in str(err.value)
    finally:
        ray.shutdown()
