"""A KV cache in pages (``redray/models/paged.py``): a prefill and decoding through a
scattered page table give ``generate``'s logits and tokens (grouped heads, a sliding
window, soft-capped scores), reading the few table widths a row's length picks; the
Pallas kernels
compute what the gathered path computes and a decoding step lowers to them for GPU and
TPU; the Sampler's pool is sized by the memory it has and refuses what cannot fit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_post_training import CONFIGS, left_padded, prompts_of

from redray.models import build, generate, paged
from redray.models.attention import AttentionMask
from redray.post_training import Sampler, SamplingParams
from redray.post_training.sampler import KV_MEMORY_SHARE, pool_pages


def test_decoding_through_scattered_pages_equals_generate():
    # Gemma 2: a sliding window shorter than the rows, soft-capped scores (the Sampler's
    # paged runs cover LLaMA and GPT-2: tests/test_post_training.py)
    model = build(CONFIGS["gemma2"](), rngs=nnx.Rngs(0))
    prompts, new, size = prompts_of(5), 12, 4
    ids, mask = left_padded(prompts)
    ref = np.asarray(generate(model, ids, mask, max_new_tokens=new, eos_token_id=-1))
    # each row's pages anywhere in the pool, interleaved with the others' (3 spare)
    rows, per_row = len(prompts), -(-(ids.shape[1] + new) // size)
    table = np.random.default_rng(0).permutation(rows * per_row + 3)[:rows * per_row]
    table = jnp.asarray(table.reshape(rows, per_row), jnp.int32)
    pool = model.init_pages(rows * per_row + 3, page_size=size)
    # the prompts through the pages, left padding left out: positions count real tokens
    logits, pool = jax.jit(lambda pool: model(
        jnp.asarray(ids), jnp.asarray(mask), cache=pool,
        cache_index=paged.Pages(table, jnp.zeros(rows, jnp.int32))))(pool)
    lengths = jnp.asarray(mask.sum(1), jnp.int32)
    step = jax.jit(lambda pool, token, lengths: model(
        token[:, None], None, cache=pool, cache_index=paged.Pages(table, lengths)))
    token, got = jnp.argmax(logits[:, -1], -1), []
    want = jax.jit(lambda: model(jnp.asarray(ids), jnp.asarray(mask), cache=model.init_cache(
        rows, ids.shape[1] + new), cache_index=0)[0])()
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(want[:, -1]),
                               rtol=1e-5, atol=1e-5)
    for _ in range(new):
        got.append(np.asarray(token))
        logits, pool = step(pool, token, lengths)
        lengths = lengths + 1
        token = jnp.argmax(logits[:, -1], -1)
    assert np.array_equal(np.stack(got, 1), ref)
    # a token for padding rows writes nothing: a row marked invalid keeps its pages
    before = pool[0]["k"]
    _, after = jax.jit(lambda pool: model(token[:, None], jnp.zeros((rows, 1), bool), cache=pool,
                                          cache_index=paged.Pages(table, lengths)))(pool)
    assert np.array_equal(np.asarray(after[0]["k"]), np.asarray(before))


def _pools(kv=2, pages=40, size=16, d=16, dtype=jnp.float32, seed=0):
    rs = np.random.default_rng(seed)
    return tuple(jnp.asarray(rs.normal(size=(kv, pages, size, d)), dtype) for _ in range(2))


def test_the_gpu_kernel_computes_what_the_gathered_pages_give():
    rs = np.random.default_rng(1)
    k, v = _pools()
    q = jnp.asarray(rs.normal(size=(3, 1, 4, 16)), jnp.float32)
    table = jnp.asarray(rs.permutation(40)[:3 * 4].reshape(3, 4), jnp.int32)
    lengths = jnp.asarray([5, 37, 60], jnp.int32)  # before the new token
    pages = paged.Pages(table, lengths)
    mask = AttentionMask(jnp.ones((3, 1), bool), jnp.arange(1))
    for cap in (None, 2.0):
        want = paged.attention(q, {"k": k, "v": v}, pages, mask, 0.25, cap)[:, 0]
        got = paged.gpu_kernel(q[:, 0], k, v, table, lengths + 1, 0.25, cap, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_decoding_step_lowers_to_the_paged_kernel(monkeypatch, platform):
    # No accelerator here: a bf16 decoding step of a LLaMA lowered for it with
    # jax.export, its custom calls read. A sliding window gathers the pages instead.
    import transformers
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    triton = "__gpu$xla.gpu.triton"
    target = {"gpu": ("cuda", triton), "tpu": ("tpu", "tpu_custom_call")}[platform]

    def lowered(window):
        config = (transformers.MistralConfig if window else transformers.LlamaConfig)(
            vocab_size=97, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, sliding_window=window)
        model = build(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        pool = model.init_pages(64, page_size=16)

        def step(pool, token, table, lengths):
            return model(token[:, None], None, cache=pool,
                         cache_index=paged.Pages(table, lengths))[0]
        return export.export(
            jax.jit(step), platforms=[target[0]],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
            pool, jnp.zeros(4, jnp.int32), jnp.zeros((4, 16), jnp.int32),
            jnp.zeros(4, jnp.int32)).mlir_module()
    assert re.search(re.escape(target[1]), lowered(None))
    assert not re.search(re.escape(target[1]), lowered(8))


def test_the_pool_is_sized_by_memory_and_a_request_it_cannot_hold_is_refused():
    model = build(CONFIGS["llama"](), rngs=nnx.Rngs(0))
    state = nnx.state(model)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    page = 2 * 2 * 2 * 16 * 8 * 4  # k and v, 2 layers, 2 kv heads, 16 tokens, head 8, f32
    # plenty of memory: what the slots' longest requests need, no more
    assert pool_pages(model, state, 1, 4, 100, 16, memory=1e12) == 4 * 7
    # little: what the share beside the weights (twice) holds
    memory = (2 * weights + 10.5 * page) / KV_MEMORY_SHARE
    assert pool_pages(model, state, 1, 4, 100, 16, memory=memory) == 10
    with pytest.raises(ValueError, match="use 'window' or 'paged'"):
        Sampler(model, slots=4, max_length=36, kv_cache="pages")
    sampler = Sampler(model, slots=4, max_length=64, kv_cache="paged", kv_pages=2,
                      page_size=8)
    with pytest.raises(ValueError, match=r"prompt 1: 3 tokens \+ max_new_tokens=14 need 3 "
                                         r"pages of 8 tokens.*kv_pages=2"):
        sampler.sample([[7], [7, 8, 9]], [SamplingParams(max_new_tokens=4),
                                          SamplingParams(max_new_tokens=14)])
