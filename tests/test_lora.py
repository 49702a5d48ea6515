"""LoRA adapters on redray.models: exact at start, only adapters train, merge back."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import GPT2Config, LlamaConfig

import redray
from redray.models import add_lora, build, merge_lora, save_pretrained
from redray.sharding import flatten
from tiny import token_data

LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
IDS = np.asarray([e["ids"] for e in token_data(4, seq=12)])


def collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def loss(model, batch, rng, train):
    logits = model(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


@pytest.mark.parametrize("config", [LLAMA, GPT2Config(vocab_size=64, n_embd=32, n_layer=2,
                                                      n_head=4, n_positions=16)])
def test_adapters_start_exact_and_sit_on_the_qkv_projection(config):
    model = build(config, rngs=nnx.Rngs(0))
    want = model(IDS)
    add_lora(model, rank=4)
    np.testing.assert_array_equal(model(IDS), want)  # B starts at zero
    paths, leaves, _ = flatten(nnx.state(model, nnx.Param))
    adapted = {p.rsplit("/", 1)[0] for p in paths if "lora_" in p}
    expected = {"qkv_proj"} if config.model_type == "llama" else {"c_attn"}  # fused Q/K/V
    assert {p.rsplit("/", 1)[1] for p in adapted} == expected
    # the layers stacked (the default): one adapter on the stacked kernel, one slice of
    # it per layer
    assert len(adapted) == len(expected)
    assert {x.shape[0] for p, x in zip(paths, leaves) if "lora_" in p} == {2}


def test_targets_matching_nothing_lists_the_linear_layers():
    with pytest.raises(ValueError, match=r"matches no linear layer.*self_attn/qkv_proj"):
        add_lora(build(LLAMA, rngs=nnx.Rngs(0)), targets="attention_out")


def test_only_adapters_train_and_merging_keeps_the_outputs(tmp_path):
    base = build(LLAMA, rngs=nnx.Rngs(0))
    frozen_before = {p: np.asarray(x) for p, x in zip(*flatten(nnx.state(base, nnx.Param))[:2])}
    model = add_lora(base, rank=4)
    trainer = redray.Trainer.of(model, collate, loss, optax.adam(1e-2), batch_size=8,
                             model_axis=2, trainable=r"lora_", progress=False, log_every=1,
                             checkpoint=str(tmp_path))
    data = token_data(64, seq=12)
    history = trainer.fit(data, epochs=2)
    assert history[-1]["loss"] < history[0]["loss"] - 0.1
    trained = trainer.model
    paths, leaves, _ = flatten(nnx.state(trained, nnx.Param))
    for path, leaf in zip(paths, leaves):
        if "lora_" not in path:  # base weights untouched
            np.testing.assert_array_equal(np.asarray(leaf),
                                          frozen_before[path.replace("/base", "")])
    # the checkpoint holds the adapters alone: qkv_proj's (A, B), stacked over 2 layers
    assert [x.shape[0] for x in jax.tree.leaves(trainer.state.params)] == [2, 2]
    adapted = np.asarray(trained(IDS))
    merged = merge_lora(trained)
    assert not any("lora_" in p for p in flatten(nnx.state(merged, nnx.Param))[0])
    np.testing.assert_allclose(np.asarray(merged(IDS)), adapted, rtol=1e-4, atol=1e-5)
    save_pretrained(merged, str(tmp_path / "hf"))  # a regular checkpoint again
    assert (tmp_path / "hf" / "config.json").exists()


def test_adapters_on_scanned_layers_train_and_merge(tmp_path):
    model = add_lora(build(LLAMA, scan=True, seed=0), rank=4)
    adapters = model.layers.self_attn.qkv_proj
    assert adapters.lora_a[...].shape == (2, 32, 4)  # one adapter per stacked layer
    trainer = redray.Trainer.of(model, collate, loss, optax.adam(3e-2), batch_size=4,
                             model_axis=2, trainable=r"lora_", progress=False)
    data = token_data(32, seq=12)
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=3)
    after = trainer.evaluate(data)["loss"]
    assert after < before
    tuned = trainer.model
    merged = merge_lora(tuned)
    assert not any("lora_" in p for p in flatten(nnx.state(merged, nnx.Param))[0])
    np.testing.assert_allclose(np.asarray(merged(IDS)), np.asarray(trainer.model(IDS)),
                               rtol=1e-4, atol=1e-5)
