"""Against redco 0.4.23: epoch time after compilation, and time to compile.

Both sides train literally the same Linen module (benchmarks/_redco_models.py) on the
same examples with the same global batch, optimizer (adam 1e-3) and mesh (4
simulated CPU devices; model axis 1 or 2, the rest data parallel): redray through
``redray.LinenModel`` and ``Trainer.fit``, redco through its own ``Deployer`` and
``Trainer.fit`` with the sharding rules its ``get_sharding_rules`` gives (as its
tutorials do), in its own venv (.venv-redco, same jax/flax/optax) run by
benchmarks/_redco_driver.py. Each side runs in a fresh process per round, the sides
alternating (redray, redco, then redco, redray, ...), so compilation is never cached
and machine noise hits both alike.

Configurations: ``mlp`` (MEASURED.md's MLP fc_in 256->512 -> fc_mid 512->512 ->
fc_out 512->16, 8192 examples, 64 per device, i.e. global batch 256 on 4 data-parallel
devices) and ``mlp_model2`` (model axis 2: global batch 128, as redco's
per-device batch counts data-parallel devices only); ``lm`` and ``lm_model2`` (a
2-layer pre-norm decoder, dim 128, vocab 256, 64 tokens, 8 per device).

Figures, each redray over redco (lower is better for redray):
``redco/<config>/epoch``: median seconds per epoch after compilation (target <= 0.9);
``redco/<config>/compile``: the first epoch's extra time, from the first line of
set-up (model built or initialized) to the end of the first epoch, minus a steady
epoch: initialization, sharding, compilation (target <= 1.0).

    python benchmarks/redco.py [--configs mlp lm ...] [--rounds 3] [--epochs 3]
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import figure, parser, save, simulate_devices, stats  # noqa: E402

DEVICES = 4
COMMAND = "python benchmarks/redco.py"
BASE = {"seed": 0, "learning_rate": 1e-3}
LM = {"task": "lm", "vocab": 256, "dim": 128, "layers": 2, "seq": 65, "per_device_batch": 8}
CONFIGS = {
    "mlp": {"task": "mlp", "model_axis": 1, "examples": 8192, "per_device_batch": 64},
    "mlp_model2": {"task": "mlp", "model_axis": 2, "examples": 8192, "per_device_batch": 64},
    "lm": {**LM, "model_axis": 1, "examples": 512},
    "lm_model2": {**LM, "model_axis": 2, "examples": 512},
}
TINY_MLP = {"examples": 512}
TINY_LM = {"examples": 128, "dim": 32, "seq": 17, "layers": 1}


def redray_side(config: dict) -> dict:
    """Trains ``config`` with redray in this process; the same JSON as the driver's."""
    simulate_devices(DEVICES)
    import jax
    import optax

    import redray
    from _redco_models import collate, loss_of, task

    module, examples, example_input = task(config)
    start = time.perf_counter()
    dp = DEVICES // config["model_axis"]
    trainer = redray.Trainer.of(redray.LinenModel(module, example_input), collate,
                             lambda model, batch, rng, train: loss_of(model, batch),
                             optax.adam(config["learning_rate"]),
                             batch_size=config["per_device_batch"] * dp,
                             model_axis=config["model_axis"], seed=config["seed"], progress=False)

    def epoch(n):
        trainer.fit(examples, epochs=n)
        jax.block_until_ready(trainer.state)

    epoch(1)
    first = time.perf_counter() - start
    times, cpu = [], []
    for n in range(2, config["epochs"] + 2):
        t, c = time.perf_counter(), time.process_time()
        epoch(n)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    last = jax.jit(lambda p: loss_of(lambda x: module.apply({"params": p}, x),
                                     collate(examples[:256])))(jax.device_get(trainer.state.params))
    return {"first_epoch_s": first, "epoch_s": times, "epoch_cpu_s": cpu, "loss": float(last),
            "steps_per_epoch": len(examples) // trainer.batch_size}


def run_side(side: str, configs: list[dict], redco_python: str) -> list[dict]:
    """Runs ``configs`` in one fresh process of ``side`` and returns its results."""
    if side == "redray":
        command = [sys.executable, os.path.abspath(__file__), "--side-redray", json.dumps(configs)]
    else:
        command = [redco_python, os.path.join(HERE, "_redco_driver.py"), json.dumps(configs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode:
        raise RuntimeError(f"the {side} side failed on {configs}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(name: str, results: dict, config: dict) -> list[dict]:
    """The epoch and compile figures of one configuration from both sides' rounds."""
    epoch, compile_ = {}, {}
    for side, rounds in results.items():
        epoch[side] = [statistics.median(r["epoch_s"]) for r in rounds]
        compile_[side] = [r["first_epoch_s"] - statistics.median(r["epoch_s"]) for r in rounds]
    # CPU seconds of each side's process per epoch (XLA's threads included): other
    # processes' load barely moves them, a cross-check of the wall clock on a busy machine.
    cpu = {side: statistics.median(c for r in rounds for c in r["epoch_cpu_s"])
           for side, rounds in results.items()}
    detail = {"config": config, "steps_per_epoch": results["redray"][0]["steps_per_epoch"],
              "epoch_cpu_s": cpu, "epoch_cpu_ratio": cpu["redray"] / cpu["redco"],
              "final_loss": {side: [r["loss"] for r in rounds] for side, rounds in results.items()},
              "load_average": os.getloadavg()[0]}
    out = []
    for kind, values, target, unit in (("epoch", epoch, "<= 0.9", "s per epoch"),
                                       ("compile", compile_, "<= 1.0", "s")):
        medians = {side: statistics.median(v) for side, v in values.items()}
        out.append(figure(
            f"redco/{name}/{kind}", medians["redray"] / medians["redco"], "x",
            f"redco 0.4.23, same Linen model, examples, global batch, optimizer and mesh "
            f"(model axis {config['model_axis']})", target, COMMAND,
            **{f"{kind}_{unit.split()[0]}": {side: stats(v) for side, v in values.items()}},
            round_ratios=stats([a / b for a, b in zip(values["redray"], values["redco"])]),
            **detail))
    return out


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--configs", nargs="*", choices=list(CONFIGS),
                    help="default: all (with --tiny: mlp and lm_model2, redco's two code "
                         "paths, pmap and pjit with its sharding rules)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs after the first")
    ap.add_argument("--side-redray", help=__import__("argparse").SUPPRESS)
    args = ap.parse_args(argv)
    if args.side_redray:
        print(json.dumps([redray_side(c) for c in json.loads(args.side_redray)]))
        return
    from _redco_venv import python

    redco_python = python()
    simulate_devices(DEVICES)  # the sides' processes inherit it
    names = args.configs or (["mlp", "lm_model2"] if args.tiny else list(CONFIGS))
    configs = {name: {**BASE, **CONFIGS[name], "epochs": args.epochs} for name in names}
    if args.tiny:
        # One process per side for every configuration: checks the script, measures nothing.
        configs = {name: {**c, **(TINY_LM if c["task"] == "lm" else TINY_MLP), "epochs": 1}
                   for name, c in configs.items()}
        groups, rounds = [list(configs)], 1
    else:
        groups, rounds = [[name] for name in configs], args.rounds
    results = {name: {"redray": [], "redco": []} for name in configs}
    for r in range(rounds):
        for group in groups:
            for side in ("redray", "redco") if r % 2 == 0 else ("redco", "redray"):
                found = run_side(side, [configs[name] for name in group], redco_python)
                for name, result in zip(group, found, strict=True):
                    results[name][side].append(result)
    save([f for name in configs for f in figures(name, results[name], configs[name])], args.out)


if __name__ == "__main__":
    main()
