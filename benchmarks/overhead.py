"""Framework overhead: redray's training time over a hand-written ``jax.jit`` loop.

Same model (the tests' TinyLM: embedding, one attention + MLP block, tied head; NNX),
same mesh (4 simulated CPU devices, data=2 x model=2), same Megatron parameter specs,
same optimizer (optax adam), same examples in the same order, one process, one run.
The hand-written loop is what a careful user writes without a framework: one
``jax.jit`` of ``value_and_grad`` + ``optax`` update with donated state and explicit
shardings, each batch collated to numpy and placed with
``jax.make_array_from_process_local_data``, the loss fetched every 10 steps. Its
specs are written by hand (vocab-parallel embedding, Q/K/V and fc1 split on their
output, O and fc2 on their input); the script checks they equal the ones redray
derives, so both sides run the same sharded program and the ratio is what redray's
Trainer adds (batch placement, the step wrapper and its metrics, the loop).

Two redray figures, each over the hand-written loop: ``overhead`` (``Trainer.fit``,
one epoch per call) and ``overhead/train_step`` (a user loop calling
``Trainer.train_step`` with numpy batches). Each round times one epoch of each of
the three loops, in alternating order (A B C, C B A, ...) so machine noise hits all
alike; compilation is done before the first round. Target <= 1.03 (issue: Benchmarks).

    python benchmarks/overhead.py [--steps 30] [--rounds 20]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, figure, parser, save, simulate_devices, stats  # noqa: E402

simulate_devices(4)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import redray  # noqa: E402
from tiny import TinyLM, lm_collate, lm_loss, token_data  # noqa: E402

LOG_EVERY = 10  # redray's default log_every; the hand-written loop fetches as often
COMMAND = "python benchmarks/overhead.py"

# Megatron-LM's layout for TinyLM, by the last two parts of a parameter's path.
MEGATRON = {
    "wte/embedding": P("model", None),
    **{f"{name}/kernel": P(None, "model") for name in ("q", "k", "v", "fc1")},
    **{f"{name}/bias": P("model") for name in ("q", "k", "v", "fc1")},
    "o/kernel": P("model", None), "fc2/kernel": P("model", None),
}


def path_of(path) -> str:
    parts = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return "/".join(str(p) for p in parts if p != "value")


def spec_table(specs) -> dict[str, tuple]:
    """{path: spec without trailing Nones} (P('model') and P('model', None) are one layout)."""
    table = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda x: isinstance(x, P))[0]:
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        table[path_of(path)] = tuple(entries)
    return table


class HandWritten:
    """The loop a careful user writes with jax, flax and optax alone."""

    def __init__(self, build, mesh: Mesh, optimizer):
        self.mesh = mesh
        graphdef, abstract, rest_abstract = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
        self.specs = specs = jax.tree_util.tree_map_with_path(
            lambda path, _: MEGATRON.get("/".join(path_of(path).split("/")[-2:]), P()), abstract)
        param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, P))
        repl = NamedSharding(mesh, P())

        def init():
            _, params, rest = nnx.split(build(), nnx.Param, ...)
            return params, rest

        rest_sh = jax.tree.map(lambda _: repl, rest_abstract)
        params, rest = jax.jit(init, out_shardings=(param_sh, rest_sh))()
        # Adam's moments take their parameter's sharding, its step count is replicated.
        opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh,
                                       jax.eval_shape(optimizer.init, abstract), param_sh,
                                       transform_non_params=lambda _: repl)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
        self.state = {"params": params, "opt_state": opt_state}
        state_sh = {"params": param_sh, "opt_state": opt_sh}
        self.batch_sharding = NamedSharding(mesh, P("data"))

        def loss_fn(params, batch):
            return lm_loss(nnx.merge(graphdef, params, rest), batch, None, True)

        def step(state, batch):
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], batch)
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            return ({"params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}, {"loss": loss, **metrics})

        self.step = jax.jit(step, in_shardings=(state_sh, self.batch_sharding),
                            out_shardings=(state_sh, repl), donate_argnums=0)

    def train_step(self, batch: dict) -> dict:
        """One update from a numpy batch; metrics stay on the devices."""
        placed = {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                  for k, v in batch.items()}
        self.state, metrics = self.step(self.state, placed)
        return metrics


def epoch(train_step, data, order, batch_size) -> list[float]:
    """One pass of a user loop: collate each batch, step, fetch the mean loss every
    ``LOG_EVERY`` steps (what a training log needs, and no more syncs)."""
    losses, window = [], []
    for i in range(len(order) // batch_size):
        window.append(train_step(
            lm_collate([data[j] for j in order[i * batch_size:(i + 1) * batch_size]])))
        if len(window) == LOG_EVERY or i == len(order) // batch_size - 1:
            losses.append(float(np.mean([m["loss"] for m in jax.device_get(window)])))
            window = []
    return losses


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=30, help="training steps per timed epoch")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.rounds, args.dim, args.seq = 3, 2, 32, 16
    vocab = 256
    data = token_data(args.batch * args.steps, seq=args.seq, vocab=vocab)
    build = lambda rngs=None: TinyLM(rngs or nnx.Rngs(0), vocab=vocab, dim=args.dim)  # noqa: E731
    make = lambda **kw: redray.Trainer.of(build, lm_collate, lm_loss, optax.adam(1e-3),  # noqa: E731
                                       batch_size=args.batch, model_axis=2, progress=False,
                                       log_every=LOG_EVERY, **kw)
    fit_trainer, step_trainer = make(), make()
    # The same fit whose step has no non-finite guard (steps.train_step's
    # on_nonfinite=None: no select between the old and the new state): what the guard's
    # in-step part costs. Users cannot turn it off; set here, before the step compiles.
    unguarded = make()
    unguarded.on_nonfinite = None
    mesh = fit_trainer.mesh
    # Same devices in the same order as redray's (data, fsdp=1, model) mesh.
    hand = HandWritten(build, Mesh(mesh.devices.reshape(2, 2), ("data", "model")),
                       optax.adam(1e-3))
    fit_trainer.init(data)
    step_trainer.init(data)
    unguarded.init(data)
    derived, written = spec_table(fit_trainer.runtime.specs[0]), spec_table(hand.specs)
    if derived != written:
        raise SystemExit(f"redray derived other specs than the hand-written Megatron ones "
                         f"({derived} vs {written}): the comparison would not be like for like")

    n = len(data)
    epochs_done = {"fit": 0, "unguarded": 0}
    order_of = lambda epoch: np.random.default_rng([0, epoch]).permutation(n)  # noqa: E731

    def run_hand(index):
        epoch(hand.train_step, data, order_of(index), args.batch)

    def run_fit(index):
        epochs_done["fit"] += 1
        fit_trainer.fit(data, epochs=epochs_done["fit"])

    def run_step(index):
        epoch(step_trainer.train_step, data, order_of(index), args.batch)

    def run_unguarded(index):
        epochs_done["unguarded"] += 1
        unguarded.fit(data, epochs=epochs_done["unguarded"])

    loops = {"hand_written": run_hand, "fit": run_fit, "train_step": run_step,
             "fit_unguarded": run_unguarded}
    states = lambda: (hand.state, fit_trainer.state, step_trainer.state,  # noqa: E731
                      unguarded.state)
    for name, fn in loops.items():  # compile and warm up outside the measurement
        fn(0)
    jax.block_until_ready(states())
    times = {name: [] for name in loops}
    cpu = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            loops[name](r + 1)
            jax.block_until_ready(states())
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    per_step = {name: stats([t / args.steps for t in ts]) for name, ts in times.items()}
    base = per_step["hand_written"]["median"]
    # Each round's own ratio: its spread shows how far noise moves one measurement.
    paired = {name: stats([a / b for a, b in zip(times[name], times["hand_written"])])
              for name in ("fit", "train_step")}
    # CPU seconds of every thread of this process (XLA's included): other processes'
    # load barely moves them, so they cross-check the wall-clock ratio on a busy machine.
    cpu_ratio = {name: statistics.median(cpu[name]) / statistics.median(cpu["hand_written"])
                 for name in ("fit", "train_step")}
    common = dict(step_time_s=per_step, cpu_s_per_step={
                      name: statistics.median(c) / args.steps for name, c in cpu.items()},
                  rounds=args.rounds, steps_per_epoch=args.steps,
                  model=f"TinyLM dim {args.dim}, vocab {vocab}, seq {args.seq}",
                  global_batch=args.batch, mesh="data=2 x model=2 (4 CPU devices)",
                  specs="hand-written Megatron specs, checked equal to redray's derived ones",
                  load_average=os.getloadavg()[0])
    reference = "hand-written jax.jit step and loop, same model/mesh/specs/optimizer/batches"
    save([figure("overhead", per_step["fit"]["median"] / base, "x", reference, "<= 1.03",
                 COMMAND, loop="Trainer.fit", round_ratios=paired["fit"],
                 cpu_ratio=cpu_ratio["fit"],
                 **common),
          figure("overhead/train_step", per_step["train_step"]["median"] / base, "x", reference,
                 "<= 1.03", COMMAND, loop="a user loop over Trainer.train_step",
                 round_ratios=paired["train_step"], cpu_ratio=cpu_ratio["train_step"],
                 **common),
          figure("overhead/nonfinite_guard",
                 per_step["fit"]["median"] / per_step["fit_unguarded"]["median"], "x",
                 "the same Trainer.fit, its step without the guard's select", None, COMMAND,
                 loop="Trainer.fit, guard in the step (default) over none",
                 round_ratios=stats([a / b for a, b in zip(times["fit"],
                                                           times["fit_unguarded"])]),
                 **common)],
         args.out)


if __name__ == "__main__":
    main()
