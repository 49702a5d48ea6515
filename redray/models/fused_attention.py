"""The vendors' fused attention kernels behind ``attention.attend``: cuDNN's flash
attention on GPU and splash attention (Pallas, Mosaic) on TPU, each given exactly the
mask redray describes (``AttentionMask``) or not used.

**cuDNN** takes no mask: it takes causal masking, a sliding window (its length, static),
and where the real tokens are:

* a mask without padding: the plain causal kernel;
* on Hopper and newer, the packed ("THD") layout: each row's runs of real tokens of one
  segment as (offset, length) pairs, at most ``max_segments()`` per row
  (``packed_layout``). That is packed documents (segment ids), and padding in any
  position that does not cut a document: a left-padded row is one run that starts late,
  a right-padded one a run that ends early;
* on older GPUs, each row's length where its padding trails (no segments).

A batch the layout cannot describe exactly (padding inside a document, one segment id
in two places of a row, more runs in a row than the bound) runs the blockwise kernel
instead (``attention.flash_attention``: exact, linear memory), chosen at run time for the
whole batch: cuDNN would let tokens attend across what separates them. A query outside
every run (padding) gets zeros, and no gradient flows through it. A Trainer refuses, on
the host and with the fix, a batch whose ``segment_ids`` hold more documents in a row
than the bound (``check_segments``).

**Splash** takes the mask's static shape (causal, the window as a local band, chunks as
its ``ChunkedCausalMask``) and segment ids per token: packed rows are their segment ids,
padding a segment of its own (so padding in any position is exact), soft-capped scores
its ``attn_logits_soft_cap``, attention sinks its ``sinks``, grouped-query heads the
multi-query kernel run over each key/value head. Its chunks count from slot 0: a
chunked mask runs on its ``ChunkedCausalMask`` where each real query's position is its
slot (no segments, no leading padding; ``attention.attend`` checks at run time), and
elsewhere on a causal mask with a segment per (document, chunk) (``chunk_runs``), which
cuDNN's packed layout takes the same way on Hopper: chunked attention is causal
attention inside each chunk, where each document's real tokens are together (checked
at run time, else the blockwise kernel). Its blocks are
the largest of 512, 256, 128 that divide the sequence. It takes no scale: the queries
are scaled in float32 and rounded once to their dtype before it (as MaxText does), where
the XLA path scales scores in float32. At the usual scale that costs little. With scores
far above one it costs more than the XLA path's rounding of the probabilities: measured
in bf16 at 8x the usual scale, 5x the XLA path's error against float32.

A scanned stack of layers whose windows differ (Gemma's local and global layers)
passes each layer's window traced; the kernels need it static, so the mask lists the
values it can take (``AttentionMask.windows``) and each layer switches among kernels
compiled for each. Chunks likewise (``AttentionMask.chunks``: Llama 4's chunked and
global layers).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

# Runs of real tokens a row may hold in cuDNN's packed layout (documents per row), by
# default: the layout's arrays and the kernel's grid grow with it.
MAX_SEGMENTS = 64
MAX_SEGMENTS_ENV = "REDRAY_MAX_SEGMENTS"
SPLASH_BLOCKS = (512, 256, 128)


def max_segments() -> int:
    """The bound on runs per row of cuDNN's packed layout (``REDRAY_MAX_SEGMENTS``,
    default ``MAX_SEGMENTS``)."""
    value = os.environ.get(MAX_SEGMENTS_ENV, str(MAX_SEGMENTS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{MAX_SEGMENTS_ENV}={value!r}: give a positive number of segments "
                         "per row")
    return int(value)


def segment_bound(tokens: int) -> int:
    """Runs a row of ``tokens`` may hold in cuDNN's packed layout: ``max_segments()``, at
    most the tokens, at least two (JAX gives cuDNN the packed form from two up)."""
    return max(2, min(max_segments(), tokens))


# ------------------------------------------------------------------ windows and chunks
def _static(fixed, traced, values, keys: int) -> tuple[list, jax.Array | int]:
    """(the static lengths a layer's window or chunk can be, None for none, and which one
    applies here: an index, traced where the layer's length is). A length of the keys
    or more is none."""
    def static(length):
        return None if length is None or length >= keys else int(length)

    if traced is None:
        return [static(fixed)], 0
    choices = [static(x) for x in values]
    index = sum(i * (traced == x) for i, x in enumerate(values))
    return choices, jnp.asarray(index, jnp.int32)


def static_windows(mask, keys: int) -> tuple[list, jax.Array | int]:
    """(the static windows the mask's layers can have, None for none, and which one
    applies here: an index, traced where the layer's window is). A window as long as the
    keys or longer is none."""
    return _static(mask.window, mask.layer_window, mask.windows, keys)


def static_chunks(mask, keys: int) -> tuple[list, jax.Array | int]:
    """``static_windows`` for the mask's chunks."""
    return _static(mask.chunk, mask.layer_chunk, mask.chunks, keys)


def _switched(choices, index, kernel):
    if len(choices) == 1:
        return kernel(choices[0])
    branches = [kernel(x) for x in choices]
    return lambda *args: jax.lax.switch(index, branches, *args)


def by_window(mask, keys: int, kernel):
    """``kernel(window)`` (a function of arrays) for this layer's window: switched among
    the static choices where the layer's window is traced."""
    return _switched(*static_windows(mask, keys), kernel)


def by_chunk(mask, keys: int, kernel):
    """``by_window`` for this layer's chunk: ``kernel(chunk)``."""
    return _switched(*static_chunks(mask, keys), kernel)


# ------------------------------------------------------------------ cuDNN
def packed_layout(kv_valid: jax.Array, segments: jax.Array | None, bound: int):
    """cuDNN's packed layout of rows of real tokens: each row's runs (a maximal stretch
    of real tokens of one segment) as ``offsets`` (batch, bound + 1) and ``lengths``
    (batch, bound), the unused entries -1; ``inside`` (batch, tokens): the token is in a
    run; and ``exact``: the layout means what the mask does, in every row (no segment id
    in two runs of a row, which padding inside a document makes; no more runs than
    ``bound``).

    Causal attention inside each run, and a window counted inside it, is then the mask's
    attention for every real query: a run's tokens are consecutive, so their distances
    are the slots' distances."""
    b, s = kv_valid.shape
    real = kv_valid.astype(bool)
    seg = jnp.zeros((b, s), jnp.int32) if segments is None else segments.astype(jnp.int32)
    before = jnp.pad(real, ((0, 0), (1, 0)))[:, :-1]
    changed = jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    starts = real & (~before | changed)
    runs = starts.sum(-1)
    run = jnp.cumsum(starts, -1) - 1  # each real token's run
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    place = jnp.where(starts & (run < bound), run, bound + 1)  # beyond: dropped
    offsets = jnp.full((b, bound + 1), -1, jnp.int32).at[rows, place].set(
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), mode="drop")
    counted = jnp.where(real & (run < bound), run, bound + 1)
    lengths = jnp.zeros((b, bound), jnp.int32).at[rows, counted].add(1, mode="drop")
    lengths = jnp.where(jnp.arange(bound)[None] < runs[:, None], lengths, -1)
    # each segment id of a row in one run: as many runs as distinct ids among real tokens
    ordered = jnp.sort(jnp.where(real, seg, jnp.iinfo(jnp.int32).max), -1)
    distinct = (real.sum(-1) > 0) + jnp.sum(
        (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] != jnp.iinfo(jnp.int32).max), -1)
    exact = jnp.all((runs == distinct) & (runs <= bound))
    return offsets, lengths, real & (run < bound), exact


