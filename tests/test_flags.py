"""The cluster flags every example shares, and a run's closing summary."""

import argparse
import os

import redray


def test_cluster_flags_become_fit_keywords_with_an_absolute_storage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = redray.add_cluster_args(argparse.ArgumentParser(), name="digits", hosts=1)
    args = parser.parse_args(["--devices-per-host", "4", "--storage", "out", "--gpu"])
    assert redray.cluster_options(args) == redray.ClusterConfig(
        hosts=1, devices_per_host=4, use_gpu=True, name="digits",
        storage_path=os.path.join(str(tmp_path), "out"))
    assert "--hosts HOSTS" in parser.format_help()


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
    untracked = redray.RunResult(name="x", storage_path="/s", seconds=1.0).summary()
    assert "MLflow" not in untracked and "checkpoint:    none" in untracked
