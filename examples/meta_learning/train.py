"""Meta-learning: MAML on sinusoid regression (Finn et al., 2017), on a Ray cluster.

Each example is one task: a sine wave ``amplitude * sin(x - phase)`` with the
amplitude in [0.1, 5] and the phase in [0, pi], seen through K support and K query
points with x in [-5, 5] (generated, no download). ``loss`` is the whole of MAML: it
adapts the network to each task's support set with a few SGD steps (the inner loop,
vmapped over the batch of tasks) and returns the query MSE after adaptation; redray
differentiates through the inner loop (second-order MAML; ``--first-order`` drops the
second derivatives). The evaluation is the same on held-out tasks, with the query MSE
before adaptation as a metric. By default 2 simulated hosts x 2 CPU devices; MLflow
tracking and checkpoints go to ``--storage``, and running the same command again
resumes the run (or says it is complete).

    python examples/meta_learning/train.py [--steps 1000] [--hosts 2]
        [--devices-per-host 2] [--storage DIR] [--name RUN] [--first-order]
"""

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import redray

TRAIN_TASKS, HELD_OUT_TASKS = 32000, 1000


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="meta-updates in total")
    ap.add_argument("--batch-size", type=int, default=128, help="tasks per meta-update")
    ap.add_argument("--shots", type=int, default=10, help="support (and query) points per task")
    ap.add_argument("--inner-steps", type=int, default=1, help="SGD steps on the support set")
    ap.add_argument("--inner-lr", type=float, default=0.01, help="inner-loop step size")
    ap.add_argument("--lr", type=float, default=1e-2, help="meta learning rate (Adam)")
    ap.add_argument("--first-order", action="store_true", help="first-order MAML")
    return redray.add_cluster_args(ap, name="maml").parse_args(argv)


def sinusoid_tasks(n, shots, seed):
    """``n`` tasks, each ``shots`` support and ``shots`` query points of one sine wave."""
    rng = np.random.default_rng(seed)
    amplitude = rng.uniform(0.1, 5.0, (n, 1))
    phase = rng.uniform(0.0, np.pi, (n, 1))
    x = rng.uniform(-5.0, 5.0, (n, 2 * shots))
    y = amplitude * np.sin(x - phase)
    x, y = x.astype(np.float32), y.astype(np.float32)
    return [{"support_x": x[i, :shots], "support_y": y[i, :shots],
             "query_x": x[i, shots:], "query_y": y[i, shots:]} for i in range(n)]


class Regressor(nnx.Module):
    """The paper's network: 1 -> 40 -> 40 -> 1 with ReLU."""

    def __init__(self, rngs, width=40):
        self.hidden1 = nnx.Linear(1, width, rngs=rngs)
        self.hidden2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))


def collate(tasks):
    # a trailing feature axis of 1: the network maps one scalar x to one scalar y
    return {k: np.stack([t[k] for t in tasks])[..., None] for k in tasks[0]}


def loss(model, batch, rng, train, inner_steps=1, inner_lr=0.01, first_order=False):
    """Query MSE after adapting to each task's support set; the inner loop lives here."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def mse(p, x, y):
        return jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)

    def adapt_then_query(support_x, support_y, query_x, query_y):
        adapted = params
        for _ in range(inner_steps):
            grads = jax.grad(mse)(adapted, support_x, support_y)
            if first_order:  # treat the inner gradient as a constant: no Hessian terms
                grads = jax.lax.stop_gradient(grads)
            adapted = jax.tree.map(lambda p, g: p - inner_lr * g, adapted, grads)
        return mse(adapted, query_x, query_y), mse(params, query_x, query_y)

    after, before = jax.vmap(adapt_then_query)(
        batch["support_x"], batch["support_y"], batch["query_x"], batch["query_y"])
    return after.mean(), {"query_mse_unadapted": before.mean()}


def main(argv=None):
    args = parse(argv)
    train = sinusoid_tasks(TRAIN_TASKS, args.shots, seed=0)
    held_out = sinusoid_tasks(HELD_OUT_TASKS, args.shots, seed=1)
    maml = functools.partial(loss, inner_steps=args.inner_steps, inner_lr=args.inner_lr,
                             first_order=args.first_order)
    result = redray.fit(
        Regressor, collate, maml, optax.adam(args.lr), train_data=train, eval_data=held_out,
        batch_size=args.batch_size, max_steps=args.steps,
        epochs=math.ceil(args.steps / (TRAIN_TASKS // args.batch_size)), eval_at_start=True,
        checkpoint=redray.CheckpointConfig(save_every=100), log_every=20,
        cluster=redray.cluster_options(args))
    evals = [r for r in result.history if "eval_loss" in r]
    for row in evals:
        print(f"step {row['step']:>5}: held-out query MSE {row['eval_loss']:.3f} after "
              f"adaptation, {row['eval_query_mse_unadapted']:.3f} without")
    if evals:
        before, after = evals[0], evals[-1]
        print(json.dumps({"query_mse_before": before["eval_loss"],
                          "query_mse_after": after["eval_loss"],
                          "unadapted_mse_after": after["eval_query_mse_unadapted"],
                          "step": after["step"]}))
    print(result.summary())
    return result


if __name__ == "__main__":
    main()
