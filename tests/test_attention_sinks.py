"""Attention sinks (gpt-oss) and chunked attention (Llama 4) on every attention path:
each implementation ("dense", "xla", "chunked", splash in Pallas's interpreter), the
ring over a context axis, a KV cache's decoding and a paged decode compute what a plain
reference written here computes (gpt-oss's eager attention: the sinks a last softmax
column, dropped; transformers' ``create_chunked_causal_mask``: chunks counted from each
row's first real token), forward and backward, in float32 within 1e-5; "auto" sends them
to a kernel that honours them, lowered for GPU and TPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from redray.models import attention, context, layers, paged
from redray.models.attention import AttentionCall, AttentionMask, Target, attend, choose, decide

B, H, KV, D = 2, 4, 2, 8
SCALE = 0.3
NO_CHUNK = int(np.iinfo(np.int32).max)


# ------------------------------------------------------------------ the reference
def reference(q, k, v, allowed, sinks=None):
    """Attention as gpt-oss's eager code computes it: grouped heads repeated, scaled
    scores, masked to the float32 minimum, the head's sink a last column of the softmax,
    dropped after it. ``allowed``: (B, T, S) bool."""
    g = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, kk) * SCALE
    scores = jnp.where(jnp.asarray(allowed)[:, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, column], -1)
    probs = jax.nn.softmax(scores, -1)
    if sinks is not None:
        probs = probs[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", probs, vv)


def allowed_of(valid, window=None, chunk=None, segments=None) -> np.ndarray:
    """(B, T, T) which keys each query sees, from the definitions: causal, real keys,
    the ``window`` latest, the keys of its own segment, and transformers' chunks:
    ``(kv - start) // chunk == (q - start) // chunk`` where ``start`` is the row's
    leading padding (its segment's first token with ``segments``)."""
    b, t = valid.shape
    q_idx, kv_idx = np.arange(t)[:, None], np.arange(t)[None, :]
    out = np.zeros((b, t, t), bool)
    for r in range(b):
        seen = (kv_idx <= q_idx) & valid[r][None, :]
        if window is not None:
            seen &= q_idx - kv_idx < window
        if segments is not None:
            seg = segments[r]
            seen &= seg[:, None] == seg[None, :]
            start = np.array([np.argmax(seg == s) for s in seg])[:, None]
        else:
            start = int((np.cumsum(valid[r]) == 0).sum())
        if chunk is not None:
            seen &= (kv_idx - start) // chunk == (q_idx - start) // chunk
        out[r] = seen
    return out


def inputs(t, seed=0):
    rs = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rs.normal(size=(B, t, n, D)), jnp.float32) for n in (H, KV, KV))
    sinks = jnp.asarray(rs.normal(size=(H,)), jnp.float32)
    return q, k, v, sinks


def left_padded(t, lead=(5, 0)):
    return np.arange(t)[None] >= np.asarray(lead)[:, None]


def packed(t, seed=1):
    """Rows of 2-3 documents, the last 3 tokens padding (segment 0)."""
    rs = np.random.default_rng(seed)
    seg = np.sort(rs.integers(1, 4, (B, t)), 1).astype(np.int32)
    seg[:, -3:] = 0
    return seg


