"""Preference learning: DPO teaches a small LM to prefer the right sum to a near miss.

The task of examples/grpo (prompts like ``37+45=``), learned from preferences: after a
supervised warm-up, DPO trains on a fixed set of pairs, the right sum (chosen) against a
near miss (rejected: off by 1 or 10), with the warm-up's model as the frozen reference
(its log-probabilities computed once and kept in the run's folder, for resuming). The
held-out preference accuracy is logged each epoch; the same command resumes exactly.

    python examples/dpo/train.py [--epochs 12] [--storage DIR] [--name RUN]
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax

import redray
from redray.post_training import dpo_loss, sequence_logprobs, token_logprobs

CHARS = "0123456789+="
BOS, EOS, PAD, VOCAB, LENGTH = 12, 13, 14, 16, 12  # a row: BOS a+b= digits EOS, padded
BETA = 0.5  # DPO's beta: how far from the reference the implicit reward lets the model go
OFFSETS = (-10, -1, 1, 10)  # a near miss: the sum off by one of these


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=12, help="DPO epochs over the pairs")
    ap.add_argument("--warmup", type=int, default=3, help="supervised epochs first, on the chosen")
    ap.add_argument("--pairs", type=int, default=8192, help="preference pairs")
    ap.add_argument("--lr", type=float, default=3e-3, help="warm-up learning rate (Adam)")
    ap.add_argument("--dpo-lr", type=float, default=1e-3, help="DPO's learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model and the data")
    return redray.add_cluster_args(ap, name="dpo", hosts=1, devices_per_host=2).parse_args(argv)


def model(rngs):
    from transformers import LlamaConfig

    from redray.models import build

    return build(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=32, bos_token_id=BOS, eos_token_id=EOS,
                             pad_token_id=PAD), rngs=rngs)


def row(pair, wrong, reference=(0.0, 0.0), warmup=False):
    """Prompt ``a+b=`` (pair = a * 100 + b), the right sum chosen over ``wrong``, each
    right-padded with a mask on its answer; ``reference``: the reference's log-probs."""
    out = {"reference": np.float32(reference), "warmup": warmup}
    prompt = f"{pair // 100}+{pair % 100}="
    for key, total in (("chosen", pair // 100 + pair % 100), ("rejected", wrong)):
        ids = np.int32([BOS, *(CHARS.index(c) for c in prompt + str(total)), EOS])
        out[key] = np.pad(ids, (0, LENGTH - len(ids)), constant_values=PAD)
        out[key + "_mask"] = np.float32(np.arange(LENGTH) > len(prompt)) * (out[key] != PAD)
    return out


def near_misses(rng, pairs):
    totals, offsets = pairs // 100 + pairs % 100, rng.choice(OFFSETS, len(pairs))
    return np.where(totals + offsets < 0, totals - offsets, totals + offsets)


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def answers(model, batch, train=False):
    """(chosen, rejected): each row's log-probability of its two answers."""
    ids = jnp.concatenate([batch["chosen"], batch["rejected"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    return jnp.split(sequence_logprobs(token_logprobs(model, ids, train=train), mask), 2)


def loss(model, batch, rng, train):
    """DPO's loss; a warm-up batch: the chosen answer's cross-entropy (supervised)."""
    chosen, rejected = answers(model, batch, train)
    dpo, metrics = dpo_loss(chosen, rejected, *batch["reference"].T, beta=BETA)
    supervised = -chosen.sum() / batch["chosen_mask"].sum()
    return jnp.where(batch["warmup"].any(), supervised, dpo), {
        "preferred": (chosen > rejected).mean(), "reward_accuracy": metrics["accuracy"]}


def predict(model, batch, rng):
    return jnp.stack(answers(model, batch), -1)


def dpo(args):
    """The loop: warm-up epochs, then DPO epochs over the fixed pairs."""
    pairs = np.random.default_rng(1234).permutation(10_000)
    held_out, train = pairs[:1024], pairs[1024:]  # the same split whatever --seed
    test = [row(p, w) for p, w in zip(held_out, near_misses(np.random.default_rng(1), held_out))]
    chosen = np.random.default_rng(args.seed).choice(train, args.pairs, replace=False)
    prefs = list(zip(chosen, near_misses(np.random.default_rng([args.seed, 1]), chosen)))
    updates = args.pairs // 128  # one Trainer epoch per warm-up or DPO epoch
    lr = optax.piecewise_constant_schedule(args.lr, {args.warmup * updates: args.dpo_lr / args.lr})
    trainer = redray.Trainer(model, collate, loss, optax.adam(lr), predict, batch_size=128,
                             seed=args.seed, log_every=updates, progress=False)
    trainer.init([row(0, 1)])  # the model (restored when the run resumes)
    saved = os.path.join(os.path.dirname(trainer.checkpoint_config.directory), "reference.npy")
    first, reference = trainer.step // updates, None
    for epoch in range(first, args.warmup + args.epochs):
        if epoch < args.warmup:  # supervised: the chosen answers
            data = [row(p, w, warmup=True) for p, w in prefs]
        else:
            if epoch == args.warmup:  # the reference: the warm-up's model, kept for resuming
                reference = np.stack(trainer.predictor().predict([row(p, w) for p, w in prefs]))
                if jax.process_index() == 0:  # (before the epoch's checkpoint)
                    np.save(saved, reference)
            elif reference is None:
                reference = np.load(saved)
            data = [row(p, w, r) for (p, w), r in zip(prefs, reference)]
            trainer.log({"preference_accuracy": trainer.evaluate(test)["preferred"]})
        trainer.fit(data, epochs=epoch + 1)
    if first < args.warmup + args.epochs:
        trainer.log({"preference_accuracy": trainer.evaluate(test)["preferred"]})
    return {"first_epoch": first, "step": trainer.step}


def main(argv=None):
    args = parse(argv)
    result = redray.run(dpo, args, cluster=redray.cluster_options(args))
    client = mlflow.MlflowClient(result.tracking_uri)  # the history of every resumption
    accuracy = [m.value for m in sorted(client.get_metric_history(
        result.mlflow_run_id, "preference_accuracy"), key=lambda m: m.step)]
    print("\nheld-out preference accuracy per epoch: " + " ".join(f"{a:.3f}" for a in accuracy))
    print("\n" + result.summary())
    print(json.dumps({"preference_accuracy_before": accuracy[0],
                      "preference_accuracy_after": accuracy[-1], "step": result.value["step"]}))
    return result


if __name__ == "__main__":
    main()
