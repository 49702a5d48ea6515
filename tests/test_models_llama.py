"""LLaMA / Mistral / Qwen2 / Qwen3 against transformers PyTorch, loading, export, generation."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import redray
import redray.models as rm
from redray.models.generate import sample_token

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True,
                                                   attention_bias=True),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=6),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=False),
    # head_dim 24, not hidden / heads = 16: the explicit field is read
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=24),
}


def hf_model(name, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    with torch.no_grad():  # Qwen3's per-head norms start at one: a swapped pair would pass
        for key, value in model.named_parameters():
            if key.endswith(("q_norm.weight", "k_norm.weight")):
                value.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids), **kwargs).logits.numpy()


IDS = np.random.default_rng(0).integers(0, 128, (2, 12))
MASK = np.ones((2, 12), np.int64)
MASK[1, :4] = 0  # second prompt left-padded


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = hf_model(request.param, path)
    return request.param, hf, path, rm.from_pretrained(path)


def test_logits_match_transformers(pair):
    name, hf, _, model = pair
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), hf_logits(hf, IDS),
                               atol=1e-4, rtol=0)


def test_left_padded_logits_match_on_real_tokens(pair):
    name, hf, _, model = pair
    ours = np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)))
    ref = hf_logits(hf, IDS, MASK)
    real = MASK.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    name, hf, _, model = pair
    with torch.no_grad():
        ref = hf.generate(torch.tensor(IDS), attention_mask=torch.tensor(MASK), max_new_tokens=16,
                          do_sample=False).numpy()[:, IDS.shape[1]:]
    ours = np.asarray(nnx.jit(lambda m, i, a: rm.generate(m, i, a, max_new_tokens=16))(
        model, jnp.asarray(IDS), jnp.asarray(MASK)))
    assert ours.shape == (2, 16)
    np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
    pad = hf.generation_config.pad_token_id or hf.config.eos_token_id
    assert np.all(ours[:, ref.shape[1]:] == pad)


def test_a_prefill_attends_over_its_prompt_not_the_whole_cache():
    # generate's cache holds the prompt and every new token; a prefill from slot 0 sees
    # none of the later slots, and computes as much however many there are
    model = rm.build(CONFIGS["llama"](), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = IDS.shape[1]

    def flops(slots):
        def prefill(state):
            m = nnx.merge(graphdef, state)
            mask = jnp.pad(jnp.asarray(MASK), ((0, 0), (0, slots - tokens)))
            return m(jnp.asarray(IDS), mask, cache=m.init_cache(2, slots), cache_index=0)[0]
        analysis = jax.jit(prefill).lower(state).compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    assert flops(tokens + 500) == pytest.approx(flops(tokens), rel=0.01)


def test_export_round_trip(pair, tmp_path):
    name, hf, _, model = pair
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=rm.gpt2_tokenizer())
    rm.save_pretrained(model, str(tmp_path), tokenizer=tokenizer)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(hf, IDS), atol=1e-5, rtol=0)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == [type(hf).__name__]
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded("def f")["input_ids"] == [4299, 277]  # GPT-2's BPE
    # a folder's tokenizer files are copied as they are
    copy = tmp_path / "copy"
    rm.save_pretrained(model, str(copy), tokenizer=str(tmp_path))
    assert (copy / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    with pytest.raises(FileNotFoundError, match="no tokenizer files in"):
        rm.save_pretrained(model, str(tmp_path / "x"), tokenizer=str(tmp_path / "copy" / "none"))


def test_sharded_load_matches_one_device(pair):
    name, _, path, _ = pair
    one = rm.from_pretrained(path, mesh=redray.make_mesh(devices=jax.devices()[:1]))
    two = rm.from_pretrained(path, model_axis=2)
    layer = two.layers  # stacked: the layer axis first, whole
    # whole key/value groups (the kv axis) and the intermediate axis, never the part axes
    assert layer.self_attn.qkv_proj.kernel[...].sharding.spec == P(None, None, "model")
    assert layer.mlp.gate_up_proj.kernel[...].sharding.spec == P(None, None, None, "model")
    assert layer.mlp.down_proj.kernel[...].sharding.spec == P(None, "model")
    np.testing.assert_allclose(np.asarray(two(jnp.asarray(IDS))), np.asarray(one(jnp.asarray(IDS))),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("window_layers", [0, 1])
def test_qwen3_windows_the_layers_its_config_names(window_layers, tmp_path):
    window = dict(SMALL, head_dim=24, use_sliding_window=True, sliding_window=6)
    # max_window_layers 0: every layer windowed (one window for the model); 1: the
    # second only (each layer its own window, a scanned input), with biases on q/k/v/o
    # ahead of the q/k norms
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        **window, max_window_layers=window_layers, attention_bias=True)).eval()
    hf.save_pretrained(str(tmp_path))
    model = rm.from_pretrained(str(tmp_path))
    if window_layers:
        assert model.window is None and [k.window for k in model.layer_attention] == [None, 6]
    else:
        assert model.window == 6 and model.layer_attention is None
    assert IDS.shape[1] > 6
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), hf_logits(hf, IDS),
                               atol=1e-4, rtol=0)
    ours = np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)))
    real = MASK.astype(bool)
    np.testing.assert_allclose(ours[real], hf_logits(hf, IDS, MASK)[real], atol=1e-4, rtol=0)


def test_sharded_index_loading(tmp_path):
    hf = hf_model("llama", str(tmp_path / "src"))
    model = rm.from_pretrained(str(tmp_path / "src"))
    rm.save_pretrained(model, str(tmp_path / "split"), max_shard_bytes=200_000)
    files = sorted(os.listdir(tmp_path / "split"))
    shards = [f for f in files if f.startswith("model-0")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files
    back = rm.from_pretrained(str(tmp_path / "split"), model_axis=2)
    np.testing.assert_allclose(np.asarray(back(jnp.asarray(IDS))), hf_logits(hf, IDS), atol=1e-4,
                               rtol=0)
    # transformers reads the same sharded folder
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "split")).eval()
    np.testing.assert_allclose(hf_logits(again, IDS), hf_logits(hf, IDS), atol=1e-5, rtol=0)


def test_bad_checkpoint_lists_every_problem_at_once(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_model("llama", str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)
    weights["model.extra_head.weight"] = np.zeros((3,), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        rm.from_pretrained(str(tmp_path))
    msg = str(err.value)
    assert "missing from the checkpoint (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: checkpoint (5, 64)" in msg
    assert "unexpected in the checkpoint (1): model.extra_head.weight" in msg


def test_missing_folder_and_unsupported_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        rm.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported: .*llama"):
        rm.from_pretrained(str(tmp_path))


def remat_gradient(config, remat, ids=IDS):
    """jax.grad of a loss of the model built with ``remat``, jitted, and its params."""
    model = rm.build(config, remat=remat, seed=3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
        return m(jnp.asarray(ids), train=True).astype(jnp.float32).std()

    return jax.jit(jax.grad(loss)), params


@pytest.mark.parametrize("policy", [True, "full", "dots", "offload"])
def test_remat_gives_the_same_gradients(policy):
    config = CONFIGS["llama"]()
    plain, params = remat_gradient(config, False)
    remat, _ = remat_gradient(config, policy)
    def rematerialized(step):
        program = str(jax.make_jaxpr(step)(params))
        return "checkpoint" in program or "remat" in program

    assert not rematerialized(plain) and rematerialized(remat)
    for a, b in zip(jax.tree.leaves(plain(params)), jax.tree.leaves(remat(params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_compiled_step_recomputes_what_the_policy_says():
    # A block's forward holds 6 matmuls (QKV, scores, scores x values, output projection,
    # gate/up, down); the backward pass needs the inputs of all but the last, so "full"
    # recomputes 5 per layer, "dots" only the 2 batched ones of attention (it keeps the
    # projections' outputs), and both hold less memory than keeping everything.
    layers = 4
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      vocab_size=100, max_position_embeddings=64)
    ids = np.random.default_rng(0).integers(0, 100, (4, 64))
    dots, temp = {}, {}
    for policy in ("none", "full", "dots"):
        step, params = remat_gradient(config, policy, ids)
        compiled = step.lower(params).compile()
        dots[policy] = compiled.as_text().count(" dot(")
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    # the layers are scanned (the default): the text holds the loop body, one layer, once
    assert dots["full"] - dots["none"] == 5, dots
    assert dots["dots"] - dots["none"] == 2, dots
    assert temp["full"] < temp["none"] and temp["dots"] < temp["none"], temp
    with pytest.raises(ValueError, match="remat='some': use one of 'none', 'full', 'dots'"):
        rm.build(config, remat="some")


# ------------------------------------------------------------------ sampling
def test_top_k_only_samples_the_k_most_likely():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 50)), jnp.float32)
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for i in range(30):
        tok = np.asarray(sample_token(logits, jax.random.key(i), temperature=1.0, top_k=3))
        assert all(tok[r] in top3[r] for r in range(4))


def test_top_p_keeps_the_nucleus():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)
    logits = jnp.log(jnp.asarray(probs))
    seen = {int(sample_token(logits, jax.random.key(i), temperature=1.0, top_p=0.7)[0])
            for i in range(200)}
    assert seen == {0, 1}  # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it
    seen = {int(sample_token(logits, jax.random.key(i), temperature=1.0, top_p=1.0)[0])
            for i in range(400)}
    assert seen == {0, 1, 2, 3}


def test_sampling_is_reproducible_and_greedy_at_zero_temperature():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 20)), jnp.float32)
    a = sample_token(logits, jax.random.key(5), temperature=0.8)
    b = sample_token(logits, jax.random.key(5), temperature=0.8)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sample_token(logits, None), np.argmax(logits, -1))


def test_sampled_generation_stops_at_eos(tmp_path):
    hf_model("llama", str(tmp_path))
    model = rm.from_pretrained(str(tmp_path))
    out = np.asarray(rm.generate(model, IDS, MASK, max_new_tokens=24, rng=jax.random.key(0),
                                 temperature=1.5, eos_token_id=[5, 7, 9], pad_token_id=0))
    for row in out:
        hits = np.flatnonzero(np.isin(row, [5, 7, 9]))
        if hits.size:
            assert np.all(row[hits[0] + 1:] == 0)


# ------------------------------------------------------------------ with the engine
def test_generation_in_predict_on_a_sharded_predictor(tmp_path):
    hf = hf_model("llama", str(tmp_path))
    loaded = rm.from_pretrained(str(tmp_path), model_axis=2)

    def collate(examples):
        return {"ids": np.stack([e["ids"] for e in examples]),
                "mask": np.stack([e["mask"] for e in examples])}

    def predict(model, batch, rng):
        return rm.generate(model, batch["ids"], batch["mask"], max_new_tokens=8)

    examples = [{"ids": IDS[i % 2], "mask": MASK[i % 2]} for i in range(5)]
    predictor = redray.Predictor(loaded, collate, predict, batch_size=4, model_axis=2)
    outputs = predictor.predict(examples)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(IDS), attention_mask=torch.tensor(MASK), max_new_tokens=8,
                          do_sample=False).numpy()[:, IDS.shape[1]:]
    assert len(outputs) == 5
    for i, out in enumerate(outputs):
        np.testing.assert_array_equal(out[:ref.shape[1]], ref[i % 2])


def test_fine_tuning_a_loaded_model_with_the_trainer(tmp_path):
    hf_model("llama-tied", str(tmp_path))
    model = rm.from_pretrained(str(tmp_path), model_axis=2)
    rs = np.random.default_rng(0)
    data = [{"ids": ((rs.integers(0, 128) + np.arange(16)) % 128).astype(np.int32)}
            for _ in range(64)]

    def loss(m, batch, rng, train):
        logits = m(batch["ids"][:, :-1], train=train)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    trainer = redray.Trainer.of(model, lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                             optax.adam(3e-3), batch_size=8, model_axis=2, progress=False,
                             compute_dtype=jnp.float32)
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=2)
    assert trainer.evaluate(data)["loss"] < 0.5 * before
    # the attention kernel the step computes with, said once and kept (MLflow's tag)
    assert trainer.describe()["attention"] == "xla (no fused kernel on cpu)"


# ------------------------------------------------------------------ scanned layers
@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def scanned_pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"scanned-{request.param}"))
    return hf_model(request.param, path), path, rm.from_pretrained(path, scan=True)


def test_scanned_layers_match_transformers_and_generate_the_same(scanned_pair):
    hf, _, model = scanned_pair
    kernel = model.layers.self_attn.qkv_proj.kernel[...]
    assert kernel.shape[0] == SMALL["num_hidden_layers"]  # one stacked block
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), hf_logits(hf, IDS),
                               atol=1e-4, rtol=0)
    ours = np.asarray(model(jnp.asarray(IDS), jnp.asarray(MASK)))
    real = MASK.astype(bool)
    np.testing.assert_allclose(ours[real], hf_logits(hf, IDS, MASK)[real], atol=1e-4, rtol=0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(IDS), attention_mask=torch.tensor(MASK), max_new_tokens=8,
                          do_sample=False).numpy()[:, IDS.shape[1]:]
    out = np.asarray(rm.generate(model, jnp.asarray(IDS), jnp.asarray(MASK), max_new_tokens=8))
    np.testing.assert_array_equal(out[:, :ref.shape[1]], ref)


def test_scanned_layers_export_and_shard_without_splitting_the_layer_axis(scanned_pair,
                                                                           tmp_path):
    hf, path, _ = scanned_pair
    model = rm.from_pretrained(path, scan=True, model_axis=2, fsdp_axis=2)
    block = model.layers
    # the layer axis (0) stays whole: tensor parallel and FSDP split the others
    assert block.self_attn.qkv_proj.kernel[...].sharding.spec == P(None, "fsdp", "model")
    assert block.mlp.down_proj.kernel[...].sharding.spec == P(None, "model", "fsdp")
    assert block.input_layernorm.scale[...].sharding.spec == P()
    rm.save_pretrained(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(hf_logits(back, IDS), hf_logits(hf, IDS), atol=1e-5, rtol=0)


def test_a_scanned_step_compiles_one_block_whatever_the_depth():
    lines = {}
    for layers in (2, 8):
        config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": layers})
        model = rm.build(config, scan=True, remat="full")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
            return m(jnp.asarray(IDS), train=True).astype(jnp.float32).std()

        lines[layers] = len(jax.jit(jax.grad(loss)).lower(params).as_text().splitlines())
    assert lines[8] == lines[2], lines
