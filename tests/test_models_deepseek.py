"""DeepSeek-V3 (``redray/models/deepseek.py``) beside transformers PyTorch, in the parts
the family matrix (``test_families``' NEW: the registry's tiny DeepSeek-V3 with a query
rank, YaRN and interleaved rotary dims) does not reach: a plain query projection
(``q_lora_rank`` null) with rotary dims in halves, the latent KV cache, LoRA through the
absorbed decode, multi-token prediction layers and Kimi-K2's ``model_type``."""


import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_tiny import (
    IDS,
    MASK,
    assert_export_round_trip,
    assert_greedy_generation_matches,
    assert_logits_match,
    hf_model,
)

import redray.models as rm
from redray.models.families import FAMILIES

TINY = FAMILIES["deepseek_v3"].tiny


@pytest.fixture(scope="module")
def plain_query(tmp_path_factory):
    """No query rank, rotary dims in halves, biases on the latent path and the output, a
    smaller rope scaling and no mscale_all_dim: the other branches of the attention."""
    folder = str(tmp_path_factory.mktemp("deepseek_plain"))
    hf = hf_model("deepseek_v3", folder, q_lora_rank=None, rope_interleave=False,
                  attention_bias=True, rope_parameters={
                      "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                      "original_max_position_embeddings": 32, "mscale": 0.8})
    return hf, folder, rm.from_pretrained(folder)


def test_a_plain_query_projection_matches_transformers(plain_query, tmp_path):
    hf, _, model = plain_query
    assert hasattr(model.layers.self_attn, "q_proj") and model.layers.self_attn.rope == 4
    assert not hasattr(model.layers.self_attn, "q_a_proj")
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 8)
    assert_export_round_trip(model, hf, tmp_path)


def test_decoding_caches_the_latent_and_equals_the_expanded_attention():
    """The cache holds one key/value head of kv_lora_rank + qk_rope_head_dim per token;
    a prefill and each decoding step through it (the absorbed form) give the logits of
    the whole sequence at once (the expanded form), left padding included."""
    config = transformers.AutoConfig.for_model("deepseek_v3", **TINY)
    model = rm.build(config, seed=1)
    cache = model.init_cache(2, 16)
    assert len(cache) == 3 and cache[0]["k"].shape == (2, 1, 16, 12)  # latent 8 + rotary 4
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    whole = np.asarray(nnx.jit(lambda m, i, a: m(i, a))(model, ids, mask))
    full_mask = jnp.concatenate([mask, jnp.zeros((2, 4), mask.dtype)], 1)
    prefill = nnx.jit(lambda m, i, a, c: m(i, a, cache=c, cache_index=0))
    prefix, (first, cache) = 8, prefill(model, ids[:, :8], full_mask.at[:, 8:].set(0), cache)
    steps = [np.asarray(first)]
    step = nnx.jit(lambda m, i, a, c, t: m(i, a, cache=c, cache_index=t))
    for t in range(prefix, 12):
        full_mask = full_mask.at[:, t].set(1)
        logits, cache = step(model, ids[:, t:t + 1], full_mask, cache, jnp.int32(t))
        steps.append(np.asarray(logits))
    stepped = np.concatenate(steps, 1)
    real = MASK.astype(bool)
    np.testing.assert_allclose(stepped[real], whole[real], atol=2e-5, rtol=0)


def test_lora_adapters_reach_the_absorbed_decode():
    """With LoRA on the query and key/value up-projections (the default targets find
    them), decoding through the latent cache folds the adapters' update into the
    absorbed projections: its greedy tokens equal those of the merged model."""
    config = transformers.AutoConfig.for_model("deepseek_v3", **TINY)
    model = rm.add_lora(rm.build(config, seed=2), rank=2)
    adapted = [path for path, _ in nnx.iter_modules(model)
               if type(_).__name__ == "LoRA"]
    assert {p[-1] for p in adapted} == {"q_b_proj", "kv_b_proj"}
    for path, module in nnx.iter_modules(model):  # a nonzero update (B starts at zero)
        if type(module).__name__ == "LoRA":
            module.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(len(path)),
                                                        module.lora_b[...].shape)
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    ours = np.asarray(rm.generate(model, ids, mask, max_new_tokens=6, eos_token_id=-1))
    merged = rm.merge_lora(model)
    assert np.array_equal(ours, np.asarray(rm.generate(merged, ids, mask, max_new_tokens=6,
                                                       eos_token_id=-1)))
    base = rm.build(config, seed=2)  # the adapters change the tokens
    assert not np.array_equal(ours, np.asarray(rm.generate(base, ids, mask, max_new_tokens=6,
                                                           eos_token_id=-1)))


