"""A sampler with continuous batching: a finished sequence's slot takes the next prompt.

``redray.models.generate`` decodes a static batch: every row runs until the longest one
ends. Where output lengths vary (reinforcement learning's rollouts), most of that work
is padding. The ``Sampler`` keeps ``slots`` sequences in flight instead and fills a
slot with the next waiting prompt as soon as its sequence ends, so the rows decoded are
rows still writing. Its parts, each in its own module:

- the slots as the host schedules them (``slots.py``): each slot's request, when a
  round ends to refill or narrow, the packed inputs and outputs of a compiled call;
- the KV cache as a window of the live sequences' columns (``kv_window.py``): a
  row's tokens are contiguous and end at the column ``t`` every slot writes next, and
  position ids count a row's real tokens (``layers.positions_for``), so where a
  sequence sits in its row changes nothing it computes; the window's width is set by
  the sequences in flight (a step's cost grows with the columns it reads: 5.7 ms at 32,
  14.8 ms at 176 for 64 rows of the benchmark's model), not by the number of prompts
  nor by the longest request;
- the compiled prefill and decoding steps (``decode_steps.py``);
- where the slots live on the model's mesh (``slot_placement.py``; the model placed
  through ``redray.sharding.on_mesh``, as the engine and ``from_pretrained`` place it).

With more prompts than slots, one compiled call decodes them all
(``decode_steps.refill_step``): the waiting prompts are placed on the device ahead (the
longest asked first), a freed slot's next prompt is prefilled inside the decoding loop (a
few at a time), each token is written to its request's row, and the window is shifted
left inside the loop when its room runs out; the host reads the results once, when every
prompt has taken a slot, and decodes the rest as below. A GPU waits for the host
between calls: on one H200 this ran the refill workload 1.36x ``generate`` for a small
model, where the host's refills ran 0.94x, and 1.48x for a 1.1B one (before the longest
went first; docs/performance/sampler.md).
``refill_on_device=False``, or a window too narrow for the longest prompt beside the
longest completion, has the host refill instead:

Prefill runs beside decoding: between two decoding rounds, the prompts taking the free
slots are run through the model together (left-padded to a bucket of 16 tokens) and
their keys and values scattered into their rows (written as one slice when they take
every slot, as a call's first prefill does). A prompt that several of them take (the
requests of a GRPO group, side by side) is run once and its keys and values copied to
each of its slots.

Once no prompt waits (``narrow``): on CPUs, where a step costs about its rows, the live
sequences move into fewer slots as others end, a round per batch size; elsewhere the
rest is decoded in one call, its window wide enough for the longest remaining
completion, as ``generate`` decodes (a GPU's step costs about as much for a few rows as
for many, and every round costs a call and a wait for the device).

``kv_cache="paged"`` keeps the cache in pages of a pool the slots share
(``redray/models/paged.py``) instead of the window: a request holds the pages its own
prompt and maximum need while it decodes, so a long request does not widen every
slot's cache, and every request is decoded in one call that refills its own slots
(``paged_steps.py``). The pool is sized by the device's memory (``pool_pages``).

Sampling is per request (``SamplingParams``: temperature, top-k, top-p, maximum new
tokens), and so is its randomness: the key of a request's n-th token is
``fold_in(fold_in(key(seed), request_id), n)``, whatever slot or batch it shares.
A run that resumes with the same request ids samples the same tokens.
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from redray.models import paged
from redray.models.generate import for_decoding, special_tokens
from redray.post_training.decode_steps import decode_step, prefill_step, refill_step
from redray.post_training.kv_window import PROMPT_BUCKET, ROOM, KVWindow, bucket, window
from redray.post_training.paged_steps import paged_step, pages_needed
from redray.post_training.sampling import Completion, SamplingParams, requests
from redray.post_training.slot_placement import SlotPlacement
from redray.post_training.slots import (DECODE_INPUTS, DECODE_OUTPUTS, PREFILL_INPUTS,
                                        PREFILL_OUTPUTS, QUEUE_INPUTS, REQUEST_OUTPUTS,
                                        SLOT_STATE, Slots, narrowed, packed, refill_at,
                                        unpacked)
from redray.sharding import Parallelism
from redray.sharding.on_mesh import device_memory, mesh_of, placed_state, platform_of, put


class Sampler:
    """Continues prompts with continuous batching on a redray decoder-only model.

    Args:
      model: a redray causal LM (``from_pretrained``, ``build``, a Trainer's ``model()``),
        as placed; or unplaced with ``parallelism``.
      slots: sequences decoded at once (a multiple of the plan's data-parallel size).
      max_length: the longest prompt plus completion a request may have (the cache's
        window, the live sequences' span, is at most this and a quarter more).
      eos_token_id, pad_token_id: as ``generate``'s (default: the checkpoint's
        generation config's EOS ids, else the config's).
      seed: the key every request's randomness is folded from (an attribute: it may
        change between calls).
      parallelism: place ``model``'s parameters on this plan (automatic specs); None:
        leave them where they are.
      steps_per_call: decoding steps per compiled call at most (the host refills slots
        between calls).
      check_every: decoding steps between two checks of whether a call should end (a
        slot to refill, a batch to narrow): the device decodes as many in a row, and a
        freed slot may wait up to that many steps. None: 1 on CPUs, where a check is
        free, else 16, where each check waits for the device (measured on one H200:
        docs/performance/sampler.md).
      narrow: what a call does once no prompt is waiting. True: move the live sequences
        into fewer slots as they end (a round per size: a step costs about its rows on
        a CPU). False: keep the batch whole and decode the rest in one call, its window
        sized for the longest remaining completion (a GPU decodes a few rows about as
        fast as many, and each round costs a call, a copy and a wait for the device).
        None: True on CPUs, else False.
      refill_on_device: with more prompts than slots, decode them in one compiled call
        that refills each freed slot itself (``decode_steps.refill_step``: the waiting
        prompts placed on the device ahead, a freed slot's next prompt prefilled inside
        the decoding loop, the host reading the results once every prompt has taken a
        slot), then the rest as ``narrow`` says. False: the host refills the slots
        between calls (a round, a prefill and a wait for the device per refill).
      kv_cache: "window" (the default): the live window above. "paged" (the default for
        models with linear-attention layers, Qwen3-Next's and Qwen3.5's, which only it
        serves: each slot holds their state and convolution window, which a refill
        resets): a pool of
        pages shared by the slots (``redray/models/paged.py``); a request holds the
        pages its own prompt and ``max_new_tokens`` need while it decodes, and every
        request is decoded in one compiled call that refills the slots itself
        (``paged_steps.py``). A long request no longer widens every slot's cache: the
        pool, not ``slots`` x ``max_length``, is the cache's memory, so more slots fit.
      kv_pages: the pool's pages ("paged"). None: as many as ``slots`` requests of
        ``max_length`` tokens need, at most what the device's memory holds beside the
        weights (``pool_pages``).
      page_size: tokens per page ("paged").

    After a ``sample`` call, ``rounds`` is how many decoding calls it made and
    ``round_trips`` how many compiled calls and reads of device values (each a wait for
    the device).
    """

    def __init__(self, model, *, slots: int = 16, max_length: int, eos_token_id=None,
                 pad_token_id: int | None = None, seed: int = 0,
                 parallelism: Parallelism | None = None, steps_per_call: int = 32,
                 check_every: int | None = None, narrow: bool | None = None,
                 refill_on_device: bool = True, kv_cache: str | None = None,
                 kv_pages: int | None = None, page_size: int = paged.PAGE_SIZE):
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("Sampler serves decoder-only models; an encoder-decoder model "
                             "(T5) generates with redray.models.generate")
        recurrent = getattr(model, "RECURRENT_LAYERS", False)
        if kv_cache is None:
            kv_cache = "paged" if recurrent else "window"
        if recurrent and kv_cache != "paged":
            raise ValueError(f"Sampler: {config.model_type} has linear-attention layers, whose "
                             "state each slot holds in a paged cache only: give "
                             "kv_cache='paged' (the default for it)")
        eos, self.pad = special_tokens(config, eos_token_id, pad_token_id)
        self.eos = np.asarray([] if eos is None else np.atleast_1d(eos), np.int32)
        self.slots, self.max_length, self.seed = slots, max_length, seed
        self.steps_per_call = steps_per_call
        self.graphdef, self.state = nnx.split(model)
        if parallelism is not None:
            from redray.models.hub import family

            inputs = family(config.model_type).trace_inputs(config)
            self.state = placed_state(model, parallelism, inputs)
        self.mesh = mesh_of(self.state)
        on_cpu = platform_of(self.state) == "cpu"
        self.narrow = on_cpu if narrow is None else narrow
        if check_every is None:
            check_every = 1 if on_cpu else min(16, steps_per_call)
        if not 1 <= check_every <= steps_per_call:
            raise ValueError(f"check_every={check_every}: give 1 to steps_per_call="
                             f"{steps_per_call} decoding steps between two checks")
        self.check_every = check_every
        self.refill_on_device = refill_on_device
        if kv_cache not in ("window", "paged"):
            raise ValueError(f"kv_cache={kv_cache!r}: use 'window' or 'paged'")
        self.kv_cache, self.page_size = kv_cache, page_size
        # the widest window: room for the longest sequence and a round's steps
        self.length = max_length + max(PROMPT_BUCKET, max_length // 4, check_every)
        self.placement = SlotPlacement(self.mesh, slots)  # the slots' arrays on the mesh
        self._compiled = {}
        self.rounds = self._trips = 0
        self._empty = self._split = self._inner = None
        self._layers = None  # the weights as the decoding rounds read them (``_split_layers``)
        # the KV cache: a window of the live sequences' columns, room for a round past t
        self.window = KVWindow(slots, self.length, max(min(ROOM, steps_per_call), check_every),
                               self._empty_window, self.placement)
        self.kv_pages = None
        if kv_cache == "paged":
            if self.placement.data_parallel > 1:
                raise ValueError(f"kv_cache='paged' decodes on one replica: this plan has "
                                 f"{self.placement.data_parallel} data-parallel ones; give a "
                                 "plan without data parallelism (model parallelism is "
                                 "fine), or kv_cache='window'")
            devices = 1 if self.mesh is None else self.mesh.devices.size
            if kv_pages is None:
                kv_pages = pool_pages(model, self.state, devices, slots, max_length, page_size)
                if kv_pages < pages_needed(max_length, page_size):
                    raise ValueError(
                        f"kv_cache='paged': the device's memory holds {kv_pages} pages of "
                        f"{page_size} tokens beside the weights, fewer than one request of "
                        f"max_length={max_length} needs: give a smaller max_length, a plan "
                        "that splits the model over more devices, or kv_pages")
            if kv_pages < 1:
                raise ValueError(f"kv_pages={kv_pages}: give the pool at least a page")
            self.kv_pages = int(kv_pages)

    # ------------------------------------------------------------------ public
    def reset(self) -> None:
        """An empty cache (every slot free); the weights are kept."""
        self.window.reset()

    @property
    def round_trips(self) -> int:
        """The compiled calls and reads of device values of the last ``sample`` call."""
        return self._trips + self.window.calls

    @property
    def cache_tokens(self) -> int:
        """The most tokens' keys and values the KV cache held during the last
        ``sample`` call (rows x columns of its window; a paged pool's pages x
        ``page_size``)."""
        if self.kv_cache == "paged":
            return self.kv_pages * self.page_size
        return self.window.peak

    @property
    def cache_bytes(self) -> int:
        """The bytes of the KV cache arrays behind ``cache_tokens``: the paged pool's
        (linear layers' per-slot states included), or the window's at its peak, every
        layer's keys and values (a latent cache's one head of latent and rotary values,
        DeepSeek's)."""
        model = nnx.merge(self.graphdef, self.state)

        def nbytes(make) -> int:
            return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(make)))

        if self.kv_cache == "paged":
            return nbytes(lambda: model.init_pages(self.kv_pages, self.page_size,
                                                   rows=self.slots))
        return self.cache_tokens * nbytes(lambda: model.init_cache(1, 1))

    @property
    def width(self) -> int:
        """The cache's columns now (its live window; see the module)."""
        return self.window.width

    def update_weights(self, model_or_state) -> None:
        """Decode with new weights (an updated policy): a model or its ``nnx.state``,
        of the same structure. In flight sequences continue with the new weights."""
        state = model_or_state if isinstance(model_or_state, nnx.State) \
            else nnx.state(model_or_state)
        self.state = jax.tree.map(
            lambda new, old: put(new, old.sharding)
            if isinstance(old, jax.Array) else new, state, self.state)

    def sample(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams],
               request_ids: Sequence[int] | None = None) -> list[Completion]:
        """Completes every prompt; returns their completions in the prompts' order.

        Args:
          prompts: token id lists (no padding).
          params: one ``SamplingParams`` for all, or one per prompt.
          request_ids: each request's id, the key of its randomness (default: its index
            in ``prompts``).
        """
        n = len(prompts)
        params, ids = requests(n, params, request_ids)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if len(prompt) < 1:
                raise ValueError(f"prompt {i} is empty: give at least one token (a BOS)")
            if bucket(len(prompt)) + p.max_new_tokens > self.max_length:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens (padded to {bucket(len(prompt))}) + "
                    f"max_new_tokens={p.max_new_tokens} exceeds the Sampler's max_length="
                    f"{self.max_length}: build the Sampler with a larger max_length")
        greedy_only = all(p.temperature == 0 for p in params)
        if not -2**31 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed}: give a seed that fits in 32 bits")
        self._trips = self.window.calls = 0
        self.window.peak = 0
        self.window.held()
        if self.kv_cache == "paged":
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                need = pages_needed(len(prompt) + p.max_new_tokens, self.page_size)
                if need > self.kv_pages:
                    raise ValueError(
                        f"prompt {i}: {len(prompt)} tokens + max_new_tokens="
                        f"{p.max_new_tokens} need {need} pages of {self.page_size} "
                        f"tokens; the Sampler's pool has kv_pages={self.kv_pages}: build "
                        "it with more kv_pages, or ask for fewer tokens")
        if self.window.kv_valid.shape[0] != self.slots:  # narrowed by the last call's tail
            self.reset()
        self._layers = self._split_layers()
        self._trips += 1
        try:
            return self._sample(prompts, params, ids, greedy_only)
        finally:
            self._layers = None  # the split copy lives while a call samples

    def _sample(self, prompts, params, ids, greedy_only: bool) -> list[Completion]:
        n = len(prompts)
        pending = collections.deque(range(n))
        tokens = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)]
        reason = [""] * n
        owner = np.full(self.slots, -1)  # the request each slot decodes (-1: free)
        rows = Slots(self.slots, self.seed)
        self.rounds = 0
        if self.kv_cache == "paged":
            self._paged(prompts, params, ids, greedy_only, tokens, logprobs, reason)
            pending.clear()
        elif self.refill_on_device and n > self.slots:
            refilled = self._refill(prompts, params, ids, greedy_only, rows, tokens,
                                    logprobs, reason)
            if refilled is not None:  # every request has taken a slot
                owner = refilled
                pending.clear()

        def emit(slot_tokens, slot_logprobs, written, finished_by_eos, now_active):
            for s in np.nonzero(owner >= 0)[0]:
                r = owner[s]
                tokens[r] += slot_tokens[s][written[s]].tolist()
                logprobs[r] += slot_logprobs[s][written[s]].tolist()
                if not now_active[s]:
                    reason[r] = "eos" if finished_by_eos[s] else "length"
                    owner[s] = -1

        while pending or (owner >= 0).any():
            free = np.nonzero(owner < 0)[0]
            take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
            # no prompt left waiting and no narrowing: the rest decodes in one call
            to_the_end = not pending and not self.narrow
            if take:
                slots = free[:len(take)]
                owner[slots] = take
                rows.assign(slots, [params[r] for r in take], [ids[r] for r in take])
                emit(*self._prefill([prompts[r] for r in take], slots, rows, greedy_only,
                                    to_the_end))
            if not rows.active.any():
                continue
            if not pending and self.narrow:
                owner = self._narrow(rows, owner)
            # a round ends when enough slots are free to refill, or, with no prompt
            # waiting, to narrow the batch to its next size down
            ends_at = refill_at(len(owner), len(pending), self.placement.data_parallel,
                                self.narrow)
            emit(*self._decode(rows, ends_at, greedy_only, to_the_end))
        return [Completion(ids[r], np.asarray(tokens[r], np.int32),
                           np.asarray(logprobs[r], np.float32), reason[r]) for r in range(n)]

    # ------------------------------------------------------------------ device steps
    def _ahead(self, remaining) -> int:
        """The steps for completions of ``remaining`` tokens to end, in whole checks."""
        every = self.check_every
        return -(-int(np.max(remaining, initial=1)) // every) * every

    def _split_layers(self):
        """The weights as a decoding round reads them: stacked layers split into each
        layer's (``redray.models.generate.for_decoding``: XLA would copy each layer's
        slice at every step of the loop). Split once per ``sample`` call, not per round:
        the copy costs about a step's weight reads."""
        if self._split is None:
            graphdef = self.graphdef

            def decoding(state):
                return for_decoding(nnx.merge(graphdef, state))
            # the graph of the model the decoding rounds run (``_decode_fn``)
            self._inner = nnx.graphdef(nnx.eval_shape(decoding, self.state))
            self._split = jax.jit(lambda state: nnx.state(decoding(state)))
        return self._split(self.state)

    def _refill(self, prompts, params, ids, greedy_only: bool, rows: Slots, tokens, logprobs,
                reason):
        """Every request decoded through the slots in one compiled call that refills the
        slots itself (``decode_steps.refill_step``), until each has taken a slot: their
        tokens so far into ``tokens``, ``logprobs`` and ``reason``, the slots' state into
        ``rows`` and the window. Returns each slot's request (-1: free), or None (nothing
        done) where the window would not hold the longest prompt beside the longest
        completion (the host's rounds refill then)."""
        n, every = len(prompts), self.check_every
        width = bucket(max(len(p) for p in prompts))
        longest = bucket(max(p.max_new_tokens for p in params))
        span = width + longest
        length = window(span + max(ROOM, every, span // 4), self.length)
        if span + every > length:
            return None
        queue, order = self._queue(prompts, params, ids, width)
        rows_in = len(queue["id"])
        chunk = max(1, self.slots // 8)
        key = ("refill", (self.slots, length, rows_in, width, longest, chunk), greedy_only)
        if key not in self._compiled:
            step = refill_step(self._inner, key[1], greedy_only, self.pad, self.eos, every)
            self._compiled[key] = self.placement.jit(step, self.window.cache, 2)
        w = self.window
        w.held(self.slots * length)
        w.cache, w.kv_valid, state, out = self._compiled[key](
            self._layers, *self.placement.host(packed(QUEUE_INPUTS, queue, width)))
        state, out = unpacked(np.asarray(state), SLOT_STATE), unpacked(
            np.asarray(out)[:n], REQUEST_OUTPUTS, longest)
        self._trips += 3  # the call and its two reads
        self.rounds += 1
        for j, r in enumerate(order):  # the queue's row j is request r
            k = out["length"][j]
            tokens[r] += out["out"][j, :k].tolist()
            logprobs[r] += out["lps"][j, :k].tolist()
            reason[r] = {0: "", 1: "eos", 2: "length"}[int(out["reason"][j])]
        live = state["owner"] >= 0
        owner = np.where(live, np.asarray(order)[np.maximum(state["owner"], 0)], -1)
        rows.ids[live] = np.asarray(ids)[owner[live]]
        for name in Slots.DECODING:
            setattr(rows, name, state[name].copy())
        w.t = int(state["t"][0])
        w.start = state["start"].astype(np.int64)
        return owner

    def _paged(self, prompts, params, ids, greedy_only: bool, tokens, logprobs, reason):
        """Every request decoded, start to end, in one compiled call on a pool of pages
        (``paged_steps.paged_step``): their tokens into ``tokens``, ``logprobs`` and
        ``reason``."""
        n, size = len(prompts), self.page_size
        width = bucket(max(len(p) for p in prompts))
        longest = max(p.max_new_tokens for p in params)
        longest = 1 << (longest - 1).bit_length()  # a power of two: few compiles
        # the pages a slot may hold: its table's columns
        per_slot = paged.table_columns(max(pages_needed(len(p) + a.max_new_tokens, size)
                                           for p, a in zip(prompts, params)))
        queue, order = self._queue(prompts, params, ids, width)
        rows_in = len(queue["id"])
        chunk = max(1, self.slots // 8)
        shapes = (self.slots, self.kv_pages, size, per_slot, rows_in, width, longest, chunk)
        key = ("paged", shapes, greedy_only)
        if key not in self._compiled:
            step = paged_step(self._inner, shapes, greedy_only, self.pad, self.eos,
                              self.check_every)
            whole = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
            self._compiled[key] = jax.jit(step, out_shardings=whole)
        out = self._compiled[key](self._layers,
                                  *self.placement.host(packed(QUEUE_INPUTS, queue, width)))
        out = unpacked(np.asarray(out)[:n], REQUEST_OUTPUTS, longest)
        self._trips += 2  # the call and its read
        self.rounds += 1
        for j, r in enumerate(order):  # the queue's row j is request r
            k = out["length"][j]
            tokens[r] += out["out"][j, :k].tolist()
            logprobs[r] += out["lps"][j, :k].tolist()
            reason[r] = {1: "eos", 2: "length"}[int(out["reason"][j])]

    def _queue(self, prompts, params, ids, width: int):
        """The requests as a call that refills its own slots takes them
        (``QUEUE_INPUTS``: rows padded to a power of two, prompts left-padded to
        ``width``), the longest asked first, and the order (row j is request order[j])."""
        n = len(prompts)
        rows_in = 1 << (n - 1).bit_length()  # padded to a power of two: few compiles
        queue = dict(ids=np.full((rows_in, width), self.pad), mask=np.zeros((rows_in, width)),
                     id=np.zeros(rows_in), seed=np.full(rows_in, self.seed),
                     count=np.full(rows_in, n), max_new=np.ones(rows_in),
                     temperature=np.zeros(rows_in), top_k=np.zeros(rows_in),
                     top_p=np.ones(rows_in))
        # the longest asked first (in the prompts' order among equals): the requests still
        # decoding once the queue is empty are then the short ones, and a GPU's steps,
        # which cost about as much for a few rows as for all, end sooner. Requests that
        # ask alike (a GRPO iteration's) keep their order; a request's tokens are its own
        # whatever its place (its key is its id)
        order = sorted(range(n), key=lambda i: -params[i].max_new_tokens)
        for j, i in enumerate(order):
            p, how = prompts[i], params[i]
            queue["ids"][j, width - len(p):], queue["mask"][j, width - len(p):] = p, 1
            queue["max_new"][j], queue["id"][j] = how.max_new_tokens, ids[i]
            queue["temperature"][j], queue["top_k"][j], queue["top_p"][j] = (
                how.temperature, how.top_k, how.top_p)
        return queue, order

    def _prefill(self, prompts, slots, rows: Slots, greedy_only: bool, to_the_end: bool):
        k, w = len(prompts), self.window
        first, source = self._distinct(prompts)
        width = bucket(max(len(p) for p in first))
        batch = 1 << (k - 1).bit_length()  # padded to a power of two: few compiles
        source = np.pad(source, (0, batch - k)).astype(np.int32)  # padding rows: any
        # the prompts run, padded so too; None: one per slot (no gather)
        run = 1 << (len(first) - 1).bit_length() if len(first) < k else None
        ids = np.full((batch, width), self.pad, np.int32)
        mask = np.zeros((batch, width), np.int32)
        for i, p in enumerate(first):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        where = np.full(batch, self.slots, np.int32)  # a padding row writes nowhere
        where[:k] = slots
        # the window keeps the live rows and the new prompts, right-aligned behind t,
        # and room for the next round (or, before the tail's one call, for every live
        # and new sequence to end: ``_decode``)
        ahead = None
        if to_the_end:
            live = rows.active.copy()
            live[slots] = True
            ahead = self._ahead(rows.remaining[live])
        w.fit(min(w.t - width, w.oldest(rows.active)), empty=not rows.active.any(), ahead=ahead)
        w.start[slots] = w.t - width
        # every slot takes a prompt (a call's first prefill, as many prompts as slots):
        # the rows are written as one slice, not scattered (``_write``)
        every = k == len(w.kv_valid)
        fn = self._compile("prefill", (batch, every, run), (width, w.width), greedy_only)
        w.cache, w.kv_valid, got = fn(self.state, w.cache, w.kv_valid, *self.placement.host(
            self._prefill_inputs(ids, mask, where, source, rows)))
        got = unpacked(np.asarray(got)[:k], PREFILL_OUTPUTS)  # one transfer
        self._trips += 2
        token, logprob = got["token"], got["logprob"]
        rows.keys[slots] = got["keys"]
        rows.token[slots] = token
        rows.counts[slots] = 1
        rows.remaining[slots] -= 1
        by_eos = np.isin(token, self.eos)
        rows.active[slots] = ~by_eos & (rows.remaining[slots] > 0)

        def per_slot(values, dtype, shape=(1,)):  # as a decoding round gives them
            full = np.zeros((self.slots, *shape), dtype)
            full[slots] = np.reshape(values, (-1, *shape))
            return full
        return (per_slot(token, np.int32), per_slot(logprob, np.float32),
                per_slot(np.ones(k, bool), bool), per_slot(by_eos, bool, ()), rows.active)

    @staticmethod
    def _distinct(prompts):
        """A prompt taken by several slots (a group of GRPO completions) is run through
        the model once: (the distinct prompts, in order; each slot's index among them)."""
        first = {}
        source = [first.setdefault(tuple(p), len(first)) for p in prompts]
        return list(first), np.asarray(source)

    def _decode(self, rows: Slots, ends_at: int, greedy_only: bool, to_the_end: bool):
        """One decoding call; ``to_the_end``: room and steps for every live sequence to
        end in it (the window permitting), on a power of two of steps (few compiles)."""
        steps, ahead = self.steps_per_call, None
        if to_the_end:
            ahead = self._ahead(rows.remaining[rows.active])
            steps = max(steps, 1 << (ahead - 1).bit_length())
        w = self.window
        w.fit(w.oldest(rows.active), ahead=ahead)
        self.rounds += 1
        fn = self._compile("decode", steps, (len(rows.token), w.width), greedy_only)
        w.cache, w.kv_valid, got = fn(self._layers, w.cache, w.kv_valid, *self.placement.host(
            self._decode_inputs(rows, ends_at)))
        # one transfer (``DECODE_OUTPUTS``): on a GPU each read of a device array costs
        # more than a short round's steps
        got = unpacked(np.asarray(got), DECODE_OUTPUTS, steps)
        self._trips += 2
        rows.token, rows.active, rows.counts, rows.remaining = (
            got[k] for k in ("token", "active", "counts", "remaining"))
        w.t = int(got["t"][0])
        return got["out"], got["lps"], got["written"], got["by_eos"], got["active"]

    def _prefill_inputs(self, ids, mask, where, source, rows: Slots) -> np.ndarray:
        """A prefill's inputs in one array (``PREFILL_INPUTS``)."""
        at = where % self.slots
        return packed(PREFILL_INPUTS, dict(
            t=np.full(len(ids), self.window.t), ids=ids, mask=mask, where=where, source=source,
            id=rows.ids[at], seed=np.full(len(ids), self.seed),
            **{name: x[at] for name, x in rows.sampling().items()}))

    def _decode_inputs(self, rows: Slots, ends_at: int) -> np.ndarray:
        """A decoding round's inputs in one array (``DECODE_INPUTS``)."""
        n = len(rows.token)
        return packed(DECODE_INPUTS, dict(
            t=np.full(n, self.window.t), refill_at=np.full(n, ends_at), token=rows.token,
            active=rows.active, counts=rows.counts, remaining=rows.remaining, keys=rows.keys,
            **rows.sampling()))

    def _narrow(self, rows: Slots, owner):
        """With no prompt waiting, the live sequences moved into the fewest slots
        (``slots.narrowed``): a decoding step costs about its rows, and the last, long
        sequences would otherwise run with most of the batch idle. The same copy takes
        the new live window. Returns the owners."""
        keep = narrowed(rows.active, self.placement.data_parallel)
        if keep is None:
            return owner
        rows.take(keep)
        self.window.narrow(keep, rows.active)
        return owner[keep]

    def _empty_window(self, rows: int, width: int):
        """An empty cache and key mask of ``rows`` x ``width``."""
        if self._empty is None:
            graphdef = self.graphdef

            def empty(state, rows, width):
                return (nnx.merge(graphdef, state).init_cache(rows, width),
                        jnp.zeros((rows, width), jnp.int32))
            structure = jax.eval_shape(lambda state: empty(state, 1, 1), self.state)[0]
            self._empty = self.placement.jit(empty, structure, 0, static_argnums=(1, 2))
        return self._empty(self.state, rows, width)

    def _compile(self, kind: str, a, b: tuple[int, int], greedy_only: bool):
        key = (kind, a, b, greedy_only)
        if key not in self._compiled:
            make = {"prefill": self._prefill_fn, "decode": self._decode_fn}[kind]
            self._compiled[key] = make(a, b, greedy_only)
        return self._compiled[key]

    def _prefill_fn(self, rows: tuple[int, bool, int | None], widths: tuple[int, int],
                    greedy_only: bool):
        step = prefill_step(self.graphdef, rows, widths, greedy_only)
        return self.placement.jit(step, self.window.cache, 1, donate_argnums=(1, 2))

    def _decode_fn(self, steps: int, rows_and_width: tuple[int, int], greedy_only: bool):
        step = decode_step(self._inner, steps, rows_and_width, greedy_only, self.pad, self.eos,
                           self.check_every)
        return self.placement.jit(step, self.window.cache, 1, donate_argnums=(1, 2))


# the share of a device's memory a paged cache's pool may take beside the weights (held
# twice while a call samples: the model's and the split copy of its layers) and the
# activations of a step (the rest)
KV_MEMORY_SHARE = 0.8


def pool_pages(model, state, devices: int, slots: int, max_length: int, page_size: int,
               memory: float | None = None) -> int:
    """The pages of a paged cache: as many as ``slots`` requests of ``max_length``
    tokens need, at most what ``KV_MEMORY_SHARE`` of a device's ``memory`` (None: the
    live device's, ``on_mesh.device_memory``, which the planner's probe reads too) holds
    beside the weights twice. A page holds ``page_size`` tokens' keys and values in
    every attention layer (a linear-attention layer's per-slot state is counted beside
    them, once); the weights (``state``) are counted as split evenly over the model's
    ``devices`` (its model axis: a paged Sampler has no data-parallel replicas), and so
    are the pages where the key/value heads divide by them (a latent cache's single
    head does not: its pages are whole on every device)."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)
                  if hasattr(x, "dtype")) / devices

    def pool_bytes(pages: int) -> int:  # the pool's arrays, abstract
        pool = jax.eval_shape(lambda: model.init_pages(pages, page_size, rows=slots))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))

    # a page in every attention layer; the per-slot states of linear layers beside them.
    # Pages split with their key/value heads: a latent cache's one head (DeepSeek's) is
    # whole on every device.
    kv_heads = model.key_value_heads()[0] if hasattr(model, "key_value_heads") else devices
    split = devices if kv_heads % devices == 0 else 1
    page = (pool_bytes(2) - pool_bytes(1)) / split
    fixed = (pool_bytes(1) / split) - page
    if page <= 0:  # no attention layer holds pages: only the per-slot states
        return slots * pages_needed(max_length, page_size)
    memory = device_memory(jax.devices()[0]) if memory is None else memory
    fits = int((KV_MEMORY_SHARE * memory - 2 * weights - fixed) // page)
    return max(0, min(slots * pages_needed(max_length, page_size), fits))
