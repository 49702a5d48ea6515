"""One run at a time per name and storage folder: the run folder's lock file.

Two drivers started with the same ``name`` and ``storage_path`` would otherwise both
train into one checkpoint folder and one MLflow run. The driver creates
``<storage>/<name>/redray.lock`` (``RunFolders.lock``) before any host starts,
with create-if-absent semantics (``O_CREAT | O_EXCL``), writes its host, pid and start
time into it, refreshes its modification time from a daemon thread (the heartbeat) and
deletes it when the run ends, however it ends.

A lock left behind by a driver that died (SIGKILL, a lost machine) never blocks the
run's resume: on the same host it is stale as soon as its pid is gone; from another
host, once its heartbeat is older than ``STALE_S``. A storage URI (``gs://``, ``s3://``)
has no create-if-absent that redray could rely on: runs there are not locked.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from redray.storage import RunFolders, is_uri

HEARTBEAT_S = 30.0
# Ten missed heartbeats: a lock from another machine older than this is a dead run's
# (a few minutes also absorb clock differences between machines sharing the storage).
STALE_S = 300.0

log = logging.getLogger("redray")


class RunLockedError(RuntimeError):
    """Another run with the same name and storage folder is running."""


class RunLock:
    """The lock a running driver holds on its run folder (see the module's docstring).

    Use ``with RunLock.acquire(folders):`` around the run; ``release`` is idempotent.
    """

    def __init__(self, path: str | None, token: str | None):
        self.path, self.token = path, token
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @classmethod
    def acquire(cls, folders: RunFolders, *, heartbeat_s: float = HEARTBEAT_S,
                stale_s: float = STALE_S) -> "RunLock":
        """Takes the lock of the run ``folders`` describes, or raises.

        Args:
          folders: the run's folders (``RunFolders.of(storage_path, name)``).
          heartbeat_s: seconds between refreshes of the lock file's modification time.
          stale_s: a lock from another machine without a heartbeat for this long is a
            dead run's, and is taken over.

        Raises:
          RunLockedError: a live run holds it; the message names it and the ways out.
        """
        if is_uri(folders.storage):
            return cls(None, None)  # no atomic create on object stores: not locked
        path = folders.lock
        os.makedirs(os.path.dirname(path), exist_ok=True)
        owner = {"host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}
        for _ in range(3):  # a stale lock removed, then created again: at most twice more
            if _create(path, owner):
                lock = cls(path, owner["token"])
                lock._start_heartbeat(heartbeat_s)
                return lock
            held = _read(path)
            if held is None:  # released between our create and our read
                continue
            reason = _stale(held, stale_s)
            if reason is None:
                raise RunLockedError(_refusal(folders, held))
            log.warning("redray: run %r: taking over %s, left by %s (%s)", folders.name, path,
                        _who(held), reason)
            _remove(path)
        raise RunLockedError(f"run {folders.name!r} in {folders.storage}: "
                             f"could not take its lock {path}: other runs keep starting "
                             "with this name; start one at a time")

    def release(self) -> None:
        """Stops the heartbeat and deletes the lock file if it is still this run's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.path is not None:
            held = _read(self.path)
            if held is not None and held.get("token") == self.token:
                _remove(self.path)
            self.path = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _start_heartbeat(self, every: float) -> None:
        def beat():
            while not self._stop.wait(every):
                try:
                    os.utime(self.path)
                except OSError:  # deleted by hand, storage gone: the run goes on
                    pass

        self._beat = threading.Thread(target=beat, name="redray-run-lock", daemon=True)
        self._beat.start()


def _create(path: str, owner: dict) -> bool:
    """Creates the lock file holding ``owner``; False if it already exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    return True


def _read(path: str) -> dict | None:
    """The lock's owner (``{}`` when unreadable, e.g. still being written); None if the
    file is gone. ``age`` is the seconds since its last heartbeat."""
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    try:
        held = json.loads(text)
    except ValueError:
        held = {}
    if not isinstance(held, dict):
        held = {}
    return {**held, "age": age}


def _stale(held: dict, stale_s: float) -> str | None:
    """Why the lock is a dead run's, or None while its run may be alive."""
    if held["age"] > stale_s:
        return f"no heartbeat for {held['age']:.0f} s"
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
        if not _alive(held["pid"]):
            return f"process {held['pid']} is gone"
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a zombie, killed but not yet
    reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): the signal said it exists
        return True
    return state not in ("Z", "X")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _who(held: dict) -> str:
    if "pid" not in held:
        return "a run whose lock file is empty or unreadable"
    return f"pid {held['pid']} on host {held.get('host', '?')} since {held.get('started', '?')}"


def _refusal(folders: RunFolders, held: dict) -> str:
    name, path = folders.name, folders.lock
    return (f"run {name!r} in {folders.storage} is already running: "
            f"its lock {path} is held by {_who(held)} (last heartbeat {held['age']:.0f} s "
            "ago). Wait for that run to end, or give this one another name (name=...); "
            f"if you are sure no run {name!r} is active, delete {path}")
