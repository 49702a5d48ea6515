"""Attention: every implementation computes what the dense reference computes, for every
kind of mask, forward and backward; "auto" picks the right one; the blockwise path's
memory grows linearly; the GPU path lowers to cuDNN's fused flash attention."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from redray.models import attention
from redray.models.attention import AttentionMask, attend, choose, dense_attention

B, T, H, KV, D = 2, 70, 4, 2, 8


def qkv(t=T, s=T, dtype=jnp.float32, seed=0):
    rs = np.random.default_rng(seed)
    return tuple(jnp.asarray(rs.normal(size=shape), dtype)
                 for shape in ((B, t, H, D), (B, s, KV, D), (B, s, KV, D)))


def masks():
    rs = np.random.default_rng(1)
    valid = jnp.asarray(np.arange(T)[None].repeat(B, 0) >= np.array([[5], [0]]))  # left pad
    seg = jnp.asarray(np.sort(rs.integers(1, 4, (B, T)), 1))
    seg = seg.at[:, -3:].set(0)  # packing's padding
    slots = jnp.arange(T)
    return {"causal": AttentionMask(jnp.ones((B, T), bool), slots),
            "left padding": AttentionMask(valid, slots),
            "sliding window": AttentionMask(valid, slots, window=9),
            "segments": AttentionMask(seg != 0, slots, seg, seg),
            "bidirectional": AttentionMask(valid, slots, causal=False)}


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("kind", list(masks()))
def test_every_implementation_computes_the_dense_attention(impl, kind):
    mask = masks()[kind]
    q, k, v = qkv()
    weights = jnp.arange(D, dtype=jnp.float32)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * weights).sum()

    if impl == "chunked":  # blocks of 16: uneven last blocks, queries that see no key
        run = lambda q, k, v: attention.flash_attention(q, k, v, mask, 0.3, block=16)  # noqa: E731
    else:
        run = lambda q, k, v: attend(q, k, v, mask, 0.3, impl=impl)  # noqa: E731
    ref = lambda q, k, v: dense_attention(q, k, v, mask.dense(), 0.3)  # noqa: E731
    np.testing.assert_allclose(np.asarray(run(q, k, v)), np.asarray(ref(q, k, v)),
                               rtol=1e-5, atol=1e-6)
    got = jax.grad(loss(run), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_decoding_with_a_cache_in_blocks():
    # one new query at slot 40 of a 70-slot cache whose last 29 slots are still empty
    q, k, v = qkv(t=1)
    kv_valid = jnp.arange(T)[None].repeat(B, 0) <= 40
    mask = AttentionMask(kv_valid, jnp.asarray([40]))
    np.testing.assert_allclose(np.asarray(attention.flash_attention(q, k, v, mask, 0.3, 16)),
                               np.asarray(dense_attention(q, k, v, mask.dense(), 0.3)),
                               rtol=1e-5, atol=1e-6)


def test_auto_picks_by_sequence_backend_and_what_the_mask_needs(monkeypatch):
    mask = AttentionMask(jnp.ones((B, T), bool), jnp.arange(T))
    q, k, v = qkv()
    assert choose(q, k, mask, None, None, "auto") == "xla"  # short, on CPU
    assert choose(q, k, mask, None, lambda p: p, "auto") == "dense"  # dropout: probabilities
    long_q, long_k, _ = qkv(t=8, s=attention.CHUNKED_FROM)
    long_mask = AttentionMask(jnp.ones((B, attention.CHUNKED_FROM), bool), jnp.arange(8))
    assert choose(long_q, long_k, long_mask, None, None, "auto") == "chunked"
    assert choose(long_q, long_k, long_mask, jnp.zeros((1, H, 8, 1)), None, "auto") == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    bf16 = qkv(dtype=jnp.bfloat16)
    assert choose(bf16[0], bf16[1], mask, None, None, "auto") == "cudnn"
    assert choose(*bf16[:2], masks()["segments"], None, None, "auto") == "xla"  # no segments
    monkeypatch.setenv("REDRAY_ATTENTION", "chunked")
    assert choose(q, k, mask, None, None) == "chunked"
    monkeypatch.setenv("REDRAY_ATTENTION", "fast")
    with pytest.raises(ValueError, match="REDRAY_ATTENTION='fast': use one of auto"):
        choose(q, k, mask, None, None)


def peak(impl: str, seq: int) -> int:
    """Temp bytes of the compiled gradient of one attention layer at ``seq`` tokens."""
    shape = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)
    mask = AttentionMask(jnp.ones((1, seq), bool), jnp.arange(seq))

    def loss(q, k, v):
        return attend(q, k, v, mask, 0.125, impl=impl).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_with_the_sequence_not_its_square():
    # 4x the sequence: the dense scores grow 16x, the blocks' working set 4x
    chunked = peak("chunked", 4096) / peak("chunked", 1024)
    xla = peak("xla", 4096) / peak("xla", 1024)
    assert chunked < 6 and xla > 12, (chunked, xla)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "maybe-padded"])
def test_the_gpu_path_lowers_to_cudnn_flash_attention(hopper, padded):
    # No GPU here: lower a bf16 training step's attention for CUDA with jax.export (the
    # ``hopper`` fixture answers for cuDNN and the GPU). A mask that may hold padding
    # runs cuDNN's packed layout (its padding mask), or, where the layout cannot
    # describe the padding, the blockwise path, picked at run time.
    from jax import export

    mask = AttentionMask(jnp.ones((2, 128), bool), jnp.arange(128), padded=padded)
    assert choose(*qkv(128, 128, jnp.bfloat16)[:2], mask, None, None, "auto") == "cudnn"

    def loss(q, k, v):
        return attend(q, k, v, mask, 0.125).astype(jnp.float32).sum()

    shape = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    targets = ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    exported = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in targets])(
        shape, shape, shape)
    text = exported.mlir_module()
    assert set(re.findall(r"@(__cudnn\$\w+)", text)) == set(targets)
    config = text.replace("\\22", '"')  # the backend config, a JSON string in the module
    kind = "PADDING_CAUSAL" if padded else "CAUSAL"
    assert '"is_flash_attention": true' in config and f'"mask_type": "{kind}"' in config
    assert ("stablehlo.case" in text or "stablehlo.if" in text) == padded


def test_cudnn_runs_only_where_the_padding_trails():
    """cuDNN's lengths describe padding after each row's real tokens; left padding,
    padding inside a row and an all-padding row go the other way."""
    from redray.models.fused_attention import trailing_padding

    def check(rows):
        lengths, trailing = trailing_padding(jnp.asarray(rows, bool))
        return lengths.tolist(), bool(trailing)

    assert check([[1, 1, 1, 0], [1, 1, 1, 1]]) == ([3, 4], True)
    assert check([[0, 1, 1, 1], [1, 1, 1, 1]]) == ([3, 4], False)  # left-padded
    assert check([[1, 0, 1, 1]]) == ([3], False)
    assert check([[0, 0, 0, 0], [1, 1, 1, 1]]) == ([0, 4], False)


@pytest.mark.parametrize("kind", ["left padding", "sliding window", "segments"])
def test_soft_capped_scores_agree_dense_blockwise_and_through_xla(kind):
    # Gemma 2's c * tanh(s / c): forward and backward of the blockwise path against the
    # dense one, on scores large enough for the cap to matter
    mask, cap = masks()[kind], 2.0
    q, k, v = qkv()
    q = q * 4
    weights = jnp.arange(D, dtype=jnp.float32)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * weights).sum()

    ref = lambda q, k, v: dense_attention(q, k, v, mask.dense(), 0.3, softcap=cap)  # noqa: E731
    runs = {"chunked": lambda q, k, v: attention.flash_attention(q, k, v, mask, 0.3, block=16,
                                                                  softcap=cap),
            "xla": lambda q, k, v: attend(q, k, v, mask, 0.3, impl="xla", softcap=cap)}
    uncapped = np.asarray(dense_attention(q, k, v, mask.dense(), 0.3))
    assert np.abs(uncapped - np.asarray(ref(q, k, v))).max() > 0.1
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for run in runs.values():
        np.testing.assert_allclose(np.asarray(run(q, k, v)), np.asarray(ref(q, k, v)),
                                   rtol=1e-5, atol=1e-6)
        got = jax.grad(loss(run), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_a_traced_window_masks_as_the_static_one(impl):
    # scanned layers whose windows differ get theirs as an array (Gemma's)
    static = masks()["sliding window"]
    plain = static.replace(window=None)
    q, k, v = qkv()

    def run(q, k, v, window):
        mask = static if window is None else plain.windowed(window)
        return (attend(q, k, v, mask, 0.3, impl=impl) * jnp.arange(D)).sum()

    traced = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2)))(q, k, v, jnp.int32(9))
    fixed = jax.value_and_grad(run, argnums=(0, 1, 2))(q, k, v, None)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(fixed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert plain.windowed(9).window == 9 and plain.windowed(9).layer_window is None


def test_soft_capping_never_runs_on_cudnn(monkeypatch):
    mask = AttentionMask(jnp.ones((B, T), bool), jnp.arange(T))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    bf16 = qkv(dtype=jnp.bfloat16)
    assert choose(*bf16[:2], mask, None, None, "auto") == "cudnn"
    assert choose(*bf16[:2], mask, None, None, "auto", softcap=50.0) == "dense"
    assert choose(*bf16[:2], mask, None, None, "xla", softcap=50.0) == "dense"
    long_q, long_k, _ = qkv(t=8, s=attention.CHUNKED_FROM)
    long_mask = AttentionMask(jnp.ones((B, attention.CHUNKED_FROM), bool), jnp.arange(8))
    assert choose(long_q, long_k, long_mask, None, None, "auto", softcap=50.0) == "chunked"
    with pytest.raises(ValueError, match="cuDNN's fused attention has no logit soft-capping"):
        choose(*bf16[:2], mask, None, None, "cudnn", softcap=50.0)