def assert_matches(run, want, q, k, v, sinks, valid):
    """``run`` and ``want`` (functions of q, k, v, sinks) agree on every real query's
    output and on the gradients of q, k, v (and sinks) through a random weighting of
    those outputs (a padding query's output is no path's business)."""
    real = jnp.asarray(valid)[:, :, None, None]
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32) * real
    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * cotangent)

    got_out = np.asarray(jax.jit(run)(q, k, v, sinks) * real)
    want_out = np.asarray(want(q, k, v, sinks) * real)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(run), argnums=argnums))(q, k, v, sinks)
    expected = jax.grad(loss(want), argnums=argnums)(q, k, v, sinks)
    for name, a, b in zip(("dq", "dk", "dv", "d sinks"), got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def runner(impl, mask):
    """The attention ``impl`` computes for ``mask`` (blocks of 16 for "chunked": uneven
    last blocks, alignment queries and keys)."""
    if impl == "chunked":
        return lambda q, k, v, s: attention.flash_attention(q, k, v, mask, SCALE, block=16,
                                                            sinks=s)
    return lambda q, k, v, s: attend(q, k, v, mask, SCALE, impl=impl, sinks=s)


# splash runs in Pallas's interpreter on sequences of 3 x 3 blocks of 128
LENGTH = {"splash": 384}
IMPLS = ["dense", "xla", "chunked", "splash"]


# ------------------------------------------------------------------ sinks
SINK_CASES = {
    "grouped heads": lambda t: (np.ones((B, t), bool), {}),
    "padding": lambda t: (left_padded(t) & (np.arange(t)[None] < t - 4), {}),
    "sliding window": lambda t: (left_padded(t), {"window": 9}),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(SINK_CASES))
def test_sinks_join_every_implementations_softmax_as_gpt_oss_computes_it(impl, kind):
    t = LENGTH.get(impl, 40)
    q, k, v, sinks = inputs(t)
    valid, extra = SINK_CASES[kind](t)
    mask = AttentionMask(jnp.asarray(valid), jnp.arange(t), **extra)
    allowed = allowed_of(valid, **extra)
    assert_matches(runner(impl, mask), lambda q, k, v, s: reference(q, k, v, allowed, s),
                   q, k, v, sinks, valid)


def test_a_query_that_sees_no_key_puts_all_its_weight_on_the_sink():
    q, k, v, sinks = inputs(24)
    valid = left_padded(24)
    mask = AttentionMask(jnp.asarray(valid), jnp.arange(24))
    for impl in ("dense", "chunked"):
        out = np.asarray(runner(impl, mask)(q, k, v, sinks))
        assert np.all(out[0, :5] == 0) and np.abs(out[0, 5:]).min(initial=1) > 0, impl


# ------------------------------------------------------------------ chunks
def chunk_case(kind, t):
    """(kv_valid, segment ids or None, the mask) of a chunked case of ``t`` tokens."""
    slots = jnp.arange(t)
    chunk = 48 if t > 100 else 7
    if kind == "segments":  # packed rows: chunks count from each document's start
        seg = packed(t)
        mask = AttentionMask(jnp.asarray(seg != 0), slots, jnp.asarray(seg), jnp.asarray(seg))
        return seg != 0, seg, mask.chunked(chunk, layers.segment_positions(jnp.asarray(seg)))
    valid = {"left padding": left_padded(t, (11, 0)),
             "trailing padding": np.arange(t)[None].repeat(B, 0) < t - np.array([[0], [6]]),
             }.get(kind, np.ones((B, t), bool))
    mask = AttentionMask(jnp.asarray(valid), slots)
    positions = layers.positions_for(jnp.asarray(valid), slots)
    if kind == "traced chunk":  # a scanned layer's: one of the stack's values
        return valid, None, mask.chunked(jnp.int32(chunk), positions, (chunk, NO_CHUNK))
    return valid, None, mask.chunked(chunk, positions)


CHUNK_KINDS = ["left padding", "segments", "trailing padding", "traced chunk"]
CHUNK_CASES = [(i, k) for i in IMPLS for k in CHUNK_KINDS]


@pytest.mark.parametrize("impl,kind", CHUNK_CASES, ids=[f"{k}-{i}" for i, k in CHUNK_CASES])
def test_chunked_masks_are_transformers_chunks_on_every_implementation(impl, kind):
    """Chunks of 7 keys in 40 tokens (48 in splash's 384), from each row's first real
    token (11 tokens of left padding: splash, whose chunked mask counts from slot 0,
    takes each chunk as a segment of its own), from each packed document's start (the
    same), with trailing padding, and a scanned layer's traced chunk."""
    t = LENGTH.get(impl, 40)
    q, k, v, _ = inputs(t)
    valid, seg, mask = chunk_case(kind, t)
    chunk = 48 if t > 100 else 7
    allowed = allowed_of(valid, chunk=chunk, segments=seg)
    assert_matches(runner(impl, mask), lambda q, k, v, s: reference(q, k, v, allowed),
                   q, k, v, None, valid)


@pytest.mark.parametrize("kind", ["left padding", "segments", "trailing padding",
                                  "padding inside a document"])
def test_a_chunk_each_a_run_is_the_chunked_mask_where_documents_are_together(kind):
    """What cuDNN's packed layout and splash's segment ids compute for a chunked mask
    (``fused_attention.chunk_runs``): causal attention inside runs of (document, chunk)
    is the mask's attention for every real query; a row with padding inside a
    document is told (``documents_together``: the kernels then give way)."""
    from redray.models import fused_attention

    t, chunk = 40, 7
    if kind == "padding inside a document":
        valid = np.ones((B, t), bool)
        valid[1, 17] = False
        mask = AttentionMask(jnp.asarray(valid), jnp.arange(t)).chunked(
            chunk, layers.positions_for(jnp.asarray(valid), jnp.arange(t)))
    else:
        valid, _, mask = chunk_case(kind, t)
    runs = fused_attention.chunk_runs(mask, chunk)
    causal = AttentionMask(mask.kv_valid, mask.q_slots, runs, runs).dense()
    real = np.asarray(valid, bool)
    together = bool(fused_attention.documents_together(mask))
    assert together == (kind != "padding inside a document")
    if together:
        np.testing.assert_array_equal(np.asarray(causal)[real], np.asarray(mask.dense())[real])
    else:  # the runs would cut a chunk where the padding is
        assert not np.array_equal(np.asarray(causal)[real], np.asarray(mask.dense())[real])


@pytest.mark.parametrize("layer", ["chunked", "traced"])
def test_chunks_lower_to_cudnns_packed_layout_on_hopper(hopper, layer):
    """A bf16 training step's chunked attention lowered for CUDA on Hopper: cuDNN's
    flash attention on its packed layout (a run per chunk), forward and backward, under
    the run-time condition that each document's tokens are together; a scanned layer's
    traced chunk switches between that and the plain causal kernel."""
    t = 256
    positions = jnp.broadcast_to(jnp.arange(t), (2, t))
    mask = AttentionMask(jnp.ones((2, t), bool), jnp.arange(t), padded=False)
    mask = mask.chunked(64, positions) if layer == "chunked" else \
        mask.chunked(jnp.int32(64), positions, (64, NO_CHUNK))
    shape = jax.ShapeDtypeStruct((2, t, 4, 64), jnp.bfloat16)
    assert choose(jnp.zeros(shape.shape, shape.dtype), jnp.zeros(shape.shape, shape.dtype),
                  mask, None, None, "auto") == "cudnn"

    def loss(q, k, v):
        return attend(q, k, v, mask, 0.125).astype(jnp.float32).sum()

    targets = ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    text = exported(loss, "cuda", targets, shape, shape, shape)
    assert set(re.findall(r"@(__cudnn\$\w+)", text)) == set(targets)
    config = text.replace("\\22", '"')
    assert '"mask_type": "PADDING_CAUSAL"' in config
    assert ('"mask_type": "CAUSAL"' in config) == (layer == "traced")


def test_the_planner_counts_each_chunks_triangle():
    t = 40
    mask = AttentionMask(jnp.ones((1, t), bool), jnp.arange(t)).chunked(7, None)
    q = jnp.zeros((1, t, H, D))
    assert AttentionCall.of(q, q, mask).pairs == int(np.asarray(mask.dense()).sum())
    assert AttentionCall.of(q, q, mask).pairs == 5 * 28 + 15
    scanned = mask.chunked(jnp.int32(7), None, (7, NO_CHUNK))  # chunked and global layers
    assert AttentionCall.of(q, q, scanned).pairs == (5 * 28 + 15 + t * (t + 1) / 2) / 2


# ------------------------------------------------------------------ the context axis
RING_CASES = {  # (method, kind): sinks throughout
    ("ring", "chunks, left padding"): dict(lead=(5, 0), chunk=6),
    ("ring", "window, packed rows"): dict(window=7, segments=True),
    ("all_gather", "chunks, packed rows"): dict(chunk=6, segments=True),
}


@pytest.mark.parametrize("method,kind", list(RING_CASES), ids=[f"{m}-{k}" for m, k in
                                                               RING_CASES])
def test_a_sequence_split_over_the_context_axis_equals_one_device(monkeypatch, method, kind):
    """32 tokens over a context axis of 4 (the zigzag layout), with sinks: the ring (the
    sinks in the diagonal block's statistics, their gradient its step's, summed over the
    devices) and the all-gather give the reference's output and gradients."""
    from redray.sharding import Parallelism
    from redray.sharding.tracing import traced

    case = RING_CASES[method, kind]
    t, ways = 32, 4
    q, k, v, sinks = inputs(t)
    slots = jnp.arange(t)
    seg = packed(t) if case.get("segments") else None
    valid = seg != 0 if seg is not None else left_padded(t, case["lead"])
    mask = AttentionMask(jnp.asarray(valid), slots,
                         *((jnp.asarray(seg),) * 2 if seg is not None else (None, None)),
                         window=case.get("window"))
    positions = layers.segment_positions(jnp.asarray(seg)) if seg is not None \
        else layers.positions_for(jnp.asarray(valid), slots)
    if "chunk" in case:
        mask = mask.chunked(case["chunk"], positions)
    allowed = allowed_of(valid, case.get("window"), case.get("chunk"), seg)
    plan = Parallelism.of(data_axis=1, context_axis=ways).build(jax.devices()[:ways])
    order = jnp.asarray(context.zigzag_order(t, ways))
    back = jnp.argsort(order)
    monkeypatch.setenv("REDRAY_CONTEXT_ATTENTION", method)

    def split(q, k, v, s):
        _, zigzag, _ = context.zigzag_inputs(ways, jnp.zeros((B, t), jnp.int32), mask,
                                             positions)
        with traced(mesh=plan.mesh):
            out = context.attention(*(jnp.take(x, order, axis=1) for x in (q, k, v)), zigzag,
                                    SCALE, sinks=s)
        return jnp.take(out, back, axis=1)

    assert_matches(split, lambda q, k, v, s: reference(q, k, v, allowed, s), q, k, v, sinks,
                   valid)


# ------------------------------------------------------------------ a KV cache
@pytest.mark.parametrize("kind", ["sinks", "chunk"])
def test_decoding_with_a_cache_equals_the_whole_sequence(kind):
    """A left-padded prompt of 12 slots prefilled into a cache of 20, then 8 tokens
    decoded one at a time (``layers.self_attention``: the cache read in its own layout):
    every real query's output is the reference's over the whole sequence."""
    prompt, t = 12, 20
    q, k, v, sinks = inputs(t)
    sinks = sinks if kind == "sinks" else None
    chunk = 5 if kind == "chunk" else None
    valid = left_padded(t, (3, 0))
    allowed = allowed_of(valid, chunk=chunk)
    want = np.asarray(reference(q, k, v, allowed, sinks))
    dropout = nnx.Dropout(0.0, rngs=nnx.Rngs(0))
    attention_mask = jnp.asarray(valid, jnp.int32)

    def call(q, k, v, cache, index):
        mask, positions = layers.decoder_masks(q[..., 0, 0], attention_mask, cache, index)
        if chunk is not None:
            mask = mask.chunked(chunk, positions)
        return layers.self_attention(q, k, v, mask, SCALE, cache, index, dropout, False,
                                     sinks=sinks)

    cache = layers.empty_cache(1, B, t, KV, D)[0]
    out, cache = jax.jit(lambda q, k, v, c: call(q, k, v, c, 0))(
        q[:, :prompt], k[:, :prompt], v[:, :prompt], cache)
    outs = [np.asarray(out)]
    step = jax.jit(call)
    for i in range(prompt, t):
        out, cache = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache, jnp.int32(i))
        outs.append(np.asarray(out))
    got = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ paged
