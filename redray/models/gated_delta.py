"""Gated DeltaNet: the linear attention of Qwen3-Next and Qwen3.5's hybrid layers.

Each value head keeps a state S (key dim x value dim) in place of a KV cache. A token
decays it by exp(g) (g <= 0, per head), reads what it predicts for the token's key,
writes back the difference from the token's value at a rate beta (the delta rule), and
answers its query from the result:

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q

q and k are L2-normalized per head (q then scaled by dk^-0.5); grouped heads let one
query/key head serve ``value heads / key heads`` consecutive value heads. Before the
rule, q, k and v pass through a causal depthwise convolution of a few tokens (its last
inputs are the other half of the layer's state) and SiLU; after it, each value head's
output is RMS-normalized and gated by SiLU of its own projection z.

``delta_rule`` computes the rule in chunks of ``CHUNK`` tokens (the WY form of the
DeltaNet and Gated DeltaNet papers): inside a chunk the inverse of a (chunk x chunk)
unit lower triangular system (``unit_lower_inverse``, matmuls only) and matmuls, across
chunks a scan carrying S; nothing is (T x T). Rows packed with
several documents reset the state and the convolution's window where a document
starts (``groups``), so a packed row equals its documents run alone; padding tokens
leave both untouched.

Parameters are laid out by key head (``GatedDeltaNet``): each key head's query, key,
values and gates side by side, so a split over key heads keeps every head's group
whole (the layout Qwen3-Next's checkpoints use; Qwen3.5's separate projections are
permuted into it on load, ``redray/models/qwen3_next.py``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from redray.models import paged
from redray.sharding.tracing import constrain_rows

# Tokens per chunk of the chunked delta rule: the (chunk x chunk) solve and matmuls per
# head; transformers' and flash-linear-attention's default.
CHUNK = 64


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x`` over its last axis divided by its norm (``eps`` inside the root, as
    flash-linear-attention and transformers compute it)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + eps)


def reset_groups(starts: jax.Array) -> jax.Array:
    """(batch, tokens) int32: how many resets (``starts``: True where a document starts)
    are at or before each token; a token sees the state of its own group only, and the
    state a call starts from is group 0."""
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


# rematerialized: its backward pass recomputes the shifted, masked inputs (elementwise)
# in place of keeping one copy of the input per tap
@jax.checkpoint
def causal_conv(x: jax.Array, kernel: jax.Array, tail: jax.Array, groups: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """A causal depthwise convolution over tokens, each channel its own kernel.

    x: (batch, tokens, channels); kernel: (width, channels), its last entry on the token
    itself; tail: (batch, width - 1, channels), the inputs before ``x`` (zeros: none);
    groups: ``reset_groups`` (a token sees the inputs of its own group; the tail is
    group 0). Returns (the output, the new tail: the last width - 1 inputs).
    """
    width, t = kernel.shape[0], x.shape[1]
    ext = jnp.concatenate([tail.astype(x.dtype), x], 1)
    gext = jnp.concatenate([jnp.zeros((x.shape[0], width - 1), groups.dtype), groups], 1)
    out = jnp.zeros((x.shape[0] * t, x.shape[-1]), x.dtype)
    for back in range(width):  # the input ``back`` tokens before each token
        start = width - 1 - back
        same = gext[:, start:start + t] == groups
        seen = jnp.where(same[..., None], ext[:, start:start + t], 0)
        # (batch x tokens, channels) times the kernel: its gradient is then a reduction
        # over the major dimension; over the middle one of (1, tokens, channels), XLA:CPU's
        # fused multiply-reduce runs about 50x slower
        out = out + seen.reshape(out.shape) * kernel[start]
    return out.reshape(x.shape), ext[:, t:]


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for ``a`` strictly lower triangular (..., n, n), n a power of two.

    Recursive doubling: the inverses of the diagonal blocks of size s give those of
    size 2s, [[T1, 0], [-T2 a21 T1, T2]], in log2(n) rounds of batched matmuls (the
    block form of forward substitution: no power series, whose terms can be huge where
    the inverse is not). Not ``lax.linalg.triangular_solve``: on XLA:CPU its batched
    LAPACK kernel waits on the same thread pool that runs it, and two solves at once
    (a layer's backward pass) deadlock a 2-core machine; on GPU it is many small
    kernels.
    """
    n = a.shape[-1]
    if n & (n - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {n}")
    lead = a.shape[:-2]
    inv = jnp.ones((*lead, n, 1, 1), a.dtype)  # (..., blocks, s, s): s = 1
    s = 1
    while s < n:
        m = n // (2 * s)
        # a's blocks below the diagonal of each 2s block: rows 2j+1, columns 2j (s grid)
        grid = a.reshape(*lead, m, 2, s, m, 2, s)[..., :, 1, :, :, 0, :]
        a21 = jnp.moveaxis(jnp.diagonal(grid, axis1=-4, axis2=-2), -1, -3)  # (..., m, s, s)
        t1, t2 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -(t2 @ (a21 @ t1))
        top = jnp.concatenate([t1, jnp.zeros_like(t1)], -1)
        inv = jnp.concatenate([top, jnp.concatenate([low, t2], -1)], -2)
        s *= 2
    return inv[..., 0, :, :]


def delta_rule(q, k, v, g, beta, state, groups, chunk: int = CHUNK):
    """The gated delta rule over a sequence, in chunks, in float32 (or wider inputs').

    q, k: (batch, tokens, heads, dk), normalized and (q) scaled, one per value head;
    v: (batch, tokens, heads, dv); g, beta: (batch, tokens, heads) the log-decay and the
    write rate (0 and 0 at padding: the state passes through); state: (batch, heads,
    dk, dv) the state before the first token; groups: ``reset_groups``. Returns (the
    output (batch, tokens, heads, dv), the state after the last token).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if t == 1:  # a decoding step: the rule itself, no chunk to solve
        return _one_token(q, k, v, g, beta, state, groups)
    size = min(chunk, 1 << (t - 1).bit_length())  # a power of two (unit_lower_inverse)
    pad = (-t) % size
    wide = jnp.promote_types(jnp.asarray(q).dtype, jnp.float32)
    f32 = lambda a: jnp.asarray(a, wide)  # noqa: E731
    q, k, v, g, beta = (jnp.pad(f32(a), ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
                        for a in (q, k, v, g, beta))
    groups = jnp.pad(groups, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // size
    # the group of the token before each chunk (the carried state's)
    before = jnp.concatenate([jnp.zeros((b, 1), groups.dtype), groups], 1)[:, :-1:size][:, :n]

    def chunks(a, heads=True):  # (b, n*size, h, ...) -> (n, b, h, size, ...)
        a = a.reshape(b, n, size, *a.shape[2:])
        return jnp.moveaxis(a, (1, 3), (0, 2)) if heads and a.ndim > 3 else \
            jnp.moveaxis(a, 1, 0)

    xs = (chunks(q), chunks(k), chunks(v), chunks(g[..., None])[..., 0],
          chunks(beta[..., None])[..., 0], chunks(groups, heads=False), jnp.moveaxis(before, 1, 0))
    lower = jnp.tril(jnp.ones((size, size), bool))
    strict = jnp.tril(jnp.ones((size, size), bool), -1)

    def step(s, x):
        qc, kc, vc, gc, bc, grp, prev = x  # (b, h, size, ...); grp (b, size); prev (b,)
        cum = jnp.cumsum(gc, -1)
        same = (grp[:, :, None] == grp[:, None, :])[:, None]  # (b, 1, size, size)
        diff = cum[..., :, None] - cum[..., None, :]
        decay = jnp.where(lower & same, jnp.exp(jnp.where(lower & same, diff, 0.0)), 0.0)
        from_start = (grp == prev[:, None])[:, None]  # (b, 1, size): sees the carried state
        to_end = (grp == grp[:, -1:])[:, None]  # reaches the state passed on
        kb, vb = kc * bc[..., None], vc * bc[..., None]
        inverse = unit_lower_inverse(jnp.where(
            strict, (kb @ jnp.swapaxes(kc, -1, -2)) * decay, 0.0))
        read = jnp.where(from_start, jnp.exp(cum), 0.0)
        solved = inverse @ jnp.concatenate([vb, kb * read[..., None]], -1)
        u, w = solved[..., :dv], solved[..., dv:]
        new_v = u - w @ s
        out = (qc * read[..., None]) @ s + ((qc @ jnp.swapaxes(kc, -1, -2)) * decay) @ new_v
        last = cum[..., -1:]
        keep = jnp.where(from_start[..., -1:], jnp.exp(last), 0.0)[..., None]
        written = jnp.where(to_end, jnp.exp(last - cum), 0.0)[..., None] * kc
        return s * keep + jnp.swapaxes(written, -1, -2) @ new_v, out

    state, out = jax.lax.scan(jax.checkpoint(step), f32(state), xs)
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * size, h, dv)
    return out[:, :t], state


def _one_token(q, k, v, g, beta, state, groups):
    """``delta_rule`` of one token per row: the state decayed (or reset where the token's
    group is not the state's), what it predicts for the key corrected toward the value
    at the write rate, then read by the query."""
    wide = jnp.promote_types(jnp.asarray(q).dtype, jnp.float32)
    q, k, v, g, beta = (jnp.asarray(a, wide)[:, 0] for a in (q, k, v, g, beta))
    keep = jnp.where((groups[:, 0] == 0)[:, None], jnp.exp(g), 0.0)  # (b, h)
    s = jnp.asarray(state, wide) * keep[..., None, None]
    error = (v - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * error[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q)[:, None], s


def empty_state(batch: int, dims: tuple, width: int, dtype) -> dict:
    """A layer's state for ``batch`` rows before any token, zeros: {"conv": the
    convolution's last ``width`` - 1 inputs (batch, width - 1, channels), "state": S
    (batch, value heads, dk, dv) in float32}; ``dims``: (key heads, value heads per key
    head, dk, dv)."""
    key_heads, r, dk, dv = dims
    return {"conv": jnp.zeros((batch, width - 1, key_heads * (2 * dk + r * dv)), dtype),
            "state": jnp.zeros((batch, key_heads * r, dk, dv), jnp.float32)}


def chunk_state_elements(dims: tuple, width: int) -> int:
    """The float32 elements one chunk of one sequence passes on over a context axis
    (``across_context``): its state map (value heads x dk x (dv + dk)) and its last
    ``width - 1`` convolution inputs; ``dims``: (key heads, value heads per key head,
    dk, dv)."""
    key_heads, r, dk, dv = dims
    return key_heads * r * dk * (dk + dv) + (width - 1) * key_heads * (2 * dk + r * dv)


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet layer (see the module docstring).

    Args:
      hidden: the model's width.
      key_heads, value_heads: the query/key heads and the value heads (a multiple).
      key_dim, value_dim: their widths.
      conv: the convolution's width in tokens.
      eps: the output norm's epsilon.
      act: the activation after the convolution (SiLU in every released config).

    Parameters, by key head (``r`` = value heads / key heads): ``in_proj`` (hidden,
    key heads, 2 dk + 2 r dv): its query, key, r values and r output gates z;
    ``ba_proj`` (hidden, key heads, 2 r): each value head's write-rate and decay
    inputs; ``conv`` (width, key heads, 2 dk + r dv): the convolution over its query,
    key and values; ``A_log``, ``dt_bias`` (key heads, r); ``norm`` (dv,) the gated
    norm's scale; ``out_proj`` (key heads, r dv, hidden).
    """

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int, conv: int, eps: float, *, rngs: nnx.Rngs, dtype,
                 act: str = "silu"):
        if value_heads % key_heads:
            raise ValueError(f"linear_num_value_heads {value_heads} is not a multiple of "
                             f"linear_num_key_heads {key_heads}")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r}: the linear attention's convolution is "
                             "followed by SiLU in every released config; set it to 'silu'")
        r = value_heads // key_heads
        self.dims = (key_heads, r, key_dim, value_dim)
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.in_proj = nnx.LinearGeneral(hidden, (key_heads, 2 * key_dim + 2 * r * value_dim),
                                         **dense)
        self.ba_proj = nnx.LinearGeneral(hidden, (key_heads, 2 * r), **dense)
        channels = 2 * key_dim + r * value_dim
        # transformers' initial values: a depthwise Conv1d's uniform in +-1/sqrt(width), A
        # (the decay's rate, exp(A_log)) uniform in [0.01, 16]
        self.conv = nnx.Param(jax.random.uniform(rngs.params(), (conv, key_heads, channels),
                                                 jnp.float32, -conv ** -0.5, conv ** -0.5))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (key_heads, r), jnp.float32, 0.01, 16.0)))
        # the step size softplus(dt_bias) log-uniform in [0.001, 0.1], as Mamba and
        # flash-linear-attention start (transformers' ones decay most heads' state within a
        # few tokens, whose near-zero readouts the gated norm then amplifies)
        step = jnp.exp(jax.random.uniform(rngs.params(), (key_heads, r), jnp.float32,
                                          jnp.log(1e-3), jnp.log(1e-1)))
        self.dt_bias = nnx.Param(step + jnp.log(-jnp.expm1(-step)))
        self.norm = nnx.Param(jnp.ones((value_dim,), jnp.float32))
        self.out_proj = nnx.LinearGeneral((key_heads, r * value_dim), hidden, axis=(-2, -1),
                                          **dense)
        self.eps = eps
        self.dtype = dtype

    def context_state(self) -> tuple[int, int]:
        """(the layers this module holds, stacked ones each counted, and the float32
        elements one chunk of one sequence passes on over a context axis,
        ``chunk_state_elements``): what the planner charges a context axis for them
        (``redray.planning.memory.context_states``)."""
        shape = self.conv.shape
        return math.prod(shape[:-3]), chunk_state_elements(self.dims, shape[-3])

    def __call__(self, x, mask, cache: dict | None, cache_index):
        """(output, new cache or None) of ``x`` (batch, tokens, hidden); ``mask``: the
        decoder's ``AttentionMask`` (padding and packed documents; its key slots where
        the sequence is split over the context axis), ``cache``: the layer's {"conv",
        "state"} when decoding."""
        key_heads, r, dk, dv = self.dims
        b, t = x.shape[:2]
        valid, groups = _tokens(mask, cache, cache_index, t)
        wide = jnp.promote_types(x.dtype, jnp.float32)
        x = jnp.where(valid[..., None], x, 0)
        mixed = constrain_rows(self.in_proj(x), whole=False)  # (b, t, key heads, ...)
        conv_in, z = mixed[..., :2 * dk + r * dv], mixed[..., 2 * dk + r * dv:]
        kernel = self.conv[...].astype(x.dtype).reshape(self.conv.shape[0], -1)
        state = empty_state(b, self.dims, self.conv.shape[0], x.dtype) if cache is None \
            else cache
        ba = self.ba_proj(x).astype(wide)
        beta = jax.nn.sigmoid(ba[..., :r]).reshape(b, t, -1)
        g = (-jnp.exp(self.A_log[...]) * jax.nn.softplus(ba[..., r:] + self.dt_bias[...])
             ).reshape(b, t, -1)
        beta, g = (jnp.where(valid[..., None], a, 0.0) for a in (beta, g))
        mix = functools.partial(_mix, self.dims)
        if mask.kv_slots is not None:  # a sequence split over the context axis
            segments = None if mask.q_segments is None else jnp.where(valid, mask.q_segments, 0)
            out, last, tail = across_context(mix, kernel, conv_in.reshape(b, t, -1), beta, g,
                                             segments, state)
        else:
            out, last, tail = mix(kernel, conv_in.reshape(b, t, -1), beta, g, groups, state)
        out = out * jax.lax.rsqrt(jnp.mean(out * out, -1, keepdims=True) + self.eps)
        out = (self.norm[...] * out.astype(self.dtype)).astype(wide)
        gate = z.reshape(b, t, key_heads * r, dv).astype(wide)
        out = (out * jax.nn.silu(gate)).astype(self.dtype).reshape(b, t, key_heads, r * dv)
        new_cache = None if cache is None else {"conv": tail.astype(cache["conv"].dtype),
                                                "state": last}
        return self.out_proj(out), new_cache


