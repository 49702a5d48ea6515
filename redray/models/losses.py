"""The language-model loss, without the (tokens, vocabulary) logits in memory at once.

At a 32k vocabulary, a batch of 8 x 2048 tokens has 2 GB of float32 logits (and their
gradient): more than the rest of a small model's step. ``next_token_loss`` with
``chunk=N`` runs the LM head on N tokens at a time inside a ``scan`` whose steps are
rematerialized, so the backward pass recomputes each piece's logits instead of keeping
them all: the loss and its gradient are the same (float32 sums in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def next_token_loss(model, ids, segment_ids=None, *, chunk: int | None = None,
                    train: bool = False, **call):
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from ``ids[:, :-1]``.

    Args:
      model: a redray causal LM (``model(ids, hidden=True)`` and ``model.logits``).
      ids: (batch, length) token ids.
      segment_ids: (batch, length) of packed rows (``redray.data.pack``): attention and
        the loss stay inside each document, padding (0) counts nowhere.
      chunk: tokens whose logits exist at once (None: all of them).
      train: passed to the model (dropout, remat).
      **call: other arguments of the model's call (``attention_mask``...).
    """
    inputs, targets = ids[:, :-1], ids[:, 1:]
    if segment_ids is not None:
        call["segment_ids"] = segment_ids[:, :-1]
        weights = ((segment_ids[:, 1:] == segment_ids[:, :-1])
                   & (segment_ids[:, 1:] != 0)).astype(jnp.float32)
    else:
        weights = jnp.ones(targets.shape, jnp.float32)
    if chunk is None:
        logits = model(inputs, train=train, **call)
        tokens = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                targets)
        return (tokens * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    hidden = model(inputs, train=train, hidden=True, **call)
    return chunked_cross_entropy(model.logits, hidden, targets, weights, chunk)


def chunked_cross_entropy(head, hidden, targets, weights, chunk: int):
    """Weighted mean cross-entropy of ``head(hidden)`` against ``targets``, computed for
    ``chunk`` tokens at a time (see the module docstring).

    Args:
      head: hidden (n, d) -> logits (n, vocab).
      hidden: (..., d) final hidden states; targets, weights: (...) per token.
      chunk: tokens per piece.
    """
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    y = targets.reshape(-1)
    w = weights.reshape(-1).astype(jnp.float32)
    pad = -h.shape[0] % chunk
    if pad:  # weight 0: padding adds nothing
        h = jnp.pad(h, ((0, pad), (0, 0)))
        y, w = jnp.pad(y, (0, pad)), jnp.pad(w, (0, pad))
    pieces = h.shape[0] // chunk

    @jax.checkpoint
    def piece(total, xs):
        hc, yc, wc = xs
        logits = head(hc).astype(jnp.float32)
        return total + (optax.softmax_cross_entropy_with_integer_labels(logits, yc) * wc).sum(), \
            None

    total, _ = jax.lax.scan(piece, jnp.zeros((), jnp.float32),
                            (h.reshape(pieces, chunk, d), y.reshape(pieces, chunk),
                             w.reshape(pieces, chunk)))
    return total / jnp.maximum(w.sum(), 1.0)
