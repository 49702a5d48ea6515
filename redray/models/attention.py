"""Attention for every family: which keys a query sees, and the ways to compute it.

``AttentionMask`` describes the mask instead of holding it: which key slots are real
(padding), each query's slot (causal masking, a KV cache), an optional sliding window,
optional chunks (Llama 4's chunked attention) and optional segment ids (packed rows).
``attend`` computes attention the way ``choose`` picks, one of ``IMPLEMENTATIONS``:

* ``"cudnn"``: cuDNN's fused flash attention on GPU (``fused_attention.py``): causal,
  any static window, padding and packed rows (segment ids) through its packed layout on
  Hopper and newer, trailing padding as each row's length on older GPUs;
* ``"splash"``: splash attention (Pallas) on TPU (``fused_attention.py``): causal,
  windows, padding anywhere, packed rows and soft-capped scores;
* ``"chunked"``: blockwise attention with an online softmax and a backward pass that
  recomputes each block (``flash_attention``, a ``custom_vjp`` in plain JAX), which
  never holds a (query, key) matrix larger than a block: memory linear in the sequence;
* ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")`` with the mask
  materialized as booleans;
* ``"dense"``: the scores materialized (``dense_attention``): dropout on the attention
  probabilities, and soft-capped scores where ``"xla"`` would run (JAX's function has no
  soft-capping).

What ``"auto"`` (the default; ``REDRAY_ATTENTION`` or a trace's
``attention_forced`` asks for one) picks, for causal self-attention (queries and keys
the same tokens) of a family's model:

| the attention | GPU, Hopper+ | GPU, older | TPU | CPU |
|---|---|---|---|---|
| plain causal | cudnn | cudnn | splash | general |
| padding, leading or trailing | cudnn (packed) | cudnn if it trails | splash | general |
| packed rows (segment ids) | cudnn (packed) | general | splash | general |
| sliding window | cudnn | cudnn | splash | general |
| soft-capped scores (Gemma 2) | general | general | splash | general |
| attention sinks (gpt-oss) | general | general | splash | general |
| chunks (Llama 4) | cudnn (packed) | general | splash | general |
| chunks in packed rows | cudnn (packed) | general | splash | general |
| a bias (T5) / dropout | xla / dense | xla / dense | xla / dense | xla / dense |

"general" is chunked from ``CHUNKED_FROM`` (2,048) keys, else xla (dense with
soft-capped scores or sinks): no fused kernel takes the attention there (cuDNN has no
soft-capping or sinks, and takes chunks only as runs of its packed layout, Hopper's; a
left-padded batch on a GPU before Hopper goes this way at run time). Chunks on cuDNN's
packed layout, and on splash where they do not count from slot 0 (leading padding,
packed rows), are causal attention inside a run per (document, chunk)
(``fused_attention.chunk_runs``): exact where each document's real tokens are
together, which the step checks at run time (else the blockwise kernel).
cuDNN needs bfloat16 or float16 and a head size that is a multiple of 8, up to 256 on
Hopper (128 before); splash a sequence that divides into blocks of 128. Where they do
not apply, and for other attention (a KV cache's decoding, cross-attention, a sequence
split over the context axis, which ``context.py`` computes), the last column's rule
holds. A batch cuDNN's layout cannot describe exactly (padding inside a document) runs
the blockwise kernel at run time. The kernels a Trainer's step uses are shown once in
its console and in MLflow (``redray.attention`` tag; ``tracing.note_attention``).

**Attention sinks** (gpt-oss): a learned logit per query head joins each query's softmax
as one more column, then dropped: ``softmax([scores, sink])[..., :-1] @ v``. The
weights on the values sum to less than one, and a query that sees no key outputs zeros.
The blockwise kernel starts its online softmax with the sink (its running maximum the
sink, its sum of exponentials one).

**Chunks** (Llama 4, transformers' ``create_chunked_causal_mask``): a query sees the keys
of its own chunk of ``chunk`` tokens, at and before its slot, chunks counted from the
row's first real token (or its segment's start). A chunk being causal and contiguous,
that is a window per query: a query at position ``p`` (among its row's real tokens, or
in its segment: ``AttentionMask.q_positions``) sees the keys within ``p % chunk`` of its
slot.

Every path computes the softmax in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from redray.models import fused_attention
from redray.sharding.tracing import attention_counts, attention_forced, note_attention

# Keys from which "auto" attention is computed in chunks where no fused kernel exists.
CHUNKED_FROM = 2048
BLOCK = 512
IMPLEMENTATIONS = ("auto", "cudnn", "splash", "xla", "chunked", "dense")
_MASKED = float(jnp.finfo(jnp.float32).min)


@flax.struct.dataclass
class AttentionMask:
    """Which keys each query attends to.

    Attributes:
      kv_valid: (batch, keys) bool: the key slot holds a real token.
      q_slots: (queries,) int32: each query's slot among the keys (its position in the
        sequence, or in the KV cache).
      q_segments, kv_segments: (batch, queries) / (batch, keys) segment ids of packed
        rows (a query sees keys of its own segment only), or None.
      causal: a query sees keys at its slot and before only.
      window: a query sees the ``window`` latest keys only (sliding window), or None.
      layer_window: ``window`` as an int32 scalar array, where scanned layers differ
        in their windows (Gemma's); None: ``window`` says.
      windows: the values ``layer_window`` can take (static), for the fused kernels,
        which need their window static; () where unknown.
      chunk: a query sees the keys of its own chunk of ``chunk`` tokens only, at and
        before it (chunked attention, Llama 4), or None.
      layer_chunk: ``chunk`` as an int32 scalar array, where scanned layers differ
        (int32's maximum: no chunk); None: ``chunk`` says.
      chunks: the values ``layer_chunk`` can take (static), for the fused kernels; ()
        where unknown.
      q_positions: (batch, queries) int32: each query's position among its row's real
        tokens (or in its segment), from which chunks are counted; None: its slot.
      kv_slots: (keys,) int32: each key's slot, where the keys are not in slot order (a
        sequence split over the context axis, ``redray/models/context.py``); None: a
        key's slot is its index.
      padded: ``kv_valid`` may mark padding (False: every key is real, known where the
        mask was made, e.g. a call without an attention mask).
    """
    kv_valid: jax.Array
    q_slots: jax.Array
    q_segments: jax.Array | None = None
    kv_segments: jax.Array | None = None
    causal: bool = flax.struct.field(pytree_node=False, default=True)
    window: int | None = flax.struct.field(pytree_node=False, default=None)
    layer_window: jax.Array | None = None
    kv_slots: jax.Array | None = None
    padded: bool = flax.struct.field(pytree_node=False, default=True)
    windows: tuple = flax.struct.field(pytree_node=False, default=())
    chunk: int | None = flax.struct.field(pytree_node=False, default=None)
    layer_chunk: jax.Array | None = None
    chunks: tuple = flax.struct.field(pytree_node=False, default=())
    q_positions: jax.Array | None = None

    def block(self, q_slots, kv_slots, kv_valid, q_segments=None, kv_segments=None,
              q_positions=None):
        """The (batch, queries, keys) boolean mask of some queries and keys
        (``q_positions``: those queries' positions, for chunks; None: their slots)."""
        mask = kv_valid.astype(bool)[:, None, :]
        distance = q_slots[None, :, None] - kv_slots[None, None, :]
        if self.causal:
            mask = mask & (distance >= 0)
        for window in (self.window, self.layer_window):
            if window is not None:
                mask = mask & (distance < window)
        for chunk in (self.chunk, self.layer_chunk):
            if chunk is not None:  # the keys of the query's chunk, at and before it
                pos = q_slots[None] if q_positions is None else q_positions
                mask = mask & (distance >= 0) & (distance <= (pos % chunk)[:, :, None])
        if q_segments is not None:
            mask = mask & (q_segments[:, :, None] == kv_segments[:, None, :])
        return mask

    def windowed(self, window, choices: tuple = ()) -> AttentionMask:
        """This mask with a sliding window of ``window`` keys: an int, None (no window),
        or an int32 scalar array (a scanned layer's, ``layer_window``), one of the ints
        ``choices`` where they are known."""
        if window is None or isinstance(window, int):
            return self.replace(window=window, layer_window=None, windows=())
        return self.replace(window=None, layer_window=jnp.asarray(window, jnp.int32),
                            windows=tuple(int(c) for c in choices))

    def chunked(self, chunk, positions, choices: tuple = ()) -> AttentionMask:
        """This mask with chunks of ``chunk`` tokens (Llama 4's chunked attention): an int,
        None (no chunks), or an int32 scalar array (a scanned layer's, ``layer_chunk``;
        int32's maximum: no chunk), one of the ints ``choices`` where they are known.
        ``positions`` (batch, queries): each query's position among its row's real
        tokens or in its segment (a decoder's position ids), from which chunks count;
        None: its slot."""
        positions = None if positions is None else jnp.asarray(positions, jnp.int32)
        if chunk is None or isinstance(chunk, int):
            return self.replace(chunk=chunk, layer_chunk=None, chunks=(),
                                q_positions=positions)
        return self.replace(chunk=None, layer_chunk=jnp.asarray(chunk, jnp.int32),
                            chunks=tuple(int(c) for c in choices), q_positions=positions)

    @property
    def sliding(self) -> bool:
        """Whether a sliding window applies (the same in every layer, or this layer's)."""
        return self.window is not None or self.layer_window is not None

    @property
    def chunking(self) -> bool:
        """Whether chunks apply (the same in every layer, or this layer's)."""
        return self.chunk is not None or self.layer_chunk is not None

    def positions_are_slots(self) -> jax.Array:
        """Whether every real query's position is its slot (self-attention: query ``i``
        is key ``i``): chunks then count from slot 0, as splash's chunked mask does."""
        if self.q_positions is None:
            return jnp.asarray(True)
        return jnp.all((self.q_positions == self.q_slots[None]) | ~self.kv_valid.astype(bool))

    def key_slots(self) -> jax.Array:
        """Each key's slot (``kv_slots``, or the keys' indices)."""
        return jnp.arange(self.kv_valid.shape[1]) if self.kv_slots is None else self.kv_slots

    def dense(self) -> jax.Array:
        """The whole (batch, queries, keys) boolean mask."""
        return self.block(self.q_slots, self.key_slots(), self.kv_valid, self.q_segments,
                          self.kv_segments, self.q_positions)

    @property
    def segmented(self) -> bool:
        return self.q_segments is not None


def implementation() -> str:
    """The attention implementation asked for: the trace's
    (``redray.sharding.tracing.attention_forced``), else ``REDRAY_ATTENTION``
    (default "auto")."""
    name = attention_forced() or os.environ.get("REDRAY_ATTENTION", "auto")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"REDRAY_ATTENTION={name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return name


@dataclasses.dataclass(frozen=True)
class Target:
    """What attention is computed on: the platform (``jax.default_backend()``: "gpu",
    "tpu", "cpu") and, on a GPU, whether it has cuDNN's packed layout (Hopper and
    newer)."""
    platform: str
    packed: bool = False

    @classmethod
    def live(cls) -> "Target":
        platform = jax.default_backend()
        return cls(platform, platform == "gpu" and fused_attention.packed_layout_available())

    def describe(self) -> str:
        if self.platform != "gpu":
            return self.platform.upper()
        return "GPU, Hopper or newer" if self.packed else "GPU, before Hopper"


def choose(q, k, mask: AttentionMask, bias, dropout, asked: str | None = None,
           softcap: float | None = None, target: Target | None = None,
           sinks=None) -> str:
    """Which implementation computes this attention (the table of the module
    docstring); ``target``: the live devices' by default."""
    return decide(q, k, mask, bias, dropout, asked, softcap, target, sinks)[0]


def decide(q, k, mask: AttentionMask, bias, dropout, asked: str | None = None,
           softcap: float | None = None, target: Target | None = None,
           sinks=None) -> tuple[str, str]:
    """``choose``'s pick and why, in a few words."""
    asked = asked or implementation()
    if dropout is not None:
        return "dense", "dropout on the attention probabilities"
    if asked == "cudnn":
        # cuDNN would compute another attention than the model's: refused, not ignored
        lacks = [what for what, present in (
            (f"logit soft-capping (softcap={softcap}, attn_logit_softcapping)",
             softcap is not None),
            ("attention sinks (gpt-oss's per-head sink logits)", sinks is not None),
            ("chunked attention (Llama 4's attention_chunk_size) before Hopper (its packed "
             "layout takes a run per chunk)",
             mask.chunking and not (target or Target.live()).packed)) if present]
        if lacks:
            raise ValueError(f"REDRAY_ATTENTION=cudnn: cuDNN's fused attention has no "
                             f"{' and no '.join(lacks)}; use 'auto', 'splash' (TPU), "
                             "'chunked' or 'dense'")
    if asked == "xla" and (softcap is not None or sinks is not None):
        return "dense", ("soft-capped scores" if softcap is not None else "attention sinks") \
            + " (XLA's attention has none)"
    if asked != "auto":
        return asked, "asked for"
    target = target or Target.live()
    general = ("chunked" if k.shape[1] >= CHUNKED_FROM and bias is None
               else "xla" if softcap is None and sinks is None else "dense")
    # causal self-attention in slot order, its window and chunk static: what the
    # kernels take
    own = (mask.causal and q.shape[1] == k.shape[1] and mask.kv_slots is None
           and bias is None and (mask.layer_window is None or mask.windows)
           and (mask.layer_chunk is None or mask.chunks))
    if not own:
        return general, "not causal self-attention with a static window and chunk"
    if target.platform == "tpu":
        if fused_attention.splash_blocks(q.shape[1]) and q.shape[-1] % 8 == 0:
            if mask.chunking and (mask.q_positions is not None or mask.segmented):
                return "splash", "splash attention; a segment per chunk where chunks " \
                    "do not count from slot 0: leading padding, packed rows"
            return "splash", "splash attention"
        return general, "a sequence splash cannot cut into blocks of 128"
    if target.platform != "gpu":
        return general, f"no fused kernel on {target.platform}"
    if sinks is not None:
        return general, "attention sinks (cuDNN has none)"
    if mask.chunking and not target.packed:
        return general, "chunked attention (cuDNN takes it as a run per chunk of its " \
            "packed layout: Hopper or newer)"
    limit = 256 if target.packed else 128
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return general, f"{q.dtype} (cuDNN's flash attention takes bfloat16 or float16)"
    if q.shape[-1] > limit or q.shape[-1] % 8:
        return general, f"head size {q.shape[-1]} (cuDNN: a multiple of 8 up to {limit})"
    if softcap is not None:
        return general, "soft-capped scores (cuDNN has no soft-capping)"
    if mask.segmented and not target.packed:
        return general, "packed rows (cuDNN's packed layout needs Hopper or newer)"
    if target.packed and mask.chunking:
        return "cudnn", "packed layout, a run per chunk"
    if target.packed and (mask.padded or mask.segmented):
        return "cudnn", "packed layout"
    if mask.padded:
        return "cudnn", "rows' lengths; blockwise where the padding leads"
    return "cudnn", "causal"


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(scores / cap)``: scores squashed into (-cap, cap) (Gemma 2's attention
    logits, Gemma's final logits); ``cap`` None: the scores unchanged."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def attend(q, k, v, mask: AttentionMask, scale: float, bias=None,
           dropout: Callable | None = None, impl: str | None = None,
           softcap: float | None = None, sinks=None):
    """Scaled dot-product attention with grouped-query heads, softmax in float32.

    q: (B, T, H, D); k, v: (B, S, KV, D) with H a multiple of KV (query head h reads
    key/value head h // (H // KV)); mask: an ``AttentionMask``; bias: broadcastable to
    (B, H, T, S); dropout: applied to the attention probabilities; impl: one of
    ``IMPLEMENTATIONS`` (default: ``REDRAY_ATTENTION``, else "auto"); softcap: the
    scaled scores are soft-capped to (-softcap, softcap) (``soft_cap``) before the mask
    and the bias; sinks: (H,) a logit per query head that joins each query's softmax
    as one more column (gpt-oss's attention sinks, the module docstring), or None.
    """
    counts = attention_counts()
    if counts is not None:
        counts.append(AttentionCall.of(q, k, mask))
        return _stand_in(q, k, v)
    target = Target.live()
    chosen, why = decide(q, k, mask, bias, dropout, impl, softcap, target, sinks)
    # a batch with more documents in a row than cuDNN's packed layout takes is refused on
    # the host (the kernel would give way to the blockwise one on every such batch)
    packed = chosen == "cudnn" and target.packed and mask.segmented
    note_attention(chosen, why, fused_attention.check_segments if packed else None)
    if chosen == "dense":
        return dense_attention(q, k, v, mask.dense(), scale, bias, dropout, softcap,
                               sinks=sinks)
    if chosen == "chunked":
        if bias is not None:
            raise ValueError("chunked attention takes no bias: use 'xla' or 'dense'")
        return flash_attention(q, k, v, mask, scale, softcap=softcap, sinks=sinks)
    if chosen == "cudnn":
        def general(q, k, v):  # what a batch cuDNN's layout cannot describe runs
            return flash_attention(q, k, v, mask, scale).astype(v.dtype)
        return fused_attention.cudnn_attention(q, k, v, mask, scale, target.packed, general)
    if chosen == "splash":
        if fused_attention.splash_blocks(q.shape[1]) is None:
            raise ValueError(f"splash attention cuts the sequence into blocks of "
                             f"{', '.join(map(str, fused_attention.SPLASH_BLOCKS))}: "
                             f"{q.shape[1]} tokens divide by none; pad the sequence")

        def splash(q, k, v, by_runs=False):
            return fused_attention.splash_attention(q, k, v, mask, scale, softcap,
                                                    sinks=sinks, by_runs=by_runs
                                                    ).astype(v.dtype)
        if mask.chunking and (mask.q_positions is not None or mask.segmented):
            # splash's chunked mask counts chunks from slot 0, the mask from each
            # document's first real token: where they differ (leading padding, packed
            # rows) each chunk is a segment of its own, exact where each document's
            # real tokens are together, else the blockwise kernel runs
            def blockwise(q, k, v):
                return flash_attention(q, k, v, mask, scale, softcap=softcap,
                                       sinks=sinks).astype(v.dtype)

            def by_runs(q, k, v):
                return jax.lax.cond(fused_attention.documents_together(mask),
                                    functools.partial(splash, by_runs=True), blockwise,
                                    q, k, v)
            slots = mask.positions_are_slots() & (not mask.segmented)
            return jax.lax.cond(slots, splash, by_runs, q, k, v)
        return splash(q, k, v)
    return _xla(q, k, v, mask, scale, bias)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention's geometry, as the planner costs it (``counted_attention``).

    Attributes:
      rows, heads, head_dim: batch rows, query heads and the head size.
      queries, keys: per row.
      pairs: the (query, key) pairs a block-skipping kernel computes per row and head:
        all of them, the lower triangle of causal self-attention, or a sliding
        window's band.
    """
    rows: int
    heads: int
    head_dim: int
    queries: int
    keys: int
    pairs: float

    @classmethod
    def of(cls, q, k, mask: AttentionMask) -> "AttentionCall":
        b, t, h, d = q.shape
        s = k.shape[1]
        pairs = float(t * s)
        if mask.causal and t == s and mask.kv_slots is None:
            windows = [w for w in (mask.window, *mask.windows) if w is not None]
            # a scanned stack's windows differ by layer: their mean
            w = sum(windows) / len(windows) if windows else t
            w = min(w, t)
            pairs = w * t - w * (w - 1) / 2
            chunks = [c for c in (mask.chunk, *mask.chunks) if c is not None]
            if chunks:  # each chunk's triangle, the last chunk's shorter; their mean
                pairs = sum(_chunk_pairs(t, min(c, t)) for c in chunks) / len(chunks)
        return cls(b, h, d, t, s, pairs)

    @property
    def flops(self) -> float:
        """Forward FLOPs a block-skipping kernel computes: scores and values, 2 x 2 per
        pair, head and head dimension."""
        return 4.0 * self.rows * self.heads * self.head_dim * self.pairs

    @property
    def dense_flops(self) -> float:
        """Forward FLOPs of every (query, key) pair (a materialized mask's)."""
        return 4.0 * self.rows * self.heads * self.head_dim * self.queries * self.keys


def _chunk_pairs(tokens: int, chunk: int) -> float:
    """The (query, key) pairs of chunked causal attention over ``tokens`` tokens."""
    whole, rest = divmod(tokens, chunk)
    return whole * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2


def _stand_in(q, k, v):
    """An output of attention's shape that reads q, k and v once each (grouped heads
    broadcast), for ``counted_attention``'s traces."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    mean = lambda x: jnp.mean(x, axis=1, keepdims=True)  # noqa: E731
    kvsum = (mean(k) + mean(v)).astype(q.dtype)
    return (q.reshape(b, t, kv, h // kv, d) + kvsum[:, :, :, None]).reshape(b, t, h, d)


def _xla(q, k, v, mask: AttentionMask, scale: float, bias=None):
    out = jax.nn.dot_product_attention(
        q, k, v, bias=None if bias is None else bias.astype(jnp.float32),
        mask=mask.dense()[:, None], scale=scale, implementation="xla")
    return out.astype(v.dtype)


def dense_attention(q, k, v, mask, scale: float, bias=None, dropout: Callable | None = None,
                    softcap: float | None = None, heads_first: bool = False, sinks=None):
    """Attention through a materialized (B, T, S) boolean ``mask``, float32 scores.
    ``heads_first``: k and v are (B, KV, S, D) (a KV cache's layout), not (B, S, KV, D);
    ``sinks``: (H,) each query head's sink logit, one more column of the softmax,
    dropped after it (``attend``'s)."""
    b, t, h, d = q.shape
    kv = k.shape[1 if heads_first else 2]
    keys = k.shape[2 if heads_first else 1]
    g = h // kv
    qg = q.reshape(b, t, kv, g, d)
    layout = "bksd" if heads_first else "bskd"
    scores = jnp.einsum(f"btkgd,{layout}->bkgts", qg, k,
                        preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, softcap)
    if bias is not None:
        bias = jnp.broadcast_to(bias, (bias.shape[0], h, t, keys))
        scores = scores + bias.reshape(bias.shape[0], kv, g, t, keys).astype(jnp.float32)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    if sinks is None:
        probs = jax.nn.softmax(scores, -1)
    else:
        sink = jnp.asarray(sinks, jnp.float32).reshape(kv, g, 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
    probs = probs.astype(v.dtype)
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum(f"bkgts,{layout}->btkgd", probs, v)
    return out.reshape(b, t, h, v.shape[-1])


# ------------------------------------------------------------------ flash attention
def flash_attention(q, k, v, mask: AttentionMask, scale: float, block: int = BLOCK,
                    softcap: float | None = None, sinks=None):
    """Attention in blocks of ``block`` queries x ``block`` keys, with an online softmax
    forward and a backward that recomputes each block's probabilities from the saved
    softmax statistics (the FlashAttention algorithm, in plain JAX): memory linear in the
    sequence. ``softcap``, ``sinks``: as ``attend``'s."""
    t = q.shape[1]
    lay, args = _padded(q, k, v, mask, scale, block, softcap)
    return _flash(lay, *args, _grouped(sinks, k.shape[2]))[:, :t].astype(v.dtype)


def flash_forward(q, k, v, mask: AttentionMask, scale: float, softcap: float | None = None,
                  block: int = BLOCK, sinks=None):
    """``flash_attention``'s forward, not differentiable, with its softmax statistics:
    (output (B, T, H, D) float32, statistics (2, B, KV, G, T): each query's largest
    score and its sum of exponentials per key/value head and group). Attention over
    keys in parts (a ring, ``redray/models/context.py``) merges the parts' outputs by
    their statistics and computes its gradients with ``flash_backward``. ``sinks``
    (H,): the sinks counted in this part's statistics (give them to one part only)."""
    t = q.shape[1]
    lay, args = _padded(q, k, v, mask, scale, block, softcap)
    out, residuals = _flash_forward(lay, *args, _grouped(sinks, k.shape[2]))
    return out[:, :t], residuals[-1][..., :t]


def flash_backward(q, k, v, mask: AttentionMask, scale: float, out, stats, d_out,
                   softcap: float | None = None, block: int = BLOCK, sinks=None):
    """The gradients (dq, dk, dv, d sinks) that reach ``q``, ``k``, ``v`` and ``sinks``
    through attention over these keys, where ``out`` and ``stats`` are the attention's
    output and statistics over all the keys the queries see (``flash_forward``'s,
    merged, the sinks counted once) and ``d_out`` the output's gradient. d sinks (H,)
    float32 is these queries' whole share of the sinks' gradient (give ``sinks`` to one
    part only); None without sinks."""
    t, s, kv = q.shape[1], k.shape[1], k.shape[2]
    lay, args = _padded(q, k, v, mask, scale, block, softcap)
    pad = args[0].shape[1] - t
    if pad:  # alignment queries: no output, no gradient, statistics that divide by 1
        out = jnp.pad(out, ((0, 0), (0, pad), (0, 0), (0, 0)))
        d_out = jnp.pad(d_out, ((0, 0), (0, pad), (0, 0), (0, 0)))
        stats = jnp.concatenate([jnp.pad(stats[:1], [(0, 0)] * 4 + [(0, pad)]),
                                 jnp.pad(stats[1:], [(0, 0)] * 4 + [(0, pad)],
                                         constant_values=1.0)])
    grouped = _grouped(sinks, kv)
    dq, dk, dv, *_, d_sinks = _flash_bwd(lay, (*args, grouped, out, stats), d_out)
    return (dq[:, :t], dk[:, :s], dv[:, :s],
            None if d_sinks is None else d_sinks.reshape(-1))


def _grouped(sinks, kv: int):
    """(H,) sinks as (KV, G) float32, the heads' grouping; None stays None."""
    return None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(kv, -1)


def _padded(q, k, v, mask: AttentionMask, scale: float, block: int, softcap):
    """(layout, the arguments of ``_flash`` but the sinks) of a flash attention: queries
    and keys padded to whole blocks, the mask's facts as arrays."""
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    tq, tk = min(block, t), min(block, s)
    pad_q, pad_k = -t % tq, -s % tk
    segments = mask.segmented
    q_seg = mask.q_segments if segments else jnp.zeros((b, t), jnp.int32)
    kv_seg = mask.kv_segments if segments else jnp.zeros((b, s), jnp.int32)
    q_slots, kv_slots = mask.q_slots, mask.key_slots()
    q_pos = (jnp.broadcast_to(q_slots, (b, t)) if mask.q_positions is None
             else mask.q_positions).astype(jnp.int32)
    if pad_q:
        q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
        q_slots = jnp.pad(q_slots, (0, pad_q), constant_values=q_slots[-1])
        q_seg = jnp.pad(q_seg, ((0, 0), (0, pad_q)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pad_q)))
    kv_real = jnp.pad(jnp.ones((s,), bool), (0, pad_k))  # alignment keys: never seen
    if pad_k:
        k = jnp.pad(k, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad_k)))
        kv_slots = jnp.pad(kv_slots, (0, pad_k))
    kv_valid = jnp.pad(mask.kv_valid.astype(bool), ((0, 0), (0, pad_k)))
    # the window and the chunk travel as arrays: a scanned layer's are traced
    window = mask.window if mask.layer_window is None else mask.layer_window
    chunk = mask.chunk if mask.layer_chunk is None else mask.layer_chunk
    layout = _Layout(mask.causal, window is not None, chunk is not None, segments, tq, tk,
                     h // kv, scale, softcap)
    limits = tuple(jnp.asarray(0 if x is None else x, jnp.int32) for x in (window, chunk))
    return layout, (q, k, v, (q_slots, q_pos, q_seg), (kv_slots, kv_valid, kv_seg, kv_real),
                    limits)


@dataclasses.dataclass(frozen=True)
class _Layout:
    causal: bool
    windowed: bool
    chunked: bool
    segments: bool
    tq: int
    tk: int
    groups: int
    scale: float
    softcap: float | None


def _block_scores(lay, limits, qb, kb, q_facts, k_facts):
    """(B, KV, G, tq, tk) float32 scores of a block (soft-capped where the layout says),
    masked (the float32 minimum, as the dense path) and alignment keys at -inf; and where
    the mask allows (B, tq, tk). ``q_facts``: the block's queries' (slots, positions,
    segments); ``k_facts``: its keys' (slots, validity, segments, alignment)."""
    b, tq, h, d = qb.shape
    # The mask's facts are the same in every layer: XLA would hoist the masks of every
    # block out of the layers' loop and hold them all at once (memory quadratic in the
    # sequence, measured). Tied to this block's keys they are made where they are used.
    kb, q_facts, k_facts, limits = jax.lax.optimization_barrier((kb, q_facts, k_facts, limits))
    q_slots, q_pos, q_seg = q_facts
    kv_slots, kv_valid, kv_seg, kv_real = k_facts
    window, chunk = limits
    qg = qb.reshape(b, tq, h // lay.groups, lay.groups, d)
    scores = soft_cap(jnp.einsum("btkgd,bskd->bkgts", qg, kb,
                                 preferred_element_type=jnp.float32) * lay.scale, lay.softcap)
    allowed = AttentionMask(kv_valid, q_slots, causal=lay.causal,
                            layer_window=window if lay.windowed else None,
                            layer_chunk=chunk if lay.chunked else None).block(
        q_slots, kv_slots, kv_valid, q_seg if lay.segments else None,
        kv_seg if lay.segments else None, q_pos if lay.chunked else None)
    scores = jnp.where(allowed[:, None, None], scores, _MASKED)
    return jnp.where(kv_real[None, None, None, None, :], scores, -jnp.inf), allowed


def _key_blocks(lay, k, v, k_facts):
    """Keys, values and their facts (slots, validity, segments, alignment) cut into
    blocks along a leading axis: (k, v, facts)."""
    kv_slots, kv_valid, kv_seg, kv_real = k_facts
    b, s = k.shape[:2]
    n = s // lay.tk

    def cut(x, axis=1):
        shape = x.shape[:axis] + (n, lay.tk) + x.shape[axis + 1:]
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    return (cut(k), cut(v), (cut(kv_slots[None])[:, 0], cut(kv_valid), cut(kv_seg),
                             cut(kv_real[None])[:, 0]))


def _forward_block(lay, limits, sinks, qb, q_facts, keys):
    """(out, [max score, sum of exponentials]) of one query block over every key block
    (online softmax; ``sinks`` (KV, G): its first column, or None)."""
    b, tq, h, d = qb.shape
    kvh, g = h // lay.groups, lay.groups

    def step(carry, blk):
        top, total, acc = carry  # running max, sum of exponentials, weighted values
        kb, vb, k_facts = blk
        sc, _ = _block_scores(lay, limits, qb, kb, q_facts, k_facts)
        new_top = jnp.maximum(top, sc.max(-1))
        p = jnp.exp(sc - new_top[..., None])
        corr = jnp.exp(top - new_top)
        total = total * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p,
                                                  vb.astype(jnp.float32))
        return (new_top, total, acc), None

    if sinks is None:
        top, total = (jnp.full((b, kvh, g, tq), -jnp.inf, jnp.float32),
                      jnp.zeros((b, kvh, g, tq), jnp.float32))
    else:  # the sink's column first: its score the maximum so far, exp(0) = 1 the sum
        top = jnp.broadcast_to(sinks[None, :, :, None], (b, kvh, g, tq))
        total = jnp.ones((b, kvh, g, tq), jnp.float32)
    init = (top, total, jnp.zeros((b, kvh, g, tq, d), jnp.float32))
    (top, total, acc), _ = jax.lax.scan(step, init, keys)
    # the max and the sum apart, not their log-sum-exp: for a query that sees no key
    # (every score the float32 minimum) top + log(total) rounds back to top
    return acc / total[..., None], jnp.stack([top, total])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(lay, q, k, v, q_facts, k_facts, limits, sinks):
    return _flash_forward(lay, q, k, v, q_facts, k_facts, limits, sinks)[0]


def _query_blocks(lay, x, axis=1):
    n = x.shape[axis] // lay.tq
    shape = x.shape[:axis] + (n, lay.tq) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _query_fact_blocks(lay, q_facts):
    """The queries' (slots (T,), positions (B, T), segments (B, T)) cut into blocks."""
    slots, pos, seg = q_facts
    return (_query_blocks(lay, slots[None])[:, 0], _query_blocks(lay, pos),
            _query_blocks(lay, seg))


def _unblock(x, axis):
    """The inverse of ``_query_blocks(..., axis)``: blocks stacked on axis 0, the block
    length at ``axis`` of each block, joined back into one sequence axis."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _flash_forward(lay, q, k, v, q_facts, k_facts, limits, sinks):
    b, t, h, d = q.shape
    keys = _key_blocks(lay, k, v, k_facts)

    def one(args):
        qb, facts = args
        return _forward_block(lay, limits, sinks, qb, facts, keys)

    out, stats = jax.lax.map(one, (_query_blocks(lay, q), _query_fact_blocks(lay, q_facts)))
    # out: (nq, B, KV, G, tq, D) -> (B, T, H, D); stats: (nq, 2, B, KV, G, tq) ->
    # (2, B, KV, G, T): each query's max score and sum of exponentials
    out = jnp.moveaxis(_unblock(out, 3), 3, 1).reshape(b, t, h, d)
    return out, (q, k, v, q_facts, k_facts, limits, sinks, out, _unblock(stats, 4))


def _flash_bwd(lay, residuals, d_out):
    q, k, v, q_facts, k_facts, limits, sinks, out, stats = residuals
    b, t, h, d = q.shape
    kvh, g = h // lay.groups, lay.groups
    # D_i = rowsum(dO * O), per query and head: (B, KV, G, T)
    delta = jnp.einsum("bthd,bthd->bth", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = jnp.moveaxis(delta.reshape(b, t, kvh, g), 1, 3)
    keys = _key_blocks(lay, k, v, k_facts)
    n_k = keys[0].shape[0]

    def one_query_block(dk_dv, args):
        qb, facts, dob, stats_b, delta_b = args
        qg = qb.reshape(b, lay.tq, kvh, g, d).astype(jnp.float32)
        dog = dob.reshape(b, lay.tq, kvh, g, d).astype(jnp.float32)

        def step(dq, blk):
            kb, vb, k_facts = blk
            sc, allowed = _block_scores(lay, limits, qb, kb, facts, k_facts)
            p = jnp.exp(sc - stats_b[0][..., None]) / stats_b[1][..., None]  # probabilities
            dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
            dp = jnp.einsum("btkgd,bskd->bkgts", dog, vb.astype(jnp.float32))
            ds = p * (dp - delta_b[..., None])
            if lay.softcap is not None:  # through c * tanh(s / c): times 1 - tanh(s / c)^2
                ds = ds * (1 - jnp.square(sc / lay.softcap))
            # a masked score is a constant: no gradient reaches q or k through it (it
            # matters for a query that sees no key, whose probabilities are uniform)
            ds = jnp.where(allowed[:, None, None], ds, 0.0) * lay.scale
            dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, kb.astype(jnp.float32))
            dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg)
            return dq, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((b, lay.tq, kvh, g, d), jnp.float32),
                                    keys)
        return (dk_dv[0] + dk, dk_dv[1] + dv), dq.reshape(b, lay.tq, h, d)

    zeros = (jnp.zeros((n_k, b, lay.tk, kvh, d), jnp.float32),) * 2
    blocks = (_query_blocks(lay, q), _query_fact_blocks(lay, q_facts),
              _query_blocks(lay, d_out), _query_blocks(lay, stats, axis=4),
              _query_blocks(lay, delta, axis=3))
    (dk, dv), dq = jax.lax.scan(one_query_block, zeros, blocks)
    dq = _unblock(dq, 1)
    dk, dv = _unblock(dk, 1), _unblock(dv, 1)
    d_sinks = None
    if sinks is not None:
        # the sink's column: d sink = sum over queries of p_sink * (0 - D_i)
        p_sink = jnp.exp(sinks[None, :, :, None] - stats[0]) / stats[1]
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3))
    # slots, positions, segments, validity, window and chunk: integers
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            jax.tree.map(lambda _: None, q_facts), jax.tree.map(lambda _: None, k_facts),
            (None, None), d_sinks)


_flash.defvjp(_flash_forward, _flash_bwd)
