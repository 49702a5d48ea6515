"""One sequence split over the context axis: its layout, and attention across it.

**Layout.** On a plan with ``context_axis=C`` a decoder cuts each sequence into ``2C``
chunks and device ``i`` of the axis holds chunks ``i`` and ``2C - 1 - i`` (the "zigzag"
layout): under a causal mask the late chunks see the most keys, and pairing each early
chunk with a late one gives every device the same work. ``CausalLM`` pads the sequence
to a multiple of ``2C`` (keys nobody sees), reorders its tokens into this layout before
the embedding (``to_zigzag``: the ids are whole on every device of the axis, so that is
a local gather), computes positions and the mask's slots on the tokens' own order (RoPE
and learned positions are those of the unsplit sequence), and puts the final hidden
states back into the tokens' order (``from_zigzag``: two ``ppermute``s of half the local
chunk each) so that the user's loss reads the sequence as it wrote it.

**Attention** keeps each device's queries and moves keys and values (``attention``),
in one of two ways (``METHODS``):

* ``"ring"``: ``C`` steps; at each the device attends its queries to the keys and
  values it holds while passing them on to its neighbour (``ppermute``; the next
  block's transfer does not depend on this block's compute, so the scheduler can
  overlap them). The parts are merged by their softmax statistics (the online softmax
  of flash attention, ``attention.flash_forward``). With the zigzag layout a block from
  an earlier device is seen by all local queries through its first chunk only, and one
  from a later device only by the local late chunk: half of each off-diagonal step is
  skipped. The backward pass goes round the ring again, the keys' and values'
  gradients travelling with them and arriving home after ``C`` steps.
* ``"all_gather"``: keys and values are gathered whole on every device of the axis and
  the local queries attend to them (flash attention; MaxText's default on GPU). One
  collective per layer instead of ``C - 1``, but no skipped blocks and the whole keys
  and values held.

"auto" takes what the plan's chooser says (``redray.planning.cost.context_method``, on
the run's hardware, probed or named): the ring's steps cost the larger of their compute
and their transfer, the gather its whole compute plus what of its transfer the scheduler
cannot hide. A model traced without a chooser takes the ring.

**Attention sinks** (gpt-oss) join the softmax once: the diagonal block's statistics start
with them (``flash_forward``'s ``sinks``), the other blocks' merge into those, and the
sinks' gradient is the diagonal step's (``flash_backward``'s), summed over the devices'
queries as the ring's ``shard_map`` transposes a replicated input. **Chunks** (Llama 4)
are the mask's, each query's position travelling with it.

**Each block's kernel** (``ring_blocks``): on a GPU, for plain causal attention in
bf16 (no padding but the split's alignment after the last token, no segments, window,
chunks, sinks or soft-capping), cuDNN's fused attention (``CudnnBlocks``): in the zigzag
layout the diagonal block (the device's two chunks, in order, against themselves) is
causal and every other block is seen whole, which cuDNN's causal and unmasked kernels
take; each block's forward returns its log-sum-exp, the parts merge by it, and each block's
backward is cuDNN's from the merged output and log-sum-exp (FlashAttention-2's backward
needs nothing else). The gathered keys' mask is not one cuDNN takes, so a fused ring is
always a ring. Elsewhere, and for every other mask, redray's blockwise kernel
(``attention.flash_forward``/``flash_backward``). ``ReferenceBlocks`` is cuDNN's contract
in plain JAX: the wiring is checked against it where no GPU is.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from redray.models.attention import (AttentionMask, Target, flash_attention, flash_backward,
                                     flash_forward)
from redray.sharding.plan import CONTEXT_ATTENTION
from redray.sharding.tracing import context_choice, context_split, tracing
from redray.sharding.parallelism import CONTEXT, STAGE

METHODS = CONTEXT_ATTENTION
AXIS = CONTEXT.name


def method() -> str:
    """How attention crosses the context axis: ``REDRAY_CONTEXT_ATTENTION`` where set,
    else the plan's (``Plan.context_attention``; "auto": the plan's chooser,
    ``tracing.context_choice``)."""
    name = os.environ.get("REDRAY_CONTEXT_ATTENTION") or tracing().context_attention
    if name not in METHODS:
        raise ValueError(f"REDRAY_CONTEXT_ATTENTION={name!r}: use one of {', '.join(METHODS)}")
    return name


# ------------------------------------------------------------------ layout
def padded_length(length: int, ways: int) -> int:
    """``length`` rounded up to a multiple of ``2 * ways`` (whole zigzag chunks)."""
    return -(-length // (2 * ways)) * 2 * ways


def zigzag_order(length: int, ways: int) -> np.ndarray:
    """The token at each position of the zigzag layout: position ``p`` holds token
    ``order[p]``; ``length`` a multiple of ``2 * ways``."""
    chunks = np.arange(length).reshape(2 * ways, length // (2 * ways))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]])
                           for i in range(ways)])


def to_zigzag(x: jax.Array, ways: int, axis: int = 1) -> jax.Array:
    """``x`` with its ``axis`` (the tokens) in the zigzag layout."""
    return jnp.take(x, jnp.asarray(zigzag_order(x.shape[axis], ways)), axis=axis)


def _chunk_routes(ways: int) -> tuple[list, list]:
    """(even, odd) ``ppermute`` routes of ``from_zigzag``: device ``i`` holds exactly one
    even and one odd chunk (``i`` and ``2C - 1 - i`` differ in parity), and chunk ``c``
    belongs to device ``c // 2`` in the tokens' order; so each route is a permutation."""
    even, odd = [], []
    for i in range(ways):
        e, o = (i, 2 * ways - 1 - i) if i % 2 == 0 else (2 * ways - 1 - i, i)
        even.append((i, e // 2))
        odd.append((i, o // 2))
    return even, odd


def from_zigzag(x: jax.Array, mesh, ways: int) -> jax.Array:
    """``x`` (rows, tokens, ...) in the zigzag layout, split over the context axis on its
    tokens, back in the tokens' order (split the same way)."""
    even_route, odd_route = _chunk_routes(ways)

    def local(xl):
        half = xl.shape[1] // 2
        first, second = xl[:, :half], xl[:, half:]
        even_first = jax.lax.axis_index(AXIS) % 2 == 0
        even = jnp.where(even_first, first, second)
        odd = jnp.where(even_first, second, first)
        return jnp.concatenate([jax.lax.ppermute(even, AXIS, even_route),
                                jax.lax.ppermute(odd, AXIS, odd_route)], axis=1)

    spec = P(None, AXIS)
    return jax.shard_map(local, mesh=_within(mesh), in_specs=spec, out_specs=spec,
                         axis_names={AXIS}, check_vma=False)(x)


def in_order(x: jax.Array, slots: int) -> jax.Array:
    """A prompt's keys or values split over the context axis (the zigzag layout,
    padded) in the tokens' order, its first ``slots`` (as far as a KV cache reaches:
    the padding's slots are overwritten by the first decoded tokens before a query sees
    them, each reading only slots up to its own)."""
    mesh, ways = context_split()
    return from_zigzag(x, mesh, ways)[:, :slots]


def split_sequence(ids: jax.Array, attention_mask, segment_ids):
    """(ways, padded ids, attention mask, segment ids) of a decoder's inputs where a step
    is traced on a plan with a context axis (the sequence padded with keys nobody sees
    to whole zigzag chunks); None elsewhere."""
    split = context_split()
    if split is None:
        return None
    mesh, ways = split
    b, t = ids.shape
    pad = padded_length(t, ways) - t
    if attention_mask is None and segment_ids is None:
        attention_mask = jnp.ones((b, t), jnp.int32)
    if pad:
        ids = jnp.pad(ids, ((0, 0), (0, pad)))
        if attention_mask is not None:
            attention_mask = jnp.pad(attention_mask, ((0, 0), (0, pad)))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    return ways, ids, attention_mask, segment_ids


def zigzag_inputs(ways: int, ids, mask: AttentionMask, positions):
    """The ids, mask and positions of a sequence in the tokens' order, in the zigzag
    layout: the mask's query and key slots say where each token sits in the sequence."""
    order = jnp.asarray(zigzag_order(ids.shape[1], ways), jnp.int32)
    take = functools.partial(jnp.take, indices=order, axis=1)
    segments = None if mask.q_segments is None else take(mask.q_segments)
    q_positions = None if mask.q_positions is None else take(mask.q_positions)
    mask = mask.replace(kv_valid=take(mask.kv_valid), q_slots=mask.q_slots[order],
                        q_segments=segments, kv_segments=segments, kv_slots=order,
                        q_positions=q_positions)
    return take(ids), mask, take(positions)


def merge_sequence(x: jax.Array, length: int) -> jax.Array:
    """A decoder's final hidden states in the zigzag layout back in the tokens' order,
    the padding cut off."""
    mesh, ways = context_split()
    return from_zigzag(x, mesh, ways)[:, :length]


# ------------------------------------------------------------------ block kernels
class CudnnBlocks:
    """The ring's blocks through cuDNN's fused attention: ``forward`` gives a block's
    output and its softmax statistics (the log-sum-exp of each query's scaled scores,
    (B, H, T) float32), ``backward`` a block's gradients from the attention's merged
    output and statistics (FlashAttention-2's backward, which needs nothing else: each
    block's probabilities are its scores against the merged log-sum-exp). A block is
    causal (the diagonal: the device's two chunks, in order, against themselves) or
    seen whole (a block of another device)."""

    @staticmethod
    def _cudnn():
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        return cudnn

    def _bind(self, primitive, q, k, v, *residuals, scale: float, causal: bool, **kw):
        # cuDNN's own primitive, not JAX's wrapper of it: inside the ring's shard_map
        # every array is a device's own, and the wrapper's custom partitioning would
        # only hide the kernel behind a callback until compilation
        cudnn = self._cudnn()
        none = jnp.zeros(0, q.dtype)
        return primitive.bind(
            q, k, v, none, none, none, none, none, none, none, *residuals, scale=scale,
            seed=42, dropout_rate=0.0, variadic_args=(False, False),
            mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK,
            layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None, **kw)

    def forward(self, q, k, v, scale: float, causal: bool):
        cudnn = self._cudnn()
        cudnn.check_is_flash_attention(q, k, v, cudnn.AttentionLayout.BTNH.value,
                                       cudnn.check_cudnn_version(), False, True)
        out, lse = self._bind(cudnn._dot_product_attention_fwd_p, q, k, v, scale=scale,
                              causal=causal, is_training=True)
        return out, lse

    def backward(self, q, k, v, scale: float, causal: bool, out, lse, d_out):
        # JAX's cuDNN attention differentiates a block against its own statistics; the
        # ring's blocks need the merged ones, which its backward primitive takes
        cudnn = self._cudnn()
        dq, dk, dv = self._bind(cudnn._dot_product_attention_bwd_p, q, k, v,
                                lse.astype(jnp.float32), out.astype(q.dtype),
                                d_out.astype(q.dtype), scale=scale, causal=causal)
        return dq, dk, dv


class ReferenceBlocks:
    """``CudnnBlocks``' contract in plain JAX, dense, float32: what the ring's wiring of a
    fused kernel is checked against where no GPU is (``tests/test_context.py``)."""

    @staticmethod
    def _scores(q, k, scale: float, causal: bool):
        g = q.shape[2] // k.shape[2]
        kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kk) * scale
        if causal:
            t, s = scores.shape[-2:]
            scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, -jnp.inf)
        return scores, g

    def forward(self, q, k, v, scale: float, causal: bool):
        scores, g = self._scores(q, k, scale, causal)
        lse = jax.scipy.special.logsumexp(scores, -1)
        probs = jnp.exp(scores - lse[..., None])
        out = jnp.einsum("bhts,bshd->bthd", probs,
                         jnp.repeat(v.astype(jnp.float32), g, axis=2))
        return out.astype(q.dtype), lse

    def backward(self, q, k, v, scale: float, causal: bool, out, lse, d_out):
        scores, g = self._scores(q, k, scale, causal)
        probs = jnp.exp(scores - lse[..., None])
        vv = jnp.repeat(v.astype(jnp.float32), g, axis=2)
        do = d_out.astype(jnp.float32)
        dp = jnp.einsum("bthd,bshd->bhts", do, vv)
        delta = jnp.einsum("bthd,bthd->bht", do, out.astype(jnp.float32))
        ds = probs * (dp - delta[..., None]) * scale
        kk = jnp.repeat(k.astype(jnp.float32), g, axis=2)
        dq = jnp.einsum("bhts,bshd->bthd", ds, kk)
        b, s, kvh, d = k.shape
        dk = jnp.einsum("bhts,bthd->bshd", ds, q.astype(jnp.float32))
        dv = jnp.einsum("bhts,bthd->bshd", probs, do)
        dk, dv = (x.reshape(b, s, kvh, g, d).sum(3) for x in (dk, dv))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# The ring's block kernels ("flash": ``attention.flash_forward``/``flash_backward``).
BLOCK_KERNELS = {"cudnn": CudnnBlocks()}


def ring_blocks(q, mask: AttentionMask, softcap: float | None) -> str:
    """The kernel of the ring's blocks: "cudnn" on a GPU for plain causal attention in
    bf16/fp16 (no padding but the alignment's at the sequence's end, no segments,
    window, chunks or soft-capping: a block of the zigzag layout is then causal or
    whole), else "flash" (redray's blockwise kernel, every mask). Attention with sinks
    takes "flash" whatever this says (``attention``)."""
    target = Target.live()
    limit = 256 if target.packed else 128
    if (target.platform == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
            and q.shape[-1] <= limit and q.shape[-1] % 8 == 0 and not mask.padded
            and not mask.segmented and not mask.sliding and not mask.chunking
            and softcap is None):
        return "cudnn"
    return "flash"


# ------------------------------------------------------------------ attention
def attention(q, k, v, mask: AttentionMask, scale: float, softcap: float | None = None,
              sinks=None):
    """Attention of a sequence split over the context axis in the zigzag layout (``q``
    (B, T, H, D), ``k`` and ``v`` (B, T, KV, D), ``mask`` with its key slots, and its
    queries' positions where it has chunks): each device's queries over every key, by a
    ring or an all-gather (``method``); ``sinks``: (H,) attention sinks, or None."""
    mesh, ways = context_split()
    if not mask.causal:
        raise ValueError("context parallelism splits causal attention only")
    b, t, h, d = q.shape
    how = method()
    # cuDNN's blocks have no sinks
    blocks = ring_blocks(q, mask, softcap) if sinks is None else "flash"
    if how == "auto":
        # a fused kernel takes the ring's blocks (each a causal or a full block of the
        # zigzag layout), not the gathered keys' mask: the ring
        chooser = context_choice()
        how = "ring" if blocks != "flash" or chooser is None else chooser(
            b, t, ways, h, k.shape[2], d, k.dtype.itemsize)
    if how != "ring":
        blocks = "flash"
    segmented = mask.segmented
    window = mask.layer_window if mask.layer_window is not None else mask.window
    chunk = mask.layer_chunk if mask.layer_chunk is not None else mask.chunk
    ring = _Ring(ways, scale, softcap, segmented, window is not None, blocks,
                 chunk is not None)
    segments = mask.q_segments if segmented else jnp.zeros((b, t), jnp.int32)
    positions = jnp.zeros((b, t), jnp.int32) if chunk is None else \
        jnp.broadcast_to(mask.q_slots if mask.q_positions is None else mask.q_positions,
                         (b, t)).astype(jnp.int32)
    limits = tuple(jnp.asarray(0 if x is None else x, jnp.int32) for x in (window, chunk))
    facts = (mask.q_slots, mask.key_slots(), mask.kv_valid, segments, positions, limits)
    seq, rows = P(None, AXIS), P(AXIS)
    body = _ring_attention if how == "ring" else _gathered_attention
    return over_context(functools.partial(body, ring), mesh,
                        (seq, seq, seq, P(), rows, rows, seq, seq, seq, P()), seq)(
                            q, k, v, sinks, *facts)


def over_context(fn, mesh, in_specs, out_specs):
    """``fn`` as a ``shard_map`` manual over the context axis (and the stage axis where
    ``_manual`` says), on the mesh it must name where it runs (``_within``): how a
    layer runs its own code per context shard (the ring; Gated DeltaNet's state
    passing, ``gated_delta.across_context``)."""
    return jax.shard_map(fn, mesh=_within(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names=_manual(mesh), check_vma=False)


def _within(mesh):
    """The mesh the ring's ``shard_map`` names: the plan's, or inside another
    ``shard_map`` (1F1B's, manual over ``stage``) the abstract mesh it traces in, as a
    nested ``shard_map`` must."""
    current = jax.sharding.get_abstract_mesh()
    return current if current.manual_axes else mesh


def _manual(mesh) -> set:
    """The ring's manual axes: the context axis, and the stage axis where the ring runs
    inside GPipe's ``vmap`` over stages (its batching rule splits the stages' dimension
    over ``stage``, which must then be manual too); not inside 1F1B's ``shard_map``,
    where ``stage`` is manual already."""
    names = {AXIS}
    if mesh.shape.get(STAGE.name, 1) > 1 and \
            STAGE.name not in jax.sharding.get_abstract_mesh().manual_axes:
        names.add(STAGE.name)
    return names


@dataclasses.dataclass(frozen=True)
class _Ring:
    """What one attention across the context axis is: its static settings, and the mask
    of some queries over some keys."""
    ways: int
    scale: float
    softcap: float | None
    segmented: bool
    windowed: bool
    blocks: str = "flash"  # the kernel of each block: BLOCK_KERNELS' key
    chunked: bool = False

    def mask(self, q_facts, kv_slots, kv_valid, kv_seg, limits) -> AttentionMask:
        """The mask of queries of ``q_facts`` (slots, segments, positions) over keys;
        ``limits``: the (window, chunk) arrays."""
        q_slots, q_seg, q_pos = q_facts
        window, chunk = limits
        return AttentionMask(kv_valid, q_slots, q_seg if self.segmented else None,
                             kv_seg if self.segmented else None, causal=True,
                             layer_window=window if self.windowed else None,
                             kv_slots=kv_slots,
                             layer_chunk=chunk if self.chunked else None,
                             q_positions=q_pos if self.chunked else None)


def _gathered_attention(ring: _Ring, q, k, v, sinks, q_slots, kv_slots, kv_valid, segments,
                        positions, limits):
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, tiled=True)
    k_all, v_all = gather(k, axis=1), gather(v, axis=1)
    kv_segments = gather(segments, axis=1) if ring.segmented else None
    mask = ring.mask((q_slots, segments, positions), gather(kv_slots, axis=0),
                     gather(kv_valid, axis=1), kv_segments, limits)
    return flash_attention(q, k_all, v_all, mask, ring.scale, softcap=ring.softcap,
                           sinks=sinks)


def _ring_attention(ring: _Ring, q, k, v, sinks, q_slots, kv_slots, kv_valid, segments,
                    positions, limits):
    segments = segments if ring.segmented else None  # not sent round without packing
    positions = positions if ring.chunked else None
    return _ring(ring, q, k, v, sinks, (q_slots, segments, positions), kv_slots, kv_valid,
                 limits).astype(v.dtype)


def _shift(tree):
    """Each device's ``tree`` sent to the next device of the context axis."""
    ways = jax.lax.axis_size(AXIS)
    return jax.lax.ppermute(tree, AXIS, [(i, (i + 1) % ways) for i in range(ways)])


def _half(x, which: int, axis: int | None = None):
    """The first (``which`` 0) or second half of ``x`` along ``axis`` (default: the
    tokens, axis 0 of a vector, else 1); None stays None."""
    if x is None:
        return None
    axis = (0 if x.ndim == 1 else 1) if axis is None else axis
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, which * half, (which + 1) * half, axis=axis)


def _per_query(stats):
    """(2, B, KV, G, T) softmax statistics as (top, total), each (B, T, H)."""
    two, b, kv, g, t = stats.shape
    per = jnp.moveaxis(stats, 4, 2).reshape(two, b, t, kv * g)
    return per[0], per[1]


def _per_head(top, total, kv: int):
    b, t, h = top.shape
    return jnp.moveaxis(jnp.stack([top, total]).reshape(2, b, t, kv, h // kv), 2, 4)


def _merge(a, b):
    """Two parts of one attention (output, top, total) over disjoint keys, as one."""
    (out_a, top_a, total_a), (out_b, top_b, total_b) = a, b
    top = jnp.maximum(top_a, top_b)
    w_a, w_b = total_a * jnp.exp(top_a - top), total_b * jnp.exp(top_b - top)
    total = w_a + w_b
    out = (out_a * w_a[..., None] + out_b * w_b[..., None]) / total[..., None]
    return out, top, total


def _nothing(q_like):
    """No part: an output of zeros whose statistics weigh nothing in ``_merge`` (merged
    into a part whose top is finite: the diagonal block's, which every query has)."""
    b, t, h, _ = q_like.shape
    return (jnp.zeros(q_like.shape, jnp.float32), jnp.full((b, t, h), -jnp.inf, jnp.float32),
            jnp.zeros((b, t, h), jnp.float32))


def _part(ring: _Ring, q, keys, q_facts, limits, diagonal: bool, sinks=None):
    k, v, kv_slots, kv_valid, kv_seg = keys
    if ring.blocks != "flash":
        out, lse = BLOCK_KERNELS[ring.blocks].forward(q, k, v, ring.scale, diagonal)
        lse = jnp.moveaxis(lse, 1, 2)  # (B, H, T) -> (B, T, H): a total of one
        return out.astype(jnp.float32), lse, jnp.ones_like(lse)
    out, stats = flash_forward(q, k, v, ring.mask(q_facts, kv_slots, kv_valid, kv_seg, limits),
                               ring.scale, ring.softcap, sinks=sinks)
    return (out, *_per_query(stats))


def _ring_steps(ring: _Ring, keys, compute, state, travel: bool = False):
    """Runs ``compute(state, keys, which)`` once per block of the ring (``which``: 0 the
    device's own block, 1 a block from an earlier device, 2 from a later one) and
    returns the last state. Each step first sends the block it holds on to the next
    device, so that transfer and this step's compute are independent (the scheduler
    may overlap them); the last step sends nothing. ``travel``: the state's last entry
    (the blocks' gradients) belongs to the block and follows it, sent on after each
    step's compute (after the last: home)."""
    i = jax.lax.axis_index(AXIS)

    def send(state):
        return (*state[:-1], _shift(state[-1])) if travel else state

    def at(s, state, block):
        earlier = (i - s) % ring.ways < i
        return jax.lax.cond(earlier, functools.partial(compute, which=1),
                            functools.partial(compute, which=2), state, block)

    following = _shift(keys)
    state = send(compute(state, keys, which=0))
    for s in range(1, ring.ways):
        block = following
        if s < ring.ways - 1:
            following = _shift(block)
        state = send(at(s, state, block))
    return state


def _query_half(q_facts, which: int):
    """The first or second half of the queries' (slots, segments, positions)."""
    return tuple(_half(x, which) for x in q_facts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q, k, v, sinks, q_facts, kv_slots, kv_valid, limits):
    return _ring_forward(ring, q, k, v, sinks, q_facts, kv_slots, kv_valid, limits)[0]


def _ring_forward(ring, q, k, v, sinks, q_facts, kv_slots, kv_valid, limits):
    keys = (k, v, kv_slots, kv_valid, q_facts[1])

    def step(state, ks, which):
        if which == 0:  # the sinks join the softmax here, once
            return _part(ring, q, ks, q_facts, limits, diagonal=True, sinks=sinks)
        if which == 1:  # an earlier device's block: its first chunk only is seen
            first = tuple(_half(x, 0) for x in ks)
            return _merge(state, _part(ring, q, first, q_facts, limits, diagonal=False))
        q_late = _half(q, 1)  # a later device's block: seen by the local late chunk only
        early = _nothing(_half(q, 0))
        part = _part(ring, q_late, ks, _query_half(q_facts, 1), limits, diagonal=False)
        both = tuple(jnp.concatenate([e, p], axis=1) for e, p in zip(early, part))
        return _merge(state, both)

    out, top, total = _ring_steps(ring, keys, step, None)
    stats = _per_head(top, total, k.shape[2])
    return out, (q, k, v, sinks, q_facts, kv_slots, kv_valid, limits, out, stats)


def _ring_bwd(ring, residuals, d_out):
    q, k, v, sinks, q_facts, kv_slots, kv_valid, limits, out, stats = residuals
    d_out = d_out.astype(jnp.float32)
    keys = (k, v, kv_slots, kv_valid, q_facts[1])

    def grads(qq, ks, facts, o, st, do, diagonal=False, sinks=None):
        kk, vv, slots, valid, seg = ks
        if ring.blocks != "flash":  # the block's gradients from the merged statistics
            top, total = _per_query(st)
            lse = jnp.moveaxis(top + jnp.log(total), 2, 1)  # (B, H, T)
            return (*BLOCK_KERNELS[ring.blocks].backward(qq, kk, vv, ring.scale, diagonal, o,
                                                         lse, do), None)
        mask = ring.mask(facts, slots, valid, seg, limits)
        return flash_backward(qq, kk, vv, mask, ring.scale, o, st, do, ring.softcap,
                              sinks=sinks)

    def step(state, ks, which):
        dq, d_sinks, (dk, dv) = state
        if which in (0, 1):
            seen = ks if which == 0 else tuple(_half(x, 0) for x in ks)
            # the sinks' gradient: the diagonal step's, over every local query
            gq, gk, gv, gs = grads(q, seen, q_facts, out, stats, d_out, diagonal=which == 0,
                                   sinks=sinks if which == 0 else None)
            if which == 0 and gs is not None:
                d_sinks = gs
            if which == 1:
                gk = jnp.concatenate([gk, jnp.zeros_like(gk)], axis=1)
                gv = jnp.concatenate([gv, jnp.zeros_like(gv)], axis=1)
        else:
            gq, gk, gv, _ = grads(_half(q, 1), ks, _query_half(q_facts, 1), _half(out, 1),
                                  _half(stats, 1, axis=4), _half(d_out, 1))
            gq = jnp.concatenate([jnp.zeros_like(gq), gq], axis=1)
        return (dq + gq.astype(jnp.float32), d_sinks,
                (dk + gk.astype(jnp.float32), dv + gv.astype(jnp.float32)))

    init = (jnp.zeros(q.shape, jnp.float32),
            None if sinks is None else jnp.zeros(sinks.shape, jnp.float32),
            (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    dq, d_sinks, (dk, dv) = _ring_steps(ring, keys, step, init, travel=True)
    if d_sinks is not None:
        d_sinks = d_sinks.astype(sinks.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks,
            jax.tree.map(lambda _: None, q_facts), None, None, (None, None))


_ring.defvjp(_ring_forward, _ring_bwd)
