"""Compilation: how the step's program grows with depth, and what a restart costs with
the run's persistent compilation cache.

``compile/hlo_lines_32_over_2`` and ``compile/time_32_over_2``: the Trainer's training
step (LLaMA, hidden 256, 4 heads, intermediate 1024, vocabulary 1024, batch 8 x 128,
Adam, model axis 2 on 4 CPU devices, every block rematerialized) with its layers
scanned (``build(config, scan=True)``: one stacked block), at 32 layers over 2: the
lines of its compiled program (``compiled.as_text()``, XLA's HLO after its passes) and
the seconds to lower and compile it (``Trainer.compiled_step``; a fresh Trainer per
setting and round, alternating, the median; each round's ratio in ``detail``).
Targets <= 1.3 and <= 2.0. The same with the layers as a list (one copy of the block
per layer) is in ``detail``.

``compile/hlo_lines_48_over_4/llama4``: the same count for a Llama-4-shaped model
(``_lm.config("llama4", ...)``: a dense and a MoE layer in turn, 4 experts top-1 beside
a shared expert, chunks of 32 tokens in its rotary layers, every fourth layer NoPE;
hidden 256, 4 heads, intermediate 1024, the same batch, optimizer, mesh and remat), its
layers stacked as one period of a dense and a MoE layer (``layers.Period``) and scanned,
at 48 layers over 4: 24 periods over 2, whose per-layer chunks and rotary tables are
the scan's inputs. The compile seconds of each round (a fresh Trainer per depth,
alternating) and the compiled program's loops' trip counts are in ``detail``.
Target <= 1.3.

``compile/scanned_step_over_listed_32``: the time of that 32-layer step itself (3 steps
after an untimed one, per round and setting, in the same alternating rounds), scanned
over listed: what making scanned layers every family's default costs or saves a step.

``compile/restart_with_cache_over_cold``: a fresh process builds a ``redray.Trainer``
(LLaMA, 4 layers, hidden 256, vocabulary 1024, batch 8 x 128, Adam, 4 CPU devices,
model axis 2) and runs one step; the time from the Trainer's creation to the end of its
first step (init, sharded parameters, the step's compilation, the step) with the cache
folder already holding the run's programs (what ``redray.fit`` keeps in
``<storage>/<name>/compile_cache``, ``redray/engine/compile_cache.py``) over the same
with an empty one. Fresh processes, alternating, the median of each. Target <= 0.5.

    python benchmarks/compilation.py [--rounds 3] [--only restart depth llama4]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import Sizes, collate, config, loss  # noqa: E402
from common import HERE, figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(4)
# compile times are what this script measures: a persistent cache the shell may have set
# (the test suite sets one for its own session) would turn them into loads
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import numpy as np  # noqa: E402

COMMAND = "python benchmarks/compilation.py"
SIZES = Sizes(layers=4, hidden=256, heads=4, intermediate=1024, vocab=1024, batch=8, seq=128)
STEPS = 3  # timed steps of the deep step per round
TINY = Sizes(layers=1, hidden=64, heads=4, intermediate=128, vocab=128, batch=4, seq=16)


def first_step(folder: str, tiny: bool) -> None:
    """Child process: the cache in ``folder``, a Trainer, one step; prints the seconds."""
    import optax

    import redray
    from redray.engine import compile_cache
    from redray.models import build

    compile_cache.enable(folder)
    s = TINY if tiny else SIZES
    c = config("llama", s)
    rows = np.random.default_rng(0).integers(1, s.vocab, (s.batch, s.seq + 1), np.int32)
    start = time.perf_counter()
    trainer = redray.Trainer.of(lambda rngs: build(c, rngs=rngs), collate, loss, optax.adam(1e-3),
                             batch_size=s.batch, model_axis=2, progress=False)
    trainer.fit([{"ids": r} for r in rows], epochs=1, max_steps=1)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def depth_figures(tiny: bool, rounds: int) -> list[dict]:
    """(lines, seconds) of the training step at 2 and 32 layers, scanned and listed;
    ``rounds`` fresh Trainers per setting, alternating, the median seconds; and the
    deep step's own time, scanned over listed."""
    import jax
    import optax

    import redray
    from redray.models import build

    base = TINY if tiny else SIZES
    deep = 4 if tiny else 32
    rows = np.random.default_rng(0).integers(1, base.vocab, (base.batch, base.seq + 1), np.int32)
    data = [{"ids": r} for r in rows]
    lines, seconds, steps = {}, {}, {}
    for _ in range(rounds):
        for scan in (True, False):
            for layers in (2, deep):
                c = config("llama", Sizes(**{**base.__dict__, "layers": layers}))
                trainer = redray.Trainer.of(
                    lambda rngs, c=c: build(c, rngs=rngs, scan=scan, remat="full"), collate,
                    loss, optax.adam(1e-3), batch_size=base.batch, model_axis=2, progress=False)
                trainer.init(data)
                start = time.perf_counter()
                compiled = trainer.compiled_step()  # a new lowering: compiled again
                seconds.setdefault((scan, layers), []).append(time.perf_counter() - start)
                lines[(scan, layers)] = len(compiled.as_text().splitlines())
                if layers == deep:  # the step itself, after one untimed step
                    batch = collate(data)
                    jax.block_until_ready(trainer.train_step(batch))
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        metrics = trainer.train_step(batch)
                    jax.block_until_ready(metrics)
                    steps.setdefault(scan, []).append((time.perf_counter() - start) / STEPS)

    def summary(scan):
        return {n: {"lines": lines[(scan, n)], "seconds": float(np.median(seconds[(scan, n)])),
                    "all_seconds": seconds[(scan, n)]} for n in (2, deep)}

    scanned, listed = summary(True), summary(False)
    ratios = [a / b for a, b in zip(seconds[(True, deep)], seconds[(True, 2)])]
    detail = dict(scanned=scanned, listed=listed, layers=[2, deep], rounds=rounds)
    return [figure(f"compile/hlo_lines_{deep}_over_2", scanned[deep]["lines"] / scanned[2]["lines"],
                   "x", "the same scanned step at 2 layers", "<= 1.3", COMMAND, **detail),
            figure(f"compile/time_{deep}_over_2",
                   scanned[deep]["seconds"] / scanned[2]["seconds"], "x",
                   "the same scanned step at 2 layers (medians)", "<= 2.0", COMMAND,
                   round_ratios=ratios, **detail),
            figure(f"compile/scanned_step_over_listed_{deep}", float(
                       np.median(steps[True]) / np.median(steps[False])), "x",
                   f"the same step with its {deep} layers as a list (the default before "
                   "layers were scanned by default), medians", None, COMMAND,
                   step_seconds={"scanned": steps[True], "listed": steps[False]},
                   round_ratios=[a / b for a, b in zip(steps[True], steps[False])],
                   steps_per_round=STEPS, rounds=rounds)]