def test_a_kimi_k2_folder_with_a_prediction_layer_loads_as_deepseek_v3(tmp_path, capfd):
    """Kimi-K2's folder (``model_type: kimi_k2``, remote code named in ``auto_map``) with
    a multi-token prediction layer's tensors after the model's layers, as the releases
    store them: it loads as DeepSeek-V3 without running remote code, the prediction
    layer left out with a console line; the export is a DeepSeek-V3 folder without it,
    which transformers reads back."""
    import shutil

    from safetensors.numpy import load_file, save_file

    hf = hf_model("deepseek_v3", str(tmp_path / "hf"))
    folder = tmp_path / "kimi"
    shutil.copytree(tmp_path / "hf", folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(model_type="kimi_k2", num_nextn_predict_layers=1, auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    tensors = load_file(str(folder / "model.safetensors"))
    extra = {name.replace("model.layers.2.", "model.layers.3."): value
             for name, value in tensors.items() if name.startswith("model.layers.2.")}
    extra.update({"model.layers.3.eh_proj.weight": np.zeros((32, 64), np.float32),
                  "model.layers.3.enorm.weight": np.ones(32, np.float32),
                  "model.layers.3.hnorm.weight": np.ones(32, np.float32)})
    save_file({**tensors, **extra}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model = rm.from_pretrained(str(folder))
    said = capfd.readouterr().err
    assert (f"leaving out {len(extra)} tensors of its multi-token prediction layers "
            "(num_nextn_predict_layers: redray trains and decodes the next token only) "
            "(model.layers.3)") in said, said
    assert model.config.model_type == "deepseek_v3"
    assert_logits_match(model, hf)
    assert_export_round_trip(model, hf, tmp_path / "out")
    with open(tmp_path / "out" / "config.json") as f:
        written = json.load(f)
    assert written["model_type"] == "deepseek_v3" and written["num_nextn_predict_layers"] == 0


# ------------------------------------------------------------------ balancing
def _balanced_run(steps, axes, devices, checkpoint=None, data=None, max_steps=None):
    """The routers' correction biases and the logged rows of a tiny DeepSeek-V3 trained
    ``steps`` steps of 8 rows from the same built model on ``axes``."""
    import optax
    from tiny import lm_collate, lm_loss, token_data

    import redray
    from redray import Parallelism

    rows = []

    class Rows(redray.Hook):
        def on_log(self, run, row):
            rows.append(row)

    config = transformers.AutoConfig.for_model("deepseek_v3", **TINY)
    trainer = redray.Trainer.of(
        rm.build(config, seed=0), lm_collate, lm_loss, optax.adam(1e-2), batch_size=8,
        progress=False, hooks=[Rows()], log_every=1, checkpoint=checkpoint,
        plan=Parallelism.of(**axes).build(jax.devices()[:devices]))
    trainer.fit(data or token_data(8 * steps, seq=12), epochs=1, max_steps=max_steps)
    mlp = trainer.state.extra["layers"]["mlp"]
    return mlp["score_bias"].get_value(), mlp["expert_load"].get_value(), rows


def test_the_bias_moves_toward_the_underloaded_experts_from_the_whole_batch(tmp_path):
    """Auxiliary-loss-free balancing (on by default for DeepSeek-V3): after one step each
    MoE layer's bias moved by 0.001 x sign(mean load - load) of the batch's assignments
    (those of the model before the step, counted with ``aux=True``), the loads then
    reset; two data replicas (each half the rows) and an expert x data plan move it
    exactly as one device; the per-layer coefficients of variation are logged."""
    from tiny import token_data

    config = transformers.AutoConfig.for_model("deepseek_v3", **TINY)
    batch = np.stack([e["ids"] for e in token_data(8, seq=12)])
    _, aux = rm.build(config, seed=0)(jnp.asarray(batch[:, :-1]), aux=True)
    counts = np.asarray(aux["expert_tokens"])  # (the 2 MoE layers, 8 experts)
    expected = 0.001 * np.sign(counts.mean(-1, keepdims=True) - counts)
    bias, load, rows = _balanced_run(1, dict(data_axis=1), 1)
    np.testing.assert_allclose(np.asarray(bias), expected, atol=1e-9)
    assert np.abs(expected).sum() > 0 and not np.asarray(load).any()
    cv = counts.std(-1) / counts.mean(-1)
    np.testing.assert_allclose([rows[-1][f"expert_load_cv/layers/mlp/{i}"] for i in (0, 1)],
                               cv, rtol=1e-5)
    for axes, devices in ((dict(data_axis=2), 2), (dict(expert_axis=2, data_axis=2), 4)):
        bias = _balanced_run(1, axes, devices)[0]  # every device's copy
        for shard in bias.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), expected, atol=1e-9)


def test_the_bias_and_its_counts_resume_exactly(tmp_path):
    """A run stopped after its checkpoint of step 2 and resumed ends with the biases of
    the same 4 steps run straight through (the biases are run state: checkpointed)."""
    import redray
    from tiny import token_data

    data = token_data(32, seq=12)
    straight = np.asarray(_balanced_run(4, dict(data_axis=1), 1, data=data)[0])
    folder = str(tmp_path / "checkpoints")
    _balanced_run(4, dict(data_axis=1), 1, data=data, max_steps=2,
                  checkpoint=redray.CheckpointConfig(folder, save_every=2))
    resumed, _, rows = _balanced_run(4, dict(data_axis=1), 1, data=data,
                                     checkpoint=redray.CheckpointConfig(folder, save_every=2))
    assert [row["step"] for row in rows] == [3, 4]  # resumed at step 2
    assert not np.array_equal(straight, 0) and np.array_equal(np.asarray(resumed), straight)


EIGHT_DEVICES = """
import json, sys
sys.path.insert(0, "tests")
import numpy as np, transformers
from redray.models.families import FAMILIES
from test_families import loss_and_grads
config = transformers.AutoConfig.for_model("deepseek_v3", **FAMILIES["deepseek_v3"].tiny)
value, grads = loss_and_grads(config)
split, split_grads = loss_and_grads(config, expert_axis=4, model_axis=2)
print(json.dumps([abs(split - value) / abs(value),
                  max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                      for a, b in zip(split_grads, grads))]))
"""


def test_expert_4_by_model_2_takes_the_one_device_step():
    """On 8 devices (a process of its own), the 8 experts over expert 4 (the gather
    exchange) and each expert's width and the heads over model 2: one step's loss and
    every gradient as on one device."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # 8 devices, the session's other XLA flags kept; no persistent compilation cache:
    # its programs are of no other process's use, and a cache entry another process
    # reads while this one writes it is what a crashed test worker was found reading
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
        flags + ["--xla_force_host_platform_device_count=8"]))
    done = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loss_gap, grad_gap = json.loads(done.stdout.strip().splitlines()[-1])
    assert loss_gap <= 1e-5 and grad_gap <= 1e-5, (loss_gap, grad_gap)
