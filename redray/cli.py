"""The ``redray`` command line.

Subcommands:

* ``redray plan PRESET_OR_CONFIG --devices N --model-axis M [--fsdp-axis K] [--json]``:
  how the automatic rules would shard a model on N devices, computed abstractly
  (no device, no allocation).
* ``redray plot RUN [--out PNG] [--storage DIR | --tracking-uri URI]``: a PNG of a
  run's loss and learning-rate curves from its MLflow run.

Errors a user can fix are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_USAGE = 2


def _plan(args) -> int:
    from redray.models.plan import format_model_plan, load_fields, plan_model

    name, fields = load_fields(args.config)
    result = plan_model(fields, args.devices, args.model_axis, args.fsdp_axis)
    if args.json:
        print(json.dumps({"config": name, **result}, indent=2))
    else:
        print(format_model_plan(result, name))
    return 0


def _plot(args) -> int:
    from redray.tracking import plot

    out = plot(args.run, args.out or f"{args.run}.png", tracking_uri=args.tracking_uri,
               storage_path=args.storage)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redray", description="redray: distributed training and inference of JAX models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "plan", help="show how a model would be sharded, without devices",
        description="Builds the model abstractly, applies the automatic sharding rules on a "
                    "(data, fsdp, model) mesh and prints the parameter and Adam-state bytes "
                    "per device beside the ideal total / (model x fsdp).")
    p.add_argument("config", metavar="PRESET_OR_CONFIG",
                   help="a preset (gpt2-xl, gpt-j-6b, llama-7b, llama-13b, t5-11b, opt-13b, "
                        "opt-66b) or the path of a Hugging Face config.json")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    p.add_argument("--model-axis", type=int, required=True, help="tensor-parallel axis size")
    p.add_argument("--fsdp-axis", type=int, default=1,
                   help="ZeRO-3 axis size (default 1); data axis = devices / (model x fsdp)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run_command=_plan)

    p = sub.add_parser(
        "plot", help="write a PNG of a run's loss and learning-rate curves",
        description="Reads the run's metrics from MLflow and plots loss (and eval loss) and "
                    "learning rate against the step.",
        epilog="examples:\n  redray plot my-run --storage /abs/path/runs\n"
               "  redray plot 7f1dc9ae4e4a45 --tracking-uri http://mlflow:5000 --out curves.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="a redray run name or an MLflow run id")
    p.add_argument("--out", help="the PNG to write (default RUN.png)")
    p.add_argument("--storage", help="the runs' storage folder, whose mlflow.db is read "
                                     "(default ~/redray_runs)")
    p.add_argument("--tracking-uri", help="an MLflow tracking URI (default "
                                          "MLFLOW_TRACKING_URI, else the storage's mlflow.db)")
    p.set_defaults(run_command=_plot)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Planning is abstract: keep JAX off any accelerator unless the user chose one.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from redray.models.plan import PlanError

    try:
        return args.run_command(args)
    except (PlanError, FileNotFoundError, LookupError) as e:
        message = " ".join(str(e).split())  # one line, always
        print(f"redray {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
