"""The planner on DeepSeek-V3's shapes (issue 87, "real size on paper"): the preset, the
H800 preset, latent attention's key and value widths, a mixture of experts' grouped
matmuls counted as a GPU runs them (XLA:CPU's fallback runs every token through every
expert), the expert exchange of a pipeline stage's layers only, and the parts a
pipelined plan lists. Each in seconds; the 2,048-device plans themselves are
``benchmarks/planner_deepseek.py``'s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from transformers import MixtralConfig

from redray.models.moe import ExpertLayers
from redray.planning.from_config import ConfigFacts, plan_model, preset_fields
from redray.planning.hardware import GB, PRESETS, preset
from redray.planning.memory import part_lines
from redray.planning.planner import grid_plan, score
from redray.planning.work import grouped_matmuls, traced_work
from redray.sharding.pipeline_schedules import one_f_one_b_table

SEQ = 32
# 2 layers of 4 experts, 2 a token: hidden 64, each expert's inner width 128
MIXTRAL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def test_the_deepseek_v3_preset_is_the_released_model():
    """671 B parameters (transformers' own count), 37.6 B a token runs through (8 of 256
    routed experts and the shared one, in the 58 layers after 3 dense ones), and the
    keys and values a context axis moves: 128 heads of 192 (the values padded to the
    keys' width, as redray's latent attention runs them), not the config's head_dim
    (the rotary part's 64)."""
    fields = preset_fields("deepseek-v3")
    assert (fields["hidden_size"], fields["num_hidden_layers"], fields["n_routed_experts"],
            fields["rope_scaling"]["factor"]) == (7168, 61, 256, 40)
    result = plan_model("deepseek-v3", 8, fsdp_axis=8)
    assert (result["n_params"], result["active_params"]) == (671_026_404_352, 37_552_282_624)
    facts = ConfigFacts("deepseek-v3", 4096, "bfloat16")
    assert facts.experts == [ExpertLayers(58, 256, 8, 7168, 2048, None)]
    assert (facts.kv_width, facts.attention_layers) == (128 * 192, 61)


def test_the_h800_is_an_h100_with_deepseeks_links():
    h800, h100 = preset("h800"), PRESETS["h100"]
    assert (h800.peak_flops, h800.matmul_flops, h800.device_memory) == \
        (h100.peak_flops, h100.matmul_flops, h100.device_memory)
    assert (h800.intra.bandwidth, h800.inter.bandwidth, h800.devices_per_host) == \
        (160 * GB, 50 * GB, 8)
    assert "2412.19437" in h800.source and h800.grouped_matmuls
    assert not PRESETS["cpu"].grouped_matmuls


@pytest.mark.parametrize("experts", [4, 64])
def test_a_grouped_matmul_is_counted_as_each_row_through_its_own_group(experts):
    """Forward and backward: 3 matmuls of the rows against one group's kernel, whatever
    the groups; the copies XLA:CPU makes of the kernels (``relaid``) left out."""
    rows = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    kernels = jax.ShapeDtypeStruct((experts, 64, 2, 128), jnp.float32)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])

    def loss(rows, kernels, sizes):
        h = jax.lax.ragged_dot_general(rows, kernels, sizes, numbers)
        return (jax.nn.silu(h[:, 0]) * h[:, 1]).sum()

    real = jax.lax.ragged_dot, jax.lax.ragged_dot_general
    with grouped_matmuls():
        work = traced_work(jax.grad(loss, (0, 1)), rows, kernels, sizes,
                           relaid=frozenset({experts * 64 * 2 * 128}))
    assert work.matmul == 3 * 2 * 256 * 64 * 2 * 128
    # the activations' elementwise work: the (256, 2, 128) outputs and their gradients,
    # not the experts' kernels
    assert work.memory < 16 * 256 * 2 * 128 * 4
    assert (jax.lax.ragged_dot, jax.lax.ragged_dot_general) == real  # restored


def test_on_a_gpu_a_mixture_of_experts_layer_runs_its_tokens_through_their_experts_only():
    """A layer's matmul FLOPs per example: attention's projections, the router, and each
    token's 2 experts (XLA:CPU's fallback counted all 4: twice the experts' share)."""
    config = MixtralConfig(**MIXTRAL)
    facts = ConfigFacts(config, SEQ, scan=True, grouped_matmuls=True)
    hidden, inner, dim = 64, 128, 64 // 4
    per_token = (hidden * (4 + 2 * 2) * dim + 4 * dim * hidden + hidden * 4
                 + 2 * 3 * hidden * inner)
    assert facts.work().step.layer.matmul == 6 * SEQ * per_token
    head = 6 * SEQ * hidden * 128
    # XLA's cost analysis counts the elementwise work's FLOPs too
    assert facts.flops("none") < 1.2 * (2 * 6 * SEQ * per_token + head)


def test_with_stages_a_device_exchanges_its_chunks_tokens_only():
    """A stage runs 1 of the 2 expert layers: its exchange (dropless: the gather, its
    tokens gathered in the forward and the backward) at each of the schedule's passes,
    and the exchange it keeps is that layer's, in each of the chunk passes 1F1B keeps
    at once."""
    facts = ConfigFacts(MixtralConfig(**MIXTRAL), SEQ, scan=True, grouped_matmuls=True)
    h100 = PRESETS["h100"]
    sizes = dict(stage_axis=1, data_axis=1, fsdp_axis=1, expert_axis=2, context_axis=1,
                 model_axis=1)
    flat = score(facts, grid_plan(sizes, 1, "none", 4), 4, 1, h100, h100.device_memory)
    staged = score(facts, grid_plan({**sizes, "stage_axis": 2}, 1, "none", 4, "1f1b"), 4, 1,
                   h100, h100.device_memory)
    def gathers(cost):
        return [t for t in cost.traffic if "group's tokens gathered" in t.what]

    (exchange,) = gathers(staged.cost)
    assert exchange.times == 1 * 2 * one_f_one_b_table(2, 2).passes  # 2 micro-batches
    (whole,) = gathers(flat.cost)
    assert whole.times == 2 * 2 * 2  # both layers, 2 micro-batches, no recompute
    assert staged.memory["parts"]["expert_exchange"] == \
        flat.memory["parts"]["expert_exchange"] // 2 * one_f_one_b_table(2, 2).kept_slots


def test_a_1f1b_plans_parts_are_named():
    gib = 1 << 30
    plan = {"parts": {"parameters": gib, "pipeline_buffers": gib, "pipeline_gradients": gib},
            "total": 3 * gib}
    lines = part_lines(plan, {"stage": 2})
    assert any("1F1B gradients' carry" in line for line in lines)
