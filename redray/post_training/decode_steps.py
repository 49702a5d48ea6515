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
                                        PREFILL_OUTPUTS, QUEUE_INPUTS, REQUEST_OUTPUTS,
                                        SAMPLING, SLOT_STATE, packed, sampling_columns,
                                        unpacked)


def request_keys(seed, ids):
    """Each request's key: ``fold_in(key(seed), id)`` (its n-th token's is that folded
    with n), whatever slot or call it is decoded in."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids)


def decoded(model, token, active, t, cache, kv_valid, keys, counts, remaining, sampling,
            greedy_only: bool, eos):
    """One decoding step of every slot (the same in ``decode_step``'s loop and
    ``refill_step``'s): the live slots' column ``t`` marked valid, their last tokens run
    through the model, the next ones sampled with each request's key folded with its
    count. Returns the window's ``kv_valid`` and ``cache``, the tokens and their
    log-probabilities, which ended by EOS, which finished (EOS or their maximum), and
    the tokens each has left."""
    kv_valid = jax.lax.dynamic_update_slice(kv_valid, active.astype(jnp.int32)[:, None],
                                            (0, t))
    logits, cache = model(token[:, None], kv_valid, cache=cache, cache_index=t)
    return (kv_valid, cache, *sampled(logits, active, keys, counts, remaining, sampling,
                                      greedy_only, eos))


def sampled(logits, active, keys, counts, remaining, sampling, greedy_only: bool, eos):
    """A decoding step's next tokens from its ``logits`` (rows, 1, vocabulary), each
    request's key folded with its count: the tokens and their log-probabilities, which
    ended by EOS, which of the ``active`` finished (EOS or their maximum), and the
    tokens each has left."""
    step_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys), counts)
    new, lp = sample_rows(logits[:, -1], step_keys, *sampling, greedy_only)
    ended = jnp.isin(new, eos)
    remaining = remaining - active
    return new, lp, ended, active & (ended | (remaining <= 0)), remaining


def admitted(c: dict, logits, where, req, valid, keys_q, sampling_q, max_new_q,
             greedy_only: bool, eos) -> tuple[dict, jax.Array]:
    """A call that refills its own slots (``refill_step``, ``paged_steps``): the slots
    ``where`` taking the waiting requests ``req`` (the ``valid`` ones; ``where`` = the
    slots' count: nowhere), their first tokens sampled from the prefill's ``logits`` by
    each request's key, sampling and maximum (``keys_q``, ``sampling_q``, ``max_new_q``
    of every request), set into the slots' state and each request's outputs of ``c``.
    Returns (``c``, which of them decode on)."""
    n = len(c["length"])
    keys = keys_q[req]
    sampling = tuple(x[req] for x in sampling_q)
    first = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
    token, lp = sample_rows(logits, first, *sampling, greedy_only)
    ended = jnp.isin(token, eos)
    remaining = max_new_q[req] - 1
    live = ~ended & (remaining > 0)
    at = jnp.where(valid, req, n)  # n: nowhere

    def put(x, v):
        return x.at[where].set(v, mode="drop")
    return dict(
        c, token=put(c["token"], token), active=put(c["active"], live),
        counts=put(c["counts"], jnp.ones_like(token)), remaining=put(c["remaining"], remaining),
        keys=put(c["keys"], jax.random.key_data(keys)), owner=put(c["owner"], req),
        sampling=tuple(put(x, v) for x, v in zip(c["sampling"], sampling)),
        out=c["out"].at[at, 0].set(token, mode="drop"),
        lps=c["lps"].at[at, 0].set(lp, mode="drop"),
        length=c["length"].at[at].set(1, mode="drop"),
        reason=c["reason"].at[at].set(jnp.where(live, 0, jnp.where(ended, 1, 2)),
                                      mode="drop")), live


def recorded(c: dict, new, lp, ended, finished, remaining) -> dict:
    """A decoding step's sampled tokens ``new`` (their log-probabilities ``lp``; which
    ``ended`` by EOS, which ``finished``, the tokens each has left) into the slots'
    state and, for the live slots, their requests' outputs, in a call that refills its
    own slots."""
    active, counts, n = c["active"], c["counts"], len(c["length"])
    at = jnp.where(active, c["owner"], n)
    return dict(
        c, remaining=remaining, active=active & ~finished, counts=counts + active,
        token=jnp.where(active, new, c["token"]),
        out=c["out"].at[at, counts].set(new, mode="drop"),
        lps=c["lps"].at[at, counts].set(lp, mode="drop"),
        length=c["length"].at[at].set(counts + 1, mode="drop"),
        reason=c["reason"].at[jnp.where(finished, c["owner"], n)].set(
            jnp.where(ended, 1, 2), mode="drop"))


def _empty_state(slots: int, n: int, longest: int, pad: int, sampling_q) -> dict:
    """A call that refills its own slots, at its start: ``slots`` free slots (their
    sampling columns of ``sampling_q``'s dtypes) and ``n`` requests' rows of outputs,
    ``longest`` tokens of ``pad``, nothing written."""
    return dict(
        token=jnp.zeros(slots, jnp.int32), active=jnp.zeros(slots, bool),
        counts=jnp.zeros(slots, jnp.int32), remaining=jnp.zeros(slots, jnp.int32),
        keys=jnp.zeros((slots, 2), jnp.uint32), owner=jnp.full(slots, -1, jnp.int32),
        sampling=tuple(jnp.zeros(slots, x.dtype) for x in sampling_q),
        out=jnp.full((n, longest), pad, jnp.int32), lps=jnp.zeros((n, longest), jnp.float32),
        length=jnp.zeros(n, jnp.int32), reason=jnp.zeros(n, jnp.int32))


def _request_outputs(c: dict, longest: int):
    """The requests' outputs in ``c`` packed for the host (``REQUEST_OUTPUTS``)."""
    return packed(REQUEST_OUTPUTS, dict(out=c["out"], lps=c["lps"], length=c["length"],
                                        reason=c["reason"]), longest)


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
        keys = request_keys(inputs["seed"][0], inputs["id"])
        first = jax.vmap(lambda key: jax.random.fold_in(key, 0))(keys)
        token, logprob = sample_rows(logits, first, *sampling_columns(inputs), greedy_only)
        return cache, kv_valid, packed(PREFILL_OUTPUTS, dict(
            token=token, logprob=logprob, keys=jax.random.key_data(keys)))
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
            model = nnx.merge(inner, jax.tree.map(lambda x: x, weights))
            kv_valid, cache, new, lp, ended, finished, remaining = decoded(
                model, token, active, t, cache, kv_valid, keys, counts, remaining, sampling,
                greedy_only, eos)
            out = out.at[:, i].set(jnp.where(active, new, pad))
            lps = lps.at[:, i].set(jnp.where(active, lp, 0.0))
            written = written.at[:, i].set(active)
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


def _shifted(c: dict, width: int, length: int) -> dict:
    """The window's columns from the oldest live sequence's start (a new prompt keeps its
    room behind ``t``): a copy, once per many steps (``refill_step``)."""
    s = jnp.minimum(jnp.min(jnp.where(c["active"], c["start"], c["t"])), c["t"] - width)
    cols = jnp.arange(length) < length - s

    def roll(x, axis):
        return jnp.roll(x, -s, axis)
    return dict(c, t=c["t"] - s, start=c["start"] - s,
                cache=jax.tree.map(lambda x: roll(x, x.ndim - 2), c["cache"]),
                kv_valid=roll(c["kv_valid"], 1) * cols[None, :])


def _prefilled_into_window(c: dict, m, q: dict, count, keys_q, sampling_q, shapes: tuple,
                           keep, greedy_only: bool, eos) -> dict:
    """``refill_step``'s refill: the next ``chunk`` waiting prompts of the queue ``q``
    (``count`` requests) run through the model ``m`` together into the first free slots,
    right-aligned behind ``t`` (``keep``: the prompts' columns), and admitted there."""
    slots, length, n, width, _, chunk = shapes
    taken = jnp.minimum(jnp.minimum(slots - c["active"].sum(), count - c["next"]), chunk)
    valid = jnp.arange(chunk) < taken
    free_first = jnp.argsort(c["active"], stable=True)[:chunk]
    where = jnp.where(valid, free_first, slots).astype(jnp.int32)  # slots: nowhere
    req = jnp.minimum(c["next"] + jnp.arange(chunk), n - 1)
    ids, mask = q["ids"][req], q["mask"][req]
    logits, small = prompt_prefill(m, ids, mask, m.init_cache(chunk, width))
    cols = c["t"] - width + keep
    cache = jax.tree.map(lambda big, new: write(big, new, where, cols), c["cache"], small)
    row = jnp.zeros((chunk, length), jnp.int32).at[:, cols].set(mask)
    kv_valid = c["kv_valid"].at[where].set(row, mode="drop")
    c, _ = admitted(c, logits, where, req, valid, keys_q, sampling_q, q["max_new"],
                    greedy_only, eos)
    return dict(c, next=c["next"] + taken, cache=cache, kv_valid=kv_valid,
                start=c["start"].at[where].set(c["t"] - width, mode="drop"))


def _slot_state(c: dict, slots: int):
    """The slots' state in ``c`` packed for the host (``SLOT_STATE``); a free slot's
    owner is -1."""
    owner = jnp.where(c["active"], c["owner"], -1)
    return packed(SLOT_STATE, dict(
        token=c["token"], active=c["active"], counts=c["counts"],
        remaining=c["remaining"], keys=c["keys"], owner=owner, start=c["start"],
        t=jnp.broadcast_to(c["t"], (slots,)),
        **{name: x for (name, _, _), x in zip(SAMPLING, c["sampling"])}))


def refill_step(inner, shapes: tuple[int, int, int, int, int, int], greedy_only: bool, pad: int,
                eos, check_every: int):
    """A call that decodes a queue of requests through ``slots`` slots and refills each
    freed slot itself: ``(weights, queue) -> (cache, kv_valid, slot state, request
    outputs)`` (``QUEUE_INPUTS``, ``SLOT_STATE``, ``REQUEST_OUTPUTS``), for ``shapes`` =
    (slots, the window's width, rows of requests (the requests' count is an input: the
    rows are padded), the prompts' width, the longest completion asked, the prompts
    prefilled together). ``inner``: the graph of the model with its
    layers split (``generate.for_decoding``), which prefills too.

    The cache is made empty inside. Every ``check_every`` steps: the window is shifted
    left (its columns renumbered from the oldest live sequence's start) when the next
    steps would pass its end; then, while ``chunk`` slots are free (or as many as the
    requests still waiting), the next waiting prompts are run through the model together
    and written into free slots, right-aligned behind ``t`` as the host's prefill
    writes them; then ``check_every`` steps decode every slot. Each sampled token is
    written to its request's row of the outputs, so a slot serves several requests in
    one call. The call ends once every request has taken a slot (the host decodes the
    rest: ``Sampler``); the host reads its outputs then, and only then.
    """
    slots, length, n, width, longest, chunk = shapes
    every, eos = check_every, jnp.asarray(eos)
    keep = jnp.arange(width)

    def refill(weights, host_in):
        q = unpacked(host_in, QUEUE_INPUTS, width)
        seed, count = q["seed"][0], q["count"][0]  # the requests (``n``: padded)
        keys_q = request_keys(seed, q["id"])
        sampling_q = sampling_columns(q)

        def model():
            return nnx.merge(inner, jax.tree.map(lambda x: x, weights))
        c = dict(
            t=jnp.int32(width), next=jnp.int32(0),
            cache=model().init_cache(slots, length), kv_valid=jnp.zeros((slots, length), jnp.int32),
            start=jnp.zeros(slots, jnp.int32), **_empty_state(slots, n, longest, pad, sampling_q))

        def can_refill(c):
            free = slots - c["active"].sum()
            waiting = count - c["next"]
            return (waiting > 0) & (free >= jnp.minimum(chunk, waiting))

        def prefill(c):
            """The next ``chunk`` waiting prompts into the first free slots."""
            return _prefilled_into_window(c, model(), q, count, keys_q, sampling_q, shapes,
                                          keep, greedy_only, eos)

        def step(_, c):
            """One decoding step of every slot."""
            active, t, counts = c["active"], c["t"], c["counts"]
            kv_valid, cache, new, lp, ended, finished, remaining = decoded(
                model(), c["token"], active, t, c["cache"], c["kv_valid"], c["keys"], counts,
                c["remaining"], c["sampling"], greedy_only, eos)
            return dict(recorded(c, new, lp, ended, finished, remaining), t=t + 1, cache=cache,
                        kv_valid=kv_valid)

        def block(c):
            c = jax.lax.cond(c["t"] + every > length, lambda c: _shifted(c, width, length),
                             lambda c: c, c)
            c = jax.lax.while_loop(can_refill, prefill, c)
            return jax.lax.cond(c["next"] < count,
                                lambda c: jax.lax.fori_loop(0, every, step, c), lambda c: c, c)

        c = jax.lax.while_loop(lambda c: c["next"] < count, block, c)
        return c["cache"], c["kv_valid"], _slot_state(c, slots), _request_outputs(c, longest)
    return refill
