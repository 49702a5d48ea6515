"""The family registry, and the 2026 families against transformers' PyTorch models.

Each new family's tiny checkpoint (the registry's ``tiny`` configuration: windows and
chunks shorter than the sequence, sinks, NoPE layers, YaRN, dense and MoE layers in
turn) is written by transformers' own ``save_pretrained``; redray's model must give its
logits on left-padded rows, its greedy tokens, an export transformers reads back with
the same logits, the same logits stacked or listed, and one step's loss and gradients
on every plan equal to one device's. Their gradients against torch's are in
tests/test_gradients.py (every registry family).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hf_tiny import (IDS, MASK, assert_export_round_trip, assert_greedy_generation_matches,
                     hf_model, mxfp4_gpt_oss,
                     assert_language_model_loads, assert_logits_match, hf_logits)

import redray.models as rm
from redray.engine.runtime import ModelRuntime
from redray.models import mxfp4
from redray.models.families import FAMILIES, lookup, supported
from redray.sharding import Parallelism
from redray.sharding.plan import Plan

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW = ("gpt_oss", "llama4_text", "olmo3", "smollm3", "glm4_moe", "deepseek_v3")


# ------------------------------------------------------------------ the registry
def test_every_record_is_data_and_names_code_that_exists():
    for name, family in FAMILIES.items():
        assert family.model_type == name
        assert json.loads(json.dumps(family.to_dict()))["module"] == family.module
        for part in ("Model", "weight_table", "trace_inputs"):
            assert hasattr(family.code, part), (name, part)
        config = transformers.AutoConfig.for_model(name, **family.tiny)
        assert config.model_type == name
        assert type(config).__name__ != "PretrainedConfig"
    assert set(supported()) >= set(FAMILIES)
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported: .*"
                                         "gpt_oss.*llama4_text.*olmo3.*smollm3"):
        lookup("bert")


def test_the_docs_family_table_is_the_registry():
    """docs/models.md's table of families: one row per record, in the registry's order,
    naming its model_type, module and export class."""
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        text = f.read()
    rows = [line for line in text.splitlines() if line.startswith("| `")][1:]  # the header
    assert [r.split("`")[1] for r in rows] == list(FAMILIES)
    for row, family in zip(rows, FAMILIES.values()):
        assert f"`redray.models.{family.module}`" in row and family.architecture in row, row


# ------------------------------------------------------------------ parity
@pytest.fixture(scope="module", params=NEW)
def pair(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = hf_model(request.param, folder)
    return request.param, hf, folder, rm.from_pretrained(folder)


def test_logits_and_greedy_generation_match_transformers(pair):
    _, hf, _, model = pair
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 8)


def test_the_export_reads_back_in_transformers(pair, tmp_path):
    _, hf, _, model = pair
    assert_export_round_trip(model, hf, tmp_path)


def test_stacked_layers_equal_the_list(pair):
    name, hf, folder, model = pair
    listed = rm.from_pretrained(folder, scan=False)
    assert isinstance(listed.layers, nnx.List) and not isinstance(model.layers, nnx.List)
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    np.testing.assert_allclose(np.asarray(model(ids, mask)), np.asarray(listed(ids, mask)),
                               atol=1e-5, rtol=0)


def test_llama4_interleaves_dense_and_expert_layers_in_one_stacked_period(pair):
    name, _, _, model = pair
    if name != "llama4_text":
        pytest.skip("Llama 4's pattern")
    pattern = model.pattern(model.config)
    assert (pattern.first, pattern.period, pattern.repeats) == (0, 2, 2)
    assert model.layers.period[1].feed_forward.gate_up_proj[...].shape == (2, 4, 32, 2, 64)
    assert [k.chunk for k in model.layer_attention] == [4, 4, None, 4]
    assert [k.rope for k in model.layer_attention] == [0, 0, None, 0]


def test_the_multimodal_llama4_checkpoint_loads_its_language_model(tmp_path, capfd):
    assert_language_model_loads("llama4", FAMILIES["llama4"].tiny, tmp_path, capfd,
                                "leaving out 26 tensors (multi_modal_projector, vision_model)",
                                "llama4_text", "Llama4ForCausalLM")


# ------------------------------------------------------------------ plans
ROWS, SEQ = 8, 17
PLAN_IDS = np.random.default_rng(2).integers(1, 128, (ROWS, SEQ)).astype(np.int32)


def lm_loss(model, ids):
    logits = model(ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def loss_and_grads(config, micro_rows=None, **axes):
    """One step's loss and gradients of ``config``'s model on ``axes`` (4 devices at
    most), from the same initial parameters."""
    n = int(np.prod(list(axes.values()))) if axes else 1
    plan = Parallelism.of(**({"data_axis": 1} | axes)).build(jax.devices()[:n])
    runtime = ModelRuntime(lambda rngs: rm.build(config, rngs=rngs, scan=True), plan)
    runtime.derive(lm_loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    runtime.use(Plan(plan, micro_rows=micro_rows))
    params, extra = runtime.init()
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids: runtime.apply(lm_loss, p, e, jax.random.key(0), ids)[0]))
    value, grads = step(params, extra, PLAN_IDS)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]


# the data axis inside the context and expert plans (2 x 2 devices each)
PLANS = {"fsdp_model": dict(fsdp_axis=2, model_axis=2), "stage": dict(stage_axis=2),
         "context": dict(context_axis=2, data_axis=2),
         "expert": dict(expert_axis=2, data_axis=2)}


# DeepSeek-V3's further plan: the data axis alone (expert 4 x model 2, on 8 devices, is
# test_models_deepseek's)
MORE_PLANS = {"deepseek_v3": {"data": dict(data_axis=4)}}


@pytest.mark.parametrize("name", NEW)
def test_every_plan_takes_the_one_device_step(name):
    config = transformers.AutoConfig.for_model(name, **FAMILIES[name].tiny)
    expected, expected_grads = loss_and_grads(config)
    experts = getattr(config, "num_local_experts", 0)
    for plan, axes in {**PLANS, **MORE_PLANS.get(name, {})}.items():
        if plan == "expert" and not experts:
            continue
        micro = ROWS // 2 if plan == "stage" else None
        value, grads = loss_and_grads(config, micro, **axes)
        assert abs(value - expected) <= 1e-5 * abs(expected), (name, plan)
        for got, want in zip(grads, expected_grads):
            assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), (name, plan)


# ------------------------------------------------------------------ gpt-oss's pieces
def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                        dtype=torch.float32).numpy()
    ours = mxfp4.dequantize(blocks, scales)
    assert ours.shape == (3, 64, 8)
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(3, 8, 2, 16\) and scales \(3, 8\)"):
        mxfp4.dequantize(blocks, scales[..., 0])


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_and_exports_in_bfloat16(tmp_path, capfd):
    """The released checkpoints' layout: every expert tensor as blocks and scales, the
    config's quantization_config; the model whose experts are those values dequantized
    gives transformers' logits, and the export (bfloat16, no quantization_config) reads
    back in transformers."""
    from safetensors.numpy import load_file

    folder = tmp_path / "mxfp4"
    hf = mxfp4_gpt_oss(str(folder))
    model = rm.from_pretrained(str(folder))
    assert "4 tensors stored in MXFP4, dequantized" in capfd.readouterr().err
    assert_logits_match(model, hf)
    rm.save_pretrained(model, str(tmp_path / "out"))
    with open(tmp_path / "out" / "config.json") as f:
        written = json.load(f)
    assert "quantization_config" not in written and written["dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {str(v.dtype) for v in saved.values()} == {"bfloat16"}
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32).eval()
    ours = hf_logits(back, IDS)
    scale = np.abs(hf_logits(hf, IDS)).max()
    np.testing.assert_allclose(ours, hf_logits(hf, IDS), atol=2e-2 * scale, rtol=0)


def test_the_clamped_swiglu_is_gpt_oss_own():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.AutoConfig.for_model("gpt_oss", **FAMILIES["gpt_oss"].tiny)
    theirs = GptOssExperts(config)
    ours = rm.build(config).layers.mlp
    h = np.random.default_rng(0).normal(0, 6, (5, 2, 8)).astype(np.float32)  # past the limit
    interleaved = torch.tensor(h.swapaxes(-1, -2).reshape(5, 16))
    np.testing.assert_allclose(np.asarray(ours.gated(jnp.asarray(h))),
                               theirs._apply_gate(interleaved).numpy(), rtol=1e-6, atol=1e-6)


def test_first_layers_run_before_the_pipeline_and_the_rest_splits_by_stage():
    """Qwen3-MoE with a dense first layer (``mlp_only_layers``): the first layer apart,
    the two expert layers stacked and split over 2 stages; the step equals one
    device's."""
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", **{**FAMILIES["qwen3_moe"].tiny, "num_hidden_layers": 3,
                        "mlp_only_layers": [0]})
    expected, expected_grads = loss_and_grads(config)
    value, grads = loss_and_grads(config, ROWS // 2, stage_axis=2)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    for got, want in zip(grads, expected_grads):
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text", "deepseek_v3"])
def test_the_sampler_completes_as_generate_does(name):
    """The continuous-batching sampler's greedy completions through pages (sinks,
    windows, chunks and NoPE layers in the paged decode) equal ``generate``'s. Llama 4's
    temperature scale at its released floor (8192 tokens): it counts slots, which a
    paged row does from its first token, ``generate``'s left-padded rows from their
    padding."""
    from redray.post_training import Sampler, SamplingParams

    config = transformers.AutoConfig.for_model(name, **{**FAMILIES[name].tiny,
                                                        "floor_scale": 8192})
    model = rm.build(config, seed=3)
    rs = np.random.default_rng(0)
    prompts = [rs.integers(1, 128, rs.integers(3, 13)).tolist() for _ in range(6)]
    width = max(map(len, prompts))
    ids, mask = np.zeros((6, width), np.int32), np.zeros((6, width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    ref = np.asarray(rm.generate(model, ids, mask, max_new_tokens=10, eos_token_id=-1))
    sampler = Sampler(model, slots=4, max_length=32, eos_token_id=-1, kv_cache="paged",
                      kv_pages=12, page_size=8)
    done = sampler.sample(prompts, SamplingParams(max_new_tokens=10))
    assert [list(c.tokens) for c in done] == ref.tolist()


@pytest.mark.parametrize("fields", [
    dict(model_type="gpt_oss"),  # its default: factor 32, truncate False
    dict(model_type="llama", rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4,
                                                  original_max_position_embeddings=512)),
    dict(model_type="qwen3", max_position_embeddings=65536, rope_parameters=dict(
        rope_type="yarn", factor=None, rope_theta=1e6, original_max_position_embeddings=4096,
        mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2)),
    dict(model_type="llama", rope_parameters=dict(rope_type="yarn", factor=8.0, rope_theta=1e4,
                                                  original_max_position_embeddings=512,
                                                  attention_factor=1.5))],
    ids=["gpt_oss", "plain", "ratio_mscale", "attention_factor"])
def test_yarn_is_transformers_own(fields):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from redray.models import layers

    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    np.testing.assert_allclose(
        layers.rope_inv_freq(rope, dim, max_positions=config.max_position_embeddings),
        inv.numpy(), rtol=1e-6, atol=0)
    assert layers.rope_scale(rope, config.max_position_embeddings) == pytest.approx(scale,
                                                                                   rel=1e-12)


def test_a_sharded_export_with_its_tokenizer_and_chat_template(tmp_path):
    """``save_pretrained`` of a 2026 family: sharded files and their index, the tokenizer's
    files and its chat template copied; transformers reads it all back."""
    from hf_tiny import gpt2_tokenizer

    hf = hf_model("smollm3", str(tmp_path / "hf"))
    tokenizer = gpt2_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" \
                              "{% endfor %}"
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    model = rm.from_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "out"
    rm.save_pretrained(model, str(out), max_shard_bytes=20_000, tokenizer=str(tmp_path / "tok"))
    with open(out / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1 and all((out / name).exists() for name in shards)
    assert (out / "chat_template.jinja").exists()
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|user|>hi"
    np.testing.assert_allclose(
        hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval(), IDS),
        hf_logits(hf, IDS), atol=1e-5, rtol=0)
