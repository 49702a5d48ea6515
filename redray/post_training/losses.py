"""The losses of post-training, for a user's ``loss`` to call: SFT, DPO and GRPO.

A batch of post-training holds whole sequences, prompt then completion, right-padded:
``ids`` (batch, length), ``attention_mask`` 1 for real tokens, and ``completion_mask``
1 for the completion's tokens (the ones a loss scores; the prompt and the padding
count nowhere). ``token_logprobs`` gives each token's log-probability under the model,
aligned with ``ids``: entry t scores ``ids[:, t]`` from the tokens before it (entry 0,
the first token, has nothing before it and is 0).

- ``sft_loss``: cross-entropy on the completion only (the prompt masked).
- ``dpo_loss``: Direct Preference Optimization (Rafailov et al. 2023) on the sequence
  log-probabilities of a chosen and a rejected completion, under the policy and a
  frozen reference.
- ``grpo_loss``: Group Relative Policy Optimization (Shao et al. 2024): advantages
  relative to the other completions of the same prompt (``group_advantages``), the
  clipped ratio to the policy that sampled them, optionally a KL penalty to a
  reference policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def token_logprobs(model, ids, attention_mask=None, *, train: bool = False,
                   temperature: float = 1.0, **call) -> jax.Array:
    """(batch, length) float32: log p(ids[:, t] | ids[:, :t]), 0 at t = 0.

    Args:
      model: a redray causal LM.
      ids: (batch, length) token ids, prompt then completion, right-padded.
      attention_mask: (batch, length) 1 for real tokens (None: all).
      train: passed to the model (dropout, remat).
      temperature: the logits are divided by it first: the distribution a sampler at
        this temperature drew from (``Completion.logprobs``).
      **call: other arguments of the model's call.
    """
    if attention_mask is not None:
        call["attention_mask"] = attention_mask[:, :-1]
    logits = model(ids[:, :-1], train=train, **call).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


_scored = jax.jit(token_logprobs, static_argnames=("train", "temperature"))


def recomputed_logprobs(model, ids, temperature: float = 1.0) -> np.ndarray:
    """``token_logprobs`` of host token ids ``(batch, length)`` (right-padded; prompt
    then completion) on ``model`` as it is placed (a Trainer's ``model``, over every
    host too), read back whole on every process: what a GRPO loop divides by, and
    compares with the sampler's (``logprob_mismatch``), before an update."""
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from flax import nnx

    from redray.sharding.on_mesh import mesh_of, put

    ids = np.asarray(ids, np.int32)
    mesh = mesh_of(nnx.state(model))
    if mesh is not None:  # the same ids on every process, whole on every device
        ids = put(ids, NamedSharding(mesh, P()))
    out = _scored(model, ids, temperature=temperature)
    if not out.is_fully_addressable:
        out = multihost_utils.process_allgather(out, tiled=True)
    return np.asarray(out)


def logprob_mismatch(sampled, recomputed, mask) -> dict:
    """How far a sampler's log-probabilities (``Completion.logprobs``, placed as
    ``token_logprobs`` places a row's) are from the trainer's recomputation of the same
    tokens (``token_logprobs`` at the sampling temperature), over the tokens where
    ``mask`` is 1: ``{"mean": ..., "max": ...}`` of the absolute differences (floats).
    A large one says sampling and training disagree (dtype, kernels, weights not yet
    sent): a policy-gradient ratio over it is off by as much."""
    gap = np.abs(np.asarray(sampled, np.float64) - np.asarray(recomputed, np.float64))
    on = np.asarray(mask) > 0
    if not on.any():
        return {"mean": 0.0, "max": 0.0}
    return {"mean": float(gap[on].mean()), "max": float(gap[on].max())}


def masked_mean(values, mask) -> jax.Array:
    """Mean of ``values`` where ``mask`` is 1 (0 where it is empty)."""
    mask = mask.astype(jnp.float32)
    return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sft_loss(model, ids, completion_mask, attention_mask=None, *, train: bool = False,
             **call) -> jax.Array:
    """Mean cross-entropy of the completion's tokens given everything before them (the
    first token of a row, with nothing before it, is never scored)."""
    logp = token_logprobs(model, ids, attention_mask, train=train, **call)
    return -masked_mean(logp[:, 1:], completion_mask[:, 1:])


