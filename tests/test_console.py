"""The console: what a progress row reads like, the driver's view of host 0's news, the
noise dropped from Ray's stream (lines as the processes of a real run printed them),
and the local progress bar over the run's budget."""

import io
import os

import optax
import pytest

import redray
from redray.cluster.console import DriverView
from redray.processes.ray_local import OutputState, drop_noise
from redray.engine.console import duration_text, progress_text, row_text
from redray.verbosity import verbose
from tiny import TinyLM, lm_collate, lm_loss, token_data

# What the processes of runs printed before the console was quiet (`make demo`, a
# submitted job, Ray Client, a Ray without its dashboard; Ray 2.60, JAX 0.10, MLflow 3):
# every line tells a user nothing.
NOISE = [
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
    "is : 1",
    " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "[Gloo] Rank 1",
    "Starting JAX distributed service on [::]:46295",
    "Connecting to JAX distributed service on 192.0.2.2:46295",
    "Progress bars disabled. To enable, set `ray.data.DataContext.get_current()."
    "enable_progress_bars = True`.",
    "WARNING: 8 PYTHON worker processes have been started on node: 33318eb111adc931d0aad0 "
    "with address: 192.0.2.2, which is 4x the maximum expected startup concurrency (2).",
    "2026/11/25 10:52:09 INFO mlflow.store.db.utils: Creating initial MLflow database "
    "tables...",
    "2026/11/25 10:52:09 INFO mlflow.store.db.utils: Updating database tables",
    "[transformers] PyTorch was not found. Models won't be available and only tokenizers, "
    "configuration and file/data utilities can be used.",
    "2026-11-25 10:51:34,810\tWARNING authentication_token_setup.py:85 -- Token "
    "authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
    "/usr/lib/python3.11/subprocess.py:1883: RuntimeWarning: os.fork() was called. "
    "os.fork() is incompatible with multithreaded code, and JAX is multithreaded, so this "
    "will likely lead to a deadlock.",
    "  self.pid = _fork_exec(",
    "2026-11-25 11:53:30,002\tINFO client_builder.py:262 -- Passing the following kwargs to "
    "ray.init() on the server: log_to_driver",
    "SIGTERM handler is not set because current thread is not the main thread.",
    "2026-11-25 11:55:18,285\tINFO job_manager.py:581 -- Runtime env is setting up.",
    "2026-11-25 11:58:20,511\tWARNING working_dir.py:101 -- Directory '.venv' is now ignored "
    "by default when packaging the working directory. To disable this behavior, set the "
    "`RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES=''` environment variable.",
]


def test_every_known_noise_line_is_dropped():
    for line in NOISE:
        assert drop_noise([line]) == [] or line.startswith(" "), line
    assert drop_noise(NOISE) == []


def test_what_a_user_or_a_failure_prints_is_kept():
    kept = ["my debug print in collate: 8 examples",
            "/home/me/train.py:12: UserWarning: my own warning",
            "  warnings.warn('my own warning')",
            "Traceback (most recent call last):",
            "  File \"/home/me/train.py\", line 3, in collate",
            "RuntimeError: collate exploded on host 1",
            "A worker died or was killed while executing a task by an unexpected system error."]
    assert drop_noise(kept) == kept
    # a noisy warning's source line goes with it; the next warning's stays
    lines = NOISE[-2:] + kept[1:3]
    assert drop_noise(lines) == kept[1:3]


GLOO = ("[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer "
        "ranks is : ")


def test_gloo_lines_torn_by_its_threads_are_dropped_whole():
    """Gloo's threads write their lines a piece at a time: one line's end (its last
    number, or only its newline) comes after another's, alone, as a worker of `make demo`
    printed it. A number or blank line of the process's own, after whole lines, stays."""
    torn = [GLOO.format(0) + GLOO.format(0) + "1", "1", GLOO.format(1) + "1"]
    assert drop_noise(torn) == []
    assert drop_noise(torn + ["1", ""]) == ["1", ""]
    interleaved = ["[Gloo] Rank [Gloo] Rank 01 is connected to 1 peer ranks. Expected number "
                   "of connected peer ranks is : 1 is connected to 1 peer ranks. Expected "
                   "number of connected peer ranks is : 1", "", "my print"]
    assert drop_noise(interleaved) == ["my print"]
    # the torn end in the process's next batch of lines
    stream = OutputState()
    assert drop_noise(torn[:1], stream) == []
    assert drop_noise(["1", "my print: 1", "1"], stream) == ["my print: 1", "1"]


