"""The post-training examples end to end: how far each raises its held-out measure, and in
what time.

Runs each example as a user does (its defaults) in a fresh storage folder and reads its
held-out measure after the supervised warm-up and at the end:

- ``examples/grpo/train.py`` (1 host x 2 CPU devices, 60 warm-up epochs, then 20 GRPO
  iterations of 64 prompts x 8 completions): the held-out accuracy, greedy answers to
  256 prompts never trained on;
- ``examples/dpo/train.py`` (1 host x 2 CPU devices, 3 supervised epochs, then 3 DPO
  epochs over 8192 preference pairs): the held-out preference accuracy, the share of
  1024 prompts never trained on where the model gives the right sum a higher
  log-probability than a near miss.

Figures:
- ``grpo/heldout_accuracy_gain``, ``dpo/heldout_preference_accuracy_gain``: the measure
  at the end minus the measure after the warm-up. Targets: >= 0.10 (GRPO), > 0 (DPO: the
  issue asks that it rise).
- ``grpo/minutes_on_cpu``, ``dpo/minutes_on_cpu``: the whole run's wall time, Ray's
  start included. Target: under 10 minutes.

    python benchmarks/post_training_examples.py [--only grpo|dpo] [--tiny]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from common import ROOT, figure, parser, save

COMMAND = "python benchmarks/post_training_examples.py"

# example -> (its tiny sizes, the JSON keys of its measure before and after, the gain's
# figure name and unit, the reference, the target)
EXAMPLES = {
    "grpo": (["--warmup", "2", "--iterations", "1", "--prompts", "4", "--group", "4"],
             ("accuracy_before", "accuracy_after"), "grpo/heldout_accuracy_gain", "accuracy",
             "the held-out accuracy after the supervised warm-up, before GRPO", ">= 0.10"),
    "dpo": (["--warmup", "1", "--epochs", "1", "--pairs", "256"],
            ("preference_accuracy_before", "preference_accuracy_after"),
            "dpo/heldout_preference_accuracy_gain", "preference accuracy",
            "the held-out preference accuracy after the supervised warm-up, before DPO",
            "> 0"),
}


def run(name: str, tiny: bool) -> list[dict]:
    sizes, (before, after), gain_name, unit, reference, target = EXAMPLES[name]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, f"examples/{name}/train.py",
                               *(sizes if tiny else []), "--storage", folder], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"examples/{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    out = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    command = f"{COMMAND} --only {name}"
    return [figure(gain_name, out[after] - out[before], unit, reference, target, command, **out),
            figure(f"{name}/minutes_on_cpu", seconds / 60, "min",
                   "the issue's bound for the example on CPU", "< 10", command,
                   cpus=os.cpu_count())]


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", choices=sorted(EXAMPLES), help="one example (default: each)")
    args = ap.parse_args(argv)
    names = [args.only] if args.only else list(EXAMPLES)
    save([f for name in names for f in run(name, args.tiny)], args.out)


if __name__ == "__main__":
    main()
