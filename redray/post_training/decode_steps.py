"""The two compiled steps of a Sampler, as functions of its arrays.

``prefill``: the prompts taking free slots run through the model together (left-padded
to a bucket of tokens; a prompt several slots take, once) and their keys and values
written into their rows, each slot's first token sampled. ``decode``: the live slots
decoded step after step inside one loop, which ends when enough slots are free to
refill (``refill_at``), when the window has no room for another check's steps, or after
``steps``. Both take and return the host's values in one packed array
(``redray/post_training/slots.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redray.models.generate import prompt_prefill
from redray.post_training.kv_window import write
from redray.post_training.sampling import sample_rows
from redray.post_training.slots import (DECODE_INPUTS, DECODE_OUTPUTS, PREFILL_INPUTS,
                                        PREFILL_OUTPUTS, packed, sampling_columns, unpacked)


def prefill_step(graphdef, rows: tuple[int, bool, int | None], widths: tuple[int, int],
                 greedy_only: bool):
    """The prefill of ``rows`` = (prompts padded to a power of two, whether they fill
    every slot, the distinct prompts run or None: one per slot) at ``widths`` = (the
    prompts' width, the window's): ``(state, cache, kv_valid, packed) -> (cache,
    kv_valid, packed outputs)``."""
    (batch, every, run), (width, length) = rows, widths

    def prefill(state, cache, kv_valid, host_in):
        inputs = unpacked(host_in, PREFILL_INPUTS, width)
        t, ids, mask, where = (inputs[k] for k in ("t", "ids", "mask", "where"))
        t = t[0]
        model = nnx.merge(graphdef, state)
        if run is None:  # a prompt per slot
            logits, small = prompt_prefill(model, ids, mask, model.init_cache(batch, width))
        else:  # the ``run`` distinct prompts, then each slot's copied from its source
            source = inputs["source"]
            logits, small = prompt_prefill(model, ids[:run], mask[:run],
                                           model.init_cache(run, width))
            logits, mask = logits[source], mask[source]
            small = jax.tree.map(lambda x: jnp.take(x, source, axis=x.ndim - 4), small)
        cols = t - width + jnp.arange(width)
        cache = jax.tree.map(lambda big, new: write(big, new, where, cols, every), cache,
                             small)
        row = jnp.zeros((batch, length), jnp.int32).at[:, cols].set(mask)
        kv_valid = row[:len(kv_valid)] if every else kv_valid.at[where].set(row, mode="drop")
        first = jax.vmap(lambda key: jax.random.fold_in(key, 0))(
            jax.random.wrap_key_data(inputs["keys"]))
        token, logprob = sample_rows(logits, first, *sampling_columns(inputs), greedy_only)
        return cache, kv_valid, packed(PREFILL_OUTPUTS, dict(token=token, logprob=logprob))
    return prefill


def decode_step(inner, steps: int, rows_and_width: tuple[int, int], greedy_only: bool,
                pad: int, eos, check_every: int):
    """A decoding call of at most ``steps`` steps on (slots, window width): ``(weights,
    cache, kv_valid, packed) -> (cache, kv_valid, packed outputs)``; ``inner``: the graph
    of the model with its layers split (``generate.for_decoding``)."""
    (slots, length), every = rows_and_width, check_every
    eos = jnp.asarray(eos)

    def decode(weights, cache, kv_valid, host_in):
        inputs = unpacked(host_in, DECODE_INPUTS)
        t, refill_at, token, active, counts, remaining, keys = (inputs[k] for k in (
            "t", "refill_at", "token", "active", "counts", "remaining", "keys"))
        t, refill_at, sampling = t[0], refill_at[0], sampling_columns(inputs)
        out = jnp.full((slots, steps), pad, jnp.int32)
        lps = jnp.zeros((slots, steps), jnp.float32)
        written = jnp.zeros((slots, steps), bool)
        by_eos = jnp.zeros((slots,), bool)

        def cond(c):  # checked every ``every`` steps: room for as many more
            i, t, active = c[0], c[1], c[4]
            free = slots - active.sum()
            return ((i + every <= steps) & (t + every <= length) & active.any()
                    & (free < refill_at))

        def body(c):
            i, t, cache, kv_valid, active, token, counts, remaining, out, lps, written, \
                by_eos = c
            kv_valid = jax.lax.dynamic_update_slice(
                kv_valid, active.astype(jnp.int32)[:, None], (0, t))
            model = nnx.merge(inner, jax.tree.map(lambda x: x, weights))
            logits, cache = model(token[:, None], kv_valid, cache=cache, cache_index=t)
            step_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys),
                                                     counts)
            new, lp = sample_rows(logits[:, -1], step_keys, *sampling, greedy_only)
            out = out.at[:, i].set(jnp.where(active, new, pad))
            lps = lps.at[:, i].set(jnp.where(active, lp, 0.0))
            written = written.at[:, i].set(active)
            ended = jnp.isin(new, eos)
            remaining = remaining - active
            finished = active & (ended | (remaining <= 0))
            by_eos = by_eos | (active & ended)
            counts = counts + active
            token = jnp.where(active, new, token)
            return (i + 1, t + 1, cache, kv_valid, active & ~finished, token, counts,
                    remaining, out, lps, written, by_eos)

        steps_run = body if every == 1 else \
            lambda c: jax.lax.fori_loop(0, every, lambda _, c: body(c), c)
        c = jax.lax.while_loop(cond, steps_run, (jnp.int32(0), t, cache, kv_valid, active,
                                                 token, counts, remaining, out, lps,
                                                 written, by_eos))
        _, t, cache, kv_valid, active, token, counts, remaining, out, lps, written, \
            by_eos = c
        return cache, kv_valid, packed(DECODE_OUTPUTS, dict(
            out=out, written=written, lps=lps, token=token, active=active, counts=counts,
            remaining=remaining, by_eos=by_eos, t=jnp.broadcast_to(t, token.shape)), steps)
    return decode
