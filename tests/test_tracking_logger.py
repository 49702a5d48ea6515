"""MlflowLogger against a real SQLite MLflow store, in one process (no Ray)."""

import pytest
from mlflow.tracking import MlflowClient

from redray.tracking import MlflowLogger


def history(uri, run_id, key):
    return [(m.step, m.value) for m in
            sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def log_two_sessions(first):
    """Steps 1-10 (an evaluation at 10), then a restarted worker group's steps 7-12."""
    first.new_session()
    for step in range(1, 11):
        first.log_metrics({"loss": step, "lr": 0.1}, step)
    first.log_metrics({"eval_loss": 5.0}, 10)
    first.new_session()  # a restarted worker group, resumed from step 6
    for step in range(7, 13):
        first.log_metrics({"loss": step + 0.5, "lr": 0.2}, step)


def log_the_next_session(second, report):
    """A new driver's session: steps 11-15, a replayed evaluation at 10, one at 15."""
    second.new_session()
    for step in range(11, 16):
        second.log_metrics({"loss": step + 0.25}, step)
    second.log_metrics({"eval_loss": 4.0}, 10)  # replayed evaluation: left out
    second.log_metrics({"eval_loss": 3.0}, 15)
    assert second.finish()["run_id"] == report["run_id"]
    assert second.replayed == 3


def test_resumed_sessions_log_each_metric_once_per_step(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MlflowLogger(uri, "r", f"{tmp_path}/r")
    log_two_sessions(first)
    first.log_metrics({"loss": 99.0}, 12)  # within a session nothing is filtered
    report = first.finish("KILLED")
    assert first.replayed == 8  # steps 7-10, loss and lr

    second = MlflowLogger(uri, "r", f"{tmp_path}/r")  # a new driver: the store's mark
    log_the_next_session(second, report)

    run = report["run_id"]
    loss = history(uri, run, "loss")
    assert [s for s, _ in loss] == [*range(1, 13), 12, 13, 14, 15]
    assert loss[:10] == [(s, float(s)) for s in range(1, 11)]  # the first values stay
    assert loss[10] == (11, 11.5) and loss[-1] == (15, 15.25)
    assert [s for s, _ in history(uri, run, "lr")] == list(range(1, 13))
    assert history(uri, run, "eval_loss") == [(10, 5.0), (15, 3.0)]


def schedule(step):
    return 0.1


def test_a_resumed_run_s_params_say_what_it_runs_with_and_never_an_address(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MlflowLogger(uri, "r", f"{tmp_path}/r")
    first.log_params({"max_steps": 20, "learning_rate": schedule, "opt": {"b1": 0.9},
                      "thing": object()})
    run = first.finish()["run_id"]
    params = MlflowClient(uri).get_run(run).data.params
    assert params["learning_rate"] == "function test_tracking_logger.schedule"
    assert params["thing"] == "builtins.object" and params["opt.b1"] == "0.9"
    second = MlflowLogger(uri, "r", f"{tmp_path}/r")
    second.log_params({"max_steps": 40, "learning_rate": schedule, "opt": {"b1": 0.95}})
    second.finish()
    third = MlflowLogger(uri, "r", f"{tmp_path}/r")
    third.log_params({"max_steps": 60, "learning_rate": schedule, "opt": {"b1": 0.95}})
    third.finish()
    found = MlflowClient(uri).get_run(run).data
    assert found.params["max_steps"] == "60" and found.params["opt.b1"] == "0.95"
    assert found.tags["redray.params_changed"] == (
        "resumed with max_steps: 20 -> 40, opt.b1: 0.9 -> 0.95\n"
        "resumed with max_steps: 40 -> 60")


def test_plot_draws_any_logged_metric_with_labelled_axes(tmp_path):
    """redray plot on a real SQLite MLflow store: default curves, --metric, labels, and
    a metric the run never logged named with those it did."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from redray.tracking import plot_figure

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("plots"), run_name="curves")
    for step in range(1, 6):
        for name, value in (("loss", 3.0 / step), ("eval_loss", 3.5 / step),
                            ("learning_rate", 1e-3 * step), ("grad_norm", 2.0 + step),
                            ("tokens_per_s", 1000.0 + step)):
            client.log_metric(run.info.run_id, name, value, step=step)
    fig = plot_figure("curves", tracking_uri=uri)
    (losses, rate) = fig.axes
    assert [line.get_label() for line in losses.lines] == ["loss", "eval_loss"]
    assert losses.get_ylabel() == "loss" and rate.get_ylabel() == "learning rate"
    assert all(ax.get_xlabel() == "step (optimizer updates)" for ax in fig.axes)
    fig = plot_figure(run.info.run_id, tracking_uri=uri, metrics=["grad_norm", "tokens_per_s"])
    assert [ax.get_ylabel() for ax in fig.axes] == ["grad norm", "tokens per s"]
    assert list(fig.axes[0].lines[0].get_ydata()) == [3.0, 4.0, 5.0, 6.0, 7.0]
    with pytest.raises(LookupError, match="no metric \\['accuracy'\\].*grad_norm, learning_rate"):
        plot_figure("curves", tracking_uri=uri, metrics=["accuracy"])
    done = subprocess.run([sys.executable, "-m", "redray.cli", "plot", "curves", "--tracking-uri",
                           uri, "--metric", "grad_norm", "--out", str(tmp_path / "g.png")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_git_commit_outside_a_work_tree_is_what_submit_sent(tmp_path, monkeypatch):
    import subprocess

    from redray.tracking import GIT_COMMIT_ENV, git_commit

    monkeypatch.delenv(GIT_COMMIT_ENV, raising=False)
    assert git_commit(str(tmp_path)) is None  # no repository, nothing sent
    monkeypatch.setenv(GIT_COMMIT_ENV, "abc123-dirty")
    assert git_commit(str(tmp_path)) == "abc123-dirty"
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_commit(str(tmp_path)) == head.strip()  # a work tree's own commit wins


def test_new_stores_are_copies_of_one_store_migrated_once(tmp_path, monkeypatch):
    """MLflow builds a new SQLite store by running every schema migration (2.6 s); redray
    migrates one template per machine (REDRAY_CACHE_DIR here) and copies it for each new
    store, whose Default experiment MLflow then makes next to it."""
    import mlflow.store.db.utils as db

    from redray.tracking import store_template

    monkeypatch.setenv("REDRAY_CACHE_DIR", str(tmp_path / "cache"))
    migrations = []
    initialize = db._initialize_tables
    monkeypatch.setattr(db, "_initialize_tables",
                        lambda engine: (migrations.append(engine.url), initialize(engine)))
    runs = []
    for store in ("a", "b", "a"):  # two new stores, then the first one again
        uri = f"sqlite:///{tmp_path}/{store}/mlflow.db"
        logger = MlflowLogger(uri, "r", f"{tmp_path}/{store}/r")
        logger.log_metrics({"loss": 1.0}, 1)
        report = logger.finish()
        assert report["failure"] is None
        runs.append((uri, report["run_id"]))
    assert len(migrations) == 1 and str(tmp_path / "cache") in str(migrations[0])
    assert store_template().startswith(str(tmp_path / "cache"))
    for uri, run_id in runs:
        assert history(uri, run_id, "loss") == [(1, 1.0)]
        names = {e.name for e in MlflowClient(uri).search_experiments()}
        assert names == {"Default", "redray"}
    assert runs[0][1] == runs[2][1]  # the same run resumed in the first store


def tensorboard_history(logdir, key):
    """(step, value) of a scalar in write order, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = EventAccumulator(str(logdir))
    found.Reload()
    return [(e.step, e.value) for e in found.Scalars(key)] if key in found.Tags()["scalars"] \
        else []


def wandb_rows(folder, kind):
    """(step, {key: value}) of every history (or summary) record of a W&B run's local
    .wandb files, session after session."""
    import glob
    import json

    from redray.trackers import wandb_records

    for path in sorted(glob.glob(f"{folder}/wandb/*run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == kind:
                part = getattr(record, kind)
                items = part.item if kind == "history" else part.update
                yield (part.step.num if kind == "history" else None,
                       {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})


def wandb_history(folder, key):
    """(step, value) of a metric over every session's local .wandb file, in order."""
    return [(step, values[key]) for step, values in wandb_rows(folder, "history")
            if key in values]


def wandb_summary(folder, key):
    """The newest value of ``key`` in the run's summary, over every session's file."""
    found = [values[key] for _, values in wandb_rows(folder, "summary") if key in values]
    return found[-1] if found else None


@pytest.fixture
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_tensorboard_and_wandb_resume_without_a_replayed_step(tmp_path, kind, offline_wandb):
    from redray.trackers import TensorBoardLogger, WandbLogger

    def logger(run_id=None):
        if kind == "tensorboard":
            return TensorBoardLogger(str(tmp_path / "tensorboard"))
        return WandbLogger(str(tmp_path), "redray", "r", run_id=run_id)

    def history(key):
        return tensorboard_history(tmp_path / "tensorboard", key) if kind == "tensorboard" \
            else wandb_history(tmp_path, key)

    first = logger()
    first.log_params({"max_steps": 20, "opt": {"b1": 0.9}})
    log_two_sessions(first)
    report = first.finish("KILLED")
    assert report["failure"] is None and first.replayed == 8  # steps 7-10, loss and lr

    second = logger(report["run_id"])  # a new driver: the marks from the files
    log_the_next_session(second, report)

    assert history("loss") == [*((s, float(s)) for s in range(1, 11)), (11, 11.5), (12, 12.5),
                               *((s, s + 0.25) for s in range(13, 16))]
    assert [s for s, _ in history("lr")] == list(range(1, 13))
    assert history("eval_loss") == [(10, 5.0), (15, 3.0)]


def test_tracking_names_are_checked():
    from redray.trackers import trackers

    assert trackers(True) == ("mlflow",) and trackers(False) == ()
    assert trackers("wandb") == ("wandb",)
    assert trackers(["tensorboard", "mlflow", "tensorboard"]) == ("tensorboard", "mlflow")
    for bad in ("tensorflow", ("mlflow", 3), (), 1):
        with pytest.raises(ValueError, match="give True \\(MLflow\\), False \\(none\\), or "
                                             "trackers among 'mlflow', 'tensorboard', 'wandb'"):
            trackers(bad)


def test_a_tracker_that_cannot_write_reports_it_and_loses_only_its_rows(tmp_path, caplog):
    from redray.trackers import TensorBoardLogger

    (tmp_path / "file").write_text("")  # a folder that cannot be made
    broken = TensorBoardLogger(str(tmp_path / "file" / "tensorboard"))
    for step in range(1, 4):
        broken.log_metrics({"loss": 1.0}, step)
    report = broken.finish(timeout=5)
    assert report["failure"].startswith(("FileExistsError", "NotADirectoryError")), report
    assert report["dropped"] == 3 and report["uri"] == str(tmp_path / "file" / "tensorboard")
    assert "TensorBoard tracking at" in caplog.text and "training goes on" in caplog.text
