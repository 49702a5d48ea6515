"""What a request asks of the sampler (``SamplingParams``), what it gets back
(``Completion``), and how one token per row is drawn (``sample_rows``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is continued.

    Attributes:
      max_new_tokens: the most tokens to add (the completion ends earlier at EOS).
      temperature: 0 is greedy (argmax); else the logits are divided by it.
      top_k: sample among the k most likely tokens only (0: all).
      top_p: sample among the smallest set of tokens whose probability reaches it (1.0:
        all).
    """
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: ask for at least 1 token")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"{self}: temperature and top_k must be >= 0 and top_p in (0, 1]")


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      request_id: the request's id (its key of randomness).
      tokens: (n,) int32 new tokens, the EOS that ended it included.
      logprobs: (n,) float32 log-probability of each token under the distribution it
        was sampled from before top-k/top-p: the model's softmax at the request's
        temperature (at 1 for a greedy request). What a policy-gradient loss compares
        its own log-probabilities with.
      finish_reason: "eos" (an end-of-sequence token) or "length" (max_new_tokens).
    """
    request_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str


def sample_rows(logits, keys, temperature, top_k, top_p, greedy_only: bool = False):
    """One token per row of (rows, vocab) logits, each row with its own sampling.

    Args:
      logits: (rows, vocab). keys: (rows,) typed PRNG keys.
      temperature, top_k, top_p: (rows,) arrays, as ``SamplingParams``'.
      greedy_only: every row's temperature is 0 (static): no sort, no draw.

    Returns:
      (tokens (rows,) int32, their log-probabilities (rows,) float32; see
      ``Completion.logprobs``).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(scaled, -1)
    best = jnp.argmax(logits, -1).astype(jnp.int32)
    if greedy_only:
        return best, jnp.take_along_axis(logp, best[:, None], -1)[:, 0]
    vocab = logits.shape[-1]
    ordered = -jnp.sort(-scaled, -1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], -1)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, -1)
    before = jnp.cumsum(probs, -1) - probs  # the mass of strictly more likely tokens
    kept = jnp.where(before < top_p[:, None], ordered, jnp.inf)
    floor = jnp.maximum(kth, jnp.min(kept, -1, keepdims=True))
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(scaled < floor, -jnp.inf, scaled))
    token = jnp.where(greedy, best, drawn.astype(jnp.int32))
    return token, jnp.take_along_axis(logp, token[:, None], -1)[:, 0]


def requests(n: int, params, request_ids) -> tuple[list[SamplingParams], list[int]]:
    """One ``SamplingParams`` and one id for each of ``n`` prompts (``Sampler.sample``'s
    arguments: one SamplingParams for all, ids by default their indices)."""
    params = [params] * n if isinstance(params, SamplingParams) else list(params)
    ids = list(range(n)) if request_ids is None else [int(i) for i in request_ids]
    if len(params) != n or len(ids) != n:
        raise ValueError(f"{n} prompts but {len(params)} SamplingParams and {len(ids)} "
                         "request ids: give one per prompt (or one SamplingParams)")
    return params, ids
