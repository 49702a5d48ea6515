"""Classification: handwritten digits (scikit-learn's 8x8 images) on a Ray cluster.

The 1,797 images of ``sklearn.datasets.load_digits`` (shipped with scikit-learn, no
download) are split 80/20; an MLP learns the ten classes. The test accuracy comes from the
Predictor (``predict`` + ``eval_metric``) after every epoch.
By default 2 simulated hosts x 2 CPU devices, the plan chosen by redray's planner;
MLflow tracking and checkpoints go to ``--storage``. Running the same command again
resumes the run (or says it is complete).

    python examples/classification/train.py [--epochs 10] [--hosts 2]
        [--devices-per-host 2] [--model-axis M] [--storage DIR] [--name RUN]
"""

import argparse
import json

import numpy as np
import optax
from flax import nnx

import redray


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10, help="passes over the training images")
    ap.add_argument("--model-axis", type=int, help="tensor-parallel size (default: planned)")
    ap.add_argument("--batch-size", type=int, default=32, help="global batch (images)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    return redray.add_cluster_args(ap, name="digits").parse_args(argv)


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
    def __init__(self, hidden, rngs):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, pixels):
        return self.out(nnx.relu(self.hidden(pixels)))


def collate(examples):
    return {"pixels": np.stack([e["pixels"] for e in examples]),
            "label": np.asarray([e["label"] for e in examples], np.int32)}


def loss(model, batch, rng, train):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(batch["pixels"]), batch["label"]).mean()


def predict(model, batch, rng):
    return model(batch["pixels"]).argmax(-1)


def accuracy(examples, predictions):
    return {"accuracy": float(np.mean([p == e["label"] for e, p in zip(examples, predictions)]))}


def main(argv=None):
    args = parse(argv)
    train, test = digits()
    result = redray.fit(
        lambda rngs: MLP(args.hidden, rngs), collate, loss, optax.adam(args.lr), predict=predict,
        eval_metric=accuracy, train_data=train, eval_data=test, batch_size=args.batch_size,
        epochs=args.epochs, eval_at_start=True, model_axis=args.model_axis,
        cluster=redray.cluster_options(args))
    print("\n" + result.summary())
    evals = [r for r in result.history if "eval_loss" in r]
    if evals:
        before, after = evals[0], evals[-1]
        numbers = {"accuracy_before": before.get("eval_accuracy"),
                   "accuracy_after": after["eval_accuracy"], "loss_before": before["eval_loss"],
                   "loss_after": after["eval_loss"], "step": after["step"]}
        print(f"test accuracy {after['eval_accuracy']:.3f} at step {after['step']}; test loss "
              f"{before['eval_loss']:.3f} at step {before['step']} -> {after['eval_loss']:.3f}")
        print(json.dumps(numbers))
    return result

if __name__ == "__main__":
    main()
