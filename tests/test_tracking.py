"""MLflow tracking of 2-host runs (2 simulated hosts x 2 CPU devices on a local Ray
cluster): the SQLite default, a real `mlflow server`, a resumed run, a dead store."""

import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import numpy as np
import optax
import pytest
from mlflow.tracking import MlflowClient

import redray
from redray.checkpoint import latest_meta
from redray.engine.profile import PROFILE_ENV
from redray.tracking import MlflowLogger, TrackingWarning, plot
from test_tracking_logger import tensorboard_history, wandb_history, wandb_summary
from tiny import TinyLM, lm_collate, lm_loss, token_data

pytestmark = pytest.mark.ray  # a local Ray cluster (or a Ray head)

ray = pytest.importorskip("ray")

DATA, EVAL = token_data(96), token_data(16, seed=1)  # 12 steps per epoch at batch 8
OPTIONS = dict(batch_size=8, model_axis=2, log_every=2, seed=0, progress=False, hosts=2,
               devices_per_host=2, learning_rate=1e-2)


ALL = ("mlflow", "tensorboard", "wandb")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(storage, epochs, **kw):
    return redray.fit(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                      train_data=DATA, eval_data=EVAL, epochs=epochs, name="lm",
                      storage_path=str(storage), **OPTIONS, **kw)


def steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_resumed_run_logs_once_per_step_into_the_same_sqlite_run(tmp_path, monkeypatch):
    # the driver's REDRAY_PROFILE (as `redray run --profile 3:4` sets it) reaches every
    # host's Trainer through the job (the hosts' processes started without it)
    monkeypatch.setenv(PROFILE_ENV, "3:4")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the driver's, for the tracker actor
    first = run(tmp_path, epochs=1, tracking=ALL)
    monkeypatch.delenv(PROFILE_ENV)
    for host in (0, 1):  # each host's own trace, in the run's profile folder
        assert glob.glob(f"{tmp_path}/lm/profile/host{host}/**/*.xplane.pb", recursive=True)
    assert first.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"  # the embedded default
    second = run(tmp_path, epochs=2, tracking=ALL)  # resumes at step 12
    assert second.resumed_from_step == 12
    assert second.mlflow_run_id == first.mlflow_run_id  # the same MLflow run, continued
    kept = latest_meta(f"{tmp_path}/lm/checkpoints")["run"]
    wandb_id = first.trackers["wandb"]["run_id"]
    assert (kept["mlflow_run_id"], kept["wandb_run_id"]) == (first.mlflow_run_id, wandb_id)
    assert second.trackers["wandb"]["run_id"] == wandb_id  # the same W&B run, continued
    assert all(r["failure"] is None for r in second.trackers.values()), second.trackers

    client = MlflowClient(second.tracking_uri)
    found = client.get_run(second.mlflow_run_id)
    train_steps = list(range(2, 25, 2))
    for key in ("loss", "accuracy", "grad_norm", "learning_rate", "steps_per_s",
                "examples_per_s", "tokens_per_s", "step_time_s", "epoch"):
        assert steps(client, found.info.run_id, key) == train_steps, key  # once each: no host twice
    assert steps(client, found.info.run_id, "eval_loss") == [12, 24]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "epoch")] == \
        [0.0] * 6 + [1.0] * 6
    assert {"batch_size": "8", "hosts": "2", "model_axis": "2", "epochs": "2",
            "checkpoint.keep": "3"}.items() <= found.data.params.items()  # what it runs with
    tags = found.data.tags
    assert tags["redray.params_changed"] == "resumed with epochs: 1 -> 2"
    assert tags["redray.version"] == redray.__version__
    assert tags["redray.mesh"] == "data=2 x fsdp=1 x model=2"
    assert tags["redray.plan"] == "data=2 x fsdp=1 x model=2, batch 8 = 4 per device x 1 " \
        "accumulation steps"  # the plan value, as the console printed it
    assert (tags["redray.hosts"], tags["redray.devices"]) == ("2", "4")
    assert int(tags["redray.parameters"]) == 14752
    assert tags["redray.last_checkpoint"] == f"{tmp_path}/lm/checkpoints/24"
    assert found.info.status == "FINISHED"
    assert found.info.artifact_uri.startswith(f"{tmp_path}/mlartifacts/")  # beside the db
    placed = client.download_artifacts(found.info.run_id, "placement.txt", str(tmp_path))
    assert "mesh data=2 x fsdp=1 x model=2" in open(placed).read()
    # the plan as params and as the file plan= takes back
    assert found.data.params["plan.axes.model"] == "2"
    written = client.download_artifacts(found.info.run_id, "plan.json", str(tmp_path))
    assert redray.Plan.from_json(open(written).read()).shape == {
        "stage": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "model": 2}
    # TensorBoard and W&B hold every metric MLflow holds, at the same steps, once each
    for key, values in found.data.metrics.items():
        logged = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id,
                                                                            key))
        board = tensorboard_history(tmp_path / "lm" / "tensorboard", key)
        assert [s for s, _ in board] == [s for s, _ in logged], key
        np.testing.assert_allclose([v for _, v in board], [v for _, v in logged], rtol=1e-6)
        if key.startswith("startup/"):  # logged at the run's first step, at its end: W&B's
            # steps only go forward, so the newest run's value is in the W&B run's summary
            assert wandb_summary(tmp_path / "lm", key) == logged[-1][1], key
        else:
            assert wandb_history(tmp_path / "lm", key) == logged, key
    assert "placement.txt" in os.listdir(glob.glob(f"{tmp_path}/lm/wandb/*run-*{wandb_id}/"
                                                       "files")[0])
    traces = client.download_artifacts(found.info.run_id, "profile", str(tmp_path / "got"))
    assert glob.glob(f"{traces}/**/*.xplane.pb", recursive=True)  # host 0's, as an artifact

    listed = subprocess.run([sys.executable, "-m", "redray.cli", "runs", str(tmp_path), "--json"],
                            capture_output=True, text=True)
    evals = {r["step"]: r["eval_loss"] for r in first.history + second.history
             if "eval_loss" in r}
    best_step = min(evals, key=evals.get)
    assert json.loads(listed.stdout) == [{
        "name": "lm", "status": "FINISHED", "last_step": 24,
        "last_checkpoint": f"{tmp_path}/lm/checkpoints/24",
        "best": {"metric": "eval_loss", "value": evals[best_step], "step": best_step}}]

    png = plot("lm", str(tmp_path / "curves.png"), storage_path=str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    cli = subprocess.run([sys.executable, "-m", "redray.cli", "plot", "nope", "--storage",
                          str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 2 and "no MLflow run 'nope'" in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1


def test_a_real_mlflow_server_receives_every_metric_once(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host",
         "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
         "--default-artifact-root", str(tmp_path / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        uri = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "mlflow server did not start"
                time.sleep(1)
        result = run(tmp_path, epochs=1, tracking_uri=uri)
        client = MlflowClient(uri)
        assert steps(client, result.mlflow_run_id, "loss") == list(range(2, 13, 2))
        assert steps(client, result.mlflow_run_id, "eval_loss") == [12]
        found = client.get_run(result.mlflow_run_id)
        assert found.data.tags["redray.mesh"] == "data=2 x fsdp=1 x model=2"
        assert [a.path for a in client.list_artifacts(result.mlflow_run_id)] == \
            ["placement.txt", "plan.json"]
    finally:
        os.killpg(server.pid, 9)
        server.wait()


def test_a_dead_tracking_store_warns_once_and_training_completes(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(tmp_path, epochs=1, tracking_uri=uri)
    assert max(r["step"] for r in result.history) == 12  # trained to the end
    assert os.path.isdir(f"{tmp_path}/lm/checkpoints/12")
    ours = [w for w in caught if issubclass(w.category, TrackingWarning)]
    assert len(ours) == 1 and uri in str(ours[0].message)
    assert result.mlflow_run_id is None


def test_the_logger_counts_what_it_could_not_log():
    uri = f"http://127.0.0.1:{free_port()}"
    logger = MlflowLogger(uri, "x", "/nowhere/x")
    for step in range(5):
        logger.log_metrics({"loss": 1.0, "accuracy": 0.5, "note": "text is skipped"}, step)
    report = logger.finish(timeout=60)
    assert report["failure"] and report["dropped"] == 10 and report["run_id"] is None
