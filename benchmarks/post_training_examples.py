"""The post-training examples end to end: how far each raises its held-out measure, and in
what time.

Runs each example as a user does (its defaults) in a fresh storage folder and reads its
held-out measure after the supervised warm-up and at the end:

- ``examples/grpo/train.py`` (1 host x 2 CPU devices, 60 warm-up epochs, then 20 GRPO
  iterations of 64 prompts x 8 completions): the held-out accuracy, greedy answers to
  256 prompts never trained on;
- ``examples/dpo/train.py`` (1 host x 2 CPU devices, 3 supervised epochs, then 12 DPO
  epochs over 8192 preference pairs): the held-out preference accuracy, the share of
  1024 prompts never trained on where the model gives the right sum a higher
  log-probability than a near miss.

Then each again with its post-training epochs (GRPO's iterations, DPO's epochs) spent on
more of the warm-up instead (supervised on the right answers, at the warm-up's rate):
what a user would get without GRPO or DPO for as many epochs.

Figures:
- ``grpo/heldout_accuracy_gain``, ``dpo/heldout_preference_accuracy_gain``: the measure
  at the end minus the measure after the warm-up. Targets: >= 0.10 (GRPO), > 0 (DPO: the
  issue asks that it rise).
- ``grpo/minutes_on_cpu``, ``dpo/minutes_on_cpu``: the whole run's wall time, Ray's
  start included. Target: under 10 minutes.
- ``grpo/heldout_accuracy_minus_more_sft``,
  ``dpo/heldout_preference_accuracy_minus_more_sft``: the held-out measure at the end
  minus that of the supervised run of as many epochs (no target: a finding).

    python benchmarks/post_training_examples.py [--only grpo|dpo] [--tiny]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from common import ROOT, figure, parser, save

COMMAND = "python benchmarks/post_training_examples.py"

# example -> (its tiny sizes, the JSON keys of its measure before and after, the gain's
# figure name and unit, the reference, the target, the flag of its post-training epochs)
EXAMPLES = {
    "grpo": (["--warmup", "2", "--iterations", "1", "--prompts", "4", "--group", "4"],
             ("accuracy_before", "accuracy_after"), "grpo/heldout_accuracy_gain", "accuracy",
             "the held-out accuracy after the supervised warm-up, before GRPO", ">= 0.10",
             "iterations"),
    "dpo": (["--warmup", "1", "--epochs", "1", "--pairs", "256"],
            ("preference_accuracy_before", "preference_accuracy_after"),
            "dpo/heldout_preference_accuracy_gain", "preference accuracy",
            "the held-out preference accuracy after the supervised warm-up, before DPO",
            "> 0", "epochs"),
}


def example(name: str, args: list[str]) -> tuple[dict, float]:
    """Runs ``examples/<name>/train.py args`` in a fresh storage folder: (the JSON line it
    prints last, its wall time in seconds)."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, f"examples/{name}/train.py", *args,
                               "--storage", folder], cwd=ROOT, capture_output=True, text=True,
                              timeout=1800)
        seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"examples/{name} {' '.join(args)} failed:\n"
                           f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1]), \
        seconds


def more_sft(name: str, sizes: list[str]) -> list[str]:
    """An example's arguments with its post-training epochs (DPO's epochs, GRPO's
    iterations) spent on more supervised warm-up instead, at the warm-up's rate."""
    spec = importlib.util.spec_from_file_location(
        f"{name}_example", os.path.join(ROOT, "examples", name, "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args, flag = module.parse(sizes), EXAMPLES[name][-1]
    return [*sizes, "--warmup", str(args.warmup + getattr(args, flag)), f"--{flag}", "0"]


def run(name: str, tiny: bool) -> list[dict]:
    sizes, (before, after), gain_name, unit, reference, target, _ = EXAMPLES[name]
    sizes = sizes if tiny else []
    out, seconds = example(name, sizes)
    command = f"{COMMAND} --only {name}"
    figures = [figure(gain_name, out[after] - out[before], unit, reference, target, command,
                      **out),
               figure(f"{name}/minutes_on_cpu", seconds / 60, "min",
                      "the issue's bound for the example on CPU", "< 10", command,
                      cpus=os.cpu_count())]
    control, _ = example(name, more_sft(name, sizes))
    figures.append(figure(
        f"{gain_name.rsplit('_gain', 1)[0]}_minus_more_sft", out[after] - control[after],
        unit, f"the {unit} of the same run with its {name.upper()} epochs spent on more "
        "supervised warm-up (the right answers)", None, command,
        **{name: out[after], "more_sft": control[after], "step": control["step"]}))
    return figures


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", choices=sorted(EXAMPLES), help="one example (default: each)")
    args = ap.parse_args(argv)
    names = [args.only] if args.only else list(EXAMPLES)
    save([f for name in names for f in run(name, args.tiny)], args.out)


if __name__ == "__main__":
    main()