def _mix(dims, kernel, conv_in, beta, g, groups, state, augmented: bool = False):
    """The convolution, SiLU and the delta rule of a run of tokens: (the rule's output
    (b, t, value heads, dv), the state after the last token, the convolution's new
    tail). ``augmented``: the rule runs from the state [0 | I] with [v | 0] as values,
    so its state and outputs carry, beside those from a zero state, the linear map from
    the state before the run (``across_context``)."""
    key_heads, r, dk, dv = dims
    b, t = conv_in.shape[:2]
    wide = jnp.promote_types(conv_in.dtype, jnp.float32)
    conv_out, tail = causal_conv(conv_in, kernel, state["conv"], groups)
    conv_out = jax.nn.silu(conv_out).reshape(b, t, key_heads, -1)
    q = l2_normalize(conv_out[..., :dk].astype(wide))
    k = l2_normalize(conv_out[..., dk:2 * dk].astype(wide))
    v = conv_out[..., 2 * dk:].reshape(b, t, key_heads * r, dv)
    q = jnp.repeat(q, r, axis=2) * dk ** -0.5  # key head j serves value heads j*r...
    k = jnp.repeat(k, r, axis=2)
    start = state["state"]
    if augmented:
        v = jnp.concatenate([v.astype(wide), jnp.zeros((*v.shape[:3], dk), wide)], -1)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, key_heads * r, dk, dk))
        start = jnp.concatenate([jnp.zeros((b, key_heads * r, dk, dv), jnp.float32), eye], -1)
    out, last = delta_rule(q, k, v, g, beta, start, groups)
    return out, last, tail