@pytest.mark.parametrize("kind", ["sinks", "chunk"])
def test_a_paged_decode_equals_the_reference(kind):
    """One new token per row over rows of 6, 38 and 61 tokens in scattered pages of 16:
    with sinks, and with chunks of 16 counted from each row's first token."""
    rs = np.random.default_rng(3)
    size, pages_per_row = 16, 4
    k_pool, v_pool = (jnp.asarray(rs.normal(size=(KV, 40, size, D)), jnp.float32)
                      for _ in range(2))
    table = jnp.asarray(rs.permutation(40)[:3 * pages_per_row].reshape(3, pages_per_row),
                        jnp.int32)
    lengths = jnp.asarray([5, 37, 60], jnp.int32)  # before the new token
    q = jnp.asarray(rs.normal(size=(3, 1, H, D)), jnp.float32)
    sinks = jnp.asarray(rs.normal(size=(H,)), jnp.float32) if kind == "sinks" else None
    chunk = 16 if kind == "chunk" else None
    mask = AttentionMask(jnp.ones((3, 1), bool), jnp.arange(1))
    if chunk is not None:
        mask = mask.chunked(chunk, lengths[:, None])
    got = jax.jit(lambda q, s: paged.attention(q, {"k": k_pool, "v": v_pool},
                                               paged.Pages(table, lengths), mask, SCALE,
                                               sinks=s))(q, sinks)
    # each row's tokens in order, the new one last: a row of its own
    seq = pages_per_row * size
    for r, n in enumerate(np.asarray(lengths) + 1):
        keys = jnp.moveaxis(k_pool[:, table[r]].reshape(KV, seq, D), 0, 1)[None]
        values = jnp.moveaxis(v_pool[:, table[r]].reshape(KV, seq, D), 0, 1)[None]
        allowed = allowed_of(np.arange(seq)[None] < n, chunk=chunk)[:, n - 1:n]
        want = reference(q[r:r + 1], keys, values, allowed, sinks)
        np.testing.assert_allclose(np.asarray(got[r:r + 1]), np.asarray(want), rtol=1e-5,
                                   atol=1e-5)


