"""A Sampler's decoding on a paged KV cache: every request, start to end, in one call.

The cache is a pool of pages shared by the slots (``redray/models/paged.py``). A
request taking a slot is given the pages its prompt and its own ``max_new_tokens``
need, from the pool's free pages (the first free ones, in order); they return to the
pool when it ends, by EOS or its maximum. So a slot holds what its own request may
write, not the longest window of any request, and the pool, not the slots, sets how
many tokens are in flight: a request waits until enough pages are free.

The call runs as ``decode_steps.refill_step`` does (the waiting prompts on the device,
the longest asked first; every ``check_every`` steps the free slots are refilled, a
few prompts prefilled together and their keys and values written into their pages;
each token into its request's row of the outputs), but to the end: it returns when
every request has ended, and the host reads the outputs once. A row's positions count
its real tokens from its first page, so no window shifts and no column is shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redray.models import paged
from redray.models.generate import prompt_prefill
from redray.post_training.decode_steps import (_empty_state, _request_outputs, admitted,
                                               recorded, request_keys, sampled)
from redray.post_training.slots import QUEUE_INPUTS, sampling_columns, unpacked


def pages_needed(tokens, page_size: int):
    """The pages ``tokens`` tokens fill."""
    return -(-tokens // page_size)


def _released(c: dict, ended, where, slots: int, pool_pages: int, columns) -> dict:
    """The pages of the slots ``where`` whose request ``ended`` back in the pool
    (``where`` = ``slots``: nowhere; ``columns``: a page table's)."""
    rows = jnp.minimum(where, slots - 1)
    back = ended[:, None] & (where < slots)[:, None] \
        & (columns[None, :] < c["held"][rows][:, None])
    pages = jnp.where(back, c["table"][rows], pool_pages)
    return dict(c, free=c["free"].at[pages].set(True, mode="drop"))


def _prefilled_into_pages(c: dict, m, q: dict, count, keys_q, sampling_q, need_q, prompt_q,
                          shapes: tuple, columns, greedy_only: bool, eos) -> dict:
    """``paged_step``'s refill: the next waiting prompts of the queue ``q`` (``count``
    requests; at most ``chunk``, as many as free slots and free pages hold, in order) run
    through the model ``m`` into the first free slots and their pages, and admitted."""
    slots, pool_pages, _, _, n, width, _, chunk = shapes
    req = jnp.minimum(c["next"] + jnp.arange(chunk), n - 1)
    need = need_q[req]
    cum = jnp.cumsum(need)
    fits = ((jnp.arange(chunk) < jnp.minimum(slots - c["active"].sum(), count - c["next"]))
            & (cum <= c["free"].sum()))
    fits = jnp.cumprod(fits).astype(bool)  # a prefix: the queue's order
    taken = fits.sum()
    free_ids = jnp.nonzero(c["free"], size=pool_pages, fill_value=0)[0]
    use = fits[:, None] & (columns[None, :] < need[:, None])
    table = jnp.where(use, free_ids[jnp.minimum((cum - need)[:, None] + columns,
                                                pool_pages - 1)], 0)
    free = c["free"].at[jnp.where(use, table, pool_pages)].set(False, mode="drop")
    ids, mask = q["ids"][req], q["mask"][req]
    logits, small = prompt_prefill(m, ids, mask, m.init_cache(chunk, width))
    at = paged.Pages(table, jnp.zeros(chunk, jnp.int32))
    written = mask.astype(bool) & fits[:, None]
    where = jnp.where(fits, jnp.argsort(c["active"], stable=True)[:chunk],
                      slots).astype(jnp.int32)  # slots: nowhere
    # attention layers' keys and values into their pages; a linear layer's state into its
    # slot's row, replacing (resetting) the last request's
    pool = [paged.written(layer, at, where, new, written) for layer, new in zip(c["pool"], small)]
    c, live = admitted(c, logits, where, req, fits, keys_q, sampling_q, q["max_new"],
                       greedy_only, eos)

    def put(x, v):
        return x.at[where].set(v, mode="drop")
    c = dict(c, next=c["next"] + taken, pool=pool, free=free, table=put(c["table"], table),
             held=put(c["held"], need), lengths=put(c["lengths"], prompt_q[req]))
    # a request that ended on its first token gives its pages back at once
    return _released(c, fits & ~live, where, slots, pool_pages, columns)


def paged_step(inner, shapes: tuple[int, int, int, int, int, int, int, int], greedy_only: bool,
               pad: int, eos, check_every: int):
    """``(weights, queue) -> request outputs`` (``QUEUE_INPUTS``, ``REQUEST_OUTPUTS``) for
    ``shapes`` = (slots, the pool's pages, tokens per page, the pages a slot may hold,
    rows of requests (padded; their count is an input), the prompts' width, the longest
    completion asked, the prompts prefilled together). ``inner``: the graph of the model
    with its layers split (``generate.for_decoding``)."""
    slots, pool_pages, size, per_slot, n, width, longest, chunk = shapes
    every, eos = check_every, jnp.asarray(eos)
    columns = jnp.arange(per_slot)

    def run(weights, host_in):
        q = unpacked(host_in, QUEUE_INPUTS, width)
        count = q["count"][0]
        keys_q = request_keys(q["seed"][0], q["id"])
        sampling_q = sampling_columns(q)
        prompt_q = q["mask"].sum(1).astype(jnp.int32)
        need_q = pages_needed(prompt_q + q["max_new"], size)

        def model():
            return nnx.merge(inner, jax.tree.map(lambda x: x, weights))
        c = dict(
            next=jnp.int32(0), pool=model().init_pages(pool_pages, size, rows=slots),
            free=jnp.ones(pool_pages, bool), table=jnp.zeros((slots, per_slot), jnp.int32),
            held=jnp.zeros(slots, jnp.int32), lengths=jnp.zeros(slots, jnp.int32),
            **_empty_state(slots, n, longest, pad, sampling_q))

        def can_refill(c):
            free = slots - c["active"].sum()
            waiting = count - c["next"]
            room = need_q[jnp.minimum(c["next"], n - 1)] <= c["free"].sum()
            return (waiting > 0) & (free >= jnp.minimum(chunk, waiting)) & room

        def prefill(c):
            """The next waiting prompts (at most ``chunk``, as many as free slots and
            free pages hold, in order) into the first free slots and their pages."""
            return _prefilled_into_pages(c, model(), q, count, keys_q, sampling_q, need_q,
                                         prompt_q, shapes, columns, greedy_only, eos)

        def step(_, c):
            """One decoding step of every slot; a request that ends gives its pages back."""
            active = c["active"]
            at = paged.Pages(c["table"], c["lengths"])
            logits, pool = model()(c["token"][:, None], active[:, None], cache=c["pool"],
                                   cache_index=at)
            new, lp, ended, finished, remaining = sampled(
                logits, active, c["keys"], c["counts"], c["remaining"], c["sampling"], greedy_only,
                eos)
            c = dict(recorded(c, new, lp, ended, finished, remaining), pool=pool,
                     lengths=c["lengths"] + active)
            return _released(c, finished, jnp.arange(slots), slots, pool_pages, columns)

        def block(c):
            c = jax.lax.while_loop(can_refill, prefill, c)
            return jax.lax.fori_loop(0, every, step, c)

        c = jax.lax.while_loop(lambda c: (c["next"] < count) | c["active"].any(), block, c)
        return _request_outputs(c, longest)
    return run

