"""Where runs live: the storage folder, each run's folder, its checkpoints, its MLflow store.

One default for every entry point (``redray.fit``/``redray.run``, the command line,
the examples): ``~/redray_runs``. It is absolute on purpose: a Ray job runs in a
temporary copy of its working directory, so a folder relative to it would vanish with
the job. A storage folder may also be a URI (``gs://bucket/runs``) that Orbax writes to.

Layout of a storage folder::

    <storage>/mlflow.db                   the default MLflow store (SQLite)
    <storage>/mlartifacts/                its artifacts (the sharding plan)
    <storage>/<name>/checkpoints/<step>/  one run's checkpoints (Orbax)
    <storage>/<name>/config.json          a redray.models run's model config (export)
    <storage>/<name>/redray.lock          held while the run is running (its driver's
                                          host, pid and start; redray.cluster.run_lock)
"""

from __future__ import annotations

import os
import time

DEFAULT_STORAGE = "~/redray_runs"
CHECKPOINTS = "checkpoints"  # a run folder's checkpoint folder
LOCK = "redray.lock"  # a run folder's lock file, there while the run is running
SQLITE = "sqlite:///"


def is_uri(path: str) -> bool:
    """Whether ``path`` is a URI (``gs://...``) rather than a local path."""
    return "://" in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute (``~`` expanded), or a URI without its trailing ``/``."""
    path = os.fspath(path)
    if is_uri(path):
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path))


# Set by Ray's job supervisor in a submitted job's driver (``ray job submit``,
# ``redray submit``), whose working directory is a temporary copy.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def in_submitted_job() -> bool:
    """Whether this process is a Ray job's driver (started by the job server)."""
    return RAY_JOB_ENV in os.environ


def writable_folder(path: str | os.PathLike, what: str = "storage_path") -> str:
    """``absolute(path)`` for a folder a run writes to; in a submitted Ray job a path
    relative to the working directory is refused (Ray deletes that copy with the job)."""
    text = os.fspath(path)
    if in_submitted_job() and not is_uri(text) and not os.path.isabs(os.path.expanduser(text)):
        raise ValueError(
            f"{what}={text!r} is relative, and this is a submitted Ray job: its working "
            f"directory ({os.getcwd()}) is a temporary copy Ray deletes when the job ends, "
            f"so what the run writes there would be lost. Give an absolute path on storage "
            f"every node reaches (e.g. /mnt/shared/runs) or a URI (gs://bucket/runs)")
    return absolute(text)


def storage_folder(path: str | os.PathLike | None = None) -> str:
    """The storage folder to use: ``path``, else the default, made absolute (in a
    submitted Ray job a relative ``path`` is an error: see ``writable_folder``)."""
    return writable_folder(DEFAULT_STORAGE if path is None else path)


def run_name(name: str | None = None) -> str:
    """``name``, else a new timestamped one (``redray-20261123-224800``)."""
    return name or time.strftime("redray-%Y%m%d-%H%M%S")


def run_folder(storage: str, name: str) -> str:
    """``<storage>/<name>``: everything one run keeps."""
    return f"{storage_folder(storage)}/{name}"


def checkpoint_folder(storage: str, name: str) -> str:
    """``<storage>/<name>/checkpoints``: where a run's checkpoints go by default."""
    return f"{run_folder(storage, name)}/{CHECKPOINTS}"


def tokenizer_folder(storage: str, name: str) -> str:
    """Where a run keeps the tokenizer ``redray export`` ships with the model (a
    ``transformers`` tokenizer's ``save_pretrained`` folder; the run's code writes it)."""
    return f"{run_folder(storage, name)}/tokenizer"


def compile_cache_folder(storage: str, name: str) -> str:
    """``<storage>/<name>/compile_cache``: a run's compiled programs, reused on restart."""
    return f"{run_folder(storage, name)}/compile_cache"


def lock_file(storage: str, name: str) -> str:
    """``<storage>/<name>/redray.lock``: the file that keeps a second run of the same name
    out of the run folder while one is running."""
    return f"{run_folder(storage, name)}/{LOCK}"


def default_tracking_uri(storage: str | None = None) -> str:
    """``sqlite:///<storage>/mlflow.db``; for a storage URI (a bucket cannot hold a
    SQLite file) the default storage folder's database."""
    folder = storage_folder(storage)
    if is_uri(folder):
        folder = storage_folder()
    return f"{SQLITE}{folder}/mlflow.db"


def resolve_tracking_uri(given: str | None, storage: str | None = None) -> str:
    """The MLflow URI a run logs to: ``given``, else ``MLFLOW_TRACKING_URI``, else the
    storage folder's SQLite store."""
    return given or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(storage)


def sqlite_file(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI, or None for any other store."""
    return uri[len(SQLITE):] if uri.startswith(SQLITE) else None
