"""LoRA fine-tuning: low-rank adapters teach a frozen language model to write Python.

The base model, a small LLaMA-architecture causal LM, is first pretrained (run
``<name>-base``) on CPython's documentation (``pydoc_data.topics``), tokenized with
GPT-2's BPE as in examples/language_modeling. LoRA adapters (``redray.models.add_lora``,
rank ``--rank``) then go on its linear layers and alone are trained, with the base
frozen (``trainable=r"lora_"``), on a different kind of text: the Python source of four
standard-library modules. Only the adapters hold optimizer state and are saved in the
checkpoints; ``--export DIR`` folds them into the base (``merge_lora``) and writes a
regular Hugging Face checkpoint. By default 2 simulated hosts x 2 CPU devices, the plan
chosen by redray's planner; MLflow tracking and checkpoints go to ``--storage``; the same command
again resumes both runs (or says they are complete).

    python examples/lora/train.py [--steps 100] [--base-steps 200] [--rank 8]
        [--export DIR] [--hosts 2] [--devices-per-host 2] [--storage DIR] [--name RUN]
"""

import argparse
import importlib
import inspect
import json
import math
import os

import numpy as np
import optax
from flax import nnx

import redray
from redray.models import add_lora, build, gpt2_tokenizer, merge_lora, save_pretrained

CODE = ["argparse", "dataclasses", "functools", "textwrap"]  # the adaptation text's modules


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="LoRA updates in total")
    ap.add_argument("--base-steps", type=int, default=200, help="pretraining updates of the base")
    ap.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    ap.add_argument("--targets", default=r"_proj$|lm_head",
                    help="regex on the linear layers' paths that get adapters")
    ap.add_argument("--lr", type=float, default=1e-2, help="adapters' learning rate (cosine decay)")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--model-axis", type=int, help="tensor-parallel size (default: planned)")
    ap.add_argument("--export", help="write the merged model as a Hugging Face checkpoint here")
    return redray.add_cluster_args(ap, name="lora").parse_args(argv)


def texts(seq):
    """(train, eval) windows of seq+1 token ids of the docs and of the code, and the
    vocabulary: the GPT-2 BPE tokens either text uses (a small output layer)."""
    from pydoc_data.topics import topics

    bpe = gpt2_tokenizer()
    docs = bpe.encode("\n\n".join(topics[k] for k in sorted(topics))).ids
    code = bpe.encode("\n\n".join(inspect.getsource(importlib.import_module(m))
                                  for m in CODE)).ids
    used, ids = np.unique(np.asarray(docs + code), return_inverse=True)

    def windows(part):
        rows = part[: len(part) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1).astype(np.int32)
        cut = int(len(rows) * 0.95)
        return [{"ids": w} for w in rows[:cut]], [{"ids": w} for w in rows[cut:]]

    return windows(ids[:len(docs)]), windows(ids[len(docs):]), len(used)


def collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def loss(model, batch, rng, train):
    logits = model(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype("float32"), batch["ids"][:, 1:]).mean()


def fit_steps(model, data, steps, optimizer, args, **options):
    """``redray.fit`` for ``steps`` updates over ``data`` (train, eval), evaluated at
    the start and at the end of every epoch."""
    epochs = math.ceil(steps / (len(data[0]) // args.batch_size))
    return redray.fit(model, collate, loss, optimizer, train_data=data[0], eval_data=data[1],
                      batch_size=args.batch_size, epochs=epochs, max_steps=steps,
                      eval_at_start=True, model_axis=args.model_axis, **options)


def main(argv=None):
    from transformers import LlamaConfig

    args = parse(argv)
    docs, code, vocab = texts(args.seq)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=args.seq, hidden_size=128,
                         intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                         tie_word_embeddings=False)
    base_model = lambda rngs: build(config, rngs=rngs)  # noqa: E731 - built on each host
    cluster = redray.cluster_options(args)
    base_run = f"{args.name}-base"  # the base model's own run, same cluster and storage
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, args.base_steps)
    fit_steps(base_model, docs, args.base_steps, optax.adamw(schedule, weight_decay=0.01),
              args, cluster=cluster, name=base_run)
    base = redray.load_model(f"{cluster.storage_path}/{base_run}", base_model)

    model = add_lora(base, args.rank, targets=args.targets)
    decay = optax.cosine_decay_schedule(args.lr, args.steps)
    result = fit_steps(model, code, args.steps, optax.adamw(decay), args, trainable=r"lora_",
                       cluster=cluster)
    print()
    print(result.summary())
    if args.export:
        trained = redray.load_model(f"{cluster.storage_path}/{args.name}", model)
        save_pretrained(merge_lora(trained), args.export)
        print(f"merged model (Hugging Face format): {args.export}")
    evals = [r for r in result.history if "eval_loss" in r]
    if not evals:
        return result
    weights = {"/".join(map(str, p)): v[...]
               for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    stored = f"{result.checkpoint}/model"
    numbers = {"perplexity_before": math.exp(evals[0]["eval_loss"]),
               "perplexity_after": math.exp(evals[-1]["eval_loss"]), "step": evals[-1]["step"],
               "trained_parameters": sum(w.size for p, w in weights.items() if "lora_" in p),
               "parameters": sum(w.size for w in weights.values()),
               "model_bytes": sum(w.nbytes for w in weights.values()),
               "checkpoint_bytes": sum(os.path.getsize(os.path.join(d, f))
                                       for d, _, files in os.walk(stored) for f in files)}
    print(f"code perplexity {numbers['perplexity_before']:.1f} -> "
          f"{numbers['perplexity_after']:.1f}, training {numbers['trained_parameters']:,} of "
          f"{numbers['parameters']:,} parameters; the checkpoint's weights take "
          f"{numbers['checkpoint_bytes']:,} bytes (the whole model: {numbers['model_bytes']:,})")
    print(json.dumps(numbers))
    return result


if __name__ == "__main__":
    main()
