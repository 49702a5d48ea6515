"""Text to text: a T5 encoder-decoder learns to normalize written dates, on a Ray cluster.

Dates written the ways people write them ("Tuesday, 04 March 1997", "04.03.97",
"Mar 04 1997", "03/04/97 (US)", ...) go in, ISO dates ("1997-03-04") come out, one
character per token. The data is generated here from the calendar (no download), from
fixed seeds. The eval metric is exact match of the dates the model *generates*
(``predict`` runs greedy decoding with a KV cache on the Predictor), logged after every
epoch. By default 2 simulated hosts x 2 CPU devices, the plan chosen by redray's
planner; MLflow tracking and checkpoints go to ``--storage``. Running the same command
again resumes the run (or says it is complete).

    python examples/text_to_text/train.py [--epochs 3] [--hosts 2]
        [--devices-per-host 2] [--model-axis M] [--storage DIR] [--name RUN]
"""

import argparse
import datetime
import json
import string

import jax.numpy as jnp
import numpy as np
import optax
from transformers import T5Config

import redray
from redray.models import build, generate

FORMATS = ["%d %B %Y", "%B %d, %Y", "%A, %d %B %Y", "%d/%m/%Y", "%b %d %Y", "%d.%m.%y",
           "%Y/%m/%d", "%a %d %b %y", "%d %b %Y", "%m/%d/%y (US)"]
VOCAB = "_$ ,./-()" + string.digits + string.ascii_letters  # token id = index in VOCAB
PAD, EOS = VOCAB.index("_"), VOCAB.index("$")  # T5 starts decoding from the pad token
SOURCE_LEN, TARGET_LEN = 32, 11  # the longest date and an ISO date, each with its EOS


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3, help="passes over the training dates")
    ap.add_argument("--model-axis", type=int, help="tensor-parallel size (default: planned)")
    ap.add_argument("--examples", type=int, default=8000, help="training dates")
    ap.add_argument("--batch-size", type=int, default=32, help="global batch (dates)")
    ap.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    return redray.add_cluster_args(ap, name="dates").parse_args(argv)


def dates(n, seed):
    """``n`` examples {"source": a date as written, "target": the same date in ISO form}."""
    rng = np.random.default_rng(seed)
    first = datetime.date(1950, 1, 1).toordinal()  # two-digit years: 50-99 -> 19xx
    days = rng.integers(first, datetime.date(2049, 12, 31).toordinal() + 1, n)
    styles = rng.integers(0, len(FORMATS), n)
    return [{"source": datetime.date.fromordinal(int(d)).strftime(FORMATS[s]),
             "target": datetime.date.fromordinal(int(d)).isoformat()}
            for d, s in zip(days, styles)]


def encode(texts, length):
    ids = np.full((len(texts), length), PAD, np.int32)
    for row, text in zip(ids, texts):
        row[:len(text) + 1] = [VOCAB.index(c) for c in text + "$"]
    return ids


def decode(ids):
    return "".join(VOCAB[i] for i in ids).split("$")[0]


def collate(examples):
    return {"input_ids": encode([e["source"] for e in examples], SOURCE_LEN),
            "labels": encode([e["target"] for e in examples], TARGET_LEN)}


def loss(model, batch, rng, train):
    labels = batch["labels"]
    logits = model(batch["input_ids"], batch["input_ids"] != PAD, train=train,
                   decoder_input_ids=jnp.pad(labels[:, :-1], ((0, 0), (1, 0))))
    real = labels != PAD
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (logits.argmax(-1) == labels) & real
    tokens = real.sum()  # the weight: evaluation averages over every token, not batch means
    return (ce * real).sum() / tokens, {"token_accuracy": correct.sum() / tokens,
                                        "weight": tokens}


def predict(model, batch, rng):
    return generate(model, batch["input_ids"], batch["input_ids"] != PAD,
                    max_new_tokens=TARGET_LEN)


def exact_match(examples, predictions):
    return {"exact_match": float(np.mean([decode(p) == e["target"]
                                          for e, p in zip(examples, predictions)]))}


def main(argv=None):
    args = parse(argv)
    config = T5Config(vocab_size=len(VOCAB), d_model=64, d_kv=16, num_heads=4, d_ff=256,
                      num_layers=2, num_decoder_layers=2, dropout_rate=0.0, pad_token_id=PAD,
                      eos_token_id=EOS, decoder_start_token_id=PAD)
    steps = args.epochs * args.examples // args.batch_size
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, steps // 20 + 1, steps)
    result = redray.fit(
        lambda rngs: build(config, rngs=rngs), collate, loss, optax.adamw(schedule),
        predict=predict, eval_metric=exact_match, train_data=dates(args.examples, seed=0),
        eval_data=dates(500, seed=1), batch_size=args.batch_size, epochs=args.epochs,
        eval_at_start=True, model_axis=args.model_axis, learning_rate=schedule,
        cluster=redray.cluster_options(args))
    print("\n" + result.summary())
    evals = [r for r in result.history if "eval_loss" in r]
    if evals:
        before, after = evals[0], evals[-1]
        numbers = {"token_accuracy_before": before["eval_token_accuracy"],
                   "token_accuracy_after": after["eval_token_accuracy"],
                   "exact_match_before": before.get("eval_exact_match"),
                   "exact_match_after": after["eval_exact_match"], "step": after["step"]}
        print(f"generated dates exactly right: {after['eval_exact_match']:.3f} at step "
              f"{after['step']}; token accuracy {before['eval_token_accuracy']:.3f} at step "
              f"{before['step']} -> {after['eval_token_accuracy']:.3f}")
        print(json.dumps(numbers))
    return result

if __name__ == "__main__":
    main()
