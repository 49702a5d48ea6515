"""One run at a time per name and storage folder (redray.cluster.run_lock)."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import optax
import pytest

import redray
from redray.cluster.run_lock import RunLock, RunLockedError
from redray.storage import RunFolders
from tiny import TinyLM, lm_collate, lm_loss, token_data

HOLD = textwrap.dedent("""
    import sys, time
    from redray.cluster.run_lock import RunLock
    from redray.storage import RunFolders
    lock = RunLock.acquire(RunFolders.of(sys.argv[1], "shared"))
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_run_of_the_same_name_is_refused_until_the_first_is_gone(tmp_path, caplog):
    runs = str(tmp_path / "runs")
    shared = RunFolders.of(runs, "shared")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, runs], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError) as refused:
            RunLock.acquire(shared)
        text = str(refused.value)
        assert f"run 'shared' in {runs} is already running" in text
        assert f"pid {holder.pid}" in text and "name=" in text
        assert shared.lock in text  # what to delete if sure
        with RunLock.acquire(RunFolders.of(runs, "other")):  # another name is another run
            pass
    finally:
        holder.send_signal(signal.SIGKILL)  # a driver killed: its lock stays behind
        holder.wait()
    assert os.path.exists(shared.lock)
    with caplog.at_level(logging.WARNING, logger="redray"):
        lock = RunLock.acquire(shared)  # its resume is never blocked
    assert f"process {holder.pid} is gone" in caplog.text
    owner = json.load(open(shared.lock))
    assert owner["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(shared.lock)
    lock.release()  # idempotent


def test_a_lock_from_another_machine_is_stale_only_without_heartbeat(tmp_path):
    folders = RunFolders.of(str(tmp_path / "runs"), "r")
    path = folders.lock
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "started": "then", "token": "x"}, f)
    with pytest.raises(RunLockedError, match="pid 1 on host elsewhere"):
        RunLock.acquire(folders, stale_s=60)
    old = time.time() - 120
    os.utime(path, (old, old))
    with RunLock.acquire(folders, stale_s=60, heartbeat_s=0.05) as lock:
        time.sleep(0.3)
        assert time.time() - os.stat(path).st_mtime < 0.3  # its heartbeat refreshes it
        assert lock.path == path
    assert not os.path.exists(path)


def test_a_run_in_a_storage_uri_is_not_locked():
    """Object stores have no create-if-absent redray could rely on."""
    with RunLock.acquire(RunFolders.of("gs://bucket/runs/", "r")) as lock:
        assert lock.path is None


def test_redray_fit_refuses_a_running_name_before_any_host_starts(tmp_path):
    runs = str(tmp_path / "runs")
    ray = pytest.importorskip("ray")
    was_up = ray.is_initialized()
    with RunLock.acquire(RunFolders.of(runs, "busy")):
        with pytest.raises(RunLockedError, match="'busy' in .* is already running"):
            redray.fit(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       train_data=token_data(16), hosts=2, batch_size=8, name="busy",
                       storage_path=runs, progress=False)
    assert ray.is_initialized() == was_up  # refused on the driver, before Ray
    assert not os.path.exists(RunFolders.of(runs, "busy").checkpoints)
