"""The ``redray`` command line.

Subcommands:

* ``redray plan PRESET_OR_CONFIG --devices N --model-axis M [--fsdp-axis K] [--json]``:
  how the automatic rules would shard a model on N devices, computed abstractly
  (no device, no allocation).
* ``redray run SCRIPT [ARGS]``: runs a training script against the current Ray cluster
  (``--address``, else ``RAY_ADDRESS``, else a local one the script starts);
  ``--profile FIRST:LAST`` traces those optimizer steps (``REDRAY_PROFILE``).
* ``redray submit SCRIPT [ARGS] --address http://HEAD:8265``: submits it as a Ray job
  with the working directory, handles Ray's token auth, streams the logs and exits
  with the job's status (``--no-wait``: prints the job id; Ctrl-C stops following, not
  the job). A job that dies of a missing module gets a line naming ``--python``.
* ``redray logs|status|stop JOB --address http://HEAD:8265``: a submitted job's output
  (``--follow``), status, or stopping it, as ``ray job logs|status|stop``.
* ``redray export RUN --to DIR``: the run's last (or best) checkpoint as Hugging Face
  safetensors, for a run of a redray.models model (its config.json in the run folder).
* ``redray runs [STORAGE] [--json]``: the runs in a storage folder with their status,
  last step, last checkpoint and best metric.
* ``redray eval RUN --tasks T1,T2`` (or ``--model HF_FOLDER``): lm-evaluation-harness
  tasks on the run's model, sharded; a table, and the scores in its MLflow run.
* ``redray plot RUN [--metric NAME ...] [--out PNG] [--storage DIR | --tracking-uri URI]``:
  a PNG of a run's metric curves (default loss and learning rate) from its MLflow run.

Errors a user can fix are one line on stderr and exit code 2. This file parses and
dispatches; each command's parser and handler are in ``redray/commands/``.
"""

from __future__ import annotations

import argparse
import os
import sys

from redray.commands import UsageError
from redray.verbosity import set_verbose

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from redray.commands import jobs, plan, runs

    parser = argparse.ArgumentParser(
        prog="redray", description="redray: distributed training and inference of JAX models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (plan, runs, jobs):
        group.add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("run", "submit", "eval"):
        # Planning and listing are abstract: keep JAX off any accelerator.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from redray.planning.from_config import PlanError

    try:
        if getattr(args, "takes_script", False):
            from redray.commands.jobs import own_options_after_script

            own_options_after_script(args)
            if args.verbose:  # before any Ray logger is quieted; the script and job inherit it
                set_verbose(True)
        return args.run_command(args)
    except (PlanError, FileNotFoundError, LookupError, UsageError) as e:
        message = " ".join(str(e).split())  # one line, always
        print(f"redray {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
