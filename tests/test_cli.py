"""The `redray` command's local subcommands: run (argument passing) and clear errors."""

import json
import subprocess
import sys


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "redray.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_run_passes_the_script_its_arguments_and_the_address(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps([sys.argv[1:], os.environ.get('RAY_ADDRESS')]))\n"
                      "sys.exit(3)\n")
    done = cli("run", str(script), "--steps", "5", "--address", "ray://head:10001", "--",
               "--address", "mine")
    assert done.returncode == 3  # the script's own exit status
    assert json.loads(done.stdout) == [["--steps", "5", "--address", "mine"], "ray://head:10001"]
    # --profile reaches the script's Trainers as REDRAY_PROFILE
    script.write_text("import os\nprint(os.environ.get('REDRAY_PROFILE'))\n")
    done = cli("run", "--profile", "10:12", str(script))
    assert (done.returncode, done.stdout.strip()) == (0, "10:12")
    # --plan reaches them as REDRAY_PLAN (the plan's JSON: no host reads the file)
    from redray import Parallelism, Plan

    plan = Plan(Parallelism.of(model_axis=2).abstract(4))
    (tmp_path / "plan.json").write_text(plan.to_json())
    script.write_text("import os\nprint(os.environ.get('REDRAY_PLAN'))\n")
    done = cli("run", "--plan", "plan.json", str(script), cwd=tmp_path)
    assert done.returncode == 0 and Plan.from_json(done.stdout) == plan


def test_errors_are_one_line_with_the_fix(tmp_path):
    for args, words in [(["run", str(tmp_path / "nope.py")], "no script"),
                        (["submit", str(tmp_path)], "no script"),
                        (["runs", str(tmp_path / "none")], "no storage folder"),
                        (["export", "nope", "--storage", str(tmp_path), "--to", "x"], "no run"),
                        (["plot", "nope", "--storage", str(tmp_path)], "no MLflow store"),
                        (["run", "--profile", "12:10", str(tmp_path / "x.py")],
                         "--profile '12:10': give the optimizer steps to trace"),
                        (["run", "--plan", str(tmp_path / "plan.jsn"), str(tmp_path / "x.py")],
                         "neither 'auto', JSON, nor a file")]:
        if args[0] == "export":  # a run folder with a config, and a tokenizer that is not
            (tmp_path / "run" / "checkpoints").mkdir(parents=True, exist_ok=True)
            (tmp_path / "run" / "config.json").write_text("{}")
            done = cli("export", str(tmp_path / "run"), "--to", "x", "--tokenizer",
                       str(tmp_path / "tok"))
            assert done.returncode == 2 and "no tokenizer folder" in done.stderr, done.stderr
        done = cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (args, done.stderr)


def test_every_subcommand_has_help_with_examples():
    for command in ("run", "submit", "plan", "plot", "export", "runs", "logs", "status", "stop"):
        done = cli(command, "--help")
        assert done.returncode == 0 and "usage: redray " + command in done.stdout
        assert "examples:" in done.stdout


def test_a_server_that_is_not_a_ray_head_is_not_blamed_on_the_token(tmp_path):
    # A 403 from something else at the address (a web server, a proxy between) is a wrong
    # address, not a rejected token; a Ray head's own refusals are tests/test_cluster_submit.py's
    import http.server
    import threading

    class Refuses(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(403)
            self.end_headers()
            self.wfile.write(b"Forbidden by policy")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "job.py").write_text("print('hi')\n")
        done = cli("submit", str(tmp_path / "job.py"), "--address",
                   f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cannot reach the Ray job server" in lines[0] and "Forbidden by policy" in lines[0] \
        and "8265" in lines[0] and "token" not in lines[0], lines[0]
