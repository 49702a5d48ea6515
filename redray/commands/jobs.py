"""``redray run``, ``submit``, ``logs``, ``status`` and ``stop``: a training script run
against a Ray cluster, or submitted to one as a Ray job and followed (its token read as
``redray.cluster.auth`` reads it)."""

from __future__ import annotations

import argparse
import os
import re
import sys

from redray.commands import VERBOSE_HELP, UsageError, command, script
from redray.verbosity import VERBOSE_ENV, verbose


def add(sub) -> None:
    p = command(sub, "run", "run a training script on the current Ray cluster",
                 "Runs SCRIPT with this Python. redray.fit in it connects to --address "
                 "(or RAY_ADDRESS), else starts a local Ray cluster.",
                 "examples:\n  redray run examples/language_modeling/train.py --steps 50\n"
                 "  redray run --address ray://head:10001 train.py\n"
                 "  redray run --profile 10:12 train.py   # a profiler trace of steps 10-12\n"
                 "  redray plan llama-7b --devices 16 --batch-size 64 --json > plan.json\n"
                 "  redray run --plan plan.json train.py  # the planner's pick, pinned")
    p.add_argument("--address", help="a Ray cluster address (ray://HOST:10001 or HOST:6379)")
    p.add_argument("--profile", metavar="FIRST:LAST",
                   help="trace optimizer steps FIRST to LAST with JAX's profiler on every "
                        "host, into the run's profile folder (sets REDRAY_PROFILE for the "
                        "script's Trainers; docs/profiling.md)")
    p.add_argument("--plan", metavar="FILE",
                   help="run the script's Trainers on this plan (redray plan --json's output, "
                        "or a plan a run wrote) where they would choose one: sets REDRAY_PLAN "
                        "to its JSON")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run_command=_run, takes_script=True)

    p = command(sub, "submit", "submit a training script as a Ray job",
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
    p.set_defaults(run_command=_submit, takes_script=True)

    for name, does, example in (
            ("logs", "print a submitted job's output (--follow: until it ends)",
             "redray logs raysubmit_XYZ --address http://head:8265 --follow"),
            ("status", "print a submitted job's status", "redray status raysubmit_XYZ "
                                                         "--address http://head:8265"),
            ("stop", "stop a submitted job", "redray stop raysubmit_XYZ --address "
                                             "http://head:8265")):
        p = command(sub, name, does, f"{does[0].upper()}{does[1:]}, as `ray job {name}` "
                     "does; the token is read as for redray submit.", f"examples:\n  {example}")
        p.add_argument("job", metavar="JOB", help="the job id redray submit printed")
        p.add_argument("--address", help="the head's job server, http://HEAD:8265 (default "
                                         "RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
        if name == "logs":
            p.add_argument("--follow", action="store_true", help="until the job ends")
        p.set_defaults(run_command=_jobs)



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
    if args.plan is not None:
        from redray.engine.plan_choice import PLAN_ENV
        from redray.sharding.plan import load

        try:  # read here: a bad file fails before the script starts
            env[PLAN_ENV] = load(args.plan).to_json()
        except ValueError as error:
            raise UsageError(f"--plan {args.plan}: {error}".replace("plan=", "the plan ")) \
                from None
    return subprocess.call([sys.executable, script(args.script), *args.args], env=env)


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

    path = script(args.script)
    client = _job_client(args.address, "submit")
    env_vars = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI", VERBOSE_ENV)
                if k in os.environ}
    commit = git_commit(args.working_dir)  # Ray copies the folder without .git
    if commit:
        env_vars[GIT_COMMIT_ENV] = commit
    try:
        job = client.submit_job(
            entrypoint=" ".join([_quote(args.python),
                                 _quote(os.path.relpath(path, args.working_dir)),
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


def own_options_after_script(args) -> None:
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