def sequence_logprobs(token_logp, completion_mask) -> jax.Array:
    """(batch,) each sequence's completion log-probability (the sum over its tokens)."""
    return (token_logp * completion_mask.astype(jnp.float32)).sum(-1)


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, *,
             beta: float = 0.1, label_smoothing: float = 0.0):
    """DPO's loss from (batch,) sequence log-probabilities (``sequence_logprobs``).

    The implicit reward of a completion is ``beta * (policy - reference)``; the loss is
    ``-log sigmoid(reward_chosen - reward_rejected)``, averaged; ``label_smoothing``
    (the chance a preference is flipped) mixes in the opposite preference's term.

    Returns:
      (loss, metrics): ``accuracy`` (the fraction whose chosen reward is the higher),
      ``margin`` (the mean reward difference).
    """
    margin = beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
    losses = (-(1 - label_smoothing) * jax.nn.log_sigmoid(margin)
              - label_smoothing * jax.nn.log_sigmoid(-margin))
    return losses.mean(), {"accuracy": (margin > 0).mean(), "margin": margin.mean()}


def group_advantages(rewards, group_size: int, *, normalize: bool = True,
                     eps: float = 1e-6) -> jax.Array:
    """Each completion's reward relative to its group's (the completions of one prompt,
    consecutive in ``rewards``): minus the group's mean, divided by its standard
    deviation (``normalize``; a group of equal rewards gets 0)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of "
                         f"{group_size}: give group_size completions per prompt, consecutive")
    groups = rewards.reshape(-1, group_size)
    adv = groups - groups.mean(-1, keepdims=True)
    if normalize:
        adv = adv / (groups.std(-1, keepdims=True) + eps)
    return adv.reshape(rewards.shape)


def preference_pairs(rewards, group_size: int) -> np.ndarray:
    """On-policy preference pairs from scored samples: for each group (the
    ``group_size`` completions of one prompt, consecutive in ``rewards``) whose rewards
    are not all equal, the index of its best completion (chosen) and of its worst
    (rejected), the first of each where rewards tie. A verifier's 0/1 reward pairs the
    first right completion with the first wrong one; a judge's graded score, the best
    with the worst. Groups of equal rewards give no pair.

    Returns:
      (pairs, 2) int array of indices into ``rewards``: chosen, rejected.
    """
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1 or group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape} rewards do not split into groups of {group_size}: "
                         "give group_size >= 2 completions per prompt, consecutive")
    groups = rewards.reshape(-1, group_size)
    kept = np.flatnonzero(groups.max(-1) > groups.min(-1))
    base = kept * group_size
    return np.stack([base + groups[kept].argmax(-1), base + groups[kept].argmin(-1)], -1)


def grpo_loss(logprobs, old_logprobs, advantages, completion_mask, *, clip: float = 0.2,
              clip_high: float | None = None, reference_logprobs=None, kl_coef: float = 0.0,
              average: str = "sequence"):
    """GRPO's clipped policy-gradient loss with an optional KL penalty.

    Args:
      logprobs: (batch, length) the trained policy's ``token_logprobs``.
      old_logprobs: (batch, length) the sampling policy's (the sampler's
        ``Completion.logprobs``, placed at the completion's positions): the ratio's
        denominator, no gradient.
      advantages: (batch,) per completion (``group_advantages``).
      completion_mask: (batch, length) 1 on the completion's tokens.
      clip: the ratio is clipped to [1 - clip, 1 + clip_high] (``clip_high`` None:
        ``clip``; a larger one is DAPO's "clip higher").
      reference_logprobs: (batch, length) a frozen reference policy's, for
        ``kl_coef * KL`` (the unbiased estimator exp(r - p) - (r - p) - 1).
      average: "sequence" (each completion's tokens averaged, then the completions:
        the GRPO paper's) or "token" (every token of the batch weighs the same: DAPO's).

    Returns:
      (loss, metrics): ``clipped`` (the fraction of tokens whose ratio was clipped),
      ``ratio`` (mean), ``kl`` (mean, when a reference is given).
    """
    if average not in ("sequence", "token"):
        raise ValueError(f"average={average!r}: use 'sequence' or 'token'")
    high = clip if clip_high is None else clip_high
    mask = completion_mask.astype(jnp.float32)
    ratio = jnp.exp(logprobs - jax.lax.stop_gradient(old_logprobs))
    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + high) * adv)
    metrics = {"ratio": masked_mean(ratio, mask),
               "clipped": masked_mean((ratio < 1 - clip) | (ratio > 1 + high), mask)}
    if reference_logprobs is not None:
        diff = jax.lax.stop_gradient(reference_logprobs) - logprobs
        kl = jnp.exp(diff) - diff - 1
        objective = objective - kl_coef * kl
        metrics["kl"] = masked_mean(kl, mask)
    if average == "token":
        return -masked_mean(objective, mask), metrics
    per_sequence = (objective * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
    return -per_sequence.mean(), metrics
