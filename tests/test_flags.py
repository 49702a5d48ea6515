"""The cluster flags every example shares, and a run's closing summary."""

import argparse
import os

import pytest

import redray


def test_cluster_flags_become_fit_keywords_with_an_absolute_storage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = redray.add_cluster_args(argparse.ArgumentParser(), name="digits", hosts=1)
    args = parser.parse_args(["--devices-per-host", "4", "--storage", "out", "--gpu"])
    assert redray.cluster_options(args) == redray.ClusterConfig(
        hosts=1, devices_per_host=4, use_gpu=True, name="digits",
        storage_path=os.path.join(str(tmp_path), "out"))
    assert "--hosts HOSTS" in parser.format_help()
    # --tracking: comma-separated trackers, or none
    picked = redray.cluster_options(parser.parse_args(["--tracking", "mlflow,tensorboard"]))
    assert picked.trackers == ("mlflow", "tensorboard")
    assert redray.cluster_options(parser.parse_args(["--tracking", "none"])).trackers == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tracking", "mlflow,tensorflow"])
    with pytest.raises(ValueError, match="tracking='neptune': give True"):
        redray.ClusterConfig(tracking="neptune")


def test_summary_says_where_things_are_and_when_nothing_was_left_to_train():
    common = dict(name="lm", storage_path="/data/runs", seconds=1.0, tracking_uri=
                  "sqlite:////data/runs/mlflow.db", mlflow_run_id="abc",
                  checkpoint="/data/runs/lm/checkpoints/300")
    trained = redray.FitResult(history=[{"step": 300, "loss": 1.0}], **common).summary()
    assert "checkpoint:    /data/runs/lm/checkpoints/300" in trained
    assert "mlflow ui --backend-store-uri sqlite:////data/runs/mlflow.db" in trained
    assert "already complete" not in trained
    done = redray.FitResult(history=[], resumed_from_step=300, **common).summary()
    assert done.startswith("run 'lm' was already complete at step 300")
    both = redray.RunResult(name="lm", storage_path="/data/runs", seconds=1.0, trackers={
        "tensorboard": {"run_id": "/data/runs/lm/tensorboard",
                        "uri": "/data/runs/lm/tensorboard"},
        "wandb": {"run_id": "x1", "uri": "/data/runs/lm/wandb"}}).summary()
    assert "TensorBoard:   tensorboard --logdir /data/runs/lm" in both
    assert "W&B run:       x1 in /data/runs/lm/wandb (offline: wandb sync" in both
    untracked = redray.RunResult(name="x", storage_path="/s", seconds=1.0).summary()
    assert "MLflow" not in untracked and "checkpoint:    none" in untracked


def test_elastic_hosts_are_a_min_and_a_max_with_restarts_by_default():
    parser = redray.add_cluster_args(argparse.ArgumentParser(), name="lm")
    config = redray.cluster_options(parser.parse_args(["--hosts", "2:4"]))
    assert (config.elastic, config.min_hosts, config.max_hosts, config.max_failures) == \
        (True, 2, 4, 3)  # every host lost is a restart: an elastic run has some
    fixed = redray.cluster_options(parser.parse_args(["--hosts", "3"]))
    assert (fixed.elastic, fixed.min_hosts, fixed.max_hosts, fixed.max_failures) == \
        (False, 3, 3, 0)
    assert redray.ClusterConfig(hosts=[1, 2]).hosts == (1, 2)  # JSON gives lists
    for bad in ((3, 2), (0, 2), (1, 2, 3), (1.5, 2)):
        with pytest.raises(ValueError, match="1 <= min <= max"):
            redray.ClusterConfig(hosts=bad)
    with pytest.raises(ValueError, match="max_failures >= 1"):
        redray.ClusterConfig(hosts=(1, 2), max_failures=0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--hosts", "2:x"])


def test_tpu_flags_take_slices_and_leave_the_chips_to_the_slice():
    parser = redray.add_cluster_args(argparse.ArgumentParser(), name="lm")
    config = redray.cluster_options(parser.parse_args(["--tpu", "--slices", "2"]))
    # the hosts follow from the slices; each host takes its node's chips
    assert (config.use_tpu, config.slices, config.hosts, config.devices_per_host) == \
        (True, 2, 1, None)
    given = redray.cluster_options(parser.parse_args(["--tpu", "--hosts", "4"]))
    assert (given.hosts, given.slices) == (4, None)
