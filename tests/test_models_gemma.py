"""Gemma 2 / Gemma 3 (text) against transformers PyTorch: logits (both attention paths),
left padding, generation, export, scanned layers, sharded loading, remat, the plan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import (IDS, MASK, assert_export_round_trip, assert_greedy_generation_matches,
                     assert_logits_match, loaded_pair)
from jax.sharding import PartitionSpec as P

import redray
import redray.models as rm

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

# 4 layers of both kinds, a window shorter than the 12-token prompts, soft-caps and a
# query scale that matter at this initialization
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
             query_pre_attn_scalar=8, final_logit_softcapping=3.0, initializer_range=0.2)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                  "rope_theta": 1000000.0}}
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, attn_logit_softcapping=2.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, rope_parameters=GEMMA3_ROPE,
        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
}
EAGER = {"attn_implementation": "eager"}  # transformers' reference attention


def hf_model(name, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), **EAGER).eval()
    with torch.no_grad():  # the norms start at zero, where w and 1 + w cannot be told apart
        for key, param in model.named_parameters():
            if "norm" in key:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    return loaded_pair(request.param, hf_model, tmp_path_factory)


@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_logits_match_transformers_with_and_without_padding(pair, impl, monkeypatch):
    name, hf, _, model = pair
    monkeypatch.setenv("REDRAY_ATTENTION", impl)  # plain (dense or XLA) and blockwise
    assert_logits_match(model, hf)


def test_greedy_generation_matches_transformers(pair):
    name, hf, _, model = pair
    assert_greedy_generation_matches(model, hf, 16)


def test_export_round_trip(pair, tmp_path):
    name, hf, _, model = pair
    assert_export_round_trip(model, hf, tmp_path, **EAGER)


def test_scanned_layers_match_the_list_of_layers(pair):
    name, hf, path, scanned = pair  # the default: stacked layers
    assert scanned.layers.self_attn.qkv_proj.kernel[...].shape[0] == SMALL["num_hidden_layers"]
    model = rm.from_pretrained(path, scan=False)
    assert isinstance(model.layers, nnx.List)
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    np.testing.assert_allclose(np.asarray(scanned(ids)), np.asarray(model(ids)),
                               atol=1e-5, rtol=0)
    real = MASK.astype(bool)
    np.testing.assert_allclose(np.asarray(scanned(ids, mask))[real],
                               np.asarray(model(ids, mask))[real], atol=1e-5, rtol=0)
    assert_greedy_generation_matches(model, hf, 8)


@pytest.mark.parametrize("scan", [False, True])
def test_sharded_load_matches_one_device(pair, scan):
    name, _, path, _ = pair
    one = rm.from_pretrained(path, mesh=redray.make_mesh(devices=jax.devices()[:1]), scan=scan)
    two = rm.from_pretrained(path, model_axis=2, scan=scan)
    block = two.layers if scan else two.layers[0]
    layer_axis = (None,) * scan  # stacked layers: their axis stays whole
    # whole key/value groups and the intermediate axis over the model axis
    assert block.self_attn.qkv_proj.kernel[...].sharding.spec == P(*layer_axis, None, "model")
    assert block.mlp.gate_up_proj.kernel[...].sharding.spec == P(*layer_axis, None, None,
                                                                 "model")
    assert block.mlp.down_proj.kernel[...].sharding.spec == P(*layer_axis, "model")
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    np.testing.assert_allclose(np.asarray(two(ids, mask)), np.asarray(one(ids, mask)),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_gives_the_same_gradients(scan):
    # under remat the per-layer window and rotary table are traced, not Python values
    config = CONFIGS["gemma3"]()
    grads = {}
    for policy in ("none", "full"):
        model = rm.build(config, remat=policy, seed=3, scan=scan)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
            return m(jnp.asarray(IDS), train=True).astype(jnp.float32).std()

        grads[policy] = jax.jit(jax.grad(loss))(params)
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads["full"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_redray_plan_takes_gemma_configs():
    from redray.planning.memory import StepShape
    from redray.planning.from_config import choose_plan, plan_model
    from redray.planning.hardware import PRESETS

    config = CONFIGS["gemma3"]()
    n_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
        config).parameters())  # the tied head counted once
    result = plan_model(config, 4, 2, 1, step=StepShape(batch_size=4, seq_len=16))
    assert result["n_params"] == n_params
    assert result["memory"]["parts"]["activations"] > 0
    hardware = dataclasses.replace(PRESETS["cpu"], device_memory=64 << 20)
    ranking = choose_plan(config, 4, 1, 8, 16, hardware, model_axis=2, remat="full")
    assert ranking.ranked and ranking.best.plan.shape["model"] == 2


def test_unsupported_configs_say_what_to_change():
    config = CONFIGS["gemma2"]()
    config.layer_types = ["sliding_attention", "chunked_attention"] * 2
    with pytest.raises(ValueError, match="layer_types 'chunked_attention' not supported"):
        rm.build(config)
    config = CONFIGS["gemma3"]()
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        rm.build(config)
