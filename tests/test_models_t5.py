"""T5 against transformers: logits, cached decoding, greedy generation, export, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip(
    "torch", reason="parity tests need torch (pip install torch==2.13.0; make test installs it)")
transformers = pytest.importorskip("transformers")

import redray  # noqa: E402
from redray.models import from_pretrained, save_pretrained, t5  # noqa: E402

VOCAB = 128


def _hf_model(path, seed=0, untied_head=False, **config):
    """A tiny random T5ForConditionalGeneration saved into ``path``."""
    torch.manual_seed(seed)
    c = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                              num_layers=2, num_decoder_layers=2, decoder_start_token_id=0,
                              **config)
    hf = transformers.T5ForConditionalGeneration(c).eval()
    if untied_head:  # as T5 v1.1 / Flan-T5 checkpoints: their own lm_head.weight
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 64) * 0.1)
    hf.save_pretrained(path)
    return hf


def _one_device():
    return redray.make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def relu(tmp_path_factory):
    """(HF model, its folder, the redray model loaded from it on one device)."""
    path = str(tmp_path_factory.mktemp("t5_relu"))
    hf = _hf_model(path)
    return hf, path, from_pretrained(path, mesh=_one_device())


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """T5 v1.1 style: gated-gelu feed-forward, its own LM head, no output scaling."""
    path = str(tmp_path_factory.mktemp("t5_gated"))
    hf = _hf_model(path, seed=1, untied_head=True, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False)
    return hf, path, from_pretrained(path, mesh=_one_device())


def _inputs(seed=0, enc_len=10, dec_len=7):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCAB, (2, enc_len))
    dec = rng.integers(2, VOCAB, (2, dec_len))
    dec[:, 0] = 0
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return ids, mask, dec


def _hf_logits(hf, ids, mask, dec):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  decoder_input_ids=torch.tensor(dec)).logits.numpy()


@nnx.jit
def _logits(model, ids, mask, dec):
    return model(ids, mask, decoder_input_ids=dec)


def test_relative_position_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-600, 601)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (32, 20), (16, 64), (64, 256)):
            ref = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional,
                                                        num_buckets=buckets,
                                                        max_distance=distance).numpy()
            table = t5.relative_position_buckets(bidirectional, buckets, distance)
            index = np.clip(rel.numpy(), -distance, distance) + distance
            np.testing.assert_array_equal(table[index], ref)


@pytest.mark.parametrize("config", [dict(), dict(feed_forward_proj="gated-gelu",
                                                 tie_word_embeddings=False)])
def test_random_init_follows_transformers(config):
    """A T5 built from a config starts where T5 does (each tensor's mean and std equal
    transformers' within sampling error), so it trains from scratch as T5 does."""
    from redray.models import build

    c = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                              num_layers=2, initializer_factor=0.5, **config)
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(c).state_dict()
    # as a list (scan=False): the weight table names each layer's tensors
    params = nnx.to_flat_state(nnx.state(build(c, rngs=nnx.Rngs(0), scan=False), nnx.Param))
    params = {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in params}
    for row in t5.weight_table(c):
        # a fused kernel (Q, K, V) is compared part by part, each with its HF tensor
        for part, mine in zip(row.parts, row.write(params[row.path])):
            theirs = hf[part.hf].numpy()
            tolerance = 5 / np.sqrt(mine.size)  # five standard errors of the ratio of two stds
            assert mine.mean() == pytest.approx(theirs.mean(),
                                                abs=tolerance * theirs.std() + 1e-6), part.hf
            assert mine.std() == pytest.approx(theirs.std(), rel=tolerance, abs=1e-6), part.hf


@pytest.mark.parametrize("which", ["relu", "gated"])
def test_logits_match_transformers(which, request):
    hf, _, model = request.getfixturevalue(which)
    assert model.tied == (which == "relu")
    ids, mask, dec = _inputs()
    full = np.ones_like(mask)
    np.testing.assert_allclose(np.asarray(_logits(model, ids, full, dec)),
                               _hf_logits(hf, ids, full, dec), atol=1e-4, rtol=0)
    # Left-padded encoder input: every decoder position is valid.
    np.testing.assert_allclose(np.asarray(_logits(model, ids, mask, dec)),
                               _hf_logits(hf, ids, mask, dec), atol=1e-4, rtol=0)


def test_cached_decoding_matches_full_decoding(relu):
    hf, _, model = relu
    ids, mask, dec = _inputs()
    enc = nnx.jit(lambda m, ids, mask: m.encode(ids, mask))(model, ids, mask)
    cache = model.init_cache(2, dec.shape[1] + 2, encoder_out=enc)
    step = nnx.jit(lambda m, tok, cache, i: m.decode(tok, enc, jnp.asarray(mask), cache=cache,
                                                     cache_index=i))
    # Two tokens first, then one at a time: the relative bias must use absolute slots.
    first, cache = step(model, jnp.asarray(dec[:, :2]), cache, 0)
    steps = [first]
    for i in range(2, dec.shape[1]):
        logits, cache = step(model, jnp.asarray(dec[:, i:i + 1]), cache, i)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps], 1),
                               _hf_logits(hf, ids, mask, dec), atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(relu):
    hf, _, model = relu
    ids, mask, _ = _inputs(seed=3, enc_len=9)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          do_sample=False, max_new_tokens=16).numpy()[:, 1:]  # drop start
    gen = nnx.jit(lambda m, ids, mask: t5.generate(m, ids, mask, max_new_tokens=16))
    ours = np.asarray(gen(model, jnp.asarray(ids), jnp.asarray(mask)))
    assert ours.shape == (2, 16)
    n = ref.shape[1]
    np.testing.assert_array_equal(ours[:, :n], ref)
    assert (ours[:, n:] == hf.config.pad_token_id).all()
    # the common entry point hands an encoder-decoder model to T5's own decoding
    common = nnx.jit(lambda m, ids, mask: redray.models.generate(m, ids, mask, max_new_tokens=16))
    np.testing.assert_array_equal(np.asarray(common(model, jnp.asarray(ids), jnp.asarray(mask))),
                                  ours)


