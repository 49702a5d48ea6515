"""Where runs live (redray.storage) and the cluster side of a run (ClusterConfig)."""

import optax
import pytest

import redray
from redray import storage
from redray.cluster.config import ClusterConfig
from tiny import TinyLM, lm_collate, lm_loss, token_data


def test_one_default_storage_folder_made_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert storage.storage_folder() == f"{tmp_path}/redray_runs"
    assert storage.RunFolders.of(None, "lm").checkpoints == \
        f"{tmp_path}/redray_runs/lm/checkpoints"
    monkeypatch.chdir(tmp_path)
    assert storage.storage_folder("out") == f"{tmp_path}/out"
    assert storage.RunFolders.of("gs://bucket/runs/", "lm").run == "gs://bucket/runs/lm"
    # the CLI's and the examples' flags default to the same folder
    assert redray.cluster_options(redray.add_cluster_args(
        __import__("argparse").ArgumentParser(), name="x").parse_args([])).storage_path == \
        storage.storage_folder()


def test_the_mlflow_store_follows_the_storage_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert storage.RunFolders.of("/data/runs").tracking_uri == "sqlite:////data/runs/mlflow.db"
    # a bucket cannot hold SQLite: the default folder's store
    assert storage.default_tracking_uri("gs://b/runs") == \
        f"sqlite:///{tmp_path}/redray_runs/mlflow.db"
    assert storage.RunFolders.of("gs://b/runs/").tracking_uri == \
        f"sqlite:///{tmp_path}/redray_runs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert storage.RunFolders.of("/data/runs").tracking_uri == "http://mlflow:5000"
    assert storage.RunFolders.of("/data/runs", tracking_uri="sqlite:////x.db").tracking_uri \
        == "sqlite:////x.db"
    assert storage.sqlite_file("sqlite:////data/runs/mlflow.db") == "/data/runs/mlflow.db"
    assert storage.sqlite_file("http://mlflow:5000") is None


def test_a_runs_folders_are_resolved_once_into_one_value(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("REDRAY_CACHE_DIR", raising=False)
    folders = storage.RunFolders.of("runs/", "lm")
    run = f"{tmp_path}/runs/lm"
    assert folders == storage.RunFolders(storage=f"{tmp_path}/runs", name="lm",
                                         tracking_uri=f"sqlite:///{tmp_path}/runs/mlflow.db")
    assert (folders.run, folders.checkpoints, folders.lock, folders.compile_cache,
            folders.hardware, folders.model_config, folders.tokenizer) == (
        run, f"{run}/checkpoints", f"{run}/redray.lock", f"{run}/compile_cache",
        f"{tmp_path}/runs/hardware", f"{run}/config.json", f"{run}/tokenizer")
    # one folder for the compiled programs and probes of every run, where set
    monkeypatch.setenv("REDRAY_CACHE_DIR", "shared/")
    assert (folders.compile_cache, folders.hardware, folders.checkpoints) == (
        f"{tmp_path}/shared/compile_cache", f"{tmp_path}/shared/hardware", f"{run}/checkpoints")
    monkeypatch.setenv("REDRAY_CACHE_DIR", "gs://bucket/cache/")
    assert folders.compile_cache == "gs://bucket/cache/compile_cache"
    monkeypatch.delenv("REDRAY_CACHE_DIR")
    assert storage.RunFolders.of().name.startswith("redray-")  # a new timestamped run
    # the driver resolves them once, and the run's checkpoints, lock, tracker and
    # compile cache all take them from the resolved config
    resolved = ClusterConfig(storage_path="runs", name="lm").resolved()
    assert resolved.folders == folders and resolved.checkpoint.directory == folders.checkpoints
    assert (resolved.name, resolved.storage_path) == (folders.name, folders.storage)
    given = ClusterConfig(name="lm", tracking_uri="http://mlflow:5000").resolved()
    assert given.folders.tracking_uri == "http://mlflow:5000"
    with pytest.raises(ValueError, match="call config.resolved"):
        ClusterConfig(name="lm").folders  # not resolved yet


def test_cluster_keywords_split_from_the_others_and_override_a_given_config():
    config, rest = ClusterConfig.split({"hosts": 2, "model_axis": 2, "name": "a"})
    assert config == ClusterConfig(hosts=2, name="a") and rest == {"model_axis": 2}
    base = ClusterConfig(hosts=4, name="b", storage_path="/s")
    config, rest = ClusterConfig.split({"name": "c"}, base)
    assert config == ClusterConfig(hosts=4, name="c", storage_path="/s") and rest == {}
    with pytest.raises(TypeError, match="must be a redray.ClusterConfig"):
        ClusterConfig.split({}, {"hosts": 2})


def test_a_resolved_config_names_its_run_storage_and_checkpoints(tmp_path):
    resolved = ClusterConfig(storage_path=str(tmp_path), resume=False,
                             checkpoint=redray.CheckpointConfig(save_every=5)).resolved()
    assert resolved.name.startswith("redray-") and resolved.storage_path == str(tmp_path)
    assert resolved.checkpoint.directory == f"{tmp_path}/{resolved.name}/checkpoints"
    assert resolved.checkpoint.save_every == 5 and resolved.checkpoint.resume is False
    assert ClusterConfig(checkpoint=False).resolved().checkpoint is None
    assert resolved.settings()["checkpoint"]["save_every"] == 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(hosts=0), "need at least one host"),
    (dict(use_gpu=True, use_tpu=True), "exclusive"),
    (dict(slices=2), r"slices=2 takes TPU slices: add use_tpu=True"),
    (dict(tpu_type="v5p-16"), r"tpu_type='v5p-16' takes TPU slices"),
    (dict(slices=0, use_tpu=True), r"slices=0: give a whole number of TPU slices"),
    (dict(checkpoint=3), "checkpoint must be a directory"),
])
def test_bad_cluster_settings_fail_on_the_driver(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ClusterConfig(**kwargs)


def test_an_unknown_fit_keyword_fails_before_any_host_starts():
    import ray

    assert not ray.is_initialized()
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['modle_axis'\].*model_axis"):
        redray.fit(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                   train_data=token_data(16), batch_size=8, modle_axis=2)
    assert not ray.is_initialized()  # no cluster was started or reached for it


def test_a_submitted_job_refuses_a_relative_storage_folder(monkeypatch, tmp_path):
    """Ray runs a submitted job in a temporary copy of its working dir: a relative
    storage or checkpoint folder there would be deleted with the job."""
    monkeypatch.chdir(tmp_path)
    assert storage.storage_folder("runs") == f"{tmp_path}/runs"  # not a job: resolved
    monkeypatch.setenv(storage.RAY_JOB_ENV, "{}")
    with pytest.raises(ValueError, match=r"storage_path='runs' is relative, and this is a "
                                         r"submitted Ray job.*absolute path.*gs://"):
        storage.storage_folder("runs")
    with pytest.raises(ValueError, match="CheckpointConfig.directory='ckpt' is relative"):
        storage.writable_folder("ckpt", "CheckpointConfig.directory")
    assert storage.storage_folder("/abs/runs") == "/abs/runs"
    assert storage.storage_folder("gs://bucket/runs/") == "gs://bucket/runs"
    assert storage.storage_folder().endswith("/redray_runs")  # the default is absolute
    with pytest.raises(ValueError, match="is relative"):
        redray.cluster_options(redray.add_cluster_args(
            __import__("argparse").ArgumentParser(), name="x").parse_args(["--storage", "r"]))