def across_context(mix, kernel, conv_in, beta, g, segments, state):
    """``_mix`` (with the convolution's ``kernel``) of a sequence split over the context
    axis (the zigzag layout of ``redray/models/context.py``: device ``i`` holds chunks
    ``i`` and ``2C - 1 - i``).

    The state is passed, not the sequence gathered. Each device runs its two chunks at
    once from the augmented state (``_mix``): each chunk's state after it is an affine
    map of the state before, ``M S + D``, and each token's output ``o_D + o_M S``. The
    devices all-gather the maps (per chunk: value heads x dk x (dv + dk) floats) and the
    last ``width - 1`` convolution inputs of each chunk with their documents; every
    device composes the maps in the sequence's order (a scan over the axis's ``2C``
    chunks, a few small matmuls), so it knows the state before each of its chunks and
    the state after the last. A chunk whose first token starts a document sees no
    state and no convolution inputs from before it; nor does a convolution see the
    inputs of an earlier document in the chunk before. ``segments``: (b, t) packed
    documents (0 at padding), or None. Returns (output, the state after the sequence,
    the convolution's tail after it), the last two whole on every device.
    """
    from redray.models import context

    mesh, ways = context.context_split()
    width = state["conv"].shape[1] + 1
    length = conv_in.shape[1] // (2 * ways)
    if length < width - 1:
        raise ValueError(
            f"the sequence ({conv_in.shape[1]} tokens with its padding) is cut into "
            f"{2 * ways} chunks of {length} tokens over the context axis, fewer than the "
            f"linear attention's convolution reaches back ({width - 1}): use sequences of "
            f"at least {2 * ways * (width - 1)} tokens or a smaller context axis")
    packed = segments is not None
    if segments is None:
        segments = jnp.zeros(conv_in.shape[:2], jnp.int32)

    # the kernel passed in, not closed over: inside another shard_map (1F1B's stages) a
    # value closed over keeps the outer one's mesh, which the ring's shard_map refuses
    def local(kernel, conv_in, beta, g, segments, state):
        b = conv_in.shape[0]
        me = jax.lax.axis_index(context.AXIS)
        # the two chunks side by side on the rows: (2b, length, ...)
        pair = lambda a: jnp.concatenate([a[:, :length], a[:, length:]], 0)  # noqa: E731
        conv_in, beta, g, segments = map(pair, (conv_in, beta, g, segments))
        mine = jnp.stack([me, 2 * ways - 1 - me])  # this device's chunks' indices
        # every chunk's last convolution inputs and documents, in the sequence's order
        lasts = _in_order(jax.lax.all_gather(conv_in[:, length - width + 1:], context.AXIS),
                          ways, b)
        last_docs = _in_order(jax.lax.all_gather(segments[:, length - width + 1:],
                                                 context.AXIS), ways, b)
        before = jnp.maximum(mine - 1, 0)
        first_doc = segments[:, 0]
        tails = jnp.concatenate([lasts[before[0]], lasts[before[1]]], 0)
        docs = jnp.concatenate([last_docs[before[0]], last_docs[before[1]]], 0)
        head = jnp.repeat(mine == 0, b)  # rows whose chunk starts the sequence
        tails = jnp.where(head[:, None, None], jnp.concatenate([state["conv"]] * 2, 0),
                          jnp.where((docs == first_doc[:, None])[..., None], tails, 0))
        if packed:
            prev = jnp.where(head, -1, docs[:, -1])
            starts = jnp.concatenate([(segments[:, :1] != prev[:, None]),
                                      segments[:, 1:] != segments[:, :-1]], 1)
            groups = reset_groups(starts)
        else:
            groups = jnp.zeros(segments.shape, jnp.int32)
        out, maps, _ = mix(kernel, conv_in, beta, g, groups, {"conv": tails, "state": None},
                           augmented=True)
        dv = out.shape[-1] - maps.shape[2]
        # every chunk's (D | M), in order, composed from the state before the sequence
        maps = _in_order(jax.lax.all_gather(maps, context.AXIS), ways, b)

        def compose(s, m):
            return jnp.einsum("bhkj,bhjv->bhkv", m[..., dv:], s) + m[..., :dv], s

        last, befores = jax.lax.scan(compose, state["state"].astype(jnp.float32), maps)
        start = jnp.concatenate([befores[mine[0]], befores[mine[1]]], 0)
        out = out[..., :dv] + jnp.einsum("bthk,bhkv->bthv", out[..., dv:], start)
        out = jnp.concatenate([out[:b], out[b:]], 1)
        tail = lasts[-1]
        return out, last, tail

    seq, whole = jax.sharding.PartitionSpec(None, context.AXIS), jax.sharding.PartitionSpec()
    return context.over_context(local, mesh, (whole, seq, seq, seq, seq, whole),
                                (seq, whole, whole))(kernel, conv_in, beta, g, segments, state)


def _in_order(gathered: jax.Array, ways: int, rows: int) -> jax.Array:
    """Per-device pairs of chunks, gathered over the context axis ((ways, 2 rows,
    ...): each device's two chunks on its rows), as the ``2 * ways`` chunks in the
    sequence's order ((2 ways, rows, ...))."""
    first, second = gathered[:, :rows], gathered[:, rows:]
    return jnp.concatenate([first, second[::-1]], 0)


def _tokens(mask, cache, cache_index, tokens: int) -> tuple[jax.Array, jax.Array]:
    """(which of a call's tokens are real (batch, tokens), ``reset_groups``) from the
    decoder's mask: packed documents reset where each starts; a call without a cache
    starts from an empty state. Over a context axis the groups are ``across_context``'s."""
    valid = mask.kv_valid
    if cache is not None and not paged.is_paged(cache_index):  # the whole cache's slots
        valid = jax.lax.dynamic_slice_in_dim(valid, cache_index, tokens, 1)
    if mask.q_segments is None:
        return valid, jnp.zeros(valid.shape, jnp.int32)
    seg = mask.q_segments
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
    return valid & (seg != 0), reset_groups(starts)
