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


NORMALIZATIONS = ("tokens", "sequences")


def next_token_loss(model, ids, segment_ids=None, *, loss_mask=None,
                    normalize: str = "tokens", metrics: bool = False,
                    chunk: int | None = None, train: bool = False, **call):
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from ``ids[:, :-1]``.

    Args:
      model: a redray causal LM (``model(ids, hidden=True)`` and ``model.logits``).
      ids: (batch, length) token ids.
      segment_ids: (batch, length) of packed rows (``redray.data.pack``): attention and
        the loss stay inside each document, padding (0) counts nowhere, and no
        document's first token is predicted from the one before it.
      loss_mask: (batch, length), 1 on the tokens to learn (a chat row's assistant
        tokens, ``redray.data.chat``): token ``t + 1`` is a target where its mask is 1.
        None: every token (of a document).
      normalize: ``"tokens"``: the mean over every target token of the batch, so each
        token weighs the same whatever its row (the batch is the whole global batch
        inside the step; with ``metrics=True`` the Trainer's gradient accumulation
        weighs each micro-batch by its tokens, so the mean is over every micro-batch of
        the update, as TRL's ``average_tokens_across_devices`` is); ``"sequences"``:
        the mean over documents (each row, or each packed segment) of each one's mean
        over its target tokens.
      metrics: return ``(loss, {"tokens": n, "weight": n})``: the target tokens, logged
        beside the loss, and what the loss averages over as the batch's weight
        (``redray.functions.WEIGHT``): the tokens, or normalized by sequences the
        documents with a target, then logged as ``"sequences"`` too.
      chunk: tokens whose logits exist at once (None: all of them).
      train: passed to the model (dropout, remat).
      **call: other arguments of the model's call (``attention_mask``...).
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r}: give one of {NORMALIZATIONS}")
    inputs, targets = ids[:, :-1], ids[:, 1:]
    if segment_ids is not None:
        call["segment_ids"] = segment_ids[:, :-1]
        weights = ((segment_ids[:, 1:] == segment_ids[:, :-1])
                   & (segment_ids[:, 1:] != 0)).astype(jnp.float32)
    else:
        weights = jnp.ones(targets.shape, jnp.float32)
    if loss_mask is not None:
        if loss_mask.shape != ids.shape:
            raise ValueError(f"loss_mask has shape {loss_mask.shape}, ids {ids.shape}: give "
                             "a mask per token (the packed rows' loss_mask)")
        weights = weights * (loss_mask[:, 1:] != 0).astype(jnp.float32)
    count = tokens_counted = weights.sum()
    if normalize == "sequences":
        weights, count = per_sequence(weights, None if segment_ids is None
                                      else segment_ids[:, 1:])
    if chunk is None:
        logits = model(inputs, train=train, **call)
        tokens = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                targets)
        value = (tokens * weights).sum() / jnp.maximum(count, 1.0)
    else:
        hidden = model(inputs, train=train, hidden=True, **call)
        value = chunked_cross_entropy(model.logits, hidden, targets, weights, chunk,
                                      divide=count)
    if metrics:
        counted = {"tokens": tokens_counted, "weight": count}
        return value, counted if normalize == "tokens" else {**counted, "sequences": count}
    return value


def per_sequence(weights, segments=None):
    """Token weights that average each document's targets, then the documents: every
    target of a document with n targets weighs 1 / n (a document: a row, or a packed
    row's segment: ``segments``, the targets' segment ids); and the documents with a
    target, the total the weighted sum is divided by."""
    b, t = weights.shape
    doc = jnp.zeros((b, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
    slot = (jnp.arange(b)[:, None] * (t + 1) + doc).reshape(-1)
    per_doc = jax.ops.segment_sum(weights.reshape(-1), slot, num_segments=b * (t + 1))
    n = per_doc[slot].reshape(b, t)
    return jnp.where(weights > 0, weights / jnp.maximum(n, 1e-30), 0.0), \
        (per_doc > 0).sum().astype(jnp.float32)


def chunked_cross_entropy(head, hidden, targets, weights, chunk: int, divide=None):
    """Weighted mean cross-entropy of ``head(hidden)`` against ``targets``, computed for
    ``chunk`` tokens at a time (see the module docstring).

    Args:
      head: hidden (n, d) -> logits (n, vocab).
      hidden: (..., d) final hidden states; targets, weights: (...) per token.
      chunk: tokens per piece.
      divide: what the weighted sum is divided by (None: the weights' sum).
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
    return total / jnp.maximum(w.sum() if divide is None else divide, 1.0)
