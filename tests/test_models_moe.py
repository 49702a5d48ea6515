"""Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5 against transformers PyTorch; the mixture-of-experts
layer and its routers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from hf_tiny import (IDS, MASK, assert_export_round_trip, assert_greedy_generation_matches,
                     assert_logits_match, loaded_pair)

import redray
import redray.models as rm
from redray.models import moe

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, initializer_range=0.2)
CONFIGS = {
    "mixtral": lambda **kw: transformers.MixtralConfig(
        **SMALL, intermediate_size=32, num_local_experts=4, **kw),
    # the shared expert (48) wider than the routed ones (32): a swapped pair would not load
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(
        **SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        **{"norm_topk_prob": False, **kw}),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        **{**SMALL, "moe_intermediate_size": 32, "num_experts": 4, "norm_topk_prob": True, **kw}),
}


def hf_model(name, path=None, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](**kw)).eval()
    with torch.no_grad():  # biases start at zero and per-head norms at one: they would not count
        for key, value in model.named_parameters():
            if key.endswith("_proj.bias"):
                value.normal_(0.0, 0.2)
            elif key.endswith(("q_norm.weight", "k_norm.weight")):
                value.uniform_(0.5, 1.5)
    if path is not None:
        model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    return loaded_pair(request.param, hf_model, tmp_path_factory)


def test_logits_and_greedy_generation_match_transformers(pair):
    _, hf, _, model = pair
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 8)


def test_export_round_trip(pair, tmp_path):
    from safetensors.numpy import load_file

    _, hf, path, model = pair
    assert_export_round_trip(model, hf, tmp_path)
    # the tensors transformers itself writes: one per expert and projection
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == set(load_file(f"{path}/model.safetensors"))


def test_scanned_layers_equal_the_list(pair):
    _, _, path, scanned = pair  # the default: stacked layers
    assert scanned.layers.mlp.gate_up_proj[...].shape == (2, 4, 64, 2, 32)  # layers, experts
    model = rm.from_pretrained(path, scan=False)
    assert isinstance(model.layers, nnx.List)
    ids = jnp.asarray(IDS)
    (a, aux_a), (b, aux_b) = model(ids, aux=True), scanned(ids, aux=True)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    for key in aux_a:
        np.testing.assert_allclose(np.asarray(aux_b[key]), np.asarray(aux_a[key]), atol=1e-6)
    out = rm.generate(scanned, ids, jnp.asarray(MASK), max_new_tokens=4)
    np.testing.assert_array_equal(out, rm.generate(model, ids, jnp.asarray(MASK),
                                                   max_new_tokens=4))


def test_load_balancing_loss_and_expert_counts_match_transformers(pair):
    name, hf, _, model = pair
    for mask in (None, MASK):
        with torch.no_grad():
            kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
            ref = hf(torch.tensor(IDS), output_router_logits=True, **kwargs)
        logits, aux = model(jnp.asarray(IDS), None if mask is None else jnp.asarray(mask),
                            aux=True)
        np.testing.assert_allclose(float(aux["load_balancing"]), float(ref.aux_loss), rtol=1e-5)
        counts = np.asarray(aux["expert_tokens"])
        real = IDS.size if mask is None else int(mask.sum())
        assert counts.shape == (2, 4)  # layers, experts
        np.testing.assert_array_equal(counts.sum(-1), [real * 2] * 2)  # tokens x top-k
        # each layer's counts are those of its router's top 2
        for layer, router_logits in enumerate(ref.router_logits):
            chosen = torch.topk(router_logits, 2, -1).indices.numpy()
            keep = np.ones(IDS.size, bool) if mask is None else mask.reshape(-1).astype(bool)
            np.testing.assert_array_equal(counts[layer],
                                          np.bincount(chosen[keep].reshape(-1), minlength=4))
        z = np.mean([np.mean(torch.logsumexp(r, -1).numpy() ** 2) for r in ref.router_logits])
        if mask is None:
            np.testing.assert_allclose(float(aux["router_z"]), z, rtol=1e-5)
    config = model.config
    np.testing.assert_allclose(float(moe.auxiliary_loss(aux, config)),
                               config.router_aux_loss_coef * float(aux["load_balancing"]),
                               rtol=1e-6)
    # the same from the hidden states, for a loss computed a chunk at a time
    hidden, same = model(jnp.asarray(IDS), jnp.asarray(MASK), aux=True, hidden=True)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), np.asarray(logits), atol=1e-6)
    assert float(same["load_balancing"]) == float(aux["load_balancing"])


def test_qwen3_moe_without_renormalized_weights_matches_transformers(tmp_path):
    hf = hf_model("qwen3_moe", str(tmp_path), norm_topk_prob=False)
    assert_logits_match(rm.from_pretrained(str(tmp_path)), hf)


@pytest.mark.parametrize("kinds", [["sliding_attention"] * 2,
                                   ["full_attention", "sliding_attention"]])
def test_qwen2_moe_with_windows_matches_transformers(kinds, tmp_path):
    hf = hf_model("qwen2_moe", str(tmp_path), use_sliding_window=True, sliding_window=6,
                  layer_types=kinds)
    model = rm.from_pretrained(str(tmp_path))
    windows = [6 if kind == "sliding_attention" else None for kind in kinds]
    assert IDS.shape[1] > 6
    assert (model.window == 6) if len(set(windows)) == 1 else \
        [k.window for k in model.layer_attention] == windows
    assert_logits_match(model, hf)


def dense_reference(layer: moe.MoE, x):
    """Every expert on every token, weighted by the routing (zero off the top k)."""
    logits = x @ layer.router.kernel[...]
    probs = jax.nn.softmax(logits, -1)
    top, chosen = jax.lax.top_k(probs, layer.top_k)
    if layer.renormalize:
        top = top / top.sum(-1, keepdims=True)
    weights = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], chosen].set(top)
    h = jnp.einsum("nh,ehpi->nepi", x, layer.gate_up_proj[...])
    y = jnp.einsum("nei,eih->neh", layer.act(h[:, :, 0]) * h[:, :, 1], layer.down_proj[...])
    return jnp.einsum("neh,ne->nh", y, weights)


@pytest.mark.parametrize("renormalize", [True, False])
def test_gradient_matches_a_dense_reference(renormalize):
    layer = moe.MoE(64, 32, 4, 2, renormalize=renormalize, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (24, 64))
    target = jax.random.normal(jax.random.key(2), (24, 64))

    def gradient(forward):
        return nnx.grad(lambda m, x: jnp.sum((forward(m, x) - target) ** 2), argnums=(0, 1))

    ours = gradient(lambda m, x: m(x)[0])(layer, x)
    ref = gradient(dense_reference)(layer, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(b).max()))


def test_capacity_drops_what_an_expert_cannot_take():
    layer = moe.MoE(64, 32, 4, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (24, 64))
    full, report = layer(x)
    assert float(report["dropped"]) == 0.0
    loose = moe.MoE(64, 32, 4, 2, capacity_factor=4.0, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(loose(x)[0]), np.asarray(full), atol=1e-6)
    tight = moe.MoE(64, 32, 4, 2, capacity_factor=0.5, rngs=nnx.Rngs(0))
    out, report = tight(x)
    capacity = int(np.ceil(0.5 * 24 * 2 / 4))
    logits = np.asarray(x @ layer.router.kernel[...])
    chosen = np.argsort(-logits, -1)[:, :2]
    kept = np.zeros_like(chosen, bool)
    seen = np.zeros(4, int)
    for n in range(24):  # the first tokens an expert gets are kept
        for j in range(2):
            e = chosen[n, j]
            kept[n, j] = seen[e] < capacity
            seen[e] += 1
    assert float(report["dropped"]) == (~kept).sum()
    probs = jax.nn.softmax(jnp.asarray(logits), -1)
    top = jnp.take_along_axis(probs, jnp.asarray(chosen), -1)
    weights = top / top.sum(-1, keepdims=True) * kept
    expected, _ = moe.dispatch(x, jnp.asarray(chosen), weights, layer.gate_up_proj[...],
                               jnp.zeros((4, 2, 1)), layer.down_proj[...],
                               moe.ExpertFn(layer.gated))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)


# Dense MLPs among the experts: a first layer apart (mlp_only_layers), and dense and
# sparse layers in turn (decoder_sparse_step 2: one stacked period of two layers).
DENSE_LAYERS = {"first": dict(mlp_only_layers=[0], num_hidden_layers=3),
                "period": dict(decoder_sparse_step=2, num_hidden_layers=4)}


@pytest.mark.parametrize("layout", sorted(DENSE_LAYERS))
def test_qwen3_moe_with_dense_layers_matches_transformers(layout, tmp_path):
    hf = hf_model("qwen3_moe", str(tmp_path / "hf"), intermediate_size=48,
                  **DENSE_LAYERS[layout])
    model = rm.from_pretrained(str(tmp_path / "hf"))
    pattern = model.pattern(model.config)
    assert (pattern.first, pattern.period) == ((1, 1) if layout == "first" else (0, 2))
    stacked = dict(first="first_layers/0/mlp/gate_up_proj/kernel",
                   period="layers/period/0/mlp/gate_up_proj/kernel")[layout]
    assert stacked in {"/".join(map(str, p)) for p, _ in nnx.state(model, nnx.Param).flat_state()}
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 6)
    listed = rm.from_pretrained(str(tmp_path / "hf"), scan=False)
    ids = jnp.asarray(IDS)
    (a, aux_a), (b, aux_b) = listed(ids, aux=True), model(ids, aux=True)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
    for key in aux_a:
        np.testing.assert_allclose(np.asarray(aux_b[key]), np.asarray(aux_a[key]), atol=1e-6)
    assert aux_a["expert_tokens"].shape[0] == pattern.kinds.count("moe")
    assert_export_round_trip(model, hf, tmp_path / "export")


def test_unsupported_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not implemented"):
        rm.build(CONFIGS["mixtral"](router_jitter_noise=0.1))
    dense = {k: v for k, v in SMALL.items() if k != "num_experts_per_tok"}
    llama = rm.build(transformers.LlamaConfig(**dense, intermediate_size=32))
    with pytest.raises(ValueError, match="aux=True: llama has no auxiliary outputs"):
        llama(jnp.asarray(IDS), aux=True)


def test_the_plan_counts_every_expert():
    from redray.planning.memory import StepShape
    from redray.planning.from_config import plan_model

    hf = hf_model("qwen3_moe")
    total = sum(p.numel() for p in hf.parameters())
    result = plan_model(CONFIGS["qwen3_moe"](), 4, 2, 2,
                        step=StepShape(batch_size=4, seq_len=16))
    assert result["n_params"] == total
    assert result["memory"]["parts"]["activations"] > 0


def test_training_with_the_auxiliary_loss_and_expert_metrics():
    model = rm.build(CONFIGS["mixtral"](), scan=True, remat="full")
    rs = np.random.default_rng(0)
    data = [{"ids": ((rs.integers(0, 128) + np.arange(16)) % 128).astype(np.int32)}
            for _ in range(32)]

    def loss(m, batch, rng, train):
        logits, aux = m(batch["ids"][:, :-1], train=train, aux=True)
        tokens = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
        return tokens + moe.auxiliary_loss(aux, m.config), moe.metrics(aux, per_expert=True)

    trainer = redray.Trainer.of(model, lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                             optax.adam(3e-3), batch_size=8, model_axis=2, progress=False,
                             compute_dtype=jnp.float32)
    before = trainer.evaluate(data)
    trainer.fit(data, epochs=2)
    after = trainer.evaluate(data)
    assert after["loss"] < before["loss"]
    assert {"load_balancing", "router_z", "expert_load_max", "expert_share/3"} <= set(after)
    assert after["expert_load_max"] >= 1.0


@pytest.mark.parametrize("axes", [dict(data_axis=4), dict(model_axis=4), dict(expert_axis=4),
                                  dict(expert_axis=2, model_axis=2),
                                  dict(expert_axis=2, fsdp_axis=2),
                                  dict(context_axis=2, data_axis=2),
                                  dict(context_axis=2, expert_axis=2)])
def test_a_split_step_equals_one_device_and_data_parallel_tokens_stay_home(axes):
    from redray.sharding import collectives

    config = CONFIGS["mixtral"]()
    model = rm.build(config, seed=1)
    rs = np.random.default_rng(1)
    data = [{"ids": rs.integers(0, 128, 17).astype(np.int32)} for _ in range(16)]

    def loss(m, batch, rng, train):
        logits, aux = m(batch["ids"][:, :-1], train=train, aux=True)
        tokens = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
        return tokens + moe.auxiliary_loss(aux, m.config)

    def trainer(**kw):
        return redray.Trainer.of(model, lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
                              loss, optax.sgd(0.5), batch_size=8, progress=False,
                              checkpoint=False, log_every=1, **kw)

    one = trainer(mesh=redray.make_mesh(devices=jax.devices()[:1]))
    split = trainer(**axes)
    expected = [r["loss"] for r in one.fit(data, epochs=1)]
    got = [r["loss"] for r in split.fit(data, epochs=1)]
    assert len(got) == 2  # the second step's loss follows the first step's gradients
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    if "data_axis" in axes:  # only the gradients (and the router's few sums) are reduced
        moved = collectives.summarize(collectives.collectives(split.compiled_step().as_text()))
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        hidden_states = 8 * 16 * config.hidden_size * 4  # one layer's tokens, all devices
        # the router's choices may travel (the expert counts are global), no hidden state
        assert moved["all-gather"]["bytes"] + moved["all-to-all"]["bytes"] < hidden_states / 4
        assert moved["all-reduce"]["bytes"] <= 1.05 * 4 * params


def _expert_axis_step(config, exchange: str = "auto"):
    """(the model, a Trainer on expert axis 4 with ``exchange``, initialized on 8 rows of
    17 tokens)."""
    from redray import Parallelism, Plan

    model = rm.build(config, seed=1)
    rs = np.random.default_rng(1)
    data = [{"ids": rs.integers(0, 128, 17).astype(np.int32)} for _ in range(8)]

    def loss(m, batch, rng, train):
        logits = m(batch["ids"][:, :-1], train=train)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()

    plan = Plan(Parallelism.of(expert_axis=4).build(), expert_exchange=exchange)
    t = redray.Trainer.of(model, lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                          optax.sgd(0.1), batch_size=8, progress=False, checkpoint=False,
                          plan=plan, compute_dtype=jnp.float32)
    t.init(data)
    return model, t


def test_the_gather_exchange_moves_what_the_cost_model_counts():
    """A dropless layer on expert axis 4 exchanges by the gather (the plan's "auto"):
    per layer the group's tokens all-gathered and the outputs reduce-scattered, forward
    and backward, with the choices (int8) and routing weights beside them and the
    weights' gradients scattered back: the collectives ``cost.expert_traffic`` counts,
    byte for byte, and no all-to-all."""
    import re

    from redray.planning.cost import expert_traffic
    from redray.planning.memory import expert_layers
    from redray.sharding import collectives

    config = CONFIGS["mixtral"]()
    model, t = _expert_axis_step(config)
    found = [c for c in collectives.collectives(t.compiled_step().as_text())
             if "shard_map" in (re.search(r'op_name="([^"]*)"', c.line) or [""])[0]]
    n = config.num_hidden_layers  # scanned: the loop body (one layer) is listed once
    counted = expert_traffic(expert_layers(model), t.parallelism.shape, 2 * 16, 4,
                             recompute=False)
    assert not any(c.kind == "all-to-all" for c in found)
    for kind in ("all-gather", "reduce-scatter"):
        mine = [c for c in found if c.kind == kind]
        # a reduce-scatter's buffer: its result times the group
        size = sum(c.bytes * (4 if kind == "reduce-scatter" else 1) for c in mine)
        assert n * size == sum(c.bytes * c.times for c in counted if c.kind == kind), kind
        assert n * len(mine) == sum(c.times for c in counted if c.kind == kind), kind


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_the_expert_all_to_alls_are_those_the_cost_model_counts(capacity_factor):
    """Expert axis 4 with the all-to-all exchange (dropless: asked for; with a capacity
    factor: the plan's "auto"): four all-to-alls per layer (dispatch and combine,
    forward and backward) of experts x slots x hidden, as ``cost.expert_traffic`` counts
    them; with a capacity factor of 1 that is the ideal tokens x top_k x hidden."""
    from redray.sharding import collectives
    from redray.planning.memory import expert_layers
    from redray.planning.cost import expert_traffic

    config = CONFIGS["mixtral"](**({} if capacity_factor is None
                                   else {"capacity_factor": capacity_factor}))
    model, t = _expert_axis_step(config, "all_to_all")
    specs = {p: s for p, s in zip(*flatten_specs(t))}
    # stacked layers (the default): the layer axis first, whole
    assert specs["layers/mlp/gate_up_proj"] == P(None, "expert")
    assert specs["layers/mlp/router/kernel"] == P()
    compiled = collectives.summarize(collectives.collectives(t.compiled_step().as_text()))
    layers = expert_layers(model)
    tokens = 2 * 16  # a device's 2 examples of 16 tokens
    counted = expert_traffic(layers, t.parallelism.shape, tokens, 4, recompute=False,
                             exchange="all_to_all")
    # the layers are scanned: XLA's text lists the loop body (one layer) once
    n = config.num_hidden_layers
    assert n * compiled["all-to-all"]["count"] == sum(c.times for c in counted) == n * 4
    assert n * compiled["all-to-all"]["bytes"] == sum(c.bytes * c.times for c in counted)
    ideal = 4 * n * tokens * config.num_experts_per_tok * config.hidden_size * 4
    ratio = n * compiled["all-to-all"]["bytes"] / ideal
    expected = (config.num_local_experts / config.num_experts_per_tok
                if capacity_factor is None else 1.0)
    assert ratio == pytest.approx(expected)


def flatten_specs(trainer):
    from redray.sharding import flatten

    paths, specs, _ = flatten(trainer.runtime.specs[0])
    return paths, specs


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    config = CONFIGS["mixtral"]()
    config.num_local_experts = 6
    model = rm.build(config, seed=1)
    rs = np.random.default_rng(1)
    data = [{"ids": rs.integers(0, 128, 17).astype(np.int32)} for _ in range(8)]

    def loss(m, batch, rng, train):
        return m(batch["ids"][:, :-1], train=train).mean()

    t = redray.Trainer.of(model, lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                       optax.sgd(0.1), batch_size=8, progress=False, checkpoint=False,
                       expert_axis=4)
    with pytest.raises(ValueError, match="expert_axis=4 does not divide the 6 experts"):
        t.init(data)


def test_the_plan_counts_active_parameters_and_the_planner_tries_expert_axes():
    from redray.planning.from_config import ConfigFacts, plan_model
    from redray.planning.hardware import PRESETS
    from redray.planning.planner import rank

    config = CONFIGS["mixtral"]()
    result = plan_model(config, 4, expert_axis=4)
    per_expert = 3 * config.hidden_size * config.intermediate_size
    layers = config.num_hidden_layers
    idle = layers * (config.num_local_experts - config.num_experts_per_tok) * per_expert
    assert result["active_params"] == result["n_params"] - idle
    assert result["mesh"]["expert"] == 4
    assert result["ratio"]["params"] == pytest.approx(1.0, abs=0.01)
    facts = ConfigFacts(config, seq_len=16)
    ranking = rank(facts, 8, 1, 16, PRESETS["h100"])
    tried = {s.plan.shape["expert"] for s in ranking.ranked + ranking.over}
    assert tried == {1, 2, 4}  # the sizes dividing the 4 experts
    with_experts = next(s for s in ranking.ranked if s.plan.shape["expert"] == 4)
    assert with_experts.cost.experts > 0 and any(  # dropless: the gather's
        t.kind == "all-gather" and t.what.startswith("expert parallel")
        for t in with_experts.cost.traffic)


def test_the_memory_plan_counts_the_exchange_an_expert_axis_adds():
    """Dropless (the gather), the expert group's 4 x tokens x top_k assignments and its
    gathered tokens beside the rows a dispatch of the device's own tokens keeps; with a
    capacity factor of 1 (the all-to-all's slots), the same rows, nothing added."""
    from redray.planning.memory import StepShape
    from redray.planning.from_config import plan_model

    step = StepShape(batch_size=8, seq_len=16)
    config = CONFIGS["mixtral"]()
    dropless = plan_model(config, 4, expert_axis=4, step=step)["memory"]["parts"]
    tokens = 2 * 16  # a device's
    rows = (4 - 1) * tokens * config.num_experts_per_tok
    per_row = (config.hidden_size + 3 * config.intermediate_size) * 4
    gathered = (4 - 1) * tokens * config.hidden_size * 4
    assert dropless["expert_exchange"] == config.num_hidden_layers * (rows * per_row + gathered)
    config.capacity_factor = 1.0
    capped = plan_model(config, 4, expert_axis=4, step=step)["memory"]["parts"]
    assert capped["expert_exchange"] == 0
    assert "expert_exchange" not in plan_model(config, 4, step=step)["memory"]["parts"]


@pytest.mark.parametrize("normalize", [True, False])
def test_group_limited_sigmoid_routing_matches_glm4_moes_block(normalize):
    """DeepSeek-V3's router as GLM-4.5 runs it (transformers' Glm4MoeMoE: sigmoid scores,
    a correction bias for the choice only, the best 2 of 4 groups, renormalized or not,
    scaled) with its shared experts: the same outputs, and only the kept groups chosen."""
    config = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
        norm_topk_prob=normalize)
    torch.manual_seed(0)
    theirs = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE(config).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0, 0.3)
        theirs.gate.e_score_correction_bias.normal_(0, 0.5)  # moves the choice, not weights
    from redray.models.mixtral import SharedExpertMoE

    ours = SharedExpertMoE(
        32, 16, 16, 4, shared=32, act="silu", gated=False, renormalize=normalize,
        scoring="sigmoid", groups=(4, 2), scale=2.5, dtype=jnp.float32, rngs=nnx.Rngs(0))
    weights = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    ours.router.kernel[...] = weights["gate.weight"].T
    ours.score_bias[...] = weights["gate.e_score_correction_bias"]
    ours.gate_up_proj[...] = weights["experts.gate_up_proj"].transpose(0, 2, 1).reshape(
        16, 32, 2, 16)
    ours.down_proj[...] = weights["experts.down_proj"].transpose(0, 2, 1)
    shared = ours.shared_expert
    shared.gate_up_proj.kernel[...] = np.stack(
        [weights["shared_experts.gate_proj.weight"].T,
         weights["shared_experts.up_proj.weight"].T], 1).reshape(
        shared.gate_up_proj.kernel.shape)
    shared.down_proj.kernel[...] = weights["shared_experts.down_proj.weight"].T
    x = np.random.default_rng(0).normal(size=(3, 5, 32)).astype(np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)).numpy()
        _, _, their_chosen = theirs.gate(torch.from_numpy(x))
    out, report = ours(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
    # the choice: each token's experts (as sets) those transformers picks, in <= 2 groups
    logits = np.asarray(ours.router(jnp.asarray(x))).reshape(-1, 16)
    _, chosen, _ = ours._sigmoid_choice(jnp.asarray(logits))
    for mine, their in zip(np.asarray(chosen), their_chosen.numpy()):
        assert set(mine) == set(their) and len({e // 4 for e in mine}) <= 2
    assert float(report["tokens"]) == 15 and float(report["expert_tokens"].sum()) == 60
    # DeepSeek-V3's sequence-wise balance loss from transformers' choices and scores:
    # per sequence, sum over experts of (16 / (4 x 5)) x its assignments x its mean
    # normalized score; the mean over the 3 sequences
    scores = (1 / (1 + np.exp(-logits.astype(np.float64)))).reshape(3, 5, 16)
    picks = np.zeros((3, 16))
    for b, row in enumerate(their_chosen.numpy().reshape(3, 5, 4)):
        np.add.at(picks[b], row.reshape(-1), 1)
    share = (scores / scores.sum(-1, keepdims=True)).mean(1)
    expected_balance = (16 / 20 * picks * share).sum(-1).mean()
    found = moe.summarize(jax.tree.map(lambda r: r[None], report), 16)["sequence_balance"]
    np.testing.assert_allclose(float(found), expected_balance, rtol=1e-5)
    # the bias is state beside the parameters: no optimizer or gradient touches it
    assert not nnx.state(ours, moe.RouterBias) == {} and \
        "score_bias" not in str(nnx.state(ours, nnx.Param))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """A tiny GLM-4.5 (a dense first layer, then 2 MoE layers; the registry's) whose
    routers' correction biases are drawn away from zero, as trained ones are."""
    from hf_tiny import hf_model

    hf = hf_model("glm4_moe")
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
    folder = str(tmp_path_factory.mktemp("glm4_moe"))
    hf.save_pretrained(folder)
    return hf, folder, rm.from_pretrained(folder)


def test_glm4_moe_matches_transformers_and_exports_its_router_biases(glm, tmp_path):
    hf, folder, model = glm
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 8)
    pattern = model.pattern(model.config)
    assert (pattern.first, pattern.repeats) == (1, 2)  # the dense prefix apart
    biases = np.asarray(model.layers.mlp.score_bias[...])  # stacked: (2 layers, 8 experts)
    for i in (1, 2):
        np.testing.assert_array_equal(
            biases[i - 1], hf.model.layers[i].mlp.gate.e_score_correction_bias.numpy())
    assert_export_round_trip(model, hf, tmp_path)  # the biases written back, and read
    # in bfloat16 the weights are, the biases (moved by 0.001 a step) stay float32
    from safetensors.numpy import load_file

    rm.save_pretrained(model, str(tmp_path / "bf16"), dtype="bfloat16")
    written = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for i in (1, 2):
        bias = written[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == np.float32
        np.testing.assert_array_equal(bias, biases[i - 1])
    assert written["model.layers.1.mlp.gate.weight"].dtype != np.float32


def test_a_glm4_moe_runs_checkpoint_exports_its_balanced_router_biases(glm, tmp_path):
    """A run's checkpoint holds the routers' correction biases beside the parameters
    (the Trainer's extra state: no optimizer moves them, the bias update does, by 0.001
    a step); ``redray export`` writes them as the run left them (restoring the model: an
    export a tensor at a time reads parameters only)."""
    import os

    from redray.commands.runs import export_run
    from redray.engine.load import stored_params
    from tiny import lm_collate, lm_loss, token_data

    hf, folder, model = glm
    run = tmp_path / "run"
    os.makedirs(run)
    hf.config.save_pretrained(run)
    trainer = redray.Trainer.of(model, lm_collate, lm_loss, optax.adam(1e-2), batch_size=4,
                                progress=False, fsdp_axis=2, checkpoint=redray.CheckpointConfig(
                                    str(run / "checkpoints"), save_every=1))
    trainer.fit(token_data(8, seq=12), epochs=1)
    config = rm.load_config(str(run / "config.json"))
    assert stored_params(str(run), lambda rngs: rm.build(config, rngs=rngs)) is None
    export_run(str(run), config, str(tmp_path / "out"), dtype="float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    balanced = np.asarray(trainer.state.extra["layers"]["mlp"]["score_bias"].get_value())
    for i in (1, 2):
        exported = back.model.layers[i].mlp.gate.e_score_correction_bias.numpy()
        np.testing.assert_array_equal(exported, balanced[i - 1])
        steps = (exported - hf.model.layers[i].mlp.gate.e_score_correction_bias.numpy()) / 1e-3
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)  # whole steps of 0.001
        assert np.abs(steps).max() > 0.5 and np.abs(steps).max() < 2.5  # 2 steps at most
    assert not torch.equal(back.model.layers[1].mlp.gate.weight,  # the rest trained
                           hf.model.layers[1].mlp.gate.weight)
