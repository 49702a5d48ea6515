"""Input pipeline: step time fed from Ray Data over step time fed from memory.

Same model (a small transformer LM), same mesh (4 simulated CPU devices, data=2 x
model=2), same examples, same steps, one process, one run: the two feeds alternate
(A B A B ...) so machine noise hits both alike, and the ratio of median step times is
reported. Target <= 1.05 (issue: Cluster).

    python benchmarks/input_pipeline.py [--steps 60] [--rounds 3]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(4)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402
import optax  # noqa: E402
import ray  # noqa: E402

import redray  # noqa: E402
from redray.data import RowSource, to_dataset  # noqa: E402
from tiny import TinyLM, lm_collate, lm_loss, token_data  # noqa: E402


class StepTimer:
    """Wraps a trainer's step to time each optimizer update (device work included)."""

    def __init__(self, trainer):
        self.times, self._step = [], trainer._step

        def timed(placed):
            start = time.perf_counter()
            metrics = self._step(placed)
            metrics["loss"].block_until_ready()
            self.times.append(time.perf_counter() - start)
            return metrics

        trainer._step = timed


def run(feed, steps, seed):
    trainer = redray.Trainer.of(lambda rngs: TinyLM(rngs, vocab=256, dim=128), lm_collate, lm_loss,
                             optax.adam(1e-3), batch_size=32, model_axis=2, progress=False,
                             log_every=steps, seed=seed)
    trainer.fit(feed, epochs=1, max_steps=3)  # compile outside the measurement
    timer = StepTimer(trainer)
    start = time.perf_counter()
    trainer.fit(feed, epochs=1, max_steps=3 + steps)
    return np.median(timer.times), (time.perf_counter() - start) / steps


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.rounds = 2, 1
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    data = token_data(32 * (args.steps + 4), seq=64, vocab=256)
    rows = RowSource(to_dataset(data))
    per_step = {"memory": [], "ray_data": []}
    wall = {"memory": [], "ray_data": []}
    for r in range(args.rounds):
        for name, feed in (("memory", data), ("ray_data", rows)):
            step, total = run(feed, args.steps, seed=r)
            per_step[name].append(step)
            wall[name].append(total)
    ratio = float(np.median(wall["ray_data"]) / np.median(wall["memory"]))
    save([figure("input_pipeline", ratio, "x",
                 "Trainer.fit fed from an in-memory list, same model/mesh/steps", "<= 1.05",
                 "python benchmarks/input_pipeline.py",
                 wall_per_step_s={k: float(np.median(v)) for k, v in wall.items()},
                 device_step_s={k: float(np.median(v)) for k, v in per_step.items()},
                 rounds=args.rounds, steps=args.steps)], args.out)


if __name__ == "__main__":
    main()
