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

Errors a user can fix are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from redray import storage as storage_module
from redray.verbosity import VERBOSE_ENV, set_verbose, verbose

VERBOSE_HELP = ("show everything the run's processes print (default: one progress line "
                "and the run's messages; REDRAY_VERBOSE=1 does the same)")

EXIT_USAGE = 2


def _plan(args) -> int:
    from redray.planning.from_config import format_model_plan, load_fields, plan_model
    from redray.sharding.parallelism import AXES

    from redray.planning.memory import StepShape

    name, fields = load_fields(args.config)
    sizes = {a.keyword: getattr(args, a.keyword) for a in AXES if a.default != "auto"}
    if args.hosts is not None or args.hardware is not None or all(
            v is None for v in sizes.values()):
        return _choose(args, name, fields, {k: v for k, v in sizes.items() if v is not None})
    sizes = {a.keyword: a.default if sizes[a.keyword] is None else sizes[a.keyword]
             for a in AXES if a.keyword in sizes}
    step = None
    if args.batch_size is not None or args.seq_len is not None:
        if args.batch_size is None or args.seq_len is None:
            raise UsageError("the step's memory needs both --batch-size and --seq-len")
        try:
            step = StepShape(batch_size=args.batch_size, seq_len=args.seq_len,
                             remat=args.remat or "none", compute_dtype=args.compute_dtype,
                             loss_chunk=args.loss_chunk, micro_batch_size=args.micro_batch_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.device_memory is not None:
        raise UsageError("--device-memory needs the step's shape: give --batch-size and "
                         "--seq-len too")
    result = plan_model(fields, args.devices, step=step, device_gib=args.device_memory,
                        scan=args.scan, **sizes)
    if args.json:
        print(json.dumps({"config": name, **result, "plan": _given_plan(args, sizes)},
                         indent=2))
    else:
        print(format_model_plan(result, name))
    return 0


def _given_plan(args, sizes: dict) -> dict:
    """The plan of ``redray plan``'s axis sizes (and its batch, where given) written out:
    what ``plan=`` takes."""
    from redray.sharding import Parallelism, Plan

    par = Parallelism.of(**sizes).abstract(args.devices)
    if args.batch_size is None:
        return Plan(par, remat=args.remat).to_dict()
    try:
        return Plan.of(par, par.step_geometry(args.batch_size, args.micro_batch_size),
                       remat=args.remat).to_dict()
    except ValueError as e:
        raise UsageError(str(e)) from None


def _choose(args, name: str, fields: dict, pinned: dict) -> int:
    """``redray plan`` without every axis size: the planner's ranked plans."""
    import dataclasses

    from redray.planning import resolve_hardware
    from redray.planning.from_config import choose_plan

    if args.batch_size is None or args.seq_len is None:
        raise UsageError("choosing a plan needs the step: give --batch-size and --seq-len "
                         "(or --model-axis, without --hosts or --hardware, for one plan's "
                         "placement)")
    try:
        hardware = resolve_hardware(args.hardware or "h100")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device_memory is not None:
        hardware = dataclasses.replace(hardware, device_memory=args.device_memory * (1 << 30))
    hosts = args.hosts or max(1, args.devices // hardware.devices_per_host)
    ranking = choose_plan(fields, args.devices, hosts, args.batch_size, args.seq_len, hardware,
                          compute_dtype=args.compute_dtype, loss_chunk=args.loss_chunk,
                          micro_rows=args.micro_batch_size, remat=args.remat, scan=args.scan,
                          **pinned)
    if args.json:
        print(json.dumps({"config": name, "hardware": hardware.describe(), "hosts": hosts,
                          "plans": [_scored_json(s, hardware) for s in ranking.ranked],
                          "over_budget": len(ranking.over)}, indent=2))
        return 0
    print(f"{name}: {args.devices} devices in {hosts} host(s), {hardware.name} "
          f"({hardware.source})")
    print(f"batch {args.batch_size} x {args.seq_len} tokens")
    print(ranking.why())
    print()
    print(ranking.table())
    return 0


def _scored_json(s, hardware) -> dict:
    """A ranked plan: ``plan`` written out (what ``plan=`` takes), its axes, its
    predicted step by part."""
    import dataclasses

    c = s.cost
    plan = dataclasses.replace(s.plan, hardware=hardware.to_dict())
    return {"plan": plan.to_dict(), "axes": s.plan.shape,
            "micro_batch_size": s.plan.geometry.micro_batch_size,
            "remat": s.plan.remat, "accumulation": s.accumulation,
            "pipeline_schedule": s.plan.pipeline_schedule,
            "stage_repeats": s.plan.stage_repeats,
            "step_seconds": c.seconds, "compute_seconds": c.compute,
            "attention_seconds": c.attention, "memory_bound_seconds": c.memory,
            "update_seconds": c.update, "pipeline_seconds": c.pipeline,
            "tensor_seconds": c.tensor, "gradient_seconds": c.gradients,
            "exposed_gradient_seconds": c.exposed, "tokens_per_s": s.tokens_per_s,
            "mfu": s.mfu, "memory_bytes": s.memory["total"]}


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


class UsageError(Exception):
    """A mistake the user can fix; printed as one line."""


def _script(path: str) -> str:
    if not os.path.isfile(path):
        raise UsageError(f"no script {path!r}: give the path of a Python training script")
    return path


def _run(args) -> int:
    import subprocess

    env = dict(os.environ)
    if args.address:
        env["RAY_ADDRESS"] = args.address
    if args.profile is not None:
        from redray.engine.profile import PROFILE_ENV, profile_window

        try:
            profile_window(args.profile, "--profile")
        except ValueError as error:
            raise UsageError(str(error).replace("--profile=", "--profile ")) from None
        env[PROFILE_ENV] = args.profile
    return subprocess.call([sys.executable, _script(args.script), *args.args], env=env)


def _job_client(address: str | None, command: str):
    """A Ray ``JobSubmissionClient`` for the head's job server, with the token read as
    ``redray submit`` reads it; a wrong address, a missing or rejected token is a
    ``UsageError`` that says what to do."""
    if not address:
        address = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        raise UsageError(f"--address is required: the head's job server, e.g. "
                         f"redray {command} ... --address http://HEAD:8265")
    if not address.startswith(("http://", "https://")):
        raise UsageError(f"--address {address!r}: give the head's job server, e.g. "
                         "http://HEAD:8265 (a ray:// address is for redray.fit(address=...))")
    from redray.cluster.auth import use_token

    token = use_token()
    from ray.job_submission import JobSubmissionClient

    if not verbose():
        from redray.processes.ray_local import quiet_job_sdk

        quiet_job_sdk()

    try:
        return JobSubmissionClient(address)
    except Exception as error:  # noqa: BLE001 - turned into one line
        raise UsageError(_submit_error(address, error, token)) from None


def _submit(args) -> int:
    from redray.cluster.auth import find_token
    from redray.tracking import GIT_COMMIT_ENV, git_commit

    script = _script(args.script)
    client = _job_client(args.address, "submit")
    env_vars = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI", VERBOSE_ENV)
                if k in os.environ}
    commit = git_commit(args.working_dir)  # Ray copies the folder without .git
    if commit:
        env_vars[GIT_COMMIT_ENV] = commit
    try:
        job = client.submit_job(
            entrypoint=" ".join([_quote(args.python),
                                 _quote(os.path.relpath(script, args.working_dir)),
                                 *map(_quote, args.args)]),
            runtime_env={"working_dir": args.working_dir, "env_vars": env_vars})
    except Exception as error:  # noqa: BLE001 - turned into one line below
        raise UsageError(_submit_error(args.address, error, find_token())) from None
    if args.no_wait:
        print(job)
        return 0
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started with Ctrl-C ignored (a background job of a script, a parent that
        # ignores it): following is what Ctrl-C stops, never the job
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        logs = _follow(client, job)
    except KeyboardInterrupt:
        # Ctrl-C stops following, not the job: say so, and how to stop it
        print(f"\nredray submit: stopped following job {job}; it is still running. "
              f"Stop it: redray stop {job} --address {args.address}; its output: redray logs "
              f"{job} --address {args.address}", file=sys.stderr, flush=True)
        return 130
    status = _status_name(client.get_job_status(job))
    hint = _missing_module_hint(logs, args.python) if status == "FAILED" else None
    if hint:
        print(f"redray submit: {hint}", file=sys.stderr)
    print(f"redray submit: job {job} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def _follow(client, job: str) -> str:
    """Prints a job's logs as they come until it ends; returns them.

    The logs are read by an event loop on a thread of its own, and printed here: Ctrl-C
    (``KeyboardInterrupt`` in this, the main thread) then stops following at once. An
    event loop on the main thread turns Ctrl-C into a cancellation of the task reading
    the logs, and waits for it to end, which the job client's web socket did not always
    do (the follower hung)."""
    import asyncio
    import queue
    import threading

    from redray.processes.ray_local import OutputState, drop_noise

    seen: list[str] = []
    stream = OutputState()
    arrived: queue.Queue = queue.Queue()
    done = object()

    def read():
        async def tail():
            async for lines in client.tail_job_logs(job):
                arrived.put(lines)

        try:
            asyncio.run(tail())
        except BaseException as error:  # noqa: BLE001 - raised again on the main thread
            arrived.put(error)
        arrived.put(done)

    threading.Thread(target=read, name="redray-follow", daemon=True).start()
    while True:
        try:
            lines = arrived.get(timeout=0.5)
        except queue.Empty:
            continue
        if lines is done:
            return "".join(seen)
        if isinstance(lines, BaseException):
            raise lines
        seen.append(lines)
        shown = lines.splitlines() if verbose() else drop_noise(lines.splitlines(), stream)
        if shown:
            print("\n".join(shown), flush=True)


def _status_name(status) -> str:
    return str(status).split(".")[-1]


def _missing_module_hint(logs: str, python: str) -> str | None:
    """For a job that died of a missing module: which Python ran it and how to choose."""
    import re

    found = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", logs)
    if not found:
        return None
    return (f"the job's Python ({python!r} on the cluster) has no module {found[-1]!r}: give "
            f"--python the cluster's Python that has your packages (e.g. --python "
            f"/path/to/venv/bin/python), or install {found[-1].split('.')[0]!r} there")


def _jobs(args) -> int:
    """``redray logs|status|stop JOB``: as ``ray job logs|status|stop``."""
    client = _job_client(args.address, args.command)
    try:
        if args.command == "logs":
            if args.follow:
                _follow(client, args.job)
            else:
                print(client.get_job_logs(args.job), end="", flush=True)
        elif args.command == "status":
            info = client.get_job_info(args.job)
            print(f"{args.job} {_status_name(info.status)}"
                  + (f": {info.message}" if info.message else ""))
        else:
            stopped = client.stop_job(args.job)
            print(f"{args.job} {'stopping' if stopped else 'not running'}")
    except KeyboardInterrupt:
        return 130
    except RuntimeError as error:
        text = " ".join(str(error).split())
        if "does not exist" in text or "404" in text:
            raise UsageError(f"no job {args.job!r} on {args.address}: `ray job list "
                             f"--address ...` lists them") from None
        raise UsageError(text[:300]) from None
    return 0


def _quote(part: str) -> str:
    import shlex

    return shlex.quote(part)


def _submit_error(address: str, error: Exception, token: str | None) -> str:
    from redray.cluster.auth import TOKEN_HELP

    text = " ".join(str(error).split())
    answered = re.match(r"Authentication (?:required|failed): (.*?)(?:\n|$)", str(error))
    if answered and "authentication token" not in answered.group(1).lower():
        # a 401/403 that is not a Ray head's token refusal: another server (or a proxy
        # between) answered at that address
        return (f"cannot reach the Ray job server at {address}: something else answered "
                f"there ({answered.group(1).strip()[:120] or 'HTTP 401/403'}); check the "
                "address (the head's dashboard port, default 8265) and any HTTP proxy "
                "(NO_PROXY) between")
    if any(k in text.lower() for k in ("401", "403", "unauthorized", "unauthenticated",
                                       "authentication", "token")):
        if token is None:
            return f"the cluster at {address} requires a token and none was found: {TOKEN_HELP}"
        return (f"the cluster at {address} rejected the token (from RAY_AUTH_TOKEN or "
                f"~/.ray/auth_token): {TOKEN_HELP}")
    if isinstance(error, ConnectionError) or "connect" in text.lower():
        return (f"cannot reach the Ray job server at {address}: check the address (the head's "
                "dashboard port, default 8265) and that it is reachable (e.g. `ray dashboard "
                "cluster.yaml` forwards it)")
    return f"submitting to {address} failed: {text[:300]}"


# redray's own options of run/submit, also accepted after SCRIPT (before a literal --)
OWN_OPTIONS = {"--address": 1, "--working-dir": 1, "--no-wait": 0, "--python": 1}


def _own_options_after_script(args) -> None:
    """Moves ``--address X`` etc. written after SCRIPT from the script's arguments to
    redray's; everything after a literal ``--`` stays the script's."""
    rest, script_args = list(args.args), []
    while rest:
        part = rest.pop(0)
        if part == "--":
            script_args += rest
            break
        name = part.split("=", 1)[0]
        if name in OWN_OPTIONS and hasattr(args, name[2:].replace("-", "_")):
            if OWN_OPTIONS[name] == 0:
                value = True
            elif "=" in part:
                value = part.split("=", 1)[1]
            elif rest:
                value = rest.pop(0)
            else:
                raise UsageError(f"{name} needs a value")
            setattr(args, name[2:].replace("-", "_"), value)
        else:
            script_args.append(part)
    args.args = script_args


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
    from redray.engine.load import load_model
    from redray.models import build, load_config, save_pretrained

    folders = _run_folders(args.run, args.storage)
    config_path = args.config or folders.model_config
    if not os.path.exists(config_path):
        raise UsageError(f"no model config at {config_path}: pass --config, the Hugging Face "
                         "config.json of the redray.models model the run trained")
    tokenizer = args.tokenizer or folders.tokenizer
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise UsageError(f"no tokenizer folder {args.tokenizer!r}: give a folder a "
                         "transformers tokenizer was saved to (save_pretrained)")
    config = load_config(config_path)
    model = load_model(folders.run, lambda rngs: build(config, rngs=rngs), best=args.best)
    save_pretrained(model, args.to, tokenizer=tokenizer if os.path.isdir(tokenizer) else None)
    print(args.to)
    return 0


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


def _preset_names() -> list[str]:
    """The shipped presets of ``redray plan`` (redray/models/presets), read without
    importing the models (which would import JAX)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "presets")
    return sorted(n[:-len(".json")] for n in os.listdir(folder) if n.endswith(".json"))


def _command(sub, name: str, help: str, description: str, epilog: str):
    """A subcommand whose --help ends with usage examples."""
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    from redray.sharding.parallelism import AXES, PARAMETER_AXES

    parser = argparse.ArgumentParser(
        prog="redray", description="redray: distributed training and inference of JAX models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "plan", "show how a model would be sharded, without devices",
                 "Builds the model abstractly, applies the automatic sharding rules on a "
                 f"({', '.join(a.name for a in AXES)}) mesh and prints the parameter and "
                 "Adam-state bytes per device beside the ideal total / "
                 f"({' x '.join(a.name for a in PARAMETER_AXES)}).",
                 "examples:\n  redray plan llama-7b --devices 8 --model-axis 8\n"
                 "  redray plan llama-7b --devices 8 --model-axis 8 --batch-size 16 "
                 "--seq-len 2048 --remat full --compute-dtype bfloat16 --device-memory 80\n"
                 "  redray plan path/to/config.json --devices 16 --model-axis 4 --fsdp-axis 4\n"
                 "  redray plan llama-7b --devices 64 --hosts 8 --batch-size 256 --seq-len "
                 "4096 --compute-dtype bfloat16 --hardware h100+ethernet")
    p.add_argument("config", metavar="PRESET_OR_CONFIG",
                   help=f"a preset ({', '.join(_preset_names())}) or the path of a Hugging "
                        "Face config.json")
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    for axis in reversed(AXES):  # the data axis takes what the others leave
        if axis.default != "auto":
            p.add_argument(f"--{axis.keyword.replace('_', '-')}", type=int, default=None,
                           help=f"{axis.doc}: its size (given alone: that plan's placement, "
                                f"the others {axis.default}; with --hosts or --hardware, or "
                                "none given: the planner chooses the rest)")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                   help="the model's layers stacked and scanned, so the planner tries "
                        "pipeline stages too (the default, where the config allows it); "
                        "--no-scan: a list of layers, as build(config, scan=False)")
    p.add_argument("--hosts", type=int, default=None,
                   help="the planner: hosts the devices are in (default: devices / a host's "
                        "devices of --hardware)")
    p.add_argument("--hardware", default=None,
                   help="the planner: a preset the plans are costed on: h100, "
                        "h100-96gb-500w, h200, a100, l4, tpu-v5e or cpu, '+ethernet' for "
                        "hosts joined by 100 Gb/s Ethernet (default h100)")
    memory = p.add_argument_group(
        "one training step's memory per device (gradients, compute-dtype copies, FSDP "
        "gather buffers, activations): give --batch-size and --seq-len")
    memory.add_argument("--batch-size", type=int, help="examples per update, all devices")
    memory.add_argument("--micro-batch-size", type=int,
                        help="examples per forward/backward pass (gradient accumulation)")
    memory.add_argument("--seq-len", type=int, help="tokens per example")
    memory.add_argument("--remat", default=None, choices=("none", "full", "dots", "offload"),
                        help="the models' remat policy (default none; the planner chooses)")
    memory.add_argument("--compute-dtype", default=None,
                        help="e.g. bfloat16: the model built in it and its parameters cast "
                             "to it for the step (default: float32)")
    memory.add_argument("--loss-chunk", type=int, default=None,
                        help="tokens whose logits exist at once (next_token_loss(chunk=))")
    memory.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                        help="say whether the step fits on a device of this many GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run_command=_plan)

    p = _command(sub, "eval", "score a run or a Hugging Face model on lm-eval tasks",
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

    p = _command(sub, "plot", "write a PNG of a run's metric curves",
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

    p = _command(sub, "run", "run a training script on the current Ray cluster",
                 "Runs SCRIPT with this Python. redray.fit in it connects to --address "
                 "(or RAY_ADDRESS), else starts a local Ray cluster.",
                 "examples:\n  redray run examples/language_modeling/train.py --steps 50\n"
                 "  redray run --address ray://head:10001 train.py\n"
                 "  redray run --profile 10:12 train.py   # a profiler trace of steps 10-12")
    p.add_argument("--address", help="a Ray cluster address (ray://HOST:10001 or HOST:6379)")
    p.add_argument("--profile", metavar="FIRST:LAST",
                   help="trace optimizer steps FIRST to LAST with JAX's profiler on every "
                        "host, into the run's profile folder (sets REDRAY_PROFILE for the "
                        "script's Trainers; docs/profiling.md)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run_command=_run)

    p = _command(sub, "submit", "submit a training script as a Ray job",
                 "Submits SCRIPT as a Ray job with the working directory, streams its logs "
                 "and exits with its status. Ray 2.60 token auth: the token is read from "
                 "RAY_AUTH_TOKEN or ~/.ray/auth_token. Storage paths in the script must be "
                 "absolute (a job runs in a temporary copy of the working directory).",
                 "examples:\n"
                 "  redray submit train.py --address http://127.0.0.1:8265 -- --steps 500\n"
                 "  redray submit train.py --address http://head:8265 --no-wait")
    p.add_argument("--address", help="the head's job server, http://HEAD:8265 (required)")
    p.add_argument("--working-dir", default=".", help="uploaded with the job (default .)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--python", default="python",
                   help="the cluster's Python that runs SCRIPT, one with redray and your "
                        "packages (default: the cluster's `python`)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("script", metavar="SCRIPT", help="the training script (in the working dir)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run_command=_submit)

    for name, does, example in (
            ("logs", "print a submitted job's output (--follow: until it ends)",
             "redray logs raysubmit_XYZ --address http://head:8265 --follow"),
            ("status", "print a submitted job's status", "redray status raysubmit_XYZ "
                                                         "--address http://head:8265"),
            ("stop", "stop a submitted job", "redray stop raysubmit_XYZ --address "
                                             "http://head:8265")):
        p = _command(sub, name, does, f"{does[0].upper()}{does[1:]}, as `ray job {name}` "
                     "does; the token is read as for redray submit.", f"examples:\n  {example}")
        p.add_argument("job", metavar="JOB", help="the job id redray submit printed")
        p.add_argument("--address", help="the head's job server, http://HEAD:8265 (default "
                                         "RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
        if name == "logs":
            p.add_argument("--follow", action="store_true", help="until the job ends")
        p.set_defaults(run_command=_jobs)

    p = _command(sub, "export", "write a run's checkpoint as Hugging Face safetensors",
                 "Loads the run's newest (or best) checkpoint into its redray.models model "
                 "and writes config.json + safetensors that transformers' Auto classes load, "
                 "with the run's tokenizer (RUN/tokenizer) when it has one.",
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
    p.set_defaults(run_command=_export)

    p = _command(sub, "runs", "list the runs in a storage folder",
                 "Lists the runs under a storage folder: MLflow status, last step, last "
                 "complete checkpoint and best eval metric.",
                 "examples:\n  redray runs\n  redray runs /abs/path/runs --json")
    p.add_argument("storage", nargs="?", default=storage_module.DEFAULT_STORAGE,
                   help=f"the storage folder (default {storage_module.DEFAULT_STORAGE})")
    p.add_argument("--json", action="store_true",
                   help="a JSON list of {name, status, last_step, last_checkpoint, best}")
    p.set_defaults(run_command=_runs)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_command not in (_run, _submit, _eval):
        # Planning and listing are abstract: keep JAX off any accelerator.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from redray.planning.from_config import PlanError

    try:
        if args.run_command in (_run, _submit):
            _own_options_after_script(args)
            if args.verbose:  # before any Ray logger is quieted; the script and job inherit it
                set_verbose(True)
        return args.run_command(args)
    except (PlanError, FileNotFoundError, LookupError, UsageError) as e:
        message = " ".join(str(e).split())  # one line, always
        print(f"redray {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
