"""Exact resume and fault tolerance on a real local Ray cluster: 2 simulated hosts x 2
CPU devices, Orbax checkpoints written by both hosts, SIGKILLed hosts.

"Exact" is bitwise: float32 on CPU is deterministic for a fixed program and mesh, so
a resumed run must reproduce the uninterrupted one to the last bit.
"""

import os
import random

import jax
import optax
import pytest
from mlflow.tracking import MlflowClient

import redray
from redray import CheckpointConfig, load_params
from test_tracking_logger import tensorboard_history, wandb_history
from tiny import TinyLM, assert_same, lm_collate, lm_loss, token_data

pytestmark = pytest.mark.ray  # a local Ray cluster (or a Ray head)

ray = pytest.importorskip("ray")

DATA = token_data(96)  # 12 steps per epoch at batch 8
OPTIONS = dict(batch_size=8, model_axis=2, log_every=1, seed=0, progress=False, hosts=2,
               devices_per_host=2)


def model(rngs):
    return TinyLM(rngs)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 2 epochs straight through, saving every 4 steps."""
    storage = str(tmp_path_factory.mktemp("reference"))
    result = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), train_data=DATA, epochs=2,
                        name="ref", storage_path=storage,
                        checkpoint=CheckpointConfig(save_every=4), **OPTIONS)
    return result, load_params(f"{storage}/ref", model)


def losses(history):
    return {row["step"]: row["loss"] for row in history if "loss" in row}


def killing_collate(marker, at_call, stall_from=None):
    """Host 1 SIGKILLs itself on its ``at_call``-th training batch, once. From its
    ``stall_from``-th batch on, host 1's background checkpoint writes hold before they
    report done, so a save started then is still in flight at the kill, however fast
    the disk (else the write could finish first and the test would not test it)."""
    calls = []

    def collate(examples):
        if jax.process_index() == 1 and len(examples) == 4:
            calls.append(1)
            if len(calls) == stall_from and not os.path.exists(marker):
                _stall_background_saves()
            if len(calls) == at_call and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)  # no cleanup, no exception: a preempted machine
        return lm_collate(examples)
    return collate


def _stall_background_saves():
    """This process's Orbax background save threads wait a minute before their writes
    count as done (the process is killed long before)."""
    import time

    from orbax.checkpoint._src.checkpointers import async_checkpointer as module

    wait = module._background_wait_for_commit_futures

    def stalled(*args, **kwargs):
        time.sleep(60)
        return wait(*args, **kwargs)

    module._background_wait_for_commit_futures = stalled


def test_a_host_killed_mid_epoch_resumes_bitwise_exactly(tmp_path, uninterrupted, monkeypatch):
    reference, reference_params = uninterrupted
    monkeypatch.setenv("WANDB_MODE", "offline")
    at_call = random.Random(os.getpid()).randint(15, 23)  # a random batch inside epoch 1
    marker = str(tmp_path / "killed")
    result = redray.fit(model, killing_collate(marker, at_call), lm_loss, optax.adam(1e-2),
                        train_data=DATA, epochs=2, name="run", storage_path=str(tmp_path),
                        max_failures=1, checkpoint=CheckpointConfig(save_every=4),
                        tracking=("mlflow", "tensorboard", "wandb"), **OPTIONS)
    assert os.path.exists(marker), "host 1 was never killed"
    resumed = result.resumed_from_step
    # the last checkpoint complete at the kill (batches are collated a little ahead)
    assert resumed is not None and resumed % 4 == 0 and at_call - 12 <= resumed < at_call, \
        (resumed, at_call)
    after = losses(result.history)
    assert sorted(after) == list(range(resumed + 1, 25))  # trained on from the checkpoint
    expected = losses(reference.history)
    assert {s: expected[s] for s in after} == after  # bitwise: the same floats
    assert_same(load_params(f"{tmp_path}/run", model), reference_params)
    # MLflow: one value per step, the replayed steps (resumed+1 .. the kill) not twice
    client = MlflowClient(result.tracking_uri)
    for key in ("loss", "grad_norm", "epoch"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert sorted(logged) == list(range(1, 25)), key
    logged = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "loss")}
    assert logged == expected
    # TensorBoard and W&B the same: one value per step, the replayed steps not twice
    board = tensorboard_history(tmp_path / "run" / "tensorboard", "loss")
    assert [s for s, _ in board] == list(range(1, 25))
    assert wandb_history(tmp_path / "run", "loss") == sorted(expected.items())


def train_step_programs(storage: str, name: str) -> list:
    """The training step's entries in the run's compilation cache (process 0 writes it,
    every host reads it)."""
    return sorted(f for f in os.listdir(os.path.join(storage, name, "compile_cache"))
                  if f.startswith("jit_train_step-"))


def test_a_resubmitted_run_trains_only_what_is_left(tmp_path, uninterrupted, monkeypatch):
    monkeypatch.delenv("REDRAY_CACHE_DIR", raising=False)  # the run's own compile cache
    reference, reference_params = uninterrupted
    common = dict(train_data=DATA, name="again", storage_path=str(tmp_path),
                  checkpoint=CheckpointConfig(save_every=4), **OPTIONS)
    first = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), epochs=1, **common)
    assert first.resumed_from_step is None and max(losses(first.history)) == 12
    compiled = train_step_programs(str(tmp_path), "again")
    assert len(compiled) == 1, compiled
    second = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), epochs=2, **common)
    assert second.resumed_from_step == 12
    assert train_step_programs(str(tmp_path), "again") == compiled  # loaded, not compiled
    assert {row["epoch"] for row in second.history} == {1}  # only the new epoch trained
    assert losses(second.history) == {s: v for s, v in losses(reference.history).items() if s > 12}
    assert_same(load_params(f"{tmp_path}/again", model), reference_params)
    done = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), epochs=2, **common)
    assert done.resumed_from_step == 24 and done.history == []  # complete: nothing to do


def test_a_checkpoint_from_two_hosts_reshards_onto_one_host_with_fsdp(tmp_path, uninterrupted):
    reference, reference_params = uninterrupted
    storage = os.path.dirname(os.path.dirname(reference.checkpoint))
    trainer = redray.Trainer.of(model, lm_collate, lm_loss, optax.adam(1e-2), batch_size=8,
                             fsdp_axis=4, progress=False, checkpoint=f"{storage}/checkpoints")
    trainer.init(DATA)
    assert trainer.resumed_from["step"] == 24
    assert dict(trainer.mesh.shape) == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1,
                                        "context": 1, "model": 1}
    sharded = [x for x in jax.tree.leaves(trainer.state.params) if x.ndim == 2]
    assert any(x.sharding.spec != jax.sharding.PartitionSpec() for x in sharded)
    assert_same(trainer.state.params, reference_params[0])


def test_killing_a_host_while_a_save_is_in_flight_keeps_the_previous_checkpoint(tmp_path,
                                                                            uninterrupted):
    reference, reference_params = uninterrupted
    marker = str(tmp_path / "killed")
    # Without prefetch, host 1 collates batch 9 right after save(step 8) returned, while
    # that save is still being written in the background (held there from batch 8 on).
    result = redray.fit(model, killing_collate(marker, 9, stall_from=8), lm_loss,
                        optax.adam(1e-2),
                        train_data=DATA, epochs=2, name="run", storage_path=str(tmp_path),
                        max_failures=1, prefetch=0, checkpoint=CheckpointConfig(save_every=4),
                        **OPTIONS)
    assert os.path.exists(marker)
    assert result.resumed_from_step == 4  # the interrupted save of step 8 never counted
    assert losses(result.history) == {s: v for s, v in losses(reference.history).items() if s > 4}
    assert_same(load_params(f"{tmp_path}/run", model), reference_params)


def test_a_run_choosing_its_plan_replans_when_resumed_on_fewer_hosts(tmp_path, monkeypatch):
    monkeypatch.delenv("REDRAY_CACHE_DIR", raising=False)  # the storage's own probe
    common = dict(train_data=DATA, name="auto", storage_path=str(tmp_path), batch_size=8,
                  plan="auto", log_every=1, seed=0, progress=False, devices_per_host=2,
                  checkpoint=CheckpointConfig(save_every=4),
                  plan_timing=True)  # timed, though short: the timings are kept
    first = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), epochs=1, hosts=2,
                       **common)
    tags = MlflowClient(first.tracking_uri).get_run(first.mlflow_run_id).data.tags
    chosen = tags["redray.plan.chosen"]
    assert "runner-up" in tags["redray.plan.why"] or tags["redray.plan.plans_weighed"] == "1"
    assert tags["redray.plan.hardware"] == "probed: 2 host(s) x 2 cpu"
    # the cluster's numbers are kept in the storage folder, per cluster, and so are the
    # model's timings (per cluster and program)
    assert sorted(p.name for p in (tmp_path / "hardware").iterdir()) == [
        "cpu-cpu-4-devices-2-hosts.json", "timings"]
    (timing,) = (tmp_path / "hardware" / "timings").iterdir()
    assert timing.name.startswith("cpu-cpu-4-devices-2-hosts-")
    second = redray.fit(model, lm_collate, lm_loss, optax.adam(1e-2), epochs=2, hosts=1,
                        **common)
    assert second.resumed_from_step == 12 and second.mlflow_run_id == first.mlflow_run_id
    tags = MlflowClient(second.tracking_uri).get_run(second.mlflow_run_id).data.tags
    assert tags["redray.plan.hardware"] == "probed: 1 host(s) x 2 cpu"
    replanned = tags["redray.plan.chosen"]
    sizes = [int(part.split("=")[1]) for part in replanned.split(",")[0].split(" x ")]
    assert sizes[0] * sizes[1] * sizes[2] == 2 and replanned != chosen  # 2 devices now
    assert {row["epoch"] for row in second.history if "loss" in row} == {1}
    assert all(0 < row["loss"] < 10 for row in second.history if "loss" in row)