def chunk_runs(mask, chunk: int) -> jax.Array:
    """(batch, tokens) int32 ids that give each (document, chunk) of a row's real tokens
    a run of its own, 0 for padding: the chunks of ``chunk`` tokens counted from each
    document's start (or the row's first real token; ``mask.q_positions``). Where each
    document's real tokens are consecutive (``documents_together``), causal attention
    inside each run is the chunked mask's attention for every real query: a query sees
    the keys of its chunk up to itself. Self-attention: the queries are the keys."""
    real = mask.kv_valid.astype(bool)
    b, s = real.shape
    doc = jnp.zeros((b, s), jnp.int32) if mask.kv_segments is None \
        else mask.kv_segments.astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s), (b, s)) if mask.q_positions is None \
        else mask.q_positions
    part = positions // chunk
    before = jnp.pad(real, ((0, 0), (1, 0)))[:, :-1]
    moved = jnp.pad((doc[:, 1:] != doc[:, :-1]) | (part[:, 1:] != part[:, :-1]),
                    ((0, 0), (1, 0)), constant_values=True)
    starts = real & (~before | moved)
    return jnp.where(real, jnp.cumsum(starts, -1), 0).astype(jnp.int32)


def documents_together(mask) -> jax.Array:
    """Whether each document's real tokens (each row's, without segments) are
    consecutive in every row: no padding inside a document, no segment id in two
    places. Where they are, a document's chunks are runs (``chunk_runs``)."""
    return packed_layout(mask.kv_valid, mask.kv_segments, mask.kv_valid.shape[1])[3]


