"""Preference learning: DPO on a small LM's own answers, ranked by a judge.

After a supervised warm-up on sums (a user's ``37+45=`` in a ChatML conversation) the model
answers each prompt 8 times, a judge ranks the decoded answers, and DPO (plus ``--nll`` x
NLL; ``--sft``: NLL alone) trains on the pairs. README.md says more; to run it:
``python examples/dpo/train.py [--epochs 12] [--sft] [--storage DIR] [--name RUN]``"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from transformers import LlamaConfig

import redray
from redray.data import chat
from redray.models import build, vocabulary_tokenizer
from redray.post_training import (Sampler, SamplingParams, dpo_loss, messages,
                                  preference_pairs, score, sequence_logprobs, token_logprobs)

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"0123456789+=\n", "user", "assistant"]
# padding (the config's EOS), end of turn, tokens in a row, the generation config's EOS ids
PAD, EOT, LENGTH, STOP = 0, 2, 18, [2, 0]  # (STOP: what the sampler stops on)
TOKENIZER = vocabulary_tokenizer(TOKENS, special=TOKENS[:3], pad=TOKENS[PAD], eos=TOKENS[EOT],
                                 chat_template=chat.CHATML)  # ChatML's turns and template


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=12, help="DPO epochs over the pairs")
    ap.add_argument("--warmup", type=int, default=3, help="supervised epochs first")
    ap.add_argument("--prompts", type=int, default=8192, help="training prompts (worked)")
    ap.add_argument("--nll", type=float, default=1.0, help="weight of the chosen's NLL")
    ap.add_argument("--sft", action="store_true", help="supervised epochs instead of DPO")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate after the warm-up")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, data and samples")
    return redray.add_cluster_args(ap, name="dpo", hosts=1, devices_per_host=2).parse_args(argv)


def model(rngs):
    return build(LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, eos_token_id=PAD,
                             pad_token_id=PAD), generation={"eos_token_id": STOP}, rngs=rngs)


def prompt(p):  # p: a * 100 + b; the user's turn (a+b=), then the assistant's opening
    return chat.render_prompt([{"role": "user", "content": "%d+%d=" % divmod(p, 100)}], TOKENIZER)


def answer(pair):
    return [*TOKENIZER.encode(str(pair // 100 + pair % 100), add_special_tokens=False), EOT]


def row(pair, chosen, rejected, reference=(0.0, 0.0), warmup=False):
    """The prompt then each answer (token ids), right-padded, a mask on the answer."""
    out, head = {"reference": np.float32(reference), "warmup": warmup}, prompt(pair)
    for key, tokens in (("chosen", chosen), ("rejected", rejected)):
        ids = np.int32([*head, *tokens])
        out[key] = np.pad(ids, (0, LENGTH - len(ids)), constant_values=PAD)
        out[key + "_mask"] = np.float32(np.isin(np.arange(LENGTH), range(len(head), len(ids))))
    return out


def judge(pair, message):  # minus the decoded answer's distance to the sum; -1000: no number
    number = message is not None and message.isdigit()
    return -abs(int(message) - pair // 100 - pair % 100) if number else -1000.0


def own_pairs(trainer, sampler, pairs, samples=8):
    """Pairs of the model's answers, ranked by the judge; its log-probs: the reference."""
    asked = np.repeat(pairs, samples)
    done = [c.tokens.tolist() for c in sampler.sample(
        [prompt(p) for p in asked], SamplingParams(max_new_tokens=4, temperature=1.0))]
    ranks = preference_pairs(score(judge, asked, messages(done, TOKENIZER, STOP)), samples)
    rows = [row(asked[c], done[c], done[r]) for c, r in ranks]
    return [dict(r, reference=x) for r, x in zip(rows, trainer.predictor().predict(rows))]


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def answers(model, batch, train=False):
    """(chosen, rejected): each row's log-probability of its two answers."""
    ids = jnp.concatenate([batch["chosen"], batch["rejected"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    return jnp.split(sequence_logprobs(token_logprobs(model, ids, train=train), mask), 2)


def loss(model, batch, rng, train, nll=1.0):
    """DPO's loss plus ``nll`` x the chosen's; a warm-up batch: the chosen's alone."""
    chosen, rejected = answers(model, batch, train)
    dpo, _ = dpo_loss(chosen, rejected, *batch["reference"].T, beta=0.5)  # beta: how far
    supervised = -chosen.sum() / batch["chosen_mask"].sum()
    return jnp.where(batch["warmup"].any(), supervised, dpo + nll * supervised), {
        "preferred": (chosen > rejected).mean()}


def predict(model, batch, rng):
    return jnp.stack(answers(model, batch), -1)


def dpo(args):
    """The loop: warm-up epochs, then DPO (or, --sft, supervised) epochs over the pairs."""
    held_out, train = np.split(np.random.default_rng(1234).permutation(10_000), [1024])  # fixed
    train = np.random.default_rng(args.seed).choice(train, args.prompts, replace=False)
    updates = args.prompts // 128  # one Trainer epoch per epoch (pairs repeated to fill it)
    lr = optax.piecewise_constant_schedule(3e-3, {args.warmup * updates: args.lr / 3e-3})
    trainer = redray.Trainer.of(model, collate, lambda *a: loss(*a, nll=args.nll), optax.adam(lr),
                             predict, batch_size=128, seed=args.seed, log_every=updates)
    trainer.init([row(0, answer(0), answer(0))])  # the model (restored when the run resumes)
    saved = os.path.join(os.path.dirname(trainer.checkpoint_config.directory), "pairs.npy")
    first, prefs = trainer.step // updates, None
    for epoch in range(first, args.warmup + args.epochs):
        if epoch < args.warmup:  # supervised: the worked sums
            data = [row(p, answer(p), answer(p), warmup=True) for p in train]
        else:
            if epoch == args.warmup:  # the warm-up's answers and log-probs, kept for resuming
                sampler = Sampler(trainer.model, slots=128, max_length=32, seed=args.seed)
                test, prefs = (own_pairs(trainer, sampler, p) for p in (held_out, train))
                if jax.process_index() == 0:  # (before the epoch's checkpoint)
                    np.save(saved, {"test": test, "prefs": prefs})
            elif prefs is None:
                test, prefs = np.load(saved, allow_pickle=True).item().values()
            data = [dict(prefs[i % len(prefs)], warmup=args.sft) for i in range(args.prompts)]
            trainer.log({"preference_accuracy": trainer.evaluate(test)["preferred"]})
        trainer.fit(data, epochs=epoch + 1)
    if first < args.warmup + args.epochs:
        trainer.log({"preference_accuracy": trainer.evaluate(test)["preferred"]})
    return {"first_epoch": first, "step": trainer.step}


def main(argv=None):
    result = redray.run(dpo, args := parse(argv), cluster=redray.cluster_options(args))
    accuracy = [m.value for m in sorted(mlflow.MlflowClient(result.tracking_uri).get_metric_history(
        result.mlflow_run_id, "preference_accuracy"), key=lambda m: m.step)]  # every resumption's
    print(f"\nheld-out preference accuracy: {np.round(accuracy, 3)}\n\n{result.summary()}\n"
          + json.dumps({"before": accuracy[0], "after": accuracy[-1], **result.value}))


if __name__ == "__main__":
    main()
