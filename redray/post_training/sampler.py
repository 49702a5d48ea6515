"""A sampler with continuous batching: a finished sequence's slot takes the next prompt.

``redray.models.generate`` decodes a static batch: every row runs until the longest one
ends. Where output lengths vary (reinforcement learning's rollouts), most of that work
is padding. The ``Sampler`` keeps ``slots`` sequences in flight instead and fills a
slot with the next waiting prompt as soon as its sequence ends, so the rows decoded are
rows still writing.

The KV cache. Every slot writes its next token at the same cache slot ``t`` (one
``cache_index`` for the batch, which is what every redray model's call takes), and a
prompt joining at ``t`` is written right-aligned behind it, at ``[t - P, t)``. A row's
tokens are always contiguous and end at ``t``; the key mask (``kv_valid``) marks them,
and position ids count a row's real tokens (``layers.positions_for``), so where a
sequence sits in its row changes nothing it computes.

The cache holds the live window only: its columns run from the oldest live sequence's
start to as far as the next decoding round may write, rounded up to one of 8 widths
per doubling (``_window``), so a step's attention reads what the live rows can attend to
and not a maximum length (a step's cost grows with the slots it reads: 5.7 ms at 32,
14.8 ms at 176 for 64 rows of the benchmark's model). When the window no longer fits
(``t`` at its end, a prompt longer than the room behind ``t``) or fits a much smaller
one, the cache is copied into a new window (``_fit``); narrowing the batch (below)
makes that copy anyway. Its size is therefore set by the sequences in flight, not by
the number of prompts nor by the longest request.

Prefill runs beside decoding: between two decoding rounds, the prompts taking the free
slots are run through the model together (left-padded to a bucket of 16 tokens) and
their keys and values scattered into their rows (written as one slice when they take
every slot, as a call's first prefill does). A prompt that several of them take (the
requests of a GRPO group, side by side) is run once and its keys and values copied to
each of its slots.

Once no prompt waits (``narrow``): on CPUs, where a step costs about its rows, the live
sequences move into fewer slots as others end (``_narrow``), a round per batch size;
elsewhere the rest is decoded in one call, its window wide enough for the longest
remaining completion, as ``generate`` decodes (a GPU's step costs about as much for a
few rows as for many, and every round costs a call and a wait for the device).

Sampling is per request (``SamplingParams``: temperature, top-k, top-p, maximum new
tokens), and so is its randomness: the key of a request's n-th token is
``fold_in(fold_in(key(seed), request_id), n)``, whatever slot or batch it shares.
A run that resumes with the same request ids samples the same tokens.

Sharded as the model is: the model's parameters keep their placement (or are placed by
``parallelism=``'s automatic specs); the cache's slots are split over the batch axes
(data-parallel replicas) and its key/value heads over ``model``. A mesh over several
processes (a Trainer of several hosts, a ``SamplerGroup`` replica of several) works as
the Trainer does: every process runs this same loop on the same requests; the host's
inputs to a compiled step become global arrays and what the loop reads back is
replicated on every device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redray.models.generate import for_decoding, prompt_prefill, special_tokens
from redray.sharding import BATCH_AXES, MODEL, Parallelism

PROMPT_BUCKET = 16  # prompts are left-padded to a multiple of this (one compile per size)
# columns a decoding round's window keeps ahead of ``t`` at least: a round that reaches
# the window's end stops and the window grows (one copy); more room makes every step
# read more (of 1, 8, 16 and 32, 8 and 16 ran the benchmark's workload fastest, within
# the noise of each other)
ROOM = 16
# widths a window takes per doubling of its columns (``_window``; a power of two):
# every multiple of ``PROMPT_BUCKET`` up to 16 of them (256 columns), then 8 per
# doubling. Each width a round reads is one compile. Of a ladder of 2 widths per
# doubling (up to a third of the columns idle) and of 8 (under an eighth), 8 ran the
# benchmark's workload 4-11% faster (five runs side by side, docs/performance/sampler.md)
# with as many compiles: its rounds change width where they narrow the batch
WINDOW_RUNGS = 8
# a compiled call's inputs and the outputs the host reads, a row per slot, each in one
# int32 array (``_packed``: one transfer): (name, columns, dtype) in their order; None
# columns: the prompts' width (inputs), the call's steps (outputs)
SAMPLING = (("temperature", 1, np.float32), ("top_k", 1, np.int32), ("top_p", 1, np.float32))
PREFILL_INPUTS = (("t", 1, np.int32), ("ids", None, np.int32), ("mask", None, np.int32),
                  ("where", 1, np.int32), ("source", 1, np.int32),
                  ("keys", 2, np.uint32)) + SAMPLING
DECODE_INPUTS = (("t", 1, np.int32), ("refill_at", 1, np.int32), ("token", 1, np.int32),
                 ("active", 1, np.bool_), ("counts", 1, np.int32), ("remaining", 1, np.int32),
                 ("keys", 2, np.uint32)) + SAMPLING
PREFILL_OUTPUTS = (("token", 1, np.int32), ("logprob", 1, np.float32))
DECODE_OUTPUTS = (("out", None, np.int32), ("written", None, np.bool_),
                  ("lps", None, np.float32), ("token", 1, np.int32), ("active", 1, np.bool_),
                  ("counts", 1, np.int32), ("remaining", 1, np.int32), ("by_eos", 1, np.bool_),
                  ("t", 1, np.int32))


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


class Sampler:
    """Continues prompts with continuous batching on a redray decoder-only model.

    Args:
      model: a redray causal LM (``from_pretrained``, ``build``, a Trainer's ``model()``),
        as placed; or unplaced with ``parallelism``.
      slots: sequences decoded at once (a multiple of the plan's data-parallel size).
      max_length: the longest prompt plus completion a request may have (the cache's
        window, the live sequences' span, is at most this and a quarter more).
      eos_token_id, pad_token_id: as ``generate``'s (default: the config's).
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

    After a ``sample`` call, ``rounds`` is how many decoding calls it made.
    """

    def __init__(self, model, *, slots: int = 16, max_length: int, eos_token_id=None,
                 pad_token_id: int | None = None, seed: int = 0,
                 parallelism: Parallelism | None = None, steps_per_call: int = 32,
                 check_every: int | None = None, narrow: bool | None = None):
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("Sampler serves decoder-only models; an encoder-decoder model "
                             "(T5) generates with redray.models.generate")
        eos, self.pad = special_tokens(config, eos_token_id, pad_token_id)
        self.eos = np.asarray([] if eos is None else np.atleast_1d(eos), np.int32)
        self.slots, self.max_length, self.seed = slots, max_length, seed
        self.steps_per_call = steps_per_call
        self.graphdef, self.state = nnx.split(model)
        if parallelism is not None:
            self.state = _placed(model, self.state, parallelism)
        self.mesh = _mesh_of(self.state)
        on_cpu = _platform(self.state) == "cpu"
        self.narrow = on_cpu if narrow is None else narrow
        if check_every is None:
            check_every = 1 if on_cpu else min(16, steps_per_call)
        if not 1 <= check_every <= steps_per_call:
            raise ValueError(f"check_every={check_every}: give 1 to steps_per_call="
                             f"{steps_per_call} decoding steps between two checks")
        self.check_every = check_every
        # the widest window: room for the longest sequence and a round's steps
        self.length = max_length + max(PROMPT_BUCKET, max_length // 4, check_every)
        # a mesh over several processes (a trainer of several hosts): every process runs
        # this same host loop on the same requests, its inputs made global arrays and
        # what it reads back replicated (``_host``, ``_jit``)
        self.spmd = self.mesh is not None and any(
            d.process_index != jax.process_index() for d in self.mesh.devices.flat)
        self.data_parallel = 1
        if self.mesh is not None:
            dp = self.data_parallel = math.prod(self.mesh.shape.get(a, 1) for a in BATCH_AXES)
            if slots % dp:
                raise ValueError(f"slots={slots} must be a multiple of the plan's data-parallel "
                                 f"size ({dp}): each replica decodes its share of the slots")
        self._compiled = {}
        self.rounds = 0
        self._rewindow = self._empty = self._split = self._inner = None
        self._layers = None  # the weights as the decoding rounds read them (``_split_layers``)
        self.reset()

    # ------------------------------------------------------------------ public
    def reset(self) -> None:
        """An empty cache (every slot free); the weights are kept."""
        self.cache, self.kv_valid = self._empty_window(self.slots, PROMPT_BUCKET)
        self.t = 0
        self.start = np.zeros(self.slots, np.int64)  # each slot's first cache column
        self.shifts = 0  # times the rows were moved left (``_fit``)

    @property
    def width(self) -> int:
        """The cache's columns now (its live window; see the module)."""
        return self.kv_valid.shape[1]

    def update_weights(self, model_or_state) -> None:
        """Decode with new weights (an updated policy): a model or its ``nnx.state``,
        of the same structure. In flight sequences continue with the new weights."""
        state = model_or_state if isinstance(model_or_state, nnx.State) \
            else nnx.state(model_or_state)
        self.state = jax.tree.map(
            lambda new, old: _put(new, old.sharding)
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
            if _bucket(len(prompt)) + p.max_new_tokens > self.max_length:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens (padded to {_bucket(len(prompt))}) + "
                    f"max_new_tokens={p.max_new_tokens} exceeds the Sampler's max_length="
                    f"{self.max_length}: build the Sampler with a larger max_length")
        greedy_only = all(p.temperature == 0 for p in params)
        if self.kv_valid.shape[0] != self.slots:  # narrowed by the last call's tail
            self.reset()
        self._layers = self._split_layers()
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
        rows = _Rows(self.slots, self.seed)
        self.rounds = 0

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
            size, waiting = len(owner), len(pending)
            smaller = self._smaller(size) if self.narrow else None
            refill_at = min(waiting, max(1, size // 8)) if waiting else \
                size - smaller if smaller else size + 1
            emit(*self._decode(rows, refill_at, greedy_only, to_the_end))
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

    def _prefill(self, prompts, slots, rows: "_Rows", greedy_only: bool, to_the_end: bool):
        k = len(prompts)
        first, source = self._distinct(prompts)
        width = _bucket(max(len(p) for p in first))
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
        self._fit(min(self.t - width, self._oldest(rows)), empty=not rows.active.any(),
                  ahead=ahead)
        self.start[slots] = self.t - width
        # every slot takes a prompt (a call's first prefill, as many prompts as slots):
        # the rows are written as one slice, not scattered (``_write``)
        every = k == len(self.kv_valid)
        fn = self._compile("prefill", (batch, every, run), (width, self.width), greedy_only)
        self.cache, self.kv_valid, got = fn(self.state, self.cache, self.kv_valid, *self._host(
            self._prefill_inputs(ids, mask, where, source, rows)))
        got = _unpacked(np.asarray(got)[:k], PREFILL_OUTPUTS)  # one transfer
        token, logprob = got["token"], got["logprob"]
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

    def _decode(self, rows: "_Rows", refill_at: int, greedy_only: bool, to_the_end: bool):
        """One decoding call; ``to_the_end``: room and steps for every live sequence to
        end in it (the window permitting), on a power of two of steps (few compiles)."""
        steps, ahead = self.steps_per_call, None
        if to_the_end:
            ahead = self._ahead(rows.remaining[rows.active])
            steps = max(steps, 1 << (ahead - 1).bit_length())
        self._fit(self._oldest(rows), ahead=ahead)
        self.rounds += 1
        fn = self._compile("decode", steps, (len(rows.token), self.width), greedy_only)
        self.cache, self.kv_valid, got = fn(self._layers, self.cache, self.kv_valid, *self._host(
            self._decode_inputs(rows, refill_at)))
        # one transfer (``DECODE_OUTPUTS``): on a GPU each read of a device array costs
        # more than a short round's steps
        got = _unpacked(np.asarray(got), DECODE_OUTPUTS, steps)
        rows.token, rows.active, rows.counts, rows.remaining = (
            got[k] for k in ("token", "active", "counts", "remaining"))
        self.t = int(got["t"][0])
        return got["out"], got["lps"], got["written"], got["by_eos"], got["active"]

    def _prefill_inputs(self, ids, mask, where, source, rows: "_Rows") -> np.ndarray:
        """A prefill's inputs in one array (``PREFILL_INPUTS``)."""
        at = where % self.slots
        return _packed(PREFILL_INPUTS, dict(
            t=np.full(len(ids), self.t), ids=ids, mask=mask, where=where, source=source,
            keys=rows.keys[at],
            **{name: x[at] for name, x in rows.sampling().items()}))

    def _decode_inputs(self, rows: "_Rows", refill_at: int) -> np.ndarray:
        """A decoding round's inputs in one array (``DECODE_INPUTS``)."""
        n = len(rows.token)
        return _packed(DECODE_INPUTS, dict(
            t=np.full(n, self.t), refill_at=np.full(n, refill_at), token=rows.token,
            active=rows.active, counts=rows.counts, remaining=rows.remaining, keys=rows.keys,
            **rows.sampling()))

    def _narrow(self, rows: "_Rows", owner):
        """With no prompt waiting, the live sequences moved into the fewest slots (down
        ``_smaller``'s sizes while they fit): a decoding step costs about its rows, and
        the last, long sequences would otherwise run with most of the batch idle. The
        same copy takes the new live window (``_fit``). Returns the owners."""
        size, live = len(owner), np.nonzero(rows.active)[0]
        while (smaller := self._smaller(size)) and smaller >= len(live):
            size = smaller
        if size == len(owner):
            return owner
        idle = np.setdiff1d(np.arange(len(owner)), live)
        keep = np.sort(np.concatenate([live, idle[:size - len(live)]]))
        rows.take(keep)
        self.start = self.start[keep]
        self._fit(self._oldest(rows), keep)
        return owner[keep]

    def _smaller(self, size: int) -> int | None:
        """The next batch size below ``size`` that stays split over the data axes, on a
        ladder of 2^k and 1.5 x 2^k (64, 48, 32, 24, ...: a few compiled sizes, at most
        a third of the rows idle), or None."""
        for below in range(size - 1, 0, -1):
            if _on_ladder(below) and below % self.data_parallel == 0:
                return below
        return None

    def _oldest(self, rows: "_Rows") -> int:
        """The first column of the oldest live sequence (``t`` when none is live)."""
        live = rows.active
        return int(self.start[live].min()) if live.any() else self.t

    def _empty_window(self, rows: int, width: int):
        """An empty cache and key mask of ``rows`` x ``width``."""
        if self._empty is None:
            graphdef = self.graphdef

            def empty(state, rows, width):
                return (nnx.merge(graphdef, state).init_cache(rows, width),
                        jnp.zeros((rows, width), jnp.int32))
            structure = jax.eval_shape(lambda state: empty(state, 1, 1), self.state)[0]
            self._empty = self._jit(empty, structure, 0, static_argnums=(1, 2))
        return self._empty(self.state, rows, width)

    def _fit(self, begin: int, keep=None, empty: bool = False, ahead: int | None = None) -> None:
        """Makes the cache's window hold columns ``[begin, end)``, ``end`` the next
        round's room past ``t`` (``begin`` may be negative: room on the left for a
        prompt), copying it (and its rows ``keep``) when they do not fit, or when a
        window of at most two thirds of its width would, or when ``keep`` is given;
        ``empty``: no row is live, a new window is made empty rather than copied;
        ``ahead``: room for that many steps past ``t`` (within the widest window).
        Columns are renumbered from the window's start (see the module)."""
        end = self.t + max(min(ROOM, self.steps_per_call), self.check_every)
        if ahead is not None:
            end = max(end, min(self.t + ahead, begin + self.length))
        width = _window(end - begin, self.length)
        fits = 0 <= begin and end <= self.width and width > self.width * 2 // 3
        if fits and keep is None:
            return
        if self.t + 1 - begin > width:
            raise RuntimeError("the KV cache is full of one live sequence: max_length is "
                               "smaller than a request's prompt plus completion")
        inside = 0 <= begin and begin + width <= self.width
        if empty:
            self.cache, self.kv_valid = self._empty_window(len(self.kv_valid), width)
        else:
            if self._rewindow is None:
                self._rewindow = self._jit(_rewindowed, self.cache, 0, static_argnums=(4, 5))
            keep = None if keep is None else self._host(np.asarray(keep, np.int32))[0]
            self.cache, self.kv_valid = self._rewindow(
                self.cache, self.kv_valid, keep, *self._host(np.int32(begin)), width, inside)
        self.t -= begin
        self.start -= begin
        self.shifts += begin > 0

    def _jit(self, fn, cache, replicated: int, **jit):
        """``fn`` compiled; on a mesh, its outputs placed: the cache (of ``cache``'s
        structure) and its key mask split as the module says, then ``replicated``
        outputs the host reads, whole on every device (on every process)."""
        if self.mesh is None:
            return jax.jit(fn, **jit)
        whole = NamedSharding(self.mesh, P())
        return jax.jit(fn, out_shardings=(
            self._cache_sharding(cache), NamedSharding(self.mesh, P(BATCH_AXES)),
            *[whole] * replicated), **jit)

    def _host(self, *arrays):
        """The host's inputs to a compiled step: as they are in one process; over
        several, global arrays of the same value on every process (each process passes
        the same, as it runs the same loop)."""
        if not self.spmd:
            return arrays
        whole = NamedSharding(self.mesh, P())
        return [_put(x, whole) for x in arrays]

    def _cache_sharding(self, cache):
        kv_heads = jax.tree.leaves(cache)[0].shape[-3]
        heads = MODEL.name if kv_heads % self.mesh.shape.get(MODEL.name, 1) == 0 else None

        def spec(leaf):
            lead = (None,) * (leaf.ndim - 4)  # the layer axis of a stacked cache
            return NamedSharding(self.mesh, P(*lead, BATCH_AXES, heads, None, None))
        return jax.tree.map(spec, cache)

    def _compile(self, kind: str, a, b: tuple[int, int], greedy_only: bool):
        key = (kind, a, b, greedy_only)
        if key not in self._compiled:
            make = {"prefill": self._prefill_fn, "decode": self._decode_fn}[kind]
            self._compiled[key] = make(a, b, greedy_only)
        return self._compiled[key]

    def _prefill_fn(self, rows: tuple[int, bool, int | None], widths: tuple[int, int],
                    greedy_only: bool):
        (batch, every, run), (width, length), graphdef = rows, widths, self.graphdef

        def prefill(state, cache, kv_valid, packed):
            inputs = _unpacked(packed, PREFILL_INPUTS, width)
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
            cache = jax.tree.map(lambda big, new: _write(big, new, where, cols, every), cache,
                                 small)
            row = jnp.zeros((batch, length), jnp.int32).at[:, cols].set(mask)
            kv_valid = row[:len(kv_valid)] if every else kv_valid.at[where].set(row, mode="drop")
            first = jax.vmap(lambda key: jax.random.fold_in(key, 0))(
                jax.random.wrap_key_data(inputs["keys"]))
            token, logprob = sample_rows(logits, first, *_sampling(inputs), greedy_only)
            return cache, kv_valid, _packed(PREFILL_OUTPUTS, dict(token=token, logprob=logprob))

        return self._jit(prefill, self.cache, 1, donate_argnums=(1, 2))

    def _decode_fn(self, steps: int, rows_and_width: tuple[int, int], greedy_only: bool):
        (slots, length), inner, pad = rows_and_width, self._inner, self.pad
        every = self.check_every
        eos = jnp.asarray(self.eos)

        def decode(weights, cache, kv_valid, packed):
            inputs = _unpacked(packed, DECODE_INPUTS)
            t, refill_at, token, active, counts, remaining, keys = (inputs[k] for k in (
                "t", "refill_at", "token", "active", "counts", "remaining", "keys"))
            t, refill_at, sampling = t[0], refill_at[0], _sampling(inputs)
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
            return cache, kv_valid, _packed(DECODE_OUTPUTS, dict(
                out=out, written=written, lps=lps, token=token, active=active, counts=counts,
                remaining=remaining, by_eos=by_eos, t=jnp.broadcast_to(t, token.shape)), steps)

        return self._jit(decode, self.cache, 1, donate_argnums=(1, 2))


class _Rows:
    """The host's copy of every slot's request: its key, sampling, tokens so far."""

    def __init__(self, slots: int, seed: int):
        self.seed = seed
        # key data (uint32), not typed keys: host values, made global with the rest
        self.keys = np.array(jax.random.key_data(jax.random.split(jax.random.key(seed), slots)))
        self.token = np.zeros(slots, np.int32)
        self.active = np.zeros(slots, bool)
        self.counts = np.zeros(slots, np.int32)
        self.remaining = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.top_p = np.ones(slots, np.float32)

    def assign(self, slots, params: list[SamplingParams], ids: list[int]) -> None:
        base = jax.random.key(self.seed)
        keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(ids, jnp.int32))
        self.keys[slots] = np.asarray(jax.random.key_data(keys))
        self.counts[slots] = 0
        self.remaining[slots] = [p.max_new_tokens for p in params]
        self.temperature[slots] = [p.temperature for p in params]
        self.top_k[slots] = [p.top_k for p in params]
        self.top_p[slots] = [p.top_p for p in params]

    def sampling(self) -> dict:
        return {name: getattr(self, name) for name, _, _ in SAMPLING}

    def take(self, keep) -> None:
        """Keeps the slots ``keep``, in that order (``Sampler._narrow``)."""
        for name in ("keys", "token", "active", "counts", "remaining", "temperature",
                     "top_k", "top_p"):
            setattr(self, name, getattr(self, name)[keep])


def _packed(layout, values: dict, width: int | None = None):
    """Values of one row each (``(rows,)`` or ``(rows, k)``), named as in ``layout``
    (``DECODE_INPUTS``, ...), side by side in one int32 array, their bits kept: a compiled
    call's inputs, or the outputs it returns, in one transfer (``_unpacked`` splits them
    by the same layout). Host values give a NumPy array, traced ones a traced one;
    ``width``: the columns of the layout's None blocks (None: any)."""
    if set(values) != {name for name, _, _ in layout}:
        raise KeyError(f"packed values {sorted(values)} are not the layout's {layout}")
    xp = jnp if any(isinstance(v, jax.Array) for v in values.values()) else np
    columns = []
    for name, n, dtype in layout:
        x = xp.asarray(values[name]).astype(dtype)
        x = x.reshape(x.shape[0], -1)
        n = width if n is None else n
        if n is not None and x.shape[1] != n:
            raise ValueError(f"{name!r} has {x.shape[1]} columns, the layout {n}")
        columns.append(_bitcast(x, np.int32) if dtype in (np.float32, np.uint32)
                       else x.astype(np.int32))
    return xp.concatenate(columns, 1)


def _unpacked(packed, layout, width: int | None = None) -> dict:
    """The columns ``_packed`` joined by ``layout``, by name, from a NumPy or a traced
    array (a block of 1 column as a vector; ``width``: the columns of the layout's None
    blocks)."""
    out, at = {}, 0
    for name, n, dtype in layout:
        n = width if n is None else n
        x = packed[:, at:at + n]
        at += n
        if dtype in (np.float32, np.uint32):
            x = _bitcast(x, dtype)
        else:
            x = x != 0 if dtype is np.bool_ else x.astype(dtype)
        out[name] = x[:, 0] if n == 1 else x
    return out


def _bitcast(x, dtype):
    """``x``'s bits as ``dtype`` (of the same size), on the host or traced."""
    return x.view(dtype) if isinstance(x, np.ndarray) else jax.lax.bitcast_convert_type(x, dtype)


def _sampling(inputs: dict) -> tuple:
    """The sampling columns of unpacked inputs, in ``sample_rows``' order."""
    return tuple(inputs[name] for name, _, _ in SAMPLING)


def _bucket(n: int) -> int:
    return -(-n // PROMPT_BUCKET) * PROMPT_BUCKET


def _on_ladder(n: int) -> bool:
    """Whether ``n`` is 2^k or 3 x 2^k (the batch sizes a narrowed cache takes: few
    compiled shapes, at most a third of the rows idle)."""
    odd = n // 3 if n % 3 == 0 else n
    return odd > 0 and odd & (odd - 1) == 0


def _window(n: int, length: int) -> int:
    """The cache columns for a window of ``n``, at most ``length``: ``n`` rounded up to
    ``PROMPT_BUCKET`` columns, then, past ``2 * WINDOW_RUNGS`` buckets, to one of
    ``WINDOW_RUNGS`` widths per doubling (less than 1/``WINDOW_RUNGS`` of the columns
    idle, and few compiled widths however long the sequences grow)."""
    units = -(-n // PROMPT_BUCKET)
    step = 1 << max(0, units.bit_length() - WINDOW_RUNGS.bit_length())
    return min(-(-units // step) * step * PROMPT_BUCKET, length)


def _write(big, new, rows, cols, every: bool = False):
    """``new``'s (rows, heads, width) tokens into ``big`` at rows ``rows``, columns
    ``cols`` (a stacked cache's layer axis leads both); rows out of range write nothing.
    ``every``: ``rows`` are all of ``big``'s, in order (``new`` may have more: padding),
    and ``cols`` consecutive: one slice is written, not scattered (on XLA:CPU the
    scatter took 8 ms more of a 64 x 32-token prefill's 85)."""
    axis = big.ndim - 4
    new = new.astype(big.dtype)
    if every:
        new = jax.lax.slice_in_dim(new, 0, big.shape[axis], axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(big, new, cols[0], axis + 2)
    lead = (slice(None),) * axis
    heads = jnp.arange(big.shape[-3])
    return big.at[(*lead, rows[:, None, None], heads[None, :, None], cols[None, None, :])].set(
        new, mode="drop")


def _rewindowed(cache, kv_valid, keep, begin, width: int, inside: bool):
    """The rows ``keep`` (None: all; sorted: a gather of sorted rows runs 4x faster on
    XLA:CPU) and the columns ``[begin, begin + width)`` of the cache and its key mask;
    ``inside``: those columns are all in the old window, else the ones outside it are
    empty (masked)."""
    def take(x, rows_axis, columns_axis):
        if not inside:  # a padded slice: twice as fast on XLA:CPU as a gather with fill
            padding = [(0, 0)] * x.ndim
            padding[columns_axis] = (width, width)
            x, begin_ = jnp.pad(x, padding), begin + width
        else:
            begin_ = begin
        x = jax.lax.dynamic_slice_in_dim(x, begin_, width, columns_axis)
        if keep is not None:
            x = jnp.take(x, keep, axis=rows_axis, indices_are_sorted=True, unique_indices=True)
        return x
    return (jax.tree.map(lambda x: take(x, x.ndim - 4, x.ndim - 2), cache),
            take(kv_valid, 0, 1))


def _platform(state) -> str:
    """The platform of the devices ``state``'s first array is on ("cpu", "gpu", ...)."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def _mesh_of(state):
    for leaf in jax.tree.leaves(state):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _put(x, sharding):
    """``x`` placed on ``sharding``; one over several processes from a host value (the
    same on every process), sliced here without ``device_put``'s check that it is."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array)
                                         and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a model's RNG stream
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _placed(model, state, parallelism: Parallelism):
    from redray.models.hub import family, model_specs

    plan = parallelism.build() if parallelism.mesh is None else parallelism
    inputs = family(model.config.model_type).trace_inputs(model.config)
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    specs = model_specs(graphdef, (params, extra), plan, inputs)
    placed = jax.tree.map(lambda x, s: _put(x, NamedSharding(plan.mesh, s)),
                          (params, extra), specs,
                          is_leaf=lambda x: isinstance(x, P))
    return nnx.state(nnx.merge(graphdef, *placed))
