"""Reinforcement learning: PPO on CartPole (gymnasium), on a Ray cluster.

Proximal Policy Optimization (Schulman et al., 2017): a clipped surrogate, a value loss,
an entropy bonus and GAE advantages. Each iteration collects a rollout from ``--envs``
CartPole environments with the Predictor (``predict``: the policy's action
log-probabilities and the value of a batch of observations), trains ``--ppo-epochs``
passes over it (``loss``: the PPO loss, with the clip fraction, entropy and approximate
KL as metrics) and logs the mean return of the episodes that ended. ``redray.run`` runs
this loop on every host; MLflow tracking and checkpoints go to ``--storage``, and
running the same command again resumes the run (or says it is complete).

    python examples/reinforcement_learning/train.py [--iterations 30] [--hosts 1]
        [--devices-per-host 2] [--storage DIR] [--name RUN] [--seed 0]
"""

import argparse
import json

import gymnasium as gym
import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
from flax import nnx

import redray


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=30, help="collect-then-train rounds")
    ap.add_argument("--envs", type=int, default=8, help="environments stepped together")
    ap.add_argument("--rollout", type=int, default=128, help="steps per environment per round")
    ap.add_argument("--ppo-epochs", type=int, default=4, help="passes over each rollout")
    ap.add_argument("--batch-size", type=int, default=256, help="transitions per update")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (Adam)")
    ap.add_argument("--gamma", type=float, default=0.99, help="discount")
    ap.add_argument("--gae-lambda", type=float, default=0.95, help="GAE's lambda")
    ap.add_argument("--seed", type=int, default=0, help="seeds the model, environments, actions")
    # One host by default: every host steps every environment (their actions must agree),
    # so more simulated hosts on one machine only repeat the same rollouts.
    redray.add_cluster_args(ap, name="ppo", hosts=1, devices_per_host=2)
    return ap.parse_args(argv)


class ActorCritic(nnx.Module):
    """Separate 64-64 tanh networks for the policy's logits and the state's value."""

    def __init__(self, rngs, observations=4, actions=2, width=64):
        def mlp(out, scale):
            init = nnx.initializers.orthogonal
            return nnx.List([
                nnx.Linear(observations, width, kernel_init=init(np.sqrt(2)), rngs=rngs),
                nnx.Linear(width, width, kernel_init=init(np.sqrt(2)), rngs=rngs),
                nnx.Linear(width, out, kernel_init=init(scale), rngs=rngs)])

        # a near-uniform first policy explores; the critic starts at the usual scale
        self.policy, self.value = mlp(actions, 0.01), mlp(1, 1.0)

    def __call__(self, obs):
        def apply(layers, x):
            for layer in layers[:-1]:
                x = jnp.tanh(layer(x))
            return layers[-1](x)

        return apply(self.policy, obs), apply(self.value, obs)[:, 0]


def collate(examples):
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def loss(model, batch, rng, train, clip=0.2, value_coef=0.5, entropy_coef=0.01):
    logits, value = model(batch["obs"])
    log_probs = jax.nn.log_softmax(logits)
    ratio = jnp.exp(jnp.take_along_axis(log_probs, batch["action"][:, None], 1)[:, 0]
                    - batch["log_prob"])
    advantage = batch["advantage"]
    policy_loss = -jnp.minimum(ratio * advantage,
                               jnp.clip(ratio, 1 - clip, 1 + clip) * advantage).mean()
    value_loss = ((value - batch["return"]) ** 2).mean()
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    return policy_loss + value_coef * value_loss - entropy_coef * entropy, {
        "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy,
        "clip_fraction": (jnp.abs(ratio - 1) > clip).mean(),
        "approx_kl": (ratio - 1 - jnp.log(ratio)).mean()}


def predict(model, batch, rng):
    logits, value = model(batch["obs"])
    return {"log_probs": jax.nn.log_softmax(logits), "value": value}