def test_untied_config_saved_without_its_head_loads_the_shared_embedding(tmp_path):
    # transformers 5 ties the head even for tie_word_embeddings=False and then saves no
    # lm_head.weight: the head is the shared embedding, which is what must load.
    hf = _hf_model(str(tmp_path), seed=2, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert "lm_head.weight" not in f.keys()
    model = from_pretrained(str(tmp_path), mesh=_one_device())
    ids, mask, dec = _inputs()
    np.testing.assert_allclose(np.asarray(_logits(model, ids, mask, dec)),
                               _hf_logits(hf, ids, mask, dec), atol=1e-4, rtol=0)


@pytest.mark.parametrize("which", ["relu", "gated"])
def test_export_round_trip(which, request, tmp_path):
    hf, _, model = request.getfixturevalue(which)
    save_pretrained(model, str(tmp_path))
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path)).eval()
    ids, mask, dec = _inputs(seed=5)
    np.testing.assert_allclose(_hf_logits(back, ids, mask, dec), _hf_logits(hf, ids, mask, dec),
                               atol=1e-5, rtol=0)


def test_model_axis_two_matches_one_device(relu):
    _, path, one = relu
    ids, mask, dec = _inputs(seed=7)
    split = from_pretrained(path, model_axis=2)
    np.testing.assert_allclose(np.asarray(_logits(split, ids, mask, dec)),
                               np.asarray(_logits(one, ids, mask, dec)), atol=1e-5, rtol=0)
    for stack in ("encoder", "decoder"):
        block = getattr(split, stack).layers  # stacked: the layer axis first, whole
        attns = [block.self_attn] + ([block.cross_attn] if stack == "decoder" else [])
        for attn in attns:
            # fused kernels (d_model, heads, parts, d_kv) split heads, never their parts
            cross = attn is getattr(block, "cross_attn", None)
            kernels = [attn.q, attn.kv] if cross else [attn.qkv]
            for layer in kernels:
                assert layer.kernel.get_value().sharding.spec == P(None, None, "model")
            assert attn.o.kernel.get_value().sharding.spec == P(None, "model")
        assert block.mlp.wi.kernel.get_value().sharding.spec == P(None, None, "model")
        assert block.mlp.wo.kernel.get_value().sharding.spec == P(None, "model")
    assert split.shared.embedding.get_value().sharding.spec == P("model")


@pytest.mark.parametrize("which", ["relu", "gated"])
def test_scanned_layers_match_the_list(which, request, tmp_path):
    """The default: every block alike, stacked (the relative position bias beside them);
    the same logits, cached decoding, generation and export as the listed form."""
    hf, path, scanned = request.getfixturevalue(which)
    listed = from_pretrained(path, mesh=_one_device(), scan=False)
    for stack in (listed.encoder, listed.decoder):
        assert isinstance(stack.layers, nnx.List)
    for stack in (scanned.encoder, scanned.decoder):
        assert not isinstance(stack.layers, nnx.List)
        assert stack.relative_attention_bias.embedding.shape == (32, 4)
        assert stack.layers.mlp_norm.scale.shape == (2, 64)  # the layer axis leads
    ids, mask, dec = _inputs(seed=9)
    np.testing.assert_allclose(np.asarray(_logits(scanned, ids, mask, dec)),
                               np.asarray(_logits(listed, ids, mask, dec)), atol=1e-5, rtol=0)
    gen = nnx.jit(lambda m, ids, mask: t5.generate(m, ids, mask, max_new_tokens=8))
    np.testing.assert_array_equal(np.asarray(gen(scanned, jnp.asarray(ids), jnp.asarray(mask))),
                                  np.asarray(gen(listed, jnp.asarray(ids), jnp.asarray(mask))))
    save_pretrained(scanned, str(tmp_path))
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(_hf_logits(back, ids, mask, dec), _hf_logits(hf, ids, mask, dec),
                               atol=1e-5, rtol=0)


def test_scanned_t5_trains_split_over_the_model_axis(relu):
    """The rules split the stacked kernels' heads, never the layer axis; remat and the
    gradient go through the scan."""
    _, path, _ = relu
    model = from_pretrained(path, model_axis=2, scan=True, remat="full", dropout_rate=0.0)
    qkv = model.encoder.layers.self_attn.qkv.kernel.get_value()
    assert qkv.shape[0] == 2 and qkv.sharding.spec == P(None, None, "model")
    ids, mask, dec = (jnp.asarray(x) for x in _inputs(seed=11))

    def loss(m):
        logits = m(ids, mask, decoder_input_ids=dec, train=True)
        return optax_ce(logits, dec)

    grads = nnx.jit(nnx.grad(loss))(model)
    listed = from_pretrained(path, mesh=_one_device(), scan=False, dropout_rate=0.0)
    expected = nnx.jit(nnx.grad(loss))(listed)
    np.testing.assert_allclose(np.asarray(grads.encoder.layers.mlp.wo.kernel.get_value())[1],
                               np.asarray(expected.encoder.layers[1].mlp.wo.kernel.get_value()),
                               atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(grads.decoder.relative_attention_bias.embedding.get_value()),
        np.asarray(expected.decoder.layers[0].self_attn.relative_attention_bias.embedding
                   .get_value()), atol=1e-5, rtol=1e-4)


def optax_ce(logits, targets):
    logz = jax.nn.logsumexp(logits, -1)
    return jnp.mean(logz - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])
