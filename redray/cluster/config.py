"""``ClusterConfig``: where and how a run executes on a Ray cluster, for ``fit`` and ``run``."""

from __future__ import annotations

import dataclasses
from typing import Any

from redray import storage
from redray.checkpoint import CheckpointConfig

# An elastic run's default restarts: each host lost for good is one.
ELASTIC_MAX_FAILURES = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The cluster side of a run: hosts, devices, the run's name and storage, restarts,
    checkpoints and tracking. ``redray.fit`` and ``redray.run`` take these as keywords
    (or one ``cluster=ClusterConfig(...)``); ``redray.cluster_options(args)`` builds one
    from a script's flags.

    Attributes:
      hosts: worker processes, one per host (on one machine: simulated hosts). Or
        ``(min, max)``: elastic. The run starts on as many
        hosts as the cluster has (at least ``min``, at most ``max``); a host lost for
        good restarts it on the hosts left (one of ``max_failures``), from its last
        checkpoint, with a new plan when the Trainer chooses its own; a host that
        comes back is taken at the next checkpoint (the run regroups, losing no step).
      devices_per_host: CPU devices each host simulates (CPU only; default 1), or the
        GPUs/TPU chips each host takes.
      use_gpu, use_tpu: run on GPUs / TPUs (devices assigned by Ray). TPU hosts take
        whole TPU slices (``redray/cluster/tpu.py``): ``hosts`` must be a whole number
        of slices (or give ``slices``); host 0 runs on slice 0's worker 0, and a run on
        several slices gets the multislice environment (``MEGASCALE_*``) anew at every
        start of its group.
      slices: TPU only: the slices the run takes (multislice over the data-centre
        network where more than one); its hosts are then ``slices`` times a slice's, and
        ``hosts`` may be left out. Default: ``hosts`` over a slice's hosts.
      tpu_type: TPU only: the pod type of the slices to take (e.g. ``"v5p-16"``, Ray's
        ``ray.io/tpu-pod-type`` label), where the cluster has slices of several types;
        default: the cluster's one type.
      address: a Ray cluster (``ray://host:10001`` for Ray Client); default
        ``RAY_ADDRESS``, else a local cluster started here.
      name: the run's name; the same name in the same storage resumes it. Default: a
        timestamped one.
      storage_path: the storage folder (an absolute path, or a URI); default
        ``~/redray_runs`` (``redray.storage``).
      max_failures: restarts of the run's group of hosts after a host fails (its error,
        its process or node lost) before the run gives up; the new group resumes from
        the last complete checkpoint. Default 0, and ``ELASTIC_MAX_FAILURES`` (3) for an
        elastic run.
      hang_timeout: seconds a host may go without progress (a phase of its start, a
        training step, an evaluation or prediction batch, a checkpoint) before the job
        is stopped as stuck (a collective whose peer never arrives, a collate or a
        first batch that never comes), with the host's last progress and where it
        waits; with ``max_failures`` the group restarts from the last checkpoint. The
        clock runs from the host's start: each phase of the start (the plan, a
        restore, the compile) must take less. ``None``: no watchdog. Default 1800 (30
        minutes).
      checkpoint: a ``redray.CheckpointConfig`` (when and what to save); its directory
        defaults to ``<storage_path>/<name>/checkpoints``. Default: save at the end of
        every epoch and of the run, keep the last 3. ``False``: no checkpoints.
      resume: continue from the last complete checkpoint of the run ``name`` in
        ``storage_path`` (the same step, epoch, position inside it and RNG) and log
        into the same MLflow run.
      tracking_uri: where MLflow logs go; default ``MLFLOW_TRACKING_URI``, else
        ``sqlite:///<storage_path>/mlflow.db``.
      experiment: the MLflow experiment.
      tracking: the trackers the run logs to: True (default: MLflow), False (none), or
        names among "mlflow", "tensorboard" and "wandb" (``redray.trackers``), e.g.
        ``("mlflow", "tensorboard")``. TensorBoard writes ``<run folder>/tensorboard``;
        W&B runs in the mode ``WANDB_MODE`` says (``offline``: no network).
      compile_cache: keep the run's compiled programs in
        ``<storage_path>/<name>/compile_cache`` (JAX's persistent compilation cache), so
        a restart or a resumed run loads them instead of compiling again.
      keep_hosts: keep the hosts' processes (and their JAX runtime) when the run ends
        well, for the next run from this driver on the same hosts and devices: it starts
        in a second instead of ten or more (``redray/cluster/hosts.py``). They hold
        their resources (a CPU, or their GPUs) until then; a run of another shape, a
        failure or ``redray.cluster.release_hosts()`` ends them. An elastic run's
        are never kept. False: end them with the run.
      verbose: show everything the run's processes print (each host's progress bar,
        Ray's, JAX's, Gloo's and MLflow's set-up lines). Default (None): the
        ``REDRAY_VERBOSE`` variable, else quiet: the driver shows one progress line
        and the run's own messages.
    """
    hosts: int | tuple[int, int] = 1
    devices_per_host: int | None = None
    use_gpu: bool = False
    use_tpu: bool = False
    slices: int | None = None
    tpu_type: str | None = None
    address: str | None = None
    name: str | None = None
    storage_path: str | None = None
    max_failures: int | None = None
    hang_timeout: float | None = 1800.0
    checkpoint: Any = None
    resume: bool = True
    tracking_uri: str | None = None
    experiment: str = "redray"
    tracking: bool | str | tuple = True
    compile_cache: bool = True
    keep_hosts: bool = True
    verbose: bool | None = None

    def __post_init__(self):
        if isinstance(self.hosts, list):
            object.__setattr__(self, "hosts", tuple(self.hosts))
        if isinstance(self.hosts, tuple):
            if (len(self.hosts) != 2 or not all(isinstance(h, int) for h in self.hosts)
                    or not 1 <= self.hosts[0] <= self.hosts[1]):
                raise ValueError(f"hosts={self.hosts!r}: give a number of hosts, or (min, max) "
                                 "with 1 <= min <= max for an elastic run")
            if self.max_failures is None:
                object.__setattr__(self, "max_failures", ELASTIC_MAX_FAILURES)
            if self.max_failures < 1:
                raise ValueError(f"hosts={self.hosts!r} (elastic) goes on after a host is lost "
                                 "by restarting on the hosts left, which is one of "
                                 "max_failures: give max_failures >= 1 (default "
                                 f"{ELASTIC_MAX_FAILURES})")
        elif not isinstance(self.hosts, int) or self.hosts < 1:
            raise ValueError(f"hosts={self.hosts!r}: need at least one host")
        elif self.max_failures is None:
            object.__setattr__(self, "max_failures", 0)
        if self.use_gpu and self.use_tpu:
            raise ValueError("use_gpu and use_tpu are exclusive")
        for name in ("slices", "tpu_type"):
            if getattr(self, name) is not None and not self.use_tpu:
                raise ValueError(f"{name}={getattr(self, name)!r} takes TPU slices: add "
                                 "use_tpu=True")
        if self.slices is not None and not (isinstance(self.slices, int) and self.slices >= 1):
            raise ValueError(f"slices={self.slices!r}: give a whole number of TPU slices, "
                             ">= 1")
        if self.hang_timeout is not None and not (
                isinstance(self.hang_timeout, (int, float)) and self.hang_timeout > 0):
            raise ValueError(f"hang_timeout={self.hang_timeout!r}: give positive seconds "
                             "(None: no watchdog)")
        if self.checkpoint is not False:
            CheckpointConfig.of(self.checkpoint)  # a wrong type fails here, on the driver
        self.trackers  # a wrong tracker name fails here, on the driver

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers of ``tracking``, by name (``redray.trackers.trackers``)."""
        from redray.trackers import trackers

        return trackers(self.tracking)

    @property
    def elastic(self) -> bool:
        """Whether the number of hosts may change during the run (``hosts=(min, max)``)."""
        return isinstance(self.hosts, tuple)

    @property
    def max_hosts(self) -> int:
        """The most hosts the run takes."""
        return self.hosts[1] if self.elastic else self.hosts

    @property
    def min_hosts(self) -> int:
        """The fewest hosts the run trains on."""
        return self.hosts[0] if self.elastic else self.hosts

    @classmethod
    def split(cls, options: dict, cluster: "ClusterConfig | None" = None
              ) -> tuple["ClusterConfig", dict]:
        """(the config, the other options) from keywords given to ``fit``/``run``.

        Keywords naming a field build the config (on top of ``cluster``, if given);
        the rest are returned for the caller (Trainer options, the function's own).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in options.items() if k in fields}
        rest = {k: v for k, v in options.items() if k not in fields}
        if cluster is None:
            return cls(**mine), rest
        if not isinstance(cluster, cls):
            raise TypeError(f"cluster must be a redray.ClusterConfig, got "
                            f"{type(cluster).__name__}")
        return dataclasses.replace(cluster, **mine), rest

    def resolved(self) -> "ClusterConfig":
        """This config with its defaults made concrete, once for the whole launch: the
        run's folders (a name, an absolute storage folder, the MLflow URI; ``folders``)
        and the checkpoint config with its directory (or None: no checkpoints)."""
        folders = storage.RunFolders.of(self.storage_path, self.name, self.tracking_uri)
        checkpoint = None
        if self.checkpoint is not False:
            given = CheckpointConfig.of(self.checkpoint) or CheckpointConfig()
            checkpoint = dataclasses.replace(
                given, directory=given.directory or folders.checkpoints,
                resume=self.resume and given.resume)
        return dataclasses.replace(self, name=folders.name, storage_path=folders.storage,
                                   tracking_uri=folders.tracking_uri, checkpoint=checkpoint)

    @property
    def folders(self) -> storage.RunFolders:
        """Every folder and URI of the run, as ``resolved()`` made them."""
        if self.name is None or self.storage_path is None or self.tracking_uri is None:
            raise ValueError("ClusterConfig.folders needs a resolved config: call "
                             "config.resolved() first")
        return storage.RunFolders(self.storage_path, self.name, self.tracking_uri)

    def settings(self) -> dict:
        """The settings a run records (MLflow params, every checkpoint's config)."""
        return dict(name=self.name, storage_path=self.storage_path, hosts=self.hosts,
                    devices_per_host=self.devices_per_host, use_gpu=self.use_gpu,
                    use_tpu=self.use_tpu, slices=self.slices, tpu_type=self.tpu_type,
                    max_failures=self.max_failures,
                    hang_timeout=self.hang_timeout,
                    checkpoint=dataclasses.asdict(self.checkpoint)
                    if isinstance(self.checkpoint, CheckpointConfig) else None)
