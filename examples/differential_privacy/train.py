"""Differentially private training: DP-SGD (Abadi et al., 2016) on handwritten digits.

The 1,797 8x8 images of ``sklearn.datasets.load_digits`` (shipped with scikit-learn, no
download) are split 80/20; an MLP learns the ten classes. The gradient step is DP-SGD,
given to redray as ``grad_fn``: every example's gradient is clipped to norm
``--clip``, the clipped gradients are summed, Gaussian noise of standard deviation
``--noise * --clip`` is added to each coordinate, and the sum is divided by the batch
size. The privacy spent, epsilon at ``--delta``, comes from a Renyi-DP accountant for
the subsampled Gaussian mechanism. By default 2 simulated hosts x 2 CPU devices; MLflow
tracking and checkpoints go to ``--storage``; the same command again resumes the run
(or says it is complete).

    python examples/differential_privacy/train.py [--epochs 10] [--noise 1.5]
        [--clip 1.0] [--hosts 2] [--devices-per-host 2] [--storage DIR] [--name RUN]
"""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import redray


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10, help="passes over the training images")
    ap.add_argument("--batch-size", type=int, default=64, help="images per DP-SGD step")
    ap.add_argument("--noise", type=float, default=1.5, help="noise multiplier (sigma)")
    ap.add_argument("--clip", type=float, default=1.0, help="per-example gradient norm bound")
    ap.add_argument("--delta", type=float, default=1e-5, help="the delta epsilon is reported at")
    ap.add_argument("--lr", type=float, default=1e-2, help="learning rate (Adam)")
    return redray.add_cluster_args(ap, name="dp-digits").parse_args(argv)


def digits():
    """(train, test) examples: 64 pixels scaled to [0, 1] and the digit."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    examples = [{"pixels": (images[i] / 16).astype(np.float32), "label": int(labels[i])}
                for i in order]
    cut = int(len(examples) * 0.8)
    return examples[:cut], examples[cut:]


class MLP(nnx.Module):
    def __init__(self, rngs, hidden=128):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, pixels):
        return self.out(nnx.tanh(self.hidden(pixels)))


def collate(examples):
    return {"pixels": np.stack([e["pixels"] for e in examples]),
            "label": np.asarray([e["label"] for e in examples], np.int32)}


def loss(model, batch, rng, train):
    logits = model(batch["pixels"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), {
        "accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def dp_sgd(clip, noise):
    """A ``grad_fn``: clipped per-example gradients, summed, noised, averaged.

    redray gives it the whole global batch of a step (no gradient accumulation), so
    the noise is added once per step, as the accountant assumes.
    """
    def grad_fn(loss_fn, params, batch, rng):
        def one(example):
            single = jax.tree.map(lambda x: x[None], example)
            (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, single, rng)
            return value, metrics, grads

        values, metrics, grads = jax.vmap(one)(batch)
        scale = jnp.minimum(1.0, clip / (jax.vmap(optax.tree.norm)(grads) + 1e-12))
        summed = jax.tree.map(lambda g: jnp.tensordot(scale, g, 1), grads)
        noises = optax.tree.random_like(jax.random.fold_in(rng, 1), summed, jax.random.normal)
        grads = jax.tree.map(lambda s, z: (s + noise * clip * z) / len(values), summed, noises)
        return values.mean(), jax.tree.map(jnp.mean, metrics), grads
    return grad_fn


def epsilon(q, noise, steps, delta, orders=range(2, 257)):
    """Epsilon of ``steps`` DP-SGD steps at ``delta``, minimized over integer Renyi orders.

    Renyi DP of the Poisson-subsampled Gaussian at integer order a (Mironov, Talwar &
    Zhang 2019, Sec. 3.3): log(sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 noise^2)))
    / (a-1), composed over steps by addition, converted to (epsilon, delta) by Balle et
    al. 2020, Thm. 21: rdp + log((a-1)/a) - (log(delta) + log(a)) / (a-1).
    """
    from scipy.special import gammaln, logsumexp

    best = math.inf
    for a in orders:
        k = np.arange(a + 1)
        log_terms = (gammaln(a + 1) - gammaln(k + 1) - gammaln(a - k + 1) + k * math.log(q)
                     + (a - k) * math.log1p(-q) + (k * k - k) / (2 * noise ** 2))
        rdp = steps * logsumexp(log_terms) / (a - 1)
        best = min(best, rdp + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return best


def main(argv=None):
    args = parse(argv)
    train, test = digits()
    result = redray.fit(
        MLP, collate, loss, optax.adam(args.lr), train_data=train, eval_data=test,
        batch_size=args.batch_size, epochs=args.epochs, eval_at_start=True,
        grad_fn=dp_sgd(args.clip, args.noise), cluster=redray.cluster_options(args))
    print()
    print(result.summary())
    evals = [r for r in result.history if "eval_loss" in r]
    q = args.batch_size / len(train)
    steps = evals[-1]["step"] if evals else result.resumed_from_step
    numbers = {"epsilon": epsilon(q, args.noise, steps, args.delta), "delta": args.delta,
               "noise_multiplier": args.noise, "clip_norm": args.clip, "sampling_rate": q,
               "steps": steps}
    if evals:
        numbers.update(accuracy_before=evals[0]["eval_accuracy"],
                       accuracy_after=evals[-1]["eval_accuracy"],
                       loss_before=evals[0]["eval_loss"], loss_after=evals[-1]["eval_loss"])
        print(f"test accuracy {numbers['accuracy_before']:.3f} -> "
              f"{numbers['accuracy_after']:.3f} in {steps} DP-SGD steps")
    print(f"privacy spent: ({numbers['epsilon']:.2f}, {args.delta:g})-DP")
    print(json.dumps(numbers))
    return result


if __name__ == "__main__":
    main()