def test_a_progress_row_reads_step_of_budget_loss_speed_and_eta():
    row = {"step": 120, "epoch": 1, "loss": 4.51234, "steps_per_s": 8.3,
           "examples_per_s": 132.8, "tokens_per_s": 8499.2}
    assert progress_text(row, 300) == (
        "step 120/300 (40%) | epoch 1 | loss 4.512 | 8.3 steps/s | 8,499 tokens/s | ETA 22s")
    del row["tokens_per_s"]  # a batch without tokens: examples/s
    assert progress_text(row, None) == (
        "step 120 | epoch 1 | loss 4.512 | 8.3 steps/s | 133 examples/s")
    assert row_text({"step": 20, "epoch": 0, "eval_loss": 5.96321}) == (
        "step 20 | epoch 0 | eval_loss 5.963")
    assert [duration_text(s) for s in (0.4, 59, 61, 3599, 7260)] == [
        "0s", "59s", "1m01s", "59m59s", "2h01m"]


ROW = {"step": 10, "epoch": 0, "loss": 2.0, "steps_per_s": 5.0, "examples_per_s": 40.0}


def test_off_a_terminal_the_driver_prints_one_line_per_window_and_each_message():
    out = io.StringIO()
    view = DriverView(out, live=False)
    for event in ({"say": "redray: 2 host(s)"}, {"start": 0, "total": 20}, {"row": ROW},
                  {"row": {**ROW, "step": 20}}, {"say": "step 20 | eval_loss 1.5"}):
        view.show(event)
    view.close()
    assert out.getvalue().splitlines() == [
        "redray: 2 host(s)",
        "step 10/20 (50%) | epoch 0 | loss 2 | 5 steps/s | 40 examples/s | ETA 2s",
        "step 20/20 (100%) | epoch 0 | loss 2 | 5 steps/s | 40 examples/s | ETA 0s",
        "step 20 | eval_loss 1.5"]
    assert "\r" not in out.getvalue()


def test_on_a_terminal_the_progress_is_one_live_line_under_the_messages():
    out = io.StringIO()
    view = DriverView(out, live=True)
    view.show({"start": 0, "total": 20})
    view.show({"row": ROW})
    view.show({"row": {**ROW, "step": 20}})
    view.show({"say": "step 20 | eval_loss 1.5"})
    view.close()
    text = out.getvalue()
    # what the screen shows: each \r returns to the line's start, \x1b[K clears it
    screen = [line.split("\r")[-1].replace("\x1b[K", "") for line in text.split("\n")]
    assert screen == ["step 20 | eval_loss 1.5",
                      "step 20/20 (100%) | epoch 0 | loss 2 | 5 steps/s | 40 examples/s | "
                      "ETA 0s", ""]
    assert text.count("\n") == 2  # one message, the last progress line ended


def test_verbose_reads_its_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("REDRAY_VERBOSE", raising=False)
    assert not verbose() and verbose(True) and not verbose(False)
    for value, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("REDRAY_VERBOSE", value)
        assert verbose() is expected


def test_the_local_bar_runs_to_the_runs_budget_not_the_epochs_end(capsys):
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                             batch_size=8, log_every=2)
    trainer.fit(token_data(96), epochs=1, max_steps=5)  # 12 batches per epoch
    err = capsys.readouterr().err
    assert "/5 [" in err and "/12" not in err, err
    assert "loss" in err and "steps/s" in err


@pytest.fixture(autouse=True)
def _no_verbose_env(monkeypatch):
    if os.environ.get("REDRAY_VERBOSE"):
        monkeypatch.delenv("REDRAY_VERBOSE")


PROBE = ("import redray\n"
         "from transformers.utils import logging\n"
         "logging.get_logger('transformers').warning_advice('advice probe')\n")


@pytest.mark.parametrize("verbose_env", [None, "1"])
def test_transformers_advice_is_silenced_unless_verbose(verbose_env):
    """transformers' advisory warnings ("PyTorch was not found" on every import without
    torch) are off once redray is imported, and back when verbose."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("REDRAY_VERBOSE", "TRANSFORMERS_NO_ADVISORY_WARNINGS")}
    if verbose_env:
        env["REDRAY_VERBOSE"] = verbose_env
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("advice probe" in done.stderr) is bool(verbose_env), done.stderr
