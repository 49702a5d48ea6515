"""The command-line flags that run one script on a laptop and on a cluster unchanged."""

from __future__ import annotations

import argparse

from redray.cluster.config import ClusterConfig
from redray.storage import DEFAULT_STORAGE, storage_folder
from redray.verbosity import set_verbose


def add_cluster_args(parser: argparse.ArgumentParser, *, name: str, hosts: int = 2,
                     devices_per_host: int = 2, storage: str = DEFAULT_STORAGE
                     ) -> argparse.ArgumentParser:
    """Adds ``--hosts``, ``--devices-per-host``, ``--gpu``, ``--tpu``, ``--slices``,
    ``--storage``, ``--name``, ``--tracking`` and ``--verbose``.

    On one machine the hosts are simulated (separate processes, each with its own CPU
    devices); on a Ray cluster (``RAY_ADDRESS``, ``redray run --address``, ``ray job
    submit``) they are the cluster's machines. Pass ``cluster=cluster_options(args)`` to
    ``redray.fit`` or ``redray.run``.

    Args:
      parser: the script's parser; returned.
      name: the default run name (the same name resumes the run).
      hosts, devices_per_host, storage: defaults of the flags.
    """
    group = parser.add_argument_group("cluster")
    parser.set_defaults(default_hosts=hosts)
    group.add_argument("--hosts", type=host_count, default=hosts,
                       help=f"hosts, simulated on one machine (default {hosts}); MIN:MAX "
                       "for an elastic run (it goes on when hosts leave, grows when they "
                       "come back)")
    group.add_argument("--devices-per-host", type=int, default=devices_per_host,
                       help=f"devices per host (default {devices_per_host})")
    group.add_argument("--gpu", action="store_true", help="use the hosts' GPUs")
    group.add_argument("--tpu", action="store_true",
                       help="use the hosts' TPU chips: whole TPU slices, each host taking "
                       "its node's chips (--devices-per-host is not used)")
    group.add_argument("--slices", type=int, default=None,
                       help="TPU slices to take (multislice where more than one); --hosts "
                       "may then be left out")
    group.add_argument("--storage", default=storage,
                       help=f"runs folder: checkpoints, mlflow.db (default {storage})")
    group.add_argument("--name", default=name,
                       help=f"run name; the same name resumes (default {name})")
    group.add_argument("--tracking", type=tracker_names, default=None, metavar="NAMES",
                       help="trackers, comma-separated, among mlflow, tensorboard and wandb "
                       "(default mlflow; none: no tracking)")
    group.add_argument("--verbose", action="store_true",
                       help="show everything every process prints (default: one progress "
                       "line and the run's messages)")
    return parser


def host_count(text: str) -> int | tuple[int, int]:
    """``--hosts``'s value: ``N``, or ``MIN:MAX`` (elastic)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return tuple(parts)
    raise argparse.ArgumentTypeError(f"{text!r}: give a number of hosts (2) or MIN:MAX (2:4)")


def tracker_names(text: str) -> tuple[str, ...] | bool:
    """``--tracking``'s value: ``mlflow,tensorboard``..., or ``none``."""
    from redray.trackers import trackers

    if text.strip().lower() == "none":
        return False
    try:
        return trackers(tuple(n.strip() for n in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give trackers among mlflow, tensorboard and wandb, comma-separated "
            "(mlflow,tensorboard), or none") from None


def cluster_options(args: argparse.Namespace) -> ClusterConfig:
    """The ``ClusterConfig`` of ``add_cluster_args``'s flags, for ``redray.fit(...,
    cluster=...)``/``redray.run`` (the storage folder made absolute: a Ray job runs in a
    temporary copy of its directory)."""
    verbose = getattr(args, "verbose", False) or None  # not given: REDRAY_VERBOSE decides
    if verbose:
        set_verbose(True)  # this process too (the libraries' advice, Ray's INFO lines)
    tracking = getattr(args, "tracking", None)
    tpu, slices = getattr(args, "tpu", False), getattr(args, "slices", None)
    hosts = args.hosts
    if slices and hosts == getattr(args, "default_hosts", None):
        hosts = 1  # --hosts left at the script's default: the slices decide
    return ClusterConfig(hosts=hosts, devices_per_host=None if tpu else args.devices_per_host,
                         use_gpu=args.gpu, use_tpu=tpu, slices=slices, name=args.name,
                         storage_path=storage_folder(args.storage), verbose=verbose,
                         tracking=True if tracking is None else tracking)
