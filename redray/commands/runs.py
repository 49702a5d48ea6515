"""``redray runs``, ``export``, ``eval`` and ``plot``: what a storage folder's runs are,
and a trained run exported, scored on lm-eval tasks or plotted."""

from __future__ import annotations

import json
import os
import sys

from redray import storage as storage_module
from redray.commands import UsageError, command


def add(sub) -> None:
    for one in (_add_eval, _add_plot, _add_export, _add_runs):
        one(sub)


def _add_eval(sub) -> None:
    from redray.sharding.parallelism import AXES

    p = command(sub, "eval", "score a run or a Hugging Face model on lm-eval tasks",
                 "Runs lm-evaluation-harness tasks on a trained run (its newest checkpoint, "
                 "config.json and tokenizer) or a Hugging Face folder, on redray's sharded "
                 "Predictor; prints a table and logs eval/<task>/<measure> to the run's "
                 "MLflow run. Needs pip install 'redray[eval]'.",
                 "examples:\n  redray eval demo --storage runs --tasks hellaswag,arc_easy\n"
                 "  redray eval --model hf/ --tasks my_task --include-path tasks/ "
                 "--model-axis 2")
    p.add_argument("run", metavar="RUN", nargs="?",
                   help="a run folder, or a run name with --storage")
    p.add_argument("--tasks", required=True, help="task names, comma-separated")
    p.add_argument("--model", help="a Hugging Face folder instead of a run")
    p.add_argument("--storage", help=f"the storage folder of RUN (default "
                                     f"{storage_module.DEFAULT_STORAGE})")
    p.add_argument("--tokenizer", help="a tokenizer folder (default the run's or the model's)")
    p.add_argument("--include-path", help="a folder of task YAML files (local tasks)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per program call")
    p.add_argument("--limit", type=float, default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples")
    p.add_argument("--samples", help="a JSON lines file to write every example's requests "
                                     "and responses to")
    p.add_argument("--no-track", action="store_true", help="do not log to the run's MLflow")
    p.add_argument("--apply-chat-template", nargs="?", const=True, default=None,
                   metavar="NAME", help="render each request with the tokenizer's chat "
                                        "template (or its template NAME), as lm-eval's own "
                                        "--apply_chat_template")
    p.add_argument("--fewshot-as-multiturn", choices=("true", "false"), default="true",
                   help="with a chat template, the few-shot examples as earlier turns "
                        "(default true, as lm-eval)")
    p.add_argument("--hosts", type=int, default=None,
                   help="evaluate on this many hosts of a Ray cluster (on one machine: "
                        "simulated ones; default: this process)")
    p.add_argument("--devices-per-host", type=int, default=None,
                   help="CPU devices each simulated host has (with --hosts)")
    for axis in AXES:
        if axis.default != "auto":
            p.add_argument(f"--{axis.keyword.replace('_', '-')}", type=int, default=None,
                           help=f"{axis.doc}: its size")
    p.set_defaults(run_command=_eval)


def _add_plot(sub) -> None:
    p = command(sub, "plot", "write a PNG of a run's metric curves",
                 "Reads the run's metrics from MLflow and plots them against the step: by "
                 "default loss (and eval loss) and learning rate, or the --metric ones.",
                 "examples:\n  redray plot my-run --storage /abs/path/runs\n"
                 "  redray plot my-run --metric loss --metric grad_norm --metric tokens_per_s\n"
                 "  redray plot 7f1dc9ae4e4a45 --tracking-uri http://mlflow:5000 --out c.png")
    p.add_argument("run", metavar="RUN", help="a redray run name or an MLflow run id")
    p.add_argument("--out", help="the PNG to write (default RUN.png)")
    p.add_argument("--storage", help="the runs' storage folder, whose mlflow.db is read "
                                     f"(default {storage_module.DEFAULT_STORAGE})")
    p.add_argument("--tracking-uri", help="an MLflow tracking URI (default "
                                          "MLFLOW_TRACKING_URI, else the storage's mlflow.db)")
    p.add_argument("--metric", action="append", metavar="NAME",
                   help="a logged metric to plot (repeat for more; default loss, eval_loss, "
                        "learning_rate)")
    p.set_defaults(run_command=_plot)


def _add_export(sub) -> None:
    p = command(sub, "export", "write a run's checkpoint as Hugging Face safetensors",
                 "Reads the run's newest (or best) checkpoint a tensor (a layer) at a time, "
                 "without building the model, and writes config.json + safetensors that "
                 "transformers' Auto classes load, with the run's tokenizer (RUN/tokenizer) "
                 "when it has one. A run that trained some parameters only (trainable=) is "
                 "loaded into its model, whose other weights complete it.",
                 "examples:\n  redray export demo --storage runs --to exported/\n"
                 "  redray export /abs/runs/lm --best min:eval_loss --to best/")
    p.add_argument("run", metavar="RUN", help="a run folder, or a run name with --storage")
    p.add_argument("--to", required=True, help="the folder to write")
    p.add_argument("--storage", help=f"the storage folder of RUN (default "
                                     f"{storage_module.DEFAULT_STORAGE})")
    p.add_argument("--config", help="the model's config.json (default RUN/config.json)")
    p.add_argument("--best", help="min:<metric> or max:<metric>: the best checkpoint by it")
    p.add_argument("--tokenizer", help="a tokenizer folder to ship with the model (default "
                                       "RUN/tokenizer, when the run saved one)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="the tensors' dtype (default: bfloat16 for a model whose config says "
                        "bfloat16 or is quantized, float32 otherwise)")
    p.set_defaults(run_command=_export)


def _add_runs(sub) -> None:
    p = command(sub, "runs", "list the runs in a storage folder",
                 "Lists the runs under a storage folder: MLflow status, last step, last "
                 "complete checkpoint and best eval metric.",
                 "examples:\n  redray runs\n  redray runs /abs/path/runs --json")
    p.add_argument("storage", nargs="?", default=storage_module.DEFAULT_STORAGE,
                   help=f"the storage folder (default {storage_module.DEFAULT_STORAGE})")
    p.add_argument("--json", action="store_true",
                   help="a JSON list of {name, status, last_step, last_checkpoint, best}")
    p.set_defaults(run_command=_runs)


def _eval(args) -> int:
    from redray.evaluation import evaluate_tasks
    from redray.sharding.parallelism import AXES

    if (args.run is None) == (args.model is None):
        raise UsageError("give a run (RUN, a run folder or a name with --storage) or "
                         "--model HF_FOLDER, not both")
    axes = {a.keyword: getattr(args, a.keyword) for a in AXES
            if getattr(args, a.keyword, None) is not None}
    try:
        evaluate_tasks([t for t in args.tasks.split(",") if t], run=args.run,
                       model=args.model, storage=args.storage, tokenizer=args.tokenizer,
                       include_path=args.include_path, batch_size=args.batch_size,
                       limit=args.limit, num_fewshot=args.num_fewshot, samples=args.samples,
                       track=not args.no_track, hosts=args.hosts,
                       apply_chat_template=args.apply_chat_template or False,
                       fewshot_as_multiturn=args.fewshot_as_multiturn != "false",
                       devices_per_host=args.devices_per_host, **axes)
    except (ImportError, ValueError) as error:
        raise UsageError(str(error)) from None
    return 0


def _plot(args) -> int:
    from redray.tracking import plot

    out = plot(args.run, args.out or f"{args.run}.png", tracking_uri=args.tracking_uri,
               storage_path=args.storage, metrics=args.metric)
    print(out)
    return 0


def _run_folders(run: str, storage: str | None) -> storage_module.RunFolders:
    """The folders of ``run``: a run folder (``<storage>/<name>``), else a run name in
    ``storage``."""
    if os.path.isdir(run) and os.path.isdir(os.path.join(run, storage_module.CHECKPOINTS)):
        path = os.path.abspath(run)
        return storage_module.RunFolders.of(os.path.dirname(path), os.path.basename(path))
    folders = storage_module.RunFolders.of(storage, run)
    if not os.path.isdir(folders.checkpoints):
        raise UsageError(f"no run {run!r}: give a run folder (<storage>/<name>) or a run name "
                         f"with --storage (looked in {folders.run})")
    return folders


def _export(args) -> int:
    from redray.models import load_config, slices

    folders = _run_folders(args.run, args.storage)
    config_path = args.config or folders.model_config
    if not os.path.exists(config_path):
        raise UsageError(f"no model config at {config_path}: pass --config, the Hugging Face "
                         "config.json of the redray.models model the run trained")
    tokenizer = args.tokenizer or folders.tokenizer
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise UsageError(f"no tokenizer folder {args.tokenizer!r}: give a folder a "
                         "transformers tokenizer was saved to (save_pretrained)")
    # this process does the export alone: a decoded chunk's buffer is unmapped when freed
    slices.unmap_large_buffers()
    export_run(folders.run, load_config(config_path), args.to,
               tokenizer=tokenizer if os.path.isdir(tokenizer) else None, dtype=args.dtype,
               best=args.best)
    print(args.to)
    return 0


def export_run(run: str, config, to: str, tokenizer=None, dtype=None, best=None) -> None:
    """What ``redray export`` writes: the run's checkpoint (newest, or ``best``) as a
    Hugging Face folder, read a tensor (a stacked parameter's layer) at a time without
    building the model (``config``: its ``transformers`` config). A run that trained some
    parameters only, or a checkpoint that does not read, is restored into the model
    instead (``load_model``: a damaged checkpoint skipped, named)."""
    from redray.engine.load import load_model, stored_params
    from redray.models import build, save_pretrained
    from redray.models.hub import write_pretrained

    factory = lambda rngs: build(config, rngs=rngs)  # noqa: E731
    stored = stored_params(run, factory, best=best)
    if stored is not None:  # read from the files a tensor at a time: no model is built
        try:
            write_pretrained(config, stored.shapes, stored.fetch, to, tokenizer=tokenizer,
                             dtype=dtype)
            return
        except Exception as error:  # noqa: BLE001 - named; the restore below decides
            print(f"redray export: reading {stored.path} failed ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:200] if str(error) else ''}); restoring "
                  "instead (a damaged checkpoint is skipped, named)", file=sys.stderr)
    model = load_model(run, factory, best=best)
    save_pretrained(model, to, tokenizer=tokenizer, dtype=dtype)


def list_runs(storage: str) -> list[dict]:
    """One dict per run folder of ``storage`` that holds checkpoints: ``name``,
    ``status`` (from MLflow when the run is tracked there), ``last_step``,
    ``last_checkpoint``, ``best`` (``{"metric", "value", "step"}`` or None)."""
    from redray.checkpoint import CheckpointConfig, best_checkpoint, latest_meta

    storage = storage_module.storage_folder(storage)
    if not os.path.isdir(storage):
        raise FileNotFoundError(f"no storage folder {storage}: give the storage_path runs "
                                f"were written to (default {storage_module.DEFAULT_STORAGE})")
    store = storage_module.default_tracking_uri(storage)
    statuses = _mlflow_statuses(store)
    runs = []
    for name in sorted(os.listdir(storage)):
        folders = storage_module.RunFolders(storage, name, store)  # storage resolved above
        folder = folders.checkpoints
        if not os.path.isdir(folder):
            continue
        meta = latest_meta(folder)
        best = None
        if meta:
            config = CheckpointConfig(**{k: v for k, v in (meta.get("config", {}).get(
                "checkpoint") or {}).items() if k in CheckpointConfig.__dataclass_fields__})
            best = best_checkpoint(folder, config.best_metric or "eval_loss",
                         config.best_mode if config.best_metric else "min")
        runs.append({"name": name,
                     "status": statuses.get(folders.run,
                                            "UNTRACKED" if meta else "NO_CHECKPOINT"),
                     "last_step": meta["step"] if meta else None,
                     "last_checkpoint": os.path.join(folder, str(meta["step"])) if meta else None,
                     "best": best})
    return runs


def _mlflow_statuses(uri: str) -> dict:
    """run path -> MLflow status, from a storage folder's own SQLite store ``uri`` (if
    any)."""
    if not os.path.exists(storage_module.sqlite_file(uri)):
        return {}
    try:
        from mlflow.tracking import MlflowClient

        from redray.tracking import RUN_PATH_TAG

        client = MlflowClient(uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        out = {}
        for run in client.search_runs(ids, order_by=["attributes.start_time ASC"]):
            path = run.data.tags.get(RUN_PATH_TAG)
            if path:
                out[path] = run.info.status
        return out
    except Exception:  # noqa: BLE001 - a listing never fails on the tracker
        return {}


def _runs(args) -> int:
    runs = list_runs(args.storage)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no runs in {storage_module.storage_folder(args.storage)}")
        return 0
    print(f"{'name':<24} {'status':<13} {'last step':>9}  {'best':<24} last checkpoint")
    for r in runs:
        best = "-" if not r["best"] else \
            f"{r['best']['metric']}={r['best']['value']:.4g}@{r['best']['step']}"
        print(f"{r['name']:<24} {r['status']:<13} {r['last_step'] or '-':>9}  {best:<24} "
              f"{r['last_checkpoint'] or '-'}")
    return 0
