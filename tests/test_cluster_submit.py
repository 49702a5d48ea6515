"""Against a real `ray start --head` cluster on 127.0.0.1: `ray job submit` and `ray://`.

The cluster is this test's own (a private temp dir and free ports); teardown kills
only the processes whose command line names that temp dir.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import optax
import pytest

import redray
from tiny import TinyLM, lm_collate, lm_loss, token_data

pytestmark = pytest.mark.ray  # a Ray head of its own

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

HERE = os.path.dirname(os.path.abspath(__file__))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
OPTIONS = dict(batch_size=8, model_axis=2, log_every=1, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def closed_port():
    """A port bound and never listening, while the block runs: a connection to it is
    refused, and no other process can take it meanwhile (a port freed and tried later
    can be: another process then answers). A port whose number another socket still
    answers on (a Ray gRPC server's, bound with SO_REUSEPORT or on another address
    family: seen once in CI) is passed over."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except OSError:  # refused: nobody answers on it
                yield port
                return
    raise RuntimeError("no port that refuses connections in 20 tries")


def token_env() -> dict:
    return dict(os.environ, RAY_AUTH_MODE="token")


@pytest.fixture(scope="module")
def head():
    if ray.is_initialized():
        ray.shutdown()
    temp = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # short: Unix socket paths are limited
    # the head's token, as the README's walkthrough makes it (kept if there is one)
    made = subprocess.run([RAY, "get-auth-token", "--generate"], env=token_env(),
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    before = set(psutil.pids())
    gcs, dash, client = free_port(), free_port(), free_port()
    started = subprocess.run(
        [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", "--num-cpus=4", f"--temp-dir={temp}",
         "--disable-usage-stats"], env=token_env(), capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        wait_until_ready(f"http://127.0.0.1:{dash}", client)
        yield {"dashboard": f"http://127.0.0.1:{dash}", "client": f"ray://127.0.0.1:{client}"}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for proc in psutil.process_iter(["cmdline"]):
            if proc.pid in before:  # only what this cluster started
                continue
            try:
                cmdline = proc.info["cmdline"] or ()
                # Ray's agents retitle themselves ("ray::DashboardAgent"): no temp dir left
                if any(temp in part for part in cmdline) or (
                        cmdline and cmdline[0].startswith("ray::")):
                    proc.send_signal(signal.SIGKILL)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        time.sleep(1)
        shutil.rmtree(temp, ignore_errors=True)


def wait_until_ready(dashboard: str, client_port: int, seconds: float = 120) -> None:
    """`ray start` returns before the job agent and the client server answer."""
    deadline = time.time() + seconds
    while True:
        listed = subprocess.run([RAY, "job", "list", "--address", dashboard], env=token_env(),
                                capture_output=True, text=True, timeout=60)
        try:
            socket.create_connection(("127.0.0.1", client_port), timeout=2).close()
            client_up = True
        except OSError:
            client_up = False
        if listed.returncode == 0 and client_up:
            return
        if time.time() > deadline:
            raise TimeoutError(f"the test cluster did not come up: {listed.stderr[-2000:]}")
        time.sleep(2)


def expected_losses(steps):
    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       progress=False, **OPTIONS)
    return [r["loss"] for r in t.fit(token_data(96), epochs=1, max_steps=steps)]


JOB = '''
import json, sys
import optax
import redray
from tiny import TinyLM, lm_collate, lm_loss, token_data

result = redray.fit(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                    train_data=token_data(96), max_steps=6, hosts=2, devices_per_host=2,
                    storage_path=sys.argv[2], progress=False, **{options})
with open(sys.argv[1], "w") as f:
    json.dump([r["loss"] for r in result.history], f)
'''


def test_ray_job_submit_with_token_auth(head, tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    shutil.copy(os.path.join(HERE, "tiny.py"), job_dir)
    (job_dir / "train_job.py").write_text(JOB.format(options=repr(OPTIONS)))
    out = tmp_path / "losses.json"
    done = subprocess.run(
        [RAY, "job", "submit", "--address", head["dashboard"], "--working-dir", str(job_dir),
         "--", sys.executable, "train_job.py", str(out), str(tmp_path / "runs")],
        env=token_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    np.testing.assert_allclose(json.loads(out.read_text()), expected_losses(6), rtol=1e-5)


def test_ray_client_address(head, tmp_path):
    # A laptop script connecting with ray://: the same training through Ray Client.
    script_dir = tmp_path / "client"
    script_dir.mkdir()
    shutil.copy(os.path.join(HERE, "tiny.py"), script_dir)
    (script_dir / "train_client.py").write_text(
        JOB.format(options=repr(OPTIONS)).replace("storage_path=sys.argv[2],",
                                                  "storage_path=sys.argv[2], address=sys.argv[3],"))
    out = tmp_path / "losses.json"
    done = subprocess.run([sys.executable, "train_client.py", str(out), str(tmp_path / "runs"),
                           head["client"]], cwd=script_dir, env=token_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    np.testing.assert_allclose(json.loads(out.read_text()), expected_losses(6), rtol=1e-5)


def test_ray_client_finds_the_token_itself_and_says_when_there_is_none(head, tmp_path):
    """Without RAY_AUTH_MODE: the token in ~/.ray/auth_token is enough (redray presents
    it); with no token at all the error comes at once and says what to set."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token = token_env()["RAY_AUTH_TOKEN"] if "RAY_AUTH_TOKEN" in token_env() else open(
        os.path.expanduser("~/.ray/auth_token")).read()
    script = tmp_path / "client.py"
    script.write_text("import sys, redray.cluster.launch as l, ray\n"
                      "l.connect(sys.argv[1])\n"
                      "print('CPUs', ray.cluster_resources()['CPU'])\n")
    bare = {k: v for k, v in os.environ.items()
            if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    start = time.time()
    none = subprocess.run([sys.executable, str(script), head["client"]], env=dict(
        bare, HOME=str(home)), capture_output=True, text=True, timeout=300)
    assert none.returncode != 0 and time.time() - start < 60
    assert "is reachable, but no auth token was found" in none.stderr, none.stderr[-2000:]
    assert "RAY_AUTH_TOKEN" in none.stderr
    (home / ".ray" / "auth_token").write_text(token)
    found = subprocess.run([sys.executable, str(script), head["client"]], env=dict(
        bare, HOME=str(home)), capture_output=True, text=True, timeout=300)
    assert found.returncode == 0 and "CPUs 4.0" in found.stdout, found.stderr[-3000:]
    with closed_port() as port:
        closed = subprocess.run([sys.executable, str(script), f"ray://127.0.0.1:{port}"],
                                env=dict(bare, HOME=str(home)), capture_output=True,
                                text=True, timeout=120)
    assert "cannot reach the Ray client server" in closed.stderr, closed.stderr[-2000:]


def redray_cli(*args, env=None, cwd=None):
    if args[0] == "submit":  # the test cluster's Python is this venv's
        args = (*args, "--python", sys.executable)
    return subprocess.run([sys.executable, "-m", "redray.cli", *args], env=env or token_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_redray_submit_streams_the_job_and_returns_its_status(head, tmp_path):
    # (a job that trains, through redray submit: the walkthrough test below; through
    # ray job submit: test_ray_job_submit_with_token_auth)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    shutil.copy(os.path.join(HERE, "tiny.py"), job_dir)
    (job_dir / "train_job.py").write_text(JOB.format(options=repr(OPTIONS)))
    (job_dir / "fails.py").write_text("raise SystemExit('this job fails')\n")
    (job_dir / "says.py").write_text("import sys\nprint('the job says', *sys.argv[1:])\n")
    done = redray_cli("submit", "says.py", "hello", "--address", head["dashboard"],
                      cwd=job_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the job says hello" in done.stdout and "SUCCEEDED" in done.stderr
    out = tmp_path / "losses.json"
    relative = redray_cli("submit", "train_job.py", str(out), "runs", "--address",
                          head["dashboard"], cwd=job_dir)
    assert relative.returncode == 1, relative.stdout[-3000:] + relative.stderr[-3000:]
    assert "storage_path='runs' is relative, and this is a submitted Ray job" in relative.stdout
    failed = redray_cli("submit", "fails.py", "--address", head["dashboard"], cwd=job_dir)
    assert failed.returncode == 1 and "this job fails" in failed.stdout
    queued = redray_cli("submit", "fails.py", "--address", head["dashboard"], "--no-wait",
                        cwd=job_dir)
    assert queued.returncode == 0 and queued.stdout.strip().startswith("raysubmit_")


def one_line_error(done, *words):
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("redray submit: error:"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_redray_submit_errors_are_one_line_with_the_fix(head, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    home = tmp_path / "home"  # no ~/.ray/auth_token there
    home.mkdir()
    no_token = {k: v for k, v in token_env().items() if k != "RAY_AUTH_TOKEN"}
    one_line_error(redray_cli("submit", str(script), "--address", head["dashboard"],
                              env=dict(no_token, HOME=str(home))),
                   "requires a token", "RAY_AUTH_TOKEN")
    one_line_error(redray_cli("submit", str(script), "--address", head["dashboard"],
                              env=dict(token_env(), RAY_AUTH_TOKEN="0" * 32)),
                   "rejected the token", "~/.ray/auth_token")
    with closed_port() as port:
        one_line_error(redray_cli("submit", str(script), "--address",
                                  f"http://127.0.0.1:{port}"), "cannot reach", "8265")
    one_line_error(redray_cli("submit", str(tmp_path / "missing.py"), "--address",
                              head["dashboard"]), "no script")


def test_a_missing_module_names_python_and_jobs_are_followed_stopped_and_listed(head, tmp_path):
    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    (job_dir / "needs.py").write_text("import no_such_package_here\n")
    (job_dir / "slow.py").write_text("import time\nprint('started', flush=True)\n"
                                     "time.sleep(600)\n")
    missing = redray_cli("submit", "needs.py", "--address", head["dashboard"], cwd=job_dir)
    assert missing.returncode == 1
    assert "has no module 'no_such_package_here': give --python" in missing.stderr, \
        missing.stderr

    # Ctrl-C while following: the job keeps running, and the message says how to stop it.
    # The follower starts with SIGINT ignored, as a script's background job does (and as
    # this suite's process may pass on): following still stops at it.
    follow = subprocess.Popen(
        [sys.executable, "-m", "redray.cli", "submit", "slow.py", "--address", head["dashboard"],
         "--python", sys.executable], cwd=job_dir, env=token_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    while follow.stdout.readline().strip() != "started":  # Ray's set-up lines come first
        assert follow.poll() is None, follow.stderr.read()
    with open(f"/proc/{follow.pid}/status") as f:  # what the follower's process ignores
        ignored = next(line for line in f if line.startswith("SigIgn:"))
    follow.send_signal(signal.SIGINT)
    try:
        out, err = follow.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        follow.kill()
        out, err = follow.communicate()
        raise AssertionError(f"the follower went on after SIGINT ({ignored.strip()}): "
                             f"{err[-3000:]}") from None
    assert follow.returncode == 130 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("redray submit:")]  # (Ray: INFO lines)
    assert len(lines) == 1, err
    (line,) = lines
    job = line.split("stopped following job ")[1].split(";")[0]
    assert "it is still running" in line and f"redray stop {job}" in line
    status = redray_cli("status", job, "--address", head["dashboard"])
    assert status.returncode == 0 and status.stdout.startswith(f"{job} RUNNING"), status
    logs = redray_cli("logs", job, "--address", head["dashboard"])
    assert logs.returncode == 0 and "started" in logs.stdout
    stop = redray_cli("stop", job, "--address", head["dashboard"])
    assert stop.returncode == 0 and "stopping" in stop.stdout
    deadline = time.time() + 60
    while "STOPPED" not in redray_cli("status", job, "--address", head["dashboard"]).stdout:
        assert time.time() < deadline, "the job did not stop"
        time.sleep(1)
    unknown = redray_cli("status", "raysubmit_nope", "--address", head["dashboard"])
    assert unknown.returncode == 2 and "no job 'raysubmit_nope'" in unknown.stderr, unknown


GUIDE = os.path.join(os.path.dirname(HERE), "docs", "clusters.md")
WALKTHROUGH = "## From a laptop to a remote cluster"


def walkthrough() -> list[str]:
    """The commands of the clusters guide's walkthrough, in order."""
    with open(GUIDE) as f:
        text = f.read()
    start = text.index("```bash", text.index(WALKTHROUGH)) + len("```bash")
    block = text[start:text.index("```", start)]
    return [line.strip() for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_readme_walkthrough_runs_against_a_head_with_token_auth(head, tmp_path):
    lines = walkthrough()
    # the head: the fixture started it as the walkthrough's first line says (token auth,
    # its own ports and temp dir so that it is stopped by its processes)
    assert lines[0].startswith("ray start --head")
    home = tmp_path / "laptop-home"  # no token on the "laptop" until the walkthrough copies it
    (home / ".ray").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update(HOME=str(home), PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])
    shared = tmp_path / "shared"
    job, outputs = None, []
    for line in lines[1:]:
        command = (line.replace("scp HEAD:~/.ray/auth_token",  # no ssh here: the same file
                                f"cp {os.path.expanduser('~')}/.ray/auth_token")
                   .replace("http://HEAD:8265", head["dashboard"])
                   .replace("/opt/venv/bin/python", sys.executable)
                   .replace("/shared/runs", str(shared)))
        if " JOB " in command:
            command = command.replace(" JOB ", f" {job} ")
        done = subprocess.run(["bash", "-c", command], cwd=os.path.dirname(HERE), env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
        if "--no-wait" in command:
            job = done.stdout.strip().splitlines()[-1]
            assert job.startswith("raysubmit_")
    first, second, logs, status, runs = outputs[1:]
    assert "SUCCEEDED" in first and "checkpoint:" in first  # the job's summary
    # Ray runs a copy of the working dir without .git: the commit travelled with the job
    from mlflow.tracking import MlflowClient

    from redray.tracking import git_commit

    client = MlflowClient(f"sqlite:///{shared}/mlflow.db")
    tags = {r.data.tags.get("redray.git_commit")
            for r in client.search_runs([e.experiment_id for e in client.search_experiments()])}
    assert tags == {git_commit(os.path.dirname(HERE))}, tags
    # what the laptop shows: the job's messages and progress, none of Ray's set-up chatter
    noisy = [x for x in first.splitlines() if re.search(r"\bINFO\b|WARNING|Traceback|pid=", x)]
    assert not noisy and re.search(r"^step \d+/\d+ \(", first, re.M), first
    assert "resume" in logs and "SUCCEEDED" in status
    (row,) = [r.split() for r in runs.splitlines() if r.startswith("walkthrough")]
    assert row[2] == "8", runs  # the second job resumed the run to step 8
