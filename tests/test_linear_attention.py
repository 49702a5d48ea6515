"""Hybrid linear attention: Gated DeltaNet, and the Qwen3-Next / Qwen3.5 families.

The chunked delta rule against transformers' token-by-token reference (across chunks,
from a carried state, with documents packed in a row); each family's tiny checkpoint
(a linear and a full attention layer in turn, twice as many value heads as key heads)
written by transformers' own classes against redray's load: logits on left-padded rows,
packed rows equal to their documents run alone, greedy tokens, the export read back,
and one step on every plan equal to one device's. Their gradients against torch's are
in tests/test_gradients.py (every registry family).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from hf_tiny import (IDS, MASK, assert_export_round_trip, assert_greedy_generation_matches,
                     assert_language_model_loads, assert_logits_match, hf_logits,
                     loaded_pair)
from test_families import ROWS, hf_model, loss_and_grads

import redray.models as rm
from redray.models import gated_delta
from redray.models.families import FAMILIES

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

TEXT = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


# ------------------------------------------------------------------ the rule
def rule_inputs(seed=0, b=2, t=37, h=4, dk=8, dv=6):
    rs = np.random.default_rng(seed)
    q, k = (rs.normal(size=(b, t, h, dk)).astype(np.float32) for _ in range(2))
    v = rs.normal(size=(b, t, h, dv)).astype(np.float32)
    g = -rs.uniform(0.01, 0.5, (b, t, h)).astype(np.float32)
    beta = rs.uniform(0.1, 1.0, (b, t, h)).astype(np.float32)
    state = rs.normal(size=(b, h, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state):
    """transformers' token-by-token gated delta rule (q and k L2-normalized in it)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule)

    out, last = torch_recurrent_gated_delta_rule(
        *(torch.tensor(a) for a in (q, k, v)), g=torch.tensor(g), beta=torch.tensor(beta),
        initial_state=None if state is None else torch.tensor(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return out.numpy(), last.numpy()


def ours(q, k, v, g, beta, state, groups=None, chunk=8):
    dk = q.shape[-1]
    qn = gated_delta.l2_normalize(jnp.asarray(q)) * dk ** -0.5
    kn = gated_delta.l2_normalize(jnp.asarray(k))
    groups = jnp.zeros(q.shape[:2], jnp.int32) if groups is None else groups
    if state is None:
        state = np.zeros((q.shape[0], q.shape[2], dk, v.shape[-1]), np.float32)
    out, last = gated_delta.delta_rule(qn, kn, v, g, beta, state, groups, chunk=chunk)
    return np.asarray(out), np.asarray(last)


@pytest.mark.parametrize("chunk", [8, 64])
def test_the_chunked_rule_is_the_token_by_token_rule(chunk):
    """Over several chunks (37 tokens, the last chunk short) from a carried state: the
    outputs and the final state."""
    args = rule_inputs()
    want_out, want_state = reference(*args)
    got_out, got_state = ours(*args, chunk=chunk)
    np.testing.assert_allclose(got_out, want_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_state, want_state, atol=1e-4, rtol=0)


def test_the_chunk_solve_inverts_hard_systems_as_substitution_does():
    """``unit_lower_inverse`` against numpy's inverse on two (64 x 64) systems: random
    (the rule's own magnitudes), and identical keys at full write rate (the strictly
    lower part all ones), where the terms of a power series reach C(63, 31) ~ 1e18 but
    the inverse is I minus the subdiagonal: a series in float32 would be all noise."""
    rs = np.random.default_rng(3)
    k = rs.normal(size=(64, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    systems = np.stack([np.tril(rs.uniform(0, 1, (64, 1)) * (k @ k.T), -1),
                        np.tril(np.ones((64, 64)), -1)]).astype(np.float32)
    got = np.asarray(gated_delta.unit_lower_inverse(jnp.asarray(systems)))
    want = np.linalg.inv(np.eye(64) + systems.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got[1], np.eye(64) - np.eye(64, k=-1))
    with pytest.raises(ValueError, match="power-of-two"):
        gated_delta.unit_lower_inverse(jnp.zeros((3, 3)))


def test_one_token_at_a_time_is_the_token_by_token_rule():
    """A decoding step's rule (one token per call, ``delta_rule``'s own path for it),
    carried over the 37 tokens: the reference's outputs and final state."""
    q, k, v, g, beta, state = rule_inputs()
    want_out, want_state = reference(q, k, v, g, beta, state)
    outs = []
    for i in range(q.shape[1]):
        out, state = ours(*(a[:, i:i + 1] for a in (q, k, v, g, beta)), state)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), want_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(state, want_state, atol=1e-4, rtol=0)


def test_a_packed_row_resets_the_state_where_each_document_starts():
    """Documents of 5, 14 and 18 tokens in one row (starts inside chunks of 8 and on a
    chunk's edge): each document's outputs are its own run from an empty state, and
    the state passed on is the last document's."""
    q, k, v, g, beta, _ = rule_inputs(1, b=1)
    bounds = [0, 5, 19, 37]
    starts = np.zeros((1, 37), bool)
    starts[0, bounds[:-1]] = True
    got_out, got_state = ours(q, k, v, g, beta, None, gated_delta.reset_groups(starts))
    for lo, hi in zip(bounds, bounds[1:]):
        part = [a[:, lo:hi] for a in (q, k, v, g, beta)]
        want_out, want_state = reference(*part, None)
        np.testing.assert_allclose(got_out[:, lo:hi], want_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_state, want_state, atol=1e-4, rtol=0)


def test_the_convolution_is_torch_own_and_resets_inside_a_row():
    rs = np.random.default_rng(2)
    x = rs.normal(size=(1, 11, 6)).astype(np.float32)
    kernel = rs.normal(size=(4, 6)).astype(np.float32)
    tail = np.zeros((1, 3, 6), np.float32)
    conv = torch.nn.functional.conv1d(torch.tensor(x).transpose(1, 2),
                                      torch.tensor(kernel.T[:, None, :]), padding=3, groups=6)
    want = conv[..., :11].transpose(1, 2).numpy()
    got, new_tail = gated_delta.causal_conv(jnp.asarray(x), jnp.asarray(kernel), tail,
                                            jnp.zeros((1, 11), jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(new_tail), x[:, -3:])
    starts = np.zeros((1, 11), bool)
    starts[0, [0, 6]] = True
    got, _ = gated_delta.causal_conv(jnp.asarray(x), jnp.asarray(kernel), tail,
                                     gated_delta.reset_groups(starts))
    alone, _ = gated_delta.causal_conv(jnp.asarray(x[:, 6:]), jnp.asarray(kernel), tail,
                                       jnp.zeros((1, 5), jnp.int32))
    np.testing.assert_allclose(np.asarray(got)[:, 6:], np.asarray(alone), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ the families
def strong(name, folder=None):
    """``hf_model``'s checkpoint with its matrices scaled up, so the linear layers' state
    (and so a missing reset or a wrong permutation) moves the logits by more than the
    tolerance."""
    hf = hf_model(name)
    with torch.no_grad():
        for key, value in hf.named_parameters():
            if value.ndim >= 2 and "embed" not in key:
                value.mul_(6.0)
    if folder is not None:
        hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=TEXT)
def pair(request, tmp_path_factory):
    return loaded_pair(request.param, strong, tmp_path_factory)


def test_logits_greedy_tokens_and_export_match_transformers(pair, tmp_path):
    _, hf, _, model = pair
    assert np.abs(hf_logits(hf, IDS)).max() > 1.0
    assert_logits_match(model, hf)
    assert_greedy_generation_matches(model, hf, 8)
    assert_export_round_trip(model, hf, tmp_path)


def test_packed_rows_equal_their_documents_run_alone(pair):
    """A row of three documents (4, 29 and 15 tokens, longer than the convolution's
    window) and padding: each document's logits are transformers' for it alone."""
    _, hf, _, model = pair
    rs = np.random.default_rng(3)
    lengths = (4, 29, 15)
    ids = np.zeros((1, 52), np.int32)
    segments = np.zeros((1, 52), np.int32)
    at = 0
    for s, n in enumerate(lengths, 1):
        ids[0, at:at + n] = rs.integers(1, 128, n)
        segments[0, at:at + n] = s
        at += n
    logits = np.asarray(model(jnp.asarray(ids), segment_ids=jnp.asarray(segments)))
    at = 0
    for n in lengths:
        want = hf_logits(hf, ids[:, at:at + n])
        np.testing.assert_allclose(logits[:, at:at + n], want, atol=1e-4, rtol=0)
        at += n


def test_stacked_layers_equal_the_list_and_form_one_period(pair, tmp_path):
    """On the checkpoint as transformers initializes it (the scaled one's float32
    rounding, amplified by its 6x matrices, differs between the two programs by more
    than 1e-5: 4.9e-5 of logits up to 3.3)."""
    name = pair[0]
    hf_model(name, str(tmp_path))
    model = rm.from_pretrained(str(tmp_path))
    pattern = model.pattern(model.config)
    assert (pattern.first, pattern.period, pattern.repeats) == (0, 2, 2)
    listed = rm.from_pretrained(str(tmp_path), scan=False)
    ids, mask = jnp.asarray(IDS), jnp.asarray(MASK)
    np.testing.assert_allclose(np.asarray(model(ids, mask)), np.asarray(listed(ids, mask)),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_the_vision_language_checkpoint_loads_its_language_model(name, tmp_path, capfd):
    text = FAMILIES[name].tiny["text_config"] is FAMILIES["qwen3_5_text"].tiny
    assert_language_model_loads(name, FAMILIES[name].tiny, tmp_path, capfd,
                                "tensors (model.visual)",
                                "qwen3_5_text" if text else "qwen3_5_moe_text",
                                "Qwen3_5ForCausalLM" if text else "Qwen3_5MoeForCausalLM")


# the data axis inside the expert plan (Qwen3-Next's tiny model has 4 experts); 1F1B's
# stages beside context 2 x data 2: test_context's 8-device test
PLANS = {"fsdp_model": dict(fsdp_axis=2, model_axis=2),
         "stage": dict(stage_axis=2), "context": dict(context_axis=2, model_axis=2),
         "expert": dict(expert_axis=2, data_axis=2)}


# The gated output norm divides each value head's readout by its root mean square plus
# rms_norm_eps: where a readout is near zero (a state decayed within a few tokens, a
# query at right angles to the keys), float32 rounding comes out of it multiplied by
# up to 1/sqrt(eps). With eps 1e-6 a plan's other reduction order moved the gradient by
# 1.8e-4 of its largest entry (transformers' own float32 gradient is 2.6e-5 from its
# float64 one; softmax layers' 6e-7). The plans are checked at 1e-5 with eps 1e-2 (and
# redray's initial slow decays): 2.5e-6 to 7.6e-6 measured.
@pytest.mark.parametrize("name", ["qwen3_next"])  # Qwen3.5's layers are these, apart on disk
def test_every_plan_takes_the_one_device_step(name):
    config = transformers.AutoConfig.for_model(name, **FAMILIES[name].tiny, rms_norm_eps=1e-2)
    expected, expected_grads = loss_and_grads(config)
    for plan, axes in PLANS.items():
        if plan == "expert" and not getattr(config, "num_experts", 0):
            continue
        micro = ROWS // 2 if plan == "stage" else None
        value, grads = loss_and_grads(config, micro, **axes)
        assert abs(value - expected) <= 1e-5 * abs(expected), (name, plan)
        for got, want in zip(grads, expected_grads):
            assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), (name, plan)


def test_the_rules_split_the_linear_layers_by_key_head():
    """Found by the dataflow, not by name: every linear layer's projections column by
    key head, its convolution kernel, decays and step biases with them, the output
    projection row; the full attention's fused kernel by its key/value heads."""
    import jax
    from test_families import SEQ, lm_loss

    from redray.engine.runtime import ModelRuntime
    from redray.sharding import Parallelism, flatten

    config = transformers.AutoConfig.for_model("qwen3_next", **FAMILIES["qwen3_next"].tiny)
    plan = Parallelism.of(model_axis=2).build(jax.devices()[:2])
    runtime = ModelRuntime(lambda rngs: rm.build(config, rngs=rngs, scan=False), plan)
    runtime.derive(lm_loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    paths, _, _ = flatten(runtime.abstract[0])
    specs = dict(zip(paths, jax.tree.leaves(runtime.specs[0],
                                            is_leaf=lambda x: isinstance(x, P))))
    want = {"in_proj/kernel": P(None, "model"), "ba_proj/kernel": P(None, "model"),
            "conv": P(None, "model"), "A_log": P("model"), "dt_bias": P("model"),
            "out_proj/kernel": P("model"), "norm": P()}
    for layer in (0, 2):
        for name, spec in want.items():
            assert specs[f"layers/{layer}/linear_attn/{name}"] == spec, (layer, name)
    assert specs["layers/1/self_attn/qkv_proj/kernel"] == P(None, "model")
    assert specs["layers/1/self_attn/o_proj/kernel"] == P("model")
    assert runtime.whole == [] or all(w.by_design for w in runtime.whole)


def test_the_planner_charges_a_context_axis_the_passed_state_not_a_ring():
    """A config's facts count the linear layers apart from the attention layers: over a
    context axis the attention layers' keys and values go round the ring, the linear
    layers' chunk state maps are gathered (each chunk: value heads x dk x (dk + dv) and
    its last convolution inputs, float32), nothing of their sequence."""
    from redray.planning.cost import context_traffic
    from redray.planning.from_config import ConfigFacts
    from redray.planning.memory import context_states

    config = transformers.AutoConfig.for_model("qwen3_next", **FAMILIES["qwen3_next"].tiny)
    facts = ConfigFacts(config, 64, scan=True)
    key_heads, values, dk, dv = 2, 4, 8, 8  # TINY_HYBRID's
    state = values * dk * (dk + dv) + 3 * key_heads * (2 * dk + 2 * dv)
    assert (facts.linear_layers, facts.attention_layers, facts.linear_state) == (2, 2, state)
    # a Trainer's facts read the built model the same way, its layers listed or stacked
    for scan in (False, True):
        assert context_states(rm.build(config, scan=scan)) == (2, state)
    assert facts.splits_sequences
    traffic = context_traffic({"context": 4}, 2, 64, facts.kv_width, 16,
                              facts.attention_layers, 4, 1, None, facts.linear_layers,
                              facts.linear_state)
    gathers = [t for t in traffic if t.kind == "all-gather"]
    assert [(t.bytes, t.times) for t in gathers] == [(2 * 8 * state * 4, 2)]
    ring = [t for t in traffic if "round the ring" in t.what]
    assert ring[0].times == 2 * 3 * 2  # the two attention layers' passes only


def test_the_sampler_holds_each_slots_state_and_resets_it_on_refill(pair):
    """The continuous-batching Sampler on the paged cache (its default for these models):
    more requests than slots, so slots are refilled mid-call and their linear layers'
    state and convolution window replaced; every greedy completion equals transformers'
    own for its prompt alone (a state left from a slot's last request changes the
    tokens: measured, 4 of 7 requests)."""
    from redray.post_training import Sampler, SamplingParams

    import jax
    from flax import nnx

    _, hf, _, model = pair
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_get(state))  # one replica, as a paged Sampler's
    rs = np.random.default_rng(0)
    prompts = [list(rs.integers(3, 128, n)) for n in (5, 11, 3, 8, 14, 6)]
    news = [4, 9, 6, 10, 3, 7]
    sampler = Sampler(model, slots=2, max_length=32, eos_token_id=[], pad_token_id=0)
    assert sampler.kv_cache == "paged"
    got = sampler.sample(prompts, [SamplingParams(temperature=0.0, max_new_tokens=m)
                                   for m in news])
    for prompt, new, completion in zip(prompts, news, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, eos_token_id=None, pad_token_id=0)
        assert list(completion.tokens) == want[0, len(prompt):].tolist(), prompt


def test_what_is_not_available_is_refused_with_the_way_around():
    from redray.post_training import Sampler

    config = transformers.AutoConfig.for_model("qwen3_5_text", **FAMILIES["qwen3_5_text"].tiny)
    model = rm.build(config)
    with pytest.raises(ValueError, match="linear-attention layers.*kv_cache='paged'"):
        Sampler(model, slots=2, max_length=16, kv_cache="window")
    with pytest.raises(ValueError, match="a state per row.*rows="):
        model.init_pages(4)
