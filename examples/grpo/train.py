"""Reinforcement learning from a verifiable reward: GRPO teaches a small LM to add.

A LLaMA-architecture decoder answers a user's ``37+45=`` in a ChatML conversation: each
prompt rendered by the chat template with the assistant's opening, the sampler stopping
on the generation config's end-of-turn token, the reward reading the decoded message (1
for the sum). ``--demos`` of the 9,744 training prompts have a worked answer: ``--warmup``
supervised epochs over those, then each iteration the ``Sampler`` continues ``--prompts``
prompts ``--group`` times at temperature 1 (on the trainer's weights, or on
``--sampler-replicas`` Ray actors), and the Trainer takes an epoch of GRPO's clipped
loss over the group-relative advantages, its ratio to its own log-probabilities of the
samples (their gap to the sampler's logged). The held-out accuracy is logged each
iteration; the same command resumes a run exactly. ``--kl COEF``: GRPO's KL penalty to
the warm-up model; ``--overlap`` (with ``--sampler-replicas``): the next iteration
sampled while this one trains, one update stale (README.md says more).

    python examples/grpo/train.py [--iterations 20] [--storage DIR] [--name RUN]
"""
import argparse
import json
import os

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import redray
from redray.data import chat
from redray.models import vocabulary_tokenizer
from redray.post_training import (Sampler, SamplerGroup, SamplingParams, grpo_loss,
                                  group_advantages, logprob_mismatch, messages,
                                  recomputed_logprobs, score, token_logprobs)

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"0123456789+=\n", "user", "assistant"]
PAD, EOT, LENGTH = 0, 2, 18  # padding (the config's EOS), end of turn, tokens in a row
STOP = [EOT, PAD]  # the generation config's EOS ids: what the sampler stops on
TOKENIZER = vocabulary_tokenizer(TOKENS, special=TOKENS[:3], pad=TOKENS[PAD], eos=TOKENS[EOT],
                                 chat_template=chat.CHATML)  # ChatML's turns and template
PROMPTS = {}  # this process's rendered prompts


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20, help="GRPO iterations")
    ap.add_argument("--warmup", type=int, default=200, help="supervised epochs first")
    ap.add_argument("--demos", type=int, default=1536, help="prompts with a worked answer")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=3e-3, help="warm-up learning rate (Adam)")
    ap.add_argument("--rl-lr", type=float, default=2e-4, help="GRPO's learning rate")
    ap.add_argument("--kl", type=float, default=0.0, help="KL penalty to the warm-up model")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, prompts, samples")
    ap.add_argument("--sampler-replicas", type=int, default=0, help="samplers on Ray actors "
                    "of their own, sent the weights each iteration (0: on the trainer's)")
    ap.add_argument("--reward-workers", type=int, default=0,
                    help="score the completions on this many Ray tasks (0: in the loop)")
    ap.add_argument("--overlap", action="store_true", help="sample the next iteration "
                    "while training on this one (needs --sampler-replicas)")
    args = redray.add_cluster_args(ap, name="grpo", hosts=1, devices_per_host=2).parse_args(argv)
    if args.overlap and not args.sampler_replicas:
        ap.error("--overlap samples on Ray actors beside the trainer: add --sampler-replicas 1")
    return args


def model(rngs):
    from transformers import LlamaConfig

    from redray.models import build

    return build(LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=32, bos_token_id=None, eos_token_id=PAD,
                             pad_token_id=PAD), generation={"eos_token_id": STOP}, rngs=rngs)


def prompt(pair):  # pair: a * 100 + b; the user's turn, then the assistant's opening
    return PROMPTS.get(pair) or PROMPTS.setdefault(pair, chat.render_prompt(
        [{"role": "user", "content": f"{pair // 100}+{pair % 100}="}], TOKENIZER))