def cudnn_attention(q, k, v, mask, scale: float, packed: bool, general):
    """cuDNN's fused attention for ``mask`` (causal, its window, its padding and
    segments as the module docstring says; its chunks on the packed layout, a run per
    chunk: ``chunk_runs``); ``general(q, k, v)``: the exact path a batch the kernel
    cannot take runs instead. ``packed``: the GPU has the packed layout."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def kernel(lengths=None, offsets=None):
        def of_window(window):
            def call(q, k, v):
                return cudnn.dot_product_attention(
                    q, k, v, None, None, lengths, lengths, offsets, offsets, scale=scale,
                    mask_type=cudnn.MaskType.CAUSAL if lengths is None
                    else cudnn.MaskType.PADDING_CAUSAL, sliding_window_length=window)
            return call
        return by_window(mask, k.shape[1], of_window)

    def on_runs(segments, bound: int, exact=True):
        """The packed layout of ``segments``' runs (``exact`` besides its own check)."""
        offsets, lengths, inside, fits = packed_layout(mask.kv_valid, segments, bound)

        def fused(q, k, v):
            # nothing of a token outside every run reaches the kernel or comes back
            # from it: its output and gradients there are the kernel's scratch
            keep = inside[:, :, None, None]
            q, k, v = (jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
            out = kernel(lengths, offsets)(q, k, v)
            return jnp.where(keep, out, jnp.zeros((), out.dtype))

        return lambda q, k, v: jax.lax.cond(fits & exact, fused, general, q, k, v)

    def unchunked():
        if not mask.padded and not mask.segmented:
            return kernel()
        if packed:
            # a row without segments holds one run (its real tokens together); the
            # layout always has room for two: JAX converts the offsets into cuDNN's
            # packed form (cumulated over the rows, in elements) only where it holds
            # more than one
            return on_runs(mask.kv_segments,
                           segment_bound(k.shape[1]) if mask.segmented else 2)
        if mask.segmented:
            return general
        lengths, trailing = trailing_padding(mask.kv_valid)
        return lambda q, k, v: jax.lax.cond(trailing, kernel(lengths), general, q, k, v)

    if not mask.chunking:
        return unchunked()(q, k, v)
    together = documents_together(mask)

    def of_chunk(chunk):
        if chunk is None:  # this layer's chunk is none (a scanned stack's global layer)
            return unchunked()
        return on_runs(chunk_runs(mask, chunk), segment_bound(k.shape[1]), together)

    return by_chunk(mask, k.shape[1], of_chunk)(q, k, v)


def trailing_padding(kv_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(each row's real keys (batch,) int32, whether every row's real keys come first
    and number at least one: the padding cuDNN's per-row lengths describe)."""
    valid = kv_valid.astype(bool)
    lengths = valid.sum(-1, dtype=jnp.int32)
    prefix = jnp.arange(valid.shape[1])[None] < lengths[:, None]
    return lengths, jnp.all(valid == prefix) & jnp.all(lengths > 0)


def check_segments(batch: dict) -> None:
    """Refuses, with the bound and the fix, a batch whose ``segment_ids`` hold more runs
    (documents) in a row than cuDNN's packed layout takes: the kernel would give way to
    the blockwise one on every such batch."""
    segments = batch.get("segment_ids")
    if segments is None:
        return
    segments = np.asarray(segments)
    if segments.ndim != 2:
        return
    real = segments != 0
    starts = real & np.pad(~real[:, :-1] | (segments[:, 1:] != segments[:, :-1]),
                           ((0, 0), (1, 0)), constant_values=True)
    runs = starts.sum(-1)
    bound = segment_bound(segments.shape[1])
    if runs.max(initial=0) > bound:
        row = int(runs.argmax())
        raise ValueError(
            f"row {row} of the batch holds {int(runs[row])} documents (segment_ids): cuDNN's "
            f"packed attention takes at most {bound} per row ({MAX_SEGMENTS_ENV}, default "
            f"{MAX_SEGMENTS}); raise {MAX_SEGMENTS_ENV}, or pack longer rows' documents "
            "fewer to a row (redray.data.prepare(pack=...) with a shorter length)")


# ------------------------------------------------------------------ splash (TPU)
def splash_blocks(tokens: int) -> int | None:
    """The block size splash runs a sequence of ``tokens`` in, or None when none divides."""
    return next((b for b in SPLASH_BLOCKS if tokens % b == 0), None)


def splash_attention(q, k, v, mask, scale: float, softcap: float | None = None,
                     interpret: bool | None = None, sinks=None, by_runs: bool = False):
    """Splash attention for ``mask`` (causal; see the module docstring): q (B, T, H, D),
    k and v (B, T, KV, D); ``sinks``: (H,) attention sinks, or None. ``interpret``: run
    the kernel in Pallas's interpreter (on CPU; default there). A chunked mask's chunks
    count from slot 0 in splash's ``ChunkedCausalMask``: the caller makes sure each real
    query's position is its slot, or asks for them ``by_runs``: a causal mask with the
    segment ids of ``chunk_runs`` (each document's chunks counted from its start; the
    caller makes sure each document's real tokens are together)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)

    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    block = splash_blocks(t)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    valid = mask.kv_valid.astype(bool)
    seg = mask.kv_segments if mask.segmented else jnp.zeros((b, t), jnp.int32)
    # padding: a segment of its own, which no real token shares
    seg = jnp.where(valid, seg.astype(jnp.int32), -1)
    # (B, KV, G, T, D): the multi-query kernel over each key/value head's group
    # the scale applied in float32 and rounded once: in q's dtype the scale itself would
    # round, every score off by the same factor
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qg = scaled.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4)
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    # (KV, G): each key/value head's group of sinks, as the multi-query kernel takes them
    grouped = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(kvh, g)

    def of_shape(window, chunk):
        if window is None:
            shape = masks.CausalMask((t, t))
        else:
            shape = masks.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
        if chunk is not None and not by_runs:
            chunked = masks.ChunkedCausalMask((t, t), chunk_size=chunk)
            shape = chunked if window is None else masks.LogicalAnd(shape, chunked)
        kernel = splash.make_splash_mqa(
            masks.MultiHeadMask([shape] * g), block_sizes=sizes, head_shards=1,
            q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)

        def call(qg, kk, vv, seg, sinks):
            ids = splash.SegmentIds(seg, seg)

            def one(q, k, v, ids, sinks):
                if sinks is None:
                    return kernel(q, k, v, ids)
                return kernel(q, k, v, ids, _float32_cotangent(sinks))
            per_head = jax.vmap(one, in_axes=(0, 0, 0, None, 0))  # key/value heads
            return jax.vmap(per_head, in_axes=(0, 0, 0, 0, None))(qg, kk, vv, ids, sinks)
        return call

    def of_window(window):
        def of_chunk(chunk):
            call = of_shape(window, chunk)
            if chunk is None or not by_runs:
                return call
            # each (document, chunk) a segment of its own; padding one no real token shares
            runs = jnp.where(valid, chunk_runs(mask, chunk), -1)
            return lambda qg, kk, vv, seg, sinks: call(qg, kk, vv, runs, sinks)
        return by_chunk(mask, t, of_chunk)

    out = by_window(mask, t, of_window)(qg, kk, vv, seg, grouped)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


@jax.custom_vjp
def _float32_cotangent(sinks):
    """The sinks as they are; their gradient in float32. Splash's backward gives the
    sinks' gradient in the queries' dtype (bf16 for a bf16 model's float32 sinks): cast
    where it leaves the kernel, before the heads' and rows' gradients are summed."""
    return sinks


_float32_cotangent.defvjp(lambda sinks: (sinks, None),
                          lambda _, grad: (grad.astype(jnp.float32),))


def packed_layout_available() -> bool:
    """Whether this process's GPU has cuDNN's packed layout (Hopper and newer), and
    JAX's cuDNN attention takes it."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        return bool(cudnn.check_compute_capability("9.0"))
    except Exception:  # noqa: BLE001 - no CUDA backend, or another JAX: not available
        return False
