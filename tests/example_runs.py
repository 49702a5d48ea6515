"""Running an example script the way a user does, for the example tests."""

import importlib.util
import json
import os
import subprocess
import sys

import redray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str) -> tuple[str, dict | None]:
    """Runs ``examples/<name>/train.py`` with ``args`` from the repository root.

    Returns its stdout and the last line that is a JSON object (the learning signal
    before and after), or None when it printed none (e.g. a run already complete).
    """
    done = subprocess.run([sys.executable, f"examples/{name}/train.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.stdout, json.loads(lines[-1]) if lines else None


def example_module(name: str):
    """``examples/<name>/train.py`` as a module: its functions, not its main."""
    spec = importlib.util.spec_from_file_location(
        f"{name}_example", os.path.join(ROOT, "examples", name, "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAINER = redray.Trainer  # as imported: the class run_loop's subclasses extend


class Killed(Exception):
    """What ``run_loop(kill_at=...)`` raises in place of a kill."""


class _Kill(redray.Hook):
    def __init__(self, step: int):
        self.step = step

    def on_step(self, run, info):
        if info.step == self.step:
            run.wait_for_checkpoints()  # what a kill leaves: the checkpoints written so far
            raise Killed(f"killed after step {info.step}")


def run_loop(module, loop: str, args: list[str], folder, monkeypatch, kill_at=None):
    """An example's loop (``module.<loop>``, what ``redray.run`` runs on a host) in this
    process, its Trainer checkpointing into ``<folder>/checkpoints`` on one fixed plan
    (data over 4 devices: the planner's pick follows timings, this machine's load, and
    another plan rounds differently). Returns what the loop returned, the first Trainer
    it made and the rows it logged. ``kill_at``: the loop dies (``Killed``) right after
    that optimizer step, as a killed process would, with whatever was done since the
    last checkpoint lost."""
    made, logged = [], []

    class Checkpointed(TRAINER):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        @classmethod
        def of(cls, *a, hooks=(), **flat):  # what the examples call
            hooks = [*hooks, *([_Kill(kill_at)] if kill_at else [])]
            return super().of(*a, checkpoint=redray.CheckpointConfig(
                os.path.join(folder, "checkpoints")), data_axis=4, hooks=hooks, **flat)

        def log(self, row):
            logged.append({k: float(v) for k, v in row.items()})
            return super().log(row)

    monkeypatch.setattr(module.redray, "Trainer", Checkpointed)
    out = getattr(module, loop)(module.parse(args))
    return out, made[0], logged
