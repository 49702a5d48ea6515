"""GPT-J against a tiny random ``transformers`` model: logits, generation, export, sharding.

rotary_dim (8) is smaller than head_dim (16), so the pass-through half of each head and
the interleaved rotation are both exercised.
"""

from __future__ import annotations

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
from redray.models import from_pretrained, generate, save_pretrained  # noqa: E402

VOCAB, PAD, EOS = 128, 0, 2


def tiny_config(**overrides):
    fields = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                  rotary_dim=8, n_inner=None, activation_function="gelu_new",
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                  eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                  initializer_range=0.2)  # large enough for varied greedy tokens (and an EOS)
    fields.update(overrides)
    return transformers.GPTJConfig(**fields)


def hf_model(config):
    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-inits biases and unit-inits norms: randomize them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf_model(tiny_config())
    path = str(tmp_path_factory.mktemp("gptj"))
    model.save_pretrained(path)
    return model, path


def one_device():
    return redray.make_mesh(devices=jax.devices()[:1])


def batch():
    rng = np.random.RandomState(0)
    ids = rng.randint(3, VOCAB, (2, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    ids[1, :5], mask[1, :5] = PAD, 0  # second row left-padded
    return ids, mask


def hf_logits(model, ids, mask=None):
    kwargs = {}
    if mask is not None:  # positions count real tokens only, as in HF generate
        kwargs = dict(attention_mask=torch.tensor(mask),
                      position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)))
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


forward = nnx.jit(lambda model, ids, mask: model(ids, mask))


def test_logits_match_hf(checkpoint):
    hf, path = checkpoint
    model = from_pretrained(path, mesh=one_device())
    ids, mask = batch()
    full = np.ones_like(mask)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(full))),
                               hf_logits(hf, ids), atol=1e-4, rtol=0)
    ours = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    ref = hf_logits(hf, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)


def test_tied_head_keeps_its_bias(tmp_path):
    hf = hf_model(tiny_config(tie_word_embeddings=True))
    hf.save_pretrained(str(tmp_path))
    model = from_pretrained(str(tmp_path), mesh=one_device())
    ids, _ = batch()
    ours = forward(model, jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_greedy_generation_matches_hf(checkpoint):
    hf, path = checkpoint
    model = from_pretrained(path, mesh=one_device())
    ids, mask = batch()
    run = nnx.jit(lambda m, i, a: generate(m, i, a, max_new_tokens=16))
    ours = np.asarray(run(model, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=16, pad_token_id=PAD, eos_token_id=EOS)
    ref = out[:, ids.shape[1]:].numpy()
    assert ref.shape[1] >= 1
    np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
    assert (ours[:, ref.shape[1]:] == PAD).all()


def test_export_round_trip(checkpoint, tmp_path):
    hf, path = checkpoint
    model = from_pretrained(path, mesh=one_device())
    save_pretrained(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids, _ = batch()
    np.testing.assert_allclose(hf_logits(back, ids), hf_logits(hf, ids), atol=1e-5, rtol=0)


def test_model_parallel_matches_one_device(checkpoint):
    _, path = checkpoint
    ids, mask = batch()
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    single = from_pretrained(path, mesh=one_device())
    sharded = from_pretrained(path, model_axis=2)
    assert len(jax.devices()) == 4
    block = sharded.h  # stacked layers: their axis first, whole
    assert block.attn.qkv_proj.kernel[...].sharding.spec == P(None, None, "model")  # heads
    for kernel in (block.attn.out_proj.kernel, block.mlp.fc_in.kernel, block.mlp.fc_out.kernel):
        assert "model" in kernel[...].sharding.spec
    np.testing.assert_allclose(np.asarray(forward(sharded, ids, mask)),
                               np.asarray(forward(single, ids, mask)), atol=1e-5, rtol=0)


def test_scanned_layers_match_transformers(checkpoint, tmp_path):
    model, path = checkpoint
    ids, mask = batch()
    scanned = from_pretrained(path, scan=True, model_axis=2)
    assert scanned.h.attn.qkv_proj.kernel[...].shape[0] == 2
    with torch.no_grad():
        want = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(scanned(jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    save_pretrained(scanned, str(tmp_path))
    back = transformers.GPTJForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        again = back(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(again[real], want[real], atol=1e-5, rtol=0)
