"""Where runs live: the storage folder, and every folder and URI of one run (``RunFolders``).

One default for every entry point (``redray.fit``/``redray.run``, the command line,
the examples): ``~/redray_runs``. It is absolute on purpose: a Ray job runs in a
temporary copy of its working directory, so a folder relative to it would vanish with
the job. A storage folder may also be a URI (``gs://bucket/runs``) that Orbax writes to.

Layout of a storage folder::

    <storage>/mlflow.db                   the default MLflow store (SQLite)
    <storage>/mlartifacts/                its artifacts (the sharding plan)
    <storage>/<name>/checkpoints/<step>/  one run's checkpoints (Orbax)
    <storage>/<name>/compile_cache/       its compiled programs (JAX's persistent cache)
    <storage>/<name>/config.json          a redray.models run's model config (export)
    <storage>/<name>/tokenizer/           the tokenizer export ships with that model
    <storage>/<name>/redray.lock          held while the run is running (its driver's
                                          host, pid and start; redray.cluster.run_lock)
    <storage>/hardware/                   the probed numbers of each cluster its runs
                                          ran on (redray.planning.probe)

``REDRAY_CACHE_DIR``, where set, is one folder for what runs can share beyond their
storage: the compiled programs (``<cache>/compile_cache``: a sweep's runs of one model
compile its step once) and the probed hardware numbers (``<cache>/hardware``). Like a
storage folder, on several machines it belongs on storage they share.

A run's folders are resolved once, into a ``RunFolders`` (``ClusterConfig.resolved()``
on the driver, the command line for the run it is given), and passed along from there.
"""

from __future__ import annotations

import dataclasses
import os
import time

DEFAULT_STORAGE = "~/redray_runs"
CHECKPOINTS = "checkpoints"  # a run folder's checkpoint folder
LOCK = "redray.lock"  # a run folder's lock file, there while the run is running
SQLITE = "sqlite:///"
CACHE_ENV = "REDRAY_CACHE_DIR"  # one folder of compiled programs and probes for all runs


def _shared_cache() -> str | None:
    """``REDRAY_CACHE_DIR``, absolute (a URI as it is), or None where unset."""
    folder = os.environ.get(CACHE_ENV)
    return absolute(folder) if folder else None


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


def default_tracking_uri(folder: str) -> str:
    """``sqlite:///<folder>/mlflow.db``, the MLflow store of a storage folder (as
    ``storage_folder`` gives it); for a URI (a bucket cannot hold a SQLite file) the
    default storage folder's database."""
    if is_uri(folder):
        folder = storage_folder()
    return f"{SQLITE}{folder}/mlflow.db"


def sqlite_file(uri: str) -> str | None:
    """The database file of a ``sqlite:///`` URI, or None for any other store."""
    return uri[len(SQLITE):] if uri.startswith(SQLITE) else None


@dataclasses.dataclass(frozen=True)
class RunFolders:
    """Every folder and URI of one run. Build it with ``RunFolders.of``, which resolves
    the storage folder and the defaults once; the folders below are joined onto it, so
    whoever is handed this value never normalises a path again.

    Attributes:
      storage: the storage folder: an absolute path, or a URI without its trailing ``/``.
      name: the run's name.
      tracking_uri: the MLflow store the run logs to.
    """
    storage: str
    name: str
    tracking_uri: str

    @classmethod
    def of(cls, storage: str | os.PathLike | None = None, name: str | None = None,
           tracking_uri: str | None = None) -> RunFolders:
        """The folders of run ``name`` in ``storage``.

        Args:
          storage: the storage folder; default ``~/redray_runs``. Made absolute; in a
            submitted Ray job a relative one is an error (see ``writable_folder``).
          name: the run's name; default a new timestamped one (``redray-20261123-224800``).
          tracking_uri: the MLflow store; default ``MLFLOW_TRACKING_URI``, else the
            storage folder's SQLite store (``default_tracking_uri``).
        """
        folder = storage_folder(storage)
        return cls(storage=folder, name=name or time.strftime("redray-%Y%m%d-%H%M%S"),
                   tracking_uri=tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                   or default_tracking_uri(folder))

    @property
    def run(self) -> str:
        """``<storage>/<name>``: everything the run keeps."""
        return f"{self.storage}/{self.name}"

    @property
    def checkpoints(self) -> str:
        """``<storage>/<name>/checkpoints``: where the run's checkpoints go by default."""
        return f"{self.run}/{CHECKPOINTS}"

    @property
    def lock(self) -> str:
        """``<storage>/<name>/redray.lock``: the file that keeps a second run of the same
        name out of the run folder while one is running."""
        return f"{self.run}/{LOCK}"

    @property
    def compile_cache(self) -> str:
        """``<storage>/<name>/compile_cache``: the run's compiled programs, reused on
        restart (``<REDRAY_CACHE_DIR>/compile_cache`` where that is set)."""
        return f"{_shared_cache() or self.run}/compile_cache"

    @property
    def hardware(self) -> str:
        """``<storage>/hardware``: the probed numbers of each cluster the storage's runs
        ran on (``redray.planning.probe``), shared by its runs
        (``<REDRAY_CACHE_DIR>/hardware`` where that is set)."""
        return f"{_shared_cache() or self.storage}/hardware"

    @property
    def model_config(self) -> str:
        """``<storage>/<name>/config.json``: the Hugging Face config of a
        ``redray.models`` run's model, which ``redray export`` builds it from (the run's
        code writes it)."""
        return f"{self.run}/config.json"

    @property
    def tokenizer(self) -> str:
        """Where a run keeps the tokenizer ``redray export`` ships with the model (a
        ``transformers`` tokenizer's ``save_pretrained`` folder; the run's code writes it)."""
        return f"{self.run}/tokenizer"