def llama4_depth_figure(tiny: bool, rounds: int) -> dict:
    """``compile/hlo_lines_48_over_4/llama4``: the scanned Llama 4 step's lines at 48
    layers over 4 (``tiny``: 8 over 4); ``rounds`` fresh Trainers per depth, alternating,
    their compile seconds beside."""
    import re

    import optax

    import redray
    from redray.models import build

    base = TINY if tiny else SIZES
    shallow, deep = 4, 8 if tiny else 48
    rows = np.random.default_rng(0).integers(1, base.vocab, (base.batch, base.seq + 1), np.int32)
    data = [{"ids": r} for r in rows]
    lines, seconds, trips = {}, {}, {}
    for _ in range(rounds):
        for layers in (shallow, deep):
            c = config("llama4", Sizes(**{**base.__dict__, "layers": layers}))
            trainer = redray.Trainer.of(
                lambda rngs, c=c: build(c, rngs=rngs, scan=True, remat="full"), collate,
                loss, optax.adam(1e-3), batch_size=base.batch, model_axis=2, progress=False)
            trainer.init(data)
            start = time.perf_counter()
            text = trainer.compiled_step().as_text()
            seconds.setdefault(layers, []).append(time.perf_counter() - start)
            lines[layers] = len(text.splitlines())
            trips[layers] = sorted(int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"',
                                                              text))
    return figure(f"compile/hlo_lines_{deep}_over_{shallow}/llama4", lines[deep] / lines[shallow],
                  "x", f"the same scanned Llama 4 step at {shallow} layers", "<= 1.3", COMMAND,
                  lines=lines, seconds=seconds, loop_trip_counts=trips,
                  seconds_ratio=float(np.median(seconds[deep]) / np.median(seconds[shallow])),
                  layers=[shallow, deep], rounds=rounds)


GROUPS = ("restart", "depth", "llama4")  # the figures, by group (``--only``)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", choices=GROUPS,
                    help="these groups of figures: restart (restart_with_cache_over_cold), "
                         "depth (LLaMA's *_32_over_2), llama4 (hlo_lines_48_over_4/llama4); "
                         "default: all")
    ap.add_argument("--first-step", help=__import__("argparse").SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_step:
        return first_step(args.first_step, args.tiny)
    rounds = 1 if args.tiny else args.rounds
    groups = args.only or GROUPS
    figures = []
    if "restart" in groups:
        figures.append(restart_figure(args.tiny, rounds))
    if "depth" in groups:
        figures += depth_figures(args.tiny, rounds)
    if "llama4" in groups:
        figures.append(llama4_depth_figure(args.tiny, rounds))
    save(figures, args.out)


def restart_figure(tiny: bool, rounds: int) -> dict:
    """``compile/restart_with_cache_over_cold``: fresh processes' first steps with the
    run's cache filled over empty, alternating, the medians."""
    times = {"cold": [], "cached": []}
    with tempfile.TemporaryDirectory(prefix="redray-compile-") as work:
        warm = os.path.join(work, "warm")
        run = [sys.executable, os.path.join(HERE, "compilation.py")] + (["--tiny"] if tiny
                                                                     else [])
        subprocess.run(run + ["--first-step", warm], check=True, capture_output=True)  # fills
        for r in range(rounds):
            for name in ("cold", "cached"):
                folder = warm if name == "cached" else os.path.join(work, f"cold-{r}")
                done = subprocess.run(run + ["--first-step", folder], capture_output=True,
                                      text=True)
                if done.returncode:
                    raise RuntimeError(done.stderr[-4000:])
                times[name].append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    ratio = float(np.median(times["cached"]) / np.median(times["cold"]))
    return figure("compile/restart_with_cache_over_cold", ratio, "x",
                  "the same fresh process with an empty compilation cache", "<= 0.5", COMMAND,
                  seconds=times, rounds=rounds)


if __name__ == "__main__":
    main()
