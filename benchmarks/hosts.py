"""Hosts: 2 simulated hosts x 2 devices over 1 host x 4 devices, examples per second.

The same ``redray.fit`` run twice on one machine: a small LLaMA (``redray.models``,
fp32, 2 layers, hidden 128, 4 heads, intermediate 344, vocabulary 256), the same token
data, global batch 32 x sequence 64, AdamW, the same mesh (data 2 x model 2), the same
steps, once as 2 Ray worker processes x 2 CPU devices joined into one
``jax.distributed`` runtime over gloo, once as 1 process x 4 devices. Throughput is
the ``examples_per_s`` ``fit`` logs per window of ``--window`` steps, the first window
(compilation) excluded; the layouts alternate (A B A B ...) so machine noise hits both
alike. Figure ``hosts`` = median examples/s on 2 hosts / median on 1 host, no target:
the two processes share the same 2 cores, and their gloo collectives travel over
loopback TCP, so this measures the cost of the multi-process runtime (serialization of
the collectives, two XLA runtimes competing for the cores), not a network.

    python benchmarks/hosts.py [--steps 120] [--window 10] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lm import Sizes, collate, config, loss  # noqa: E402
from common import ROOT, figure, parser, save, stats  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))

import optax  # noqa: E402
import ray  # noqa: E402

import redray  # noqa: E402
from redray.models import build  # noqa: E402
from tiny import token_data  # noqa: E402

COMMAND = "python benchmarks/hosts.py"
# layout -> (hosts, devices per host)
LAYOUTS = {"2_hosts_x_2": (2, 2), "1_host_x_4": (1, 4)}
MODEL_AXIS = 2
SEQ = 64


# the small LLaMA, and the tiny one that checks the script
FULL = Sizes(layers=2, hidden=128, heads=4, intermediate=344, vocab=256, batch=32, seq=SEQ)
TINY = Sizes(layers=1, hidden=32, heads=4, intermediate=64, vocab=256, batch=8, seq=SEQ)


def throughput(layout: str, model_config, data, batch_size: int, steps: int, window: int,
               storage: str, run: int) -> list[float]:
    """examples/s of every logged window after the first, for one fit on ``layout``."""
    hosts, per_host = LAYOUTS[layout]
    result = redray.fit(lambda rngs: build(model_config, rngs=rngs), collate, loss,
                        optax.adamw(1e-3), train_data=data, batch_size=batch_size,
                        max_steps=steps, hosts=hosts, devices_per_host=per_host,
                        model_axis=MODEL_AXIS, log_every=window, progress=False,
                        checkpoint=False, tracking=False, name=f"{layout}-{run}",
                        storage_path=storage)
    rows = [r["examples_per_s"] for r in result.history if "examples_per_s" in r]
    if len(rows) < 2:
        raise RuntimeError(f"{layout}: {len(rows)} logged windows; need at least 2 (raise "
                           "--steps or lower --window)")
    return rows[1:]


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=120, help="steps per fit")
    ap.add_argument("--window", type=int, default=10, help="steps per logged window")
    ap.add_argument("--rounds", type=int, default=3, help="fits per layout, alternating")
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.window, args.rounds, args.batch_size = 4, 2, 1, 8
    llama = config("llama", TINY if args.tiny else FULL)
    data = token_data(args.batch_size * args.steps, seq=SEQ + 1, vocab=256)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False,
             log_to_driver=False)
    windows = {name: [] for name in LAYOUTS}
    per_round = {name: [] for name in LAYOUTS}
    try:
        with tempfile.TemporaryDirectory() as storage:
            for r in range(args.rounds):
                for name in LAYOUTS:
                    rates = throughput(name, llama, data, args.batch_size, args.steps,
                                       args.window, storage, r)
                    windows[name] += rates
                    per_round[name].append(statistics.median(rates))
    finally:
        ray.shutdown()
    two, one = (statistics.median(windows[n]) for n in LAYOUTS)
    save([figure("hosts", two / one, "x",
                 "1 host x 4 devices, same model, data, global batch, mesh (data 2 x model 2) "
                 "and steps", None, COMMAND,
                 examples_per_s={n: stats(windows[n]) for n in LAYOUTS},
                 round_medians=per_round, steps=args.steps, window=args.window,
                 rounds=args.rounds, batch_size=args.batch_size)], args.out)


if __name__ == "__main__":
    main()
