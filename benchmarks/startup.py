"""Start-up: what a tiny run costs from the call to its return, against the floor any
Ray-based framework pays on the same machine.

The run (the issue's notebook cell): ``redray.fit`` of the tests' TinyLM on 96
sequences at batch 8, 2 hosts x 2 simulated CPU devices, 12 steps, a new storage
folder and a new local Ray (each round is a fresh Python process); then the same call
again from that driver, resuming to step 24 (its storage folder kept: the probe, the
compiled programs and the plan warm; its hosts kept from the first call).

The floor: Ray Train's own ``JaxTrainer`` with its default settings, a train loop that
imports JAX and reports once, on 2 workers of a fresh local Ray, timed from before
``import ray`` to ``fit``'s return (a fresh process too). redray's call is timed from
the call (``import redray`` costs nothing: its parts load when used; the script's own
imports, optax and the model's Flax, come first as in any script).

Figures (rounds alternate floor / redray; medians, spread in ``detail``):
- ``startup/over_ray_train_floor``: the cold call over the floor. Target <= 1.2.
- ``startup/second_over_first``: the second call over the cold one. Target <= 0.4.
- ``startup/tiny_fit_s``, ``startup/second_fit_s``, ``startup/ray_train_floor_s``:
  the seconds, beside the machine. ``detail.phases`` holds each call's start-up table
  (``RunResult.startup``: where its time went).

    python benchmarks/startup.py [--rounds 5] [--tiny]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, figure, machine, parser, save, stats  # noqa: E402

COMMAND = "python benchmarks/startup.py"

FLOOR = """
import json, sys, tempfile, time
start = time.perf_counter()
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer


def loop(config):
    import jax
    import ray.train

    ray.train.report({"devices": len(jax.devices())})


ray.init(address="local")
JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
           run_config=RunConfig(name="floor", storage_path=tempfile.mkdtemp())).fit()
print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
"""

REDRAY = """
import json, sys, tempfile, time
sys.path.insert(0, {tests!r})
import optax
from tiny import TinyLM, lm_collate, lm_loss, token_data
import redray

storage = tempfile.mkdtemp()
data = token_data(96)
out = {{}}
for key, steps in (("first", 12), ("second", 24)):
    start = time.perf_counter()
    result = redray.fit(TinyLM, lm_collate, lm_loss, optax.adam(1e-3), train_data=data,
                        batch_size=8, epochs=2, max_steps=steps, hosts=2, devices_per_host=2,
                        name="tiny", storage_path=storage, progress=False)
    out[key] = {{"seconds": time.perf_counter() - start, "phases": result.startup,
                 "resumed_from_step": result.resumed_from_step,
                 "steps": sorted(r["step"] for r in result.history if "loss" in r)}}
print(json.dumps(out), flush=True)
"""


def timed(source: str) -> dict:
    """Runs ``source`` in a fresh Python process (in a new folder), returns its last
    line's JSON."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "XLA_FLAGS", "REDRAY_VERBOSE")}
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          cwd=tempfile.mkdtemp(), env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    rounds = 1 if args.tiny else args.rounds
    program = REDRAY.format(tests=os.path.join(ROOT, "tests"))
    floors, runs = [], []
    for i in range(rounds):
        pair = [("floor", FLOOR), ("redray", program)]
        for kind, source in pair if i % 2 == 0 else reversed(pair):
            (floors if kind == "floor" else runs).append(timed(source))
    for run in runs:  # the second call trained the 12 steps past the first's checkpoint
        assert run["first"]["steps"][-1] == 12, run["first"]["steps"]
        assert run["second"]["resumed_from_step"] == 12, run["second"]
        assert run["second"]["steps"][0] > 12 and run["second"]["steps"][-1] == 24, run["second"]
    floor = [f["seconds"] for f in floors]
    first = [r["first"]["seconds"] for r in runs]
    second = [r["second"]["seconds"] for r in runs]
    over_floor = [a / b for a, b in zip(first, floor)]
    over_first = [b / a for a, b in zip(first, second)]
    phases = {key: [r[key]["phases"] for r in runs] for key in ("first", "second")}
    detail = dict(rounds=rounds, machine=machine(), floor_s=stats(floor), first_s=stats(first),
                  second_s=stats(second), over_floor=stats(over_floor),
                  over_first=stats(over_first), phases=phases)
    save([
        figure("startup/over_ray_train_floor", statistics.median(over_floor), "x",
               "Ray Train's JaxTrainer (default settings) running a loop that imports JAX "
               "and reports once, 2 workers, fresh local Ray", "<= 1.2", COMMAND, **detail),
        figure("startup/second_over_first", statistics.median(over_first), "x",
               "the cold call (new Ray, new storage folder)", "<= 0.4", COMMAND),
        figure("startup/tiny_fit_s", statistics.median(first), "s",
               "seconds of the cold call: 2 hosts x 2 CPU devices, 12 steps", None, COMMAND),
        figure("startup/second_fit_s", statistics.median(second), "s",
               "seconds of the second call from the same driver: 12 more steps", None,
               COMMAND),
        figure("startup/ray_train_floor_s", statistics.median(floor), "s",
               "seconds of the floor", None, COMMAND),
    ], args.out)


if __name__ == "__main__":
    main()
