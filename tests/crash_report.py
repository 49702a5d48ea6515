"""What a test process that died without a word was doing, printed after it.

A pytest process can end with no summary and no traceback: Ray's core worker ends its
driver at once (exit status 1, its reason written only to Ray's log files) when the local
Ray it is connected to goes away, and the kernel's OOM killer leaves nothing at all. CI
then shows the dots of the tests that passed and nothing else. ``conftest.py`` starts
this watcher beside the session: when the pytest process is gone without having
finished its session, the watcher prints (to the session's own stderr) the test that was
running, the machine's memory, and the end of the newest Ray sessions' logs, where Ray
says why it ended a driver.

    python tests/crash_report.py PYTEST_PID STATE_FOLDER
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time

# Lines of Ray's logs that say why a process ended.
TELLING = re.compile(r"FATAL|Check failed|died|dead|killed|SIGKILL|SIGTERM|out of memory|OOM"
                     r"|QuickExit|Exiting", re.I)
CURRENT, FINISHED = "current", "finished"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (not yet reaped by its parent) is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-lines:]
    except OSError as e:
        return [f"(unreadable: {e})"]


def ray_logs(pid: int, since: float, sessions: int = 2) -> list[str]:
    """The end of the logs of the newest Ray sessions this process was a driver of (else
    of those started since ``since``): the raylet's, the GCS's and the driver's core
    worker's, with the lines among them that say why something ended."""
    out = []
    folders = sorted((f for f in glob.glob("/tmp/ray/session_2*")
                      if os.path.getmtime(f) >= since), key=os.path.getmtime)
    own = [f for f in folders if glob.glob(f"{f}/logs/python-core-driver-*_{pid}.log")]
    folders = (own or folders)[-sessions:]
    for folder in folders:
        logs = os.path.join(folder, "logs")
        files = [os.path.join(logs, name) for name in ("raylet.out", "raylet.err",
                                                       "gcs_server.out", "gcs_server.err")]
        files += glob.glob(os.path.join(logs, f"python-core-driver-*_{pid}.log"))
        for path in files:
            if not os.path.exists(path) or not os.path.getsize(path):
                continue
            lines = tail(path, 2000)
            telling = [x for x in lines  # log lines, not the periodic state dumps
                       if x.startswith("[20") and TELLING.search(x)][-8:]
            out.append(f"--- {path} (lines saying why, then its last lines)")
            out += ["  ! " + x[:300] for x in telling] + ["    " + x[:300] for x in lines[-6:]]
    return out or ["(no Ray session of this test session under /tmp/ray)"]


def report(pid: int, state: str, since: float) -> str:
    current = tail(os.path.join(state, CURRENT), 1)
    lines = [f"crash_report: the pytest process {pid} ended without finishing its session",
             f"  while running: {current[0] if current else '(no test had started)'}"]
    try:
        memory = subprocess.run(["free", "-m"], capture_output=True, text=True, timeout=10)
        lines += ["  " + x for x in memory.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError) as e:
        lines.append(f"  (free -m: {e})")
    return "\n".join(lines + ray_logs(pid, since)) + "\n"


def main() -> None:
    pid, state, since = int(sys.argv[1]), sys.argv[2], time.time()
    while alive(pid):
        time.sleep(0.5)
    if not os.path.exists(os.path.join(state, FINISHED)):
        sys.stderr.write(report(pid, state, since))
        sys.stderr.flush()
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