def answer(pair):
    return [*TOKENIZER.encode(str(pair // 100 + pair % 100), add_special_tokens=False), EOT]


def reward(pair, message):
    """The verifier, on the decoded assistant message: 1 for exactly the sum, else 0
    (None: a message cut before its end of turn)."""
    return float(message == str(pair // 100 + pair % 100))


def row(pair, completion, old_logp=None, advantage=1.0):
    """A training row: prompt then completion, right-padded. Without ``old_logp``, a
    warm-up row: the policy counts as its own sampler, and the loss's gradient is then
    the supervised one (the completion's log-likelihood)."""
    ids, head = np.full(LENGTH, PAD, np.int32), prompt(pair)
    start, end = len(head), len(head) + len(completion)
    ids[:end] = [*head, *completion]
    mask, old = np.zeros(LENGTH, np.float32), np.zeros(LENGTH, np.float32)
    mask[start:end] = 1
    if old_logp is not None:
        old[start:end] = old_logp
    return {"ids": ids, "completion": mask, "old_logp": old, "warmup": old_logp is None,
            "advantage": np.float32(advantage)}


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def loss(model, batch, rng, train):
    logp = token_logprobs(model, batch["ids"], train=train)
    old = jnp.where(batch["warmup"][:, None], jax.lax.stop_gradient(logp), batch["old_logp"])
    kl = {"reference_logprobs": batch["reference"], "kl_coef": batch["kl"][:, None]} \
        if "reference" in batch else {}  # --kl: GRPO's rows
    return grpo_loss(logp, old, batch["advantage"], batch["completion"], **kl)


def warmup_model(trainer):
    """The model as GRPO begins, frozen: saved beside the checkpoints then (every host
    holds the whole), loaded from there when a run resumes later."""
    path = os.path.join(os.path.dirname(trainer.checkpoint_config.directory), "warmup.npz")
    graph, params, rest = nnx.split(trainer.model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    if os.path.exists(path):
        saved = np.load(path)
        whole = [saved[f"arr_{i}"] for i in range(len(leaves))]
    else:
        whole = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]
        if jax.process_index() == 0:
            np.savez(path, *whole)
    return nnx.merge(graph, tree.unflatten([jax.make_array_from_callback(
        x.shape, x.sharding, lambda index, w=w: w[index]) for x, w in zip(leaves, whole)]), rest)


class Ahead(redray.Hook):
    """The rollouts sampled ahead (--overlap), kept in every checkpoint's meta."""

    def __init__(self):
        self.pending, self.saved = {}, {}

    def on_restore(self, run, step, path, meta):
        self.saved = dict(meta["run"].get("rollouts", {}))

    def take(self, epoch):  # (tokens, logprobs) per row, or None: never sampled
        if epoch in self.pending:
            done = self.pending.pop(epoch).result()
            self.saved[str(epoch)] = [(c.tokens.tolist(), c.logprobs.tolist()) for c in done]
        return self.saved.get(str(epoch))

    def run_meta(self, run):
        for epoch in list(self.pending):
            self.take(epoch)
        first = run.position.resume_point()[0]  # what a resumed run still trains
        self.saved = {k: v for k, v in self.saved.items() if int(k) >= first}
        return {"rollouts": self.saved}


def accuracy(sampler, pairs):
    done = sampler.sample([prompt(p) for p in pairs], SamplingParams(max_new_tokens=4))
    return float(np.mean([reward(*r) for r in zip(pairs, messages(done, TOKENIZER, STOP))]))


def grpo(args):
    """The loop (one host: the Sampler decodes on that host's devices)."""
    pairs = np.random.default_rng(1234).permutation(10_000)
    held_out, train = pairs[:256], pairs[256:]  # the same split whatever --seed
    rows = args.prompts * args.group
    batch_size = min(rows, 128)
    updates = rows // batch_size  # one Trainer epoch per warm-up epoch or iteration
    lr = optax.piecewise_constant_schedule(args.lr, {args.warmup * updates: args.rl_lr / args.lr})
    ahead = Ahead()
    trainer = redray.Trainer.of(model, collate, loss, optax.adam(lr), batch_size=batch_size,
                             seed=args.seed, log_every=updates, progress=False,
                             hooks=[ahead] if args.overlap else [])
    trainer.init([row(0, answer(0))])  # the model (restored when the run resumes)
    if args.sampler_replicas:  # separate roles: the same samples, on other processes
        sampler = SamplerGroup(model, replicas=args.sampler_replicas, slots=128, max_length=32,
                               devices_per_replica=args.devices_per_host, seed=args.seed)
    else:  # colocated: on the trainer's devices, its weights shared in place
        sampler = Sampler(trainer.model, slots=128, max_length=32, seed=args.seed)

    def chosen(epoch):  # this epoch's prompts, on resume too
        rng = np.random.default_rng([args.seed, epoch])
        return rng.choice(train[:args.demos], rows) if epoch < args.warmup else \
            np.repeat(rng.choice(train, args.prompts, replace=False), args.group)

    def draw(epoch, ask):
        return ask([prompt(p) for p in chosen(epoch)], SamplingParams(
            max_new_tokens=4, temperature=1.0), request_ids=epoch * rows + np.arange(rows))

    first, last = trainer.step // updates, args.warmup + args.iterations
    reference = None
    for epoch in range(first, last):
        if epoch < args.warmup:
            data = [row(p, answer(p)) for p in chosen(epoch)]
        else:
            sampler.update_weights(trainer.model)
            trainer.log({"heldout_accuracy": accuracy(sampler, held_out)})
            done = ahead.take(epoch) or [(c.tokens, c.logprobs)
                                         for c in draw(epoch, sampler.sample)]
            if args.overlap:  # sampled while this epoch trains (after the last one too:
                # a run resumed with more --iterations goes on as if never stopped)
                ahead.pending[epoch + 1] = draw(epoch + 1, sampler.submit)
            said = messages([tokens for tokens, _ in done], TOKENIZER, STOP)
            rewards = score(reward, chosen(epoch), said, workers=args.reward_workers)
            advantages = np.asarray(group_advantages(rewards, args.group))
            data = [row(p, tokens, logp, a)
                    for p, (tokens, logp), a in zip(chosen(epoch), done, advantages)]
            # the trainer's log-probabilities of the samples against the sampler's; the
            # ratio divides by the trainer's (by the sampler's, which drew them one
            # update earlier, with --overlap)
            rows_now = collate(data)
            mine = recomputed_logprobs(trainer.model, rows_now["ids"]) * rows_now["completion"]
            gap = logprob_mismatch(rows_now["old_logp"], mine, rows_now["completion"])
            if args.kl:  # each sample's log-probabilities under the warm-up model
                reference = warmup_model(trainer) if reference is None else reference
                for r, logp in zip(data, recomputed_logprobs(reference, rows_now["ids"])):
                    r["reference"], r["kl"] = logp.astype(np.float32), np.float32(args.kl)
            if not args.overlap:
                for r, logp in zip(data, mine):
                    r["old_logp"] = logp.astype(np.float32)
            trainer.log({"reward": rewards.mean(), "iteration": epoch - args.warmup,
                         "logprob_mismatch_mean": gap["mean"],
                         "logprob_mismatch_max": gap["max"]})
        trainer.fit(data, epochs=epoch + 1, shuffle=False)
    if first < last:
        sampler.update_weights(trainer.model)
        trainer.log({"heldout_accuracy": accuracy(sampler, held_out)})
    return {"first_epoch": first, "step": trainer.step}


def main(argv=None):
    args = parse(argv)
    result = redray.run(grpo, args, cluster=redray.cluster_options(args))
    if result.value["first_epoch"] >= args.warmup + args.iterations:
        print(f"\nrun {args.name!r} is already complete: train further with --iterations "
              f"{args.iterations * 2}, or start over with another --name.")
    client = mlflow.MlflowClient(result.tracking_uri)  # the history of every resumption
    metric = {key: [m.value for m in sorted(client.get_metric_history(
        result.mlflow_run_id, key), key=lambda m: m.step)] for key in ("heldout_accuracy",
                                                                       "reward")}
    print("\nmean reward per iteration: " + " ".join(f"{r:.2f}" for r in metric["reward"]))
    print("\n" + result.summary())
    accuracy, reward = metric["heldout_accuracy"], metric["reward"] or [None]  # none sampled
    print(json.dumps({"accuracy_before": accuracy[0], "accuracy_after": accuracy[-1],
                      "reward_first": reward[0], "reward_last": reward[-1],
                      "step": result.value["step"]}))
    return result


if __name__ == "__main__":
    main()