def gae(rewards, values, dones, last_value, gamma, lam):
    """Advantages and value targets of a (steps, envs) rollout; ``dones[t]``: the episode
    ended at step t (a time-limit end counts as one, as in most PPO implementations)."""
    advantages, running = np.zeros_like(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = last_value if t == len(rewards) - 1 else values[t + 1]
        keep = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * keep - values[t]
        advantages[t] = running = delta + gamma * lam * keep * running
    return advantages, advantages + values


def ppo(args):
    """The loop every host runs: the same environments, seeds and actions everywhere."""
    envs = gym.make_vec("CartPole-v1", num_envs=args.envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    size = args.envs * args.rollout
    updates = args.ppo_epochs * size // args.batch_size  # per iteration: one Trainer epoch
    trainer = redray.Trainer.of(ActorCritic, collate, loss, optax.adam(args.lr, eps=1e-5),
                             predict, batch_size=args.batch_size, eval_batch_size=args.envs,
                             seed=args.seed, log_every=updates, progress=False)
    example = {"obs": np.zeros(envs.single_observation_space.shape, np.float32),
               "action": np.int32(0), "log_prob": np.float32(0), "advantage": np.float32(0),
               "return": np.float32(0)}
    trainer.init([example])  # the model (restored when the run resumes) before any rollout
    policy = trainer.predictor()
    first = trainer.step // updates
    # a resumed run starts fresh episodes, seeded by where it stands
    obs, _ = envs.reset(seed=args.seed + first * args.envs)
    running = np.zeros(args.envs)
    for it in range(first, args.iterations):
        sample, returns, steps = np.random.default_rng([args.seed, it]), [], []
        for _ in range(args.rollout):
            out = collate(policy.predict([{"obs": o} for o in obs]))
            action = np.argmax(out["log_probs"] + sample.gumbel(size=out["log_probs"].shape), -1)
            step = {"obs": obs, "action": action.astype(np.int32), "value": out["value"],
                    "log_prob": out["log_probs"][np.arange(args.envs), action]}
            obs, reward, terminated, truncated, _ = envs.step(action)
            done = terminated | truncated
            steps.append({**step, "reward": reward.astype(np.float32),
                          "done": done.astype(np.float32)})
            running += reward
            returns += list(running[done])
            running[done] = 0.0
        r = collate(steps)  # (steps, envs) arrays
        last = collate(policy.predict([{"obs": o} for o in obs]))["value"]
        advantage, target = gae(r["reward"], r["value"], r["done"], last, args.gamma,
                                args.gae_lambda)
        flat = {k: v.reshape(size, *v.shape[2:]) for k, v in (
            ("obs", r["obs"]), ("action", r["action"]), ("log_prob", r["log_prob"]),
            ("advantage", (advantage - advantage.mean()) / (advantage.std() + 1e-8)),
            ("return", target))}
        transitions = [{k: v[i] for k, v in flat.items()} for i in range(size)]
        # The --ppo-epochs passes, each in its own order, make one epoch of the Trainer:
        # one row of metrics per iteration
        order = np.concatenate([sample.permutation(size) for _ in range(args.ppo_epochs)])
        trainer.fit([transitions[i] for i in order], epochs=it + 1, shuffle=False)
        if returns:  # a round where no episode ended has no return to log
            trainer.log({"return": np.mean(returns), "episodes": len(returns), "iteration": it})
    return {"first_iteration": first, "step": trainer.step}


def main(argv=None):
    args = parse(argv)
    result = redray.run(ppo, args, cluster=redray.cluster_options(args))
    first = result.value["first_iteration"]
    if first >= args.iterations:
        print(f"\nrun {args.name!r} is already complete: {first} iterations done. Train "
              f"further with --iterations {first * 2}, or start over with another --name.")
    elif first:
        print(f"\nresumed at iteration {first} (step {result.resumed_from_step})")
    # the whole run's returns, from MLflow: they span every resumption
    history = mlflow.MlflowClient(result.tracking_uri).get_metric_history(
        result.mlflow_run_id, "return")
    returns = [m.value for m in sorted(history, key=lambda m: m.step)]
    print("\nmean return per iteration: " + " ".join(f"{r:.0f}" for r in returns))
    print("\n" + result.summary())
    print(json.dumps({"return_first": returns[0], "return_last": returns[-1],
                      "iterations": args.iterations, "step": result.value["step"]}))
    return result


if __name__ == "__main__":
    main()
