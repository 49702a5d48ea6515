"""Chat fine-tuning: a local Hugging Face checkpoint on conversations, the loss on the
assistant's turns only, on a Ray cluster.

The conversations are JSON lines of ``{"messages": [...]}`` (``--data``; by default
``conversations.jsonl`` beside this file: questions on CPython's documentation topics
answered from them, made by ``make_conversations.py``). Each is rendered with the
checkpoint's own chat template and masked to the assistant's tokens, its end-of-turn
token included (``redray.data.chat``); they are packed into rows of ``--seq`` tokens
once (``redray.data.prepare``), every tenth held out to evaluate the assistant-token
loss before and during training. The run keeps the checkpoint's config and tokenizer,
so ``redray export`` writes a folder transformers serves (its chat template, and a
``generation_config.json`` that stops on the end-of-turn token). Without ``--model``
a tiny random Qwen3-shaped checkpoint (GPT-2's BPE, a ChatML template) is made first.
"""

import argparse
import json
import math
import os

import numpy as np
import optax

import redray

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local Hugging Face folder with a chat template")
    ap.add_argument("--data", default=os.path.join(HERE, "conversations.jsonl"))
    ap.add_argument("--steps", type=int, default=60, help="optimizer updates in total")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (packed rows)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    return redray.add_cluster_args(ap, name="chat").parse_args(argv)


def tiny_checkpoint(folder):
    """A random Qwen3-shaped checkpoint with GPT-2's BPE and a ChatML template."""
    from transformers import Qwen3Config

    from redray.data.chat import CHATML
    from redray.models import build, gpt2_tokenizer, save_pretrained

    tokenizer = gpt2_tokenizer(hf=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template = \
        "<|im_end|>", "<|endoftext|>", CHATML
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    save_pretrained(build(config), folder, tokenizer=tokenizer)
    return folder


def data(folder, conversations, model, seq):
    """(train, eval): packed rows of ``seq`` tokens with their loss masks, written once."""
    from transformers import AutoTokenizer

    from redray.data import chat

    rows = [json.loads(line) for line in open(conversations) if line.strip()]
    render = chat.transform(AutoTokenizer.from_pretrained(model), max_length=seq)
    out = {}
    for split, keep in (("train", lambda i: i % 10 != 5), ("eval", lambda i: i % 10 == 5)):
        path = os.path.join(folder, f"seq{seq}", split)
        if not os.path.exists(os.path.join(path, "part-00000.parquet")):
            done = redray.data.prepare([r for i, r in enumerate(rows) if keep(i)], path,
                                       transform=render, pack=seq)
            print(f"{split}: {done.documents} conversations in {done.rows} rows of {seq} tokens")
        out[split] = redray.Stream(path)
    return out["train"], out["eval"]


def collate(rows):
    return {k: np.stack([r[k] for r in rows]) for k in ("ids", "segment_ids", "loss_mask")}


def loss(model, batch, rng, train):
    """The assistant's tokens only, each conversation apart, averaged over every such
    token of the update; their count is logged (``tokens``) and weighs the batch."""
    from redray.models import next_token_loss

    return next_token_loss(model, batch["ids"], batch["segment_ids"],
                           loss_mask=batch["loss_mask"], metrics=True, train=train)


def main(argv=None):
    args = parse(argv)
    cluster = redray.cluster_options(args)
    from redray.models import from_pretrained, load_config, save_tokenizer
    from redray.storage import RunFolders

    folders = RunFolders.of(cluster.storage_path, cluster.name)
    model = args.model or os.path.join(folders.run, "tiny-checkpoint")
    if not os.path.exists(os.path.join(model, "config.json")):
        tiny_checkpoint(model)
    train, held_out = data(f"{folders.run}/data", args.data, model, args.seq)
    load_config(model).to_json_file(folders.model_config)  # what `redray export` builds
    save_tokenizer(model, folders.tokenizer)
    schedule = redray.Schedule(args.lr, warmup=0.1)
    result = redray.fit(
        from_pretrained(model), collate, loss,
        optax.adamw(schedule, weight_decay=0.0), train_data=train, eval_data=held_out,
        batch_size=args.batch_size, max_steps=args.steps, learning_rate=schedule,
        epochs=math.ceil(args.steps / train.steps_per_epoch(args.batch_size, args.hosts)),
        eval_at_start=True, log_every=10, cluster=cluster)
    evals = [r for r in result.history if "eval_loss" in r]
    if evals:
        numbers = {"loss_before": evals[0]["eval_loss"], "loss_after": evals[-1]["eval_loss"],
                   "step": evals[-1]["step"]}
        print(f"held-out assistant-token loss: {numbers['loss_before']:.3f} -> "
              f"{numbers['loss_after']:.3f} at step {numbers['step']}\n{json.dumps(numbers)}")
    print(result.summary())
    return result


if __name__ == "__main__":
    main()
