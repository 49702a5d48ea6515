"""redray.run: a loop of the user's own on every host (2 simulated hosts x 2 devices).

The loop trains on new data every iteration (as reinforcement learning does), logs its
own metric, and resumes where it stopped when the run is started again.
"""

import mlflow
import numpy as np
import optax
import pytest

import redray
from tiny import TinyLM, lm_collate, lm_loss, lm_predict, token_data

pytestmark = pytest.mark.ray  # a local Ray cluster (or a Ray head)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def loop(iterations, **trainer_options):
    """Each iteration: 16 fresh examples, one epoch (2 steps), a prediction, a log row."""
    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       predict=lm_predict, batch_size=8, model_axis=2, log_every=1,
                       progress=False, **trainer_options)
    t.init(token_data(16))
    losses, done = [], []
    for it in range(t.step // 2, iterations):
        data = token_data(16, seed=100 + it)
        losses += [r["loss"] for r in t.fit(data, epochs=it + 1)]
        first = t.predictor().predict(data[:1])[0]
        t.log({"iteration": it, "first_token": first[0]})
        done.append(it)
    return {"losses": losses, "done": done, "step": t.step}


def test_own_loop_on_two_hosts_trains_like_one_process_logs_and_resumes(tmp_path):
    common = dict(hosts=2, devices_per_host=2, name="loop", storage_path=str(tmp_path))
    first = redray.run(loop, 2, **common)
    assert first.value["done"] == [0, 1] and first.value["step"] == 4
    assert first.resumed_from_step is None
    assert first.checkpoint == f"{tmp_path}/loop/checkpoints/4"
    local = loop(3)  # one process, 4 devices, no checkpoints
    np.testing.assert_allclose(first.value["losses"], local["losses"][:4], rtol=1e-5)

    again = redray.run(loop, 3, **common)
    assert again.resumed_from_step == 4
    assert again.value["done"] == [2] and again.value["step"] == 6
    np.testing.assert_allclose(again.value["losses"], local["losses"][4:], rtol=1e-5)

    assert again.mlflow_run_id == first.mlflow_run_id
    client = mlflow.MlflowClient(again.tracking_uri)
    logged = client.get_metric_history(again.mlflow_run_id, "iteration")
    assert [(m.step, m.value) for m in logged] == [(2, 0.0), (4, 1.0), (6, 2.0)]
    assert len(client.get_metric_history(again.mlflow_run_id, "loss")) == 6
    tags = client.get_run(again.mlflow_run_id).data.tags
    assert tags["redray.hosts"] == "2" and tags["redray.last_checkpoint"].endswith("/6")


def two_trainers():
    make = lambda: redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss,  # noqa: E731
                                  optax.adam(1e-2), batch_size=8, progress=False)
    make()
    make()


def test_a_second_trainer_on_the_runs_checkpoints_is_refused_with_the_fix(tmp_path):
    with pytest.raises(redray.cluster.HostError, match="checkpoint=False"):
        redray.run(two_trainers, hosts=1, devices_per_host=2, storage_path=str(tmp_path),
                   tracking=False)


def test_run_needs_a_function():
    with pytest.raises(TypeError, match="needs a function"):
        redray.run("main.py")
