"""next_token_loss: the LM head a chunk of tokens at a time gives the same loss and
gradients as the whole logits, inside packed documents, without their memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as hf
from flax import nnx

import redray.models as rm

CONFIGS = {
    "llama": lambda v: hf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=v,
                                      max_position_embeddings=64),
    "opt": lambda v: hf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=v,
                                  max_position_embeddings=64, word_embed_proj_dim=16),
    "gptj": lambda v: hf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=v,
                                    n_positions=64, rotary_dim=4, bos_token_id=0,
                                    eos_token_id=0),
    "gpt2": lambda v: hf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=v,
                                    n_positions=64, bos_token_id=0, eos_token_id=0),
}


def loss_and_grad(family: str, chunk, vocab=300, batch=3, length=33):
    model = rm.build(CONFIGS[family](vocab), seed=1)
    rs = np.random.default_rng(0)
    ids = jnp.asarray(rs.integers(0, vocab, (batch, length)))
    segments = jnp.asarray(np.sort(rs.integers(0, 3, (batch, length)), 1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        # the model's other state as new variables of this trace: a scanned model's RNG
        # counts enter its scan, which takes no variable made outside
        model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
        return rm.next_token_loss(model, ids, segments, chunk=chunk)

    return jax.jit(jax.value_and_grad(loss)), params


@pytest.mark.parametrize("family", list(CONFIGS))
def test_chunks_give_the_whole_logits_loss_and_gradients(family):
    whole, params = loss_and_grad(family, None)
    chunked, _ = loss_and_grad(family, 7)  # 96 tokens: 13 full chunks and a short one
    (a, ga), (b, gb) = whole(params), chunked(params)
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-7)


def test_chunks_keep_the_logits_out_of_memory():
    # 64 x 64 tokens x a 16k vocabulary: 256 MB of float32 logits (and their gradient);
    # short rows, so that attention's scores stay small beside them
    temp = {}
    for chunk in (None, 256):
        step, params = loss_and_grad("llama", chunk, vocab=16384, batch=64, length=65)
        temp[chunk] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    logits = 64 * 64 * 16384 * 4
    assert temp[None] > 2 * logits and temp[256] < logits / 2, temp  # ~590 MB against ~90