# ------------------------------------------------------------------ choosing and lowering
def test_auto_sends_sinks_and_chunks_to_a_kernel_that_honours_them(monkeypatch):
    t = 256
    q = jnp.zeros((2, t, 4, 128), jnp.bfloat16)
    k = jnp.zeros((2, t, 2, 128), jnp.bfloat16)
    sinks = jnp.zeros((4,), jnp.float32)
    plain = AttentionMask(jnp.ones((2, t), bool), jnp.arange(t), padded=False)
    chunked = plain.chunked(64, jnp.broadcast_to(jnp.arange(t), (2, t)))
    seg = jnp.asarray((np.arange(t)[None] // 40 + 1).repeat(2, 0), jnp.int32)
    packed_chunks = AttentionMask(jnp.ones((2, t), bool), jnp.arange(t), seg, seg).chunked(
        64, layers.segment_positions(seg))
    hopper_gpu, tpu, cpu = Target("gpu", packed=True), Target("tpu"), Target("cpu")

    def pick(mask, target, sinks=None, asked="auto"):
        return decide(q, k, mask, None, None, asked, None, target, sinks)

    assert pick(plain, hopper_gpu) == ("cudnn", "causal")
    assert pick(plain, hopper_gpu, sinks) == ("dense", "attention sinks (cuDNN has none)")
    ampere = Target("gpu", packed=False)
    assert pick(chunked, hopper_gpu) == ("cudnn", "packed layout, a run per chunk")
    assert pick(packed_chunks, hopper_gpu)[0] == "cudnn"
    assert pick(chunked, ampere)[0] == "xla" and "Hopper" in pick(chunked, ampere)[1]
    assert pick(plain, tpu, sinks)[0] == "splash" and pick(chunked, tpu)[0] == "splash"
    assert pick(packed_chunks, tpu)[0] == "splash"  # each document's chunks a segment
    assert pick(plain, cpu, sinks)[0] == "dense" and pick(chunked, cpu)[0] == "xla"
    assert pick(plain, cpu, sinks, asked="xla") == (
        "dense", "attention sinks (XLA's attention has none)")
    long_q = jnp.zeros((2, attention.CHUNKED_FROM, 4, 8))
    assert decide(long_q, long_q[:, :, :2], AttentionMask(
        jnp.ones((2, attention.CHUNKED_FROM), bool), jnp.arange(attention.CHUNKED_FROM)),
        None, None, "auto", None, cpu, sinks)[0] == "chunked"
    with pytest.raises(ValueError, match=r"cuDNN's fused attention has no attention sinks "
                                         r".*use 'auto', 'splash' \(TPU\), 'chunked' or "
                                         r"'dense'"):
        pick(plain, hopper_gpu, sinks, asked="cudnn")
    with pytest.raises(ValueError, match="no chunked attention .* before Hopper"):
        pick(chunked, ampere, asked="cudnn")
    assert pick(chunked, hopper_gpu, asked="cudnn") == ("cudnn", "asked for")
    monkeypatch.setenv("REDRAY_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="REDRAY_ATTENTION=cudnn: cuDNN's fused attention "
                                         "has no attention sinks"):
        pick(plain, hopper_gpu, sinks, asked=None)


def exported(loss, platform, calls, *shapes):
    from jax import export

    return export.export(
        jax.jit(jax.grad(loss, argnums=tuple(range(len(shapes))))), platforms=[platform],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in calls])(
        *shapes).mlir_module()


@pytest.fixture
def tpu_v5e(monkeypatch):
    """No TPU here: Mosaic asks the device for its TPU generation while it lowers some
    operations (the integer division of splash's chunked mask); this stand-in (private
    to jax 0.10, pinned) answers as a TPU v5e would, for a step lowered with
    ``jax.export``."""
    from jax._src.pallas.mosaic import tpu_info

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1))
    yield
    tpu_info.get_tpu_info.cache_clear()


SHAPES = (jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((4,), jnp.float32))


def test_sinks_lower_to_the_general_path_on_gpu(hopper):
    """A bf16 training step's attention with sinks, lowered for CUDA: no cuDNN call."""
    mask = AttentionMask(jnp.ones((2, 256), bool), jnp.arange(256), padded=False)

    def loss(q, k, v, s):
        return attend(q, k, v, mask, 0.125, sinks=s).astype(jnp.float32).sum()

    text = exported(loss, "cuda", [], *SHAPES)
    assert not re.findall(r"__cudnn\$\w+", text)


@pytest.mark.parametrize("kind", ["sinks", "chunks"])
def test_sinks_and_chunks_lower_to_splash_on_tpu(tpu_v5e, kind):
    """A bf16 training step's attention with sinks, and with chunks (Llama 4's), lowered
    for TPU: splash's Mosaic kernels, forward and both backward ones (a chunked batch
    also holds the blockwise kernel, which a batch with leading padding runs)."""
    t = 256
    mask = AttentionMask(jnp.ones((2, t), bool), jnp.arange(t))
    if kind == "chunks":
        mask = mask.chunked(64, jnp.broadcast_to(jnp.arange(t), (2, t)))

    def loss(q, k, v, s):
        return attend(q, k, v, mask, 0.125, sinks=s if kind == "sinks" else None).astype(
            jnp.float32).sum()

    text = exported(loss, "tpu", ["tpu_custom_call"], *SHAPES)
    kernels = set(re.findall(r'kernel_name\s*=\s*"?([\w\-]+)', text))
    assert kernels == {"splash_mqa_fwd_segmented_residuals",
                       "splash_mqa_dq_segmented_no_residuals",
                       "splash_mqa_dkv_segmented_no_residuals"}, kernels
    assert ("stablehlo.case" in text or "stablehlo.if" in text) == (kind == "chunks")


def test_a_paged_decode_with_sinks_lowers_to_no_paged_kernel(monkeypatch):
    """JAX's paged-attention kernels have no sinks: a bf16 decoding step with sinks
    gathers the pages (no Triton call for GPU); without sinks it runs the kernel."""
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    triton = "__gpu$xla.gpu.triton"
    pool = jax.ShapeDtypeStruct((2, 64, 16, 64), jnp.bfloat16)
    mask = AttentionMask(jnp.ones((4, 1), bool), jnp.arange(1))

    def lowered(with_sinks):
        def step(k, v, q, table, lengths, s):
            return paged.attention(q, {"k": k, "v": v}, paged.Pages(table, lengths), mask,
                                   0.125, sinks=s if with_sinks else None)
        return export.export(
            jax.jit(step), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
            pool, pool, jax.ShapeDtypeStruct((4, 1, 4, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
            jax.ShapeDtypeStruct((4,), jnp.float32)).mlir_module()
    assert triton in lowered(False)
    assert triton not in lowered(True)

