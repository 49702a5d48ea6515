"""The continuous-batching sampler (against ``generate``, token for token) and the losses
of SFT, DPO and GRPO (against values computed here by hand)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

import redray
from redray.models import build, generate, next_token_loss
from redray.post_training import (Sampler, SamplingParams, dpo_loss, group_advantages,
                                  grpo_loss, logprob_mismatch, preference_pairs, sample_rows,
                                  sequence_logprobs, sft_loss, token_logprobs)

# run by `make test` in a process of its own (the Makefile says why)
pytestmark = pytest.mark.alone

EOS = 5
CONFIGS = {
    # scanned layers, grouped-query heads
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=EOS),
    # a sliding window shorter than the sequences, soft-capped scores and logits
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, eos_token_id=EOS,
        pad_token_id=0),
    # layers as a list, learned positions
    "gpt2": lambda: transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=128, eos_token_id=EOS),
}


def prompts_of(n, seed=0, longest=12):
    rs = np.random.default_rng(seed)
    return [rs.integers(6, 97, rs.integers(1, longest + 1)).tolist() for _ in range(n)]


def left_padded(prompts):
    width = max(map(len, prompts))
    ids, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def until_eos(row, eos=EOS):
    row = list(row)
    return row[:row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_completions_equal_generate_token_for_token(name):
    model = build(CONFIGS[name](), rngs=nnx.Rngs(0))
    prompts, new = prompts_of(13), 20
    # the end of sequence: a token this random model emits often, so that rows end early
    free = np.asarray(generate(model, *left_padded(prompts), max_new_tokens=new,
                               eos_token_id=-1))
    eos = int(np.bincount(free[:, 2:].ravel()).argmax())
    ref = np.asarray(generate(model, *left_padded(prompts), max_new_tokens=new,
                              eos_token_id=eos))
    # 4 slots for 13 prompts: slots refilled mid-run, a cache short enough that its
    # rows are shifted left, and the last sequences narrowed into fewer
    sampler = Sampler(model, slots=4, max_length=36, steps_per_call=5, eos_token_id=eos)
    done = sampler.sample(prompts, SamplingParams(max_new_tokens=new))
    assert sampler.window.shifts >= 1
    assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref]
    assert any(c.finish_reason == "eos" for c in done)
    assert all((c.finish_reason == "eos") == (c.tokens[-1] == eos) for c in done)
    assert [c.request_id for c in done] == list(range(13))
    # a paged cache whose pool holds two of these requests at most (each needs 3 or 4
    # pages of 8 tokens): requests wait for pages, which return as requests end
    pages = Sampler(model, slots=4, max_length=36, eos_token_id=eos, kv_cache="paged",
                    kv_pages=7, page_size=8)
    done = pages.sample(prompts, SamplingParams(max_new_tokens=new))
    assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref]
    assert pages.round_trips == 3  # the layers split, the call, its read
    # each request's own maximum: the rows of a static batch cut where they asked
    lengths = [1 + i % 7 for i in range(13)]
    short = sampler.sample(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert [list(c.tokens) for c in short] == [until_eos(r[:n], eos)
                                               for r, n in zip(ref, lengths)]
    assert sampler.window.kv_valid.shape[0] < 4  # the last ones ran narrowed
    # the rounds read windows narrower than the longest request's row
    widths = {key[2][1] for key in sampler._compiled if key[0] == "decode"}
    assert min(widths) < sampler.max_length and max(widths) <= sampler.length
    if name == "llama":  # several steps between two checks (the default off CPUs), 2
        # not dividing a call's 5: the same tokens, the rows ending mid-run still cut
        every = Sampler(model, slots=4, max_length=36, steps_per_call=5, eos_token_id=eos,
                        check_every=2)
        done = every.sample(prompts, SamplingParams(max_new_tokens=new))
        assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref]
        # and the batch kept whole to the end, the rest decoded in one call once no
        # prompt waits (a call as long as the longest rest, past steps_per_call)
        wide = Sampler(model, slots=4, max_length=36, steps_per_call=5, eos_token_id=eos,
                       narrow=False)
        done = wide.sample(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
        assert [list(c.tokens) for c in done] == [until_eos(r[:n], eos)
                                                  for r, n in zip(ref, lengths)]
        assert wide.window.kv_valid.shape[0] == 4
        done = wide.sample(prompts[:4], SamplingParams(max_new_tokens=new))
        assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref[:4]]
        assert wide.rounds == 1
        # 13 prompts through 4 slots refilled inside one compiled call (the default)
        # or by the host between rounds: the same tokens, the device's in fewer
        # compiled calls and reads of device values
        host = Sampler(model, slots=4, max_length=36, steps_per_call=5, eos_token_id=eos,
                       refill_on_device=False)
        done = host.sample(prompts, SamplingParams(max_new_tokens=new))
        assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref]
        device = Sampler(model, slots=4, max_length=36, steps_per_call=5, eos_token_id=eos,
                         narrow=False, check_every=2)
        done = device.sample(prompts, SamplingParams(max_new_tokens=new))
        assert [list(c.tokens) for c in done] == [until_eos(r, eos) for r in ref]
        assert device.round_trips * 3 <= host.round_trips, (device.round_trips,
                                                             host.round_trips)
        # a window too narrow for the longest prompt beside the longest completion
        # (bucketed: 32 + 32 > 36 + 16): the host refills, the same tokens
        mixed = [(prompts[0] * 20)[:20]] + prompts[1:]
        asks = [SamplingParams(max_new_tokens=2)] + [SamplingParams(max_new_tokens=new)] * 12
        mixed_ref = np.asarray(generate(model, *left_padded(mixed), max_new_tokens=new,
                                        eos_token_id=eos))
        done = device.sample(mixed, asks)
        assert [list(c.tokens) for c in done] == [until_eos(r[:a.max_new_tokens], eos)
                                                  for r, a in zip(mixed_ref, asks)]
        with pytest.raises(ValueError, match="check_every=6"):
            Sampler(model, slots=4, max_length=36, steps_per_call=5, check_every=6)


def test_the_cache_windows_and_batch_sizes_come_from_few_compiled_shapes():
    from redray.post_training.kv_window import PROMPT_BUCKET, WINDOW_RUNGS, window
    from redray.post_training.slots import smaller
    widths = [window(n, 10_000) for n in range(1, 2049)]
    assert all(w >= n and w % PROMPT_BUCKET == 0 for n, w in enumerate(widths, 1))
    # every bucket up to 2 x WINDOW_RUNGS of them, then WINDOW_RUNGS widths per doubling,
    # none with as many idle columns as 1 / WINDOW_RUNGS of it
    short = 2 * WINDOW_RUNGS * PROMPT_BUCKET
    assert sorted({w for w in widths if w <= short}) == list(range(PROMPT_BUCKET, short + 1,
                                                                   PROMPT_BUCKET))
    for low in (short, 2 * short, 4 * short):
        assert len({w for w in widths if low < w <= 2 * low}) == WINDOW_RUNGS
    assert all((w - n) * WINDOW_RUNGS < w for n, w in enumerate(widths, 1) if n > short)
    assert window(300, 200) == 200
    model = build(CONFIGS["gpt2"](), rngs=nnx.Rngs(0))
    sampler = Sampler(model, slots=64, max_length=32)
    ladder, size = [], 64
    while size:
        ladder.append(size)
        size = smaller(size, sampler.placement.data_parallel)
    assert ladder == [64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]


def test_a_prefill_of_every_slot_writes_what_the_scatter_writes():
    """``write(every=True)`` (one slice: a prefill that fills every slot) and the scatter
    (any rows) leave the same cache, a stacked cache's layer axis included."""
    from redray.post_training.kv_window import write
    rs = np.random.default_rng(0)
    for lead in ((), (2,)):
        big = jnp.asarray(rs.normal(size=(*lead, 3, 2, 9, 4)), jnp.float32)
        new = jnp.asarray(rs.normal(size=(*lead, 4, 2, 5, 4)), jnp.float32)  # a padding row
        rows, cols = jnp.asarray([0, 1, 2, 3]), jnp.arange(3, 8)
        scattered = write(big, new, rows, cols)
        assert not np.array_equal(scattered, big)
        np.testing.assert_array_equal(write(big, new, rows, cols, every=True), scattered)


def test_sampled_tokens_depend_on_the_request_not_its_slot_and_their_logprobs_are_the_models():
    model = build(CONFIGS["llama"](), rngs=nnx.Rngs(1))
    prompts = prompts_of(9, seed=1)
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_k=k, top_p=p)
              for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)] * 3]
    ids = [100 + i for i in range(9)]
    sampler = Sampler(model, slots=2, max_length=32, seed=3)
    a = sampler.sample(prompts, params, ids)
    b = Sampler(model, slots=8, max_length=48, seed=3, steps_per_call=3).sample(
        prompts[::-1], params[::-1], ids[::-1])[::-1]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    np.testing.assert_allclose(np.concatenate([x.logprobs for x in a]),
                               np.concatenate([y.logprobs for y in b]), atol=1e-5)
    # and on a paged cache, every request in one call
    paged = Sampler(model, slots=4, max_length=32, seed=3, kv_cache="paged").sample(
        prompts, params, ids)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, paged))
    np.testing.assert_allclose(np.concatenate([x.logprobs for x in a]),
                               np.concatenate([y.logprobs for y in paged]), atol=1e-5)
    # a group of one prompt's requests (GRPO's) runs the prompt through the model once
    # per prefill, each slot sampling its own request: as when each prompt ran alone
    group, group_ids = [prompts[0]] * 4 + [prompts[1]] * 4, list(range(200, 208))
    together = Sampler(model, slots=8, max_length=32, seed=3)
    c = together.sample(group, params[0], group_ids)
    assert ("prefill", (8, True, 2)) in {key[:2] for key in together._compiled}
    d = Sampler(model, slots=1, max_length=32, seed=3).sample(group, params[0], group_ids)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(c, d))
    np.testing.assert_allclose(np.concatenate([x.logprobs for x in c]),
                               np.concatenate([y.logprobs for y in d]), atol=1e-5)
    assert len({tuple(x.tokens) for x in c}) > 2  # each request sampled its own
    sampler.seed = 4
    other_seed = sampler.sample(prompts, params, ids)
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, other_seed))
    # top_k=1 is greedy whatever the temperature
    greedy = sampler.sample(prompts, SamplingParams(12))
    top1 = sampler.sample(prompts, SamplingParams(12, temperature=2.0, top_k=1))
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(greedy, top1))
    # a completion's log-probabilities are what training computes for it at that
    # temperature: the ratio GRPO starts from is 1
    rows = [prompt + c.tokens.tolist() for prompt, c in zip(prompts, a)]
    ids_, mask = np.zeros((9, 32), np.int32), np.zeros((9, 32), np.int32)
    for i, row in enumerate(rows):
        ids_[i, :len(row)], mask[i, :len(row)] = row, 1
    for temperature in {p.temperature for p in params}:
        logp = np.asarray(token_logprobs(model, ids_, mask, temperature=temperature))
        for i, (c, prompt, p) in enumerate(zip(a, prompts, params)):
            if p.temperature == temperature:
                np.testing.assert_allclose(c.logprobs, logp[i, len(prompt):len(rows[i])],
                                           atol=2e-5)
    # the mismatch a GRPO loop logs: over the completions' tokens only
    sampled = np.zeros((9, 32))
    for i, (c, prompt) in enumerate(zip(a, prompts)):
        sampled[i, len(prompt):len(rows[i])] = c.logprobs
    at_one = [i for i, p in enumerate(params) if p.temperature == 1.0]
    logp = np.asarray(token_logprobs(model, ids_, mask, temperature=1.0))
    completion = np.zeros((9, 32))
    for i in at_one:
        completion[i, len(prompts[i]):len(rows[i])] = 1
    found = logprob_mismatch(sampled, logp, completion)
    assert 0 <= found["mean"] <= found["max"] <= 2e-5, found
    assert logprob_mismatch([[0.0, -1.0, -2.0]], [[9.0, -1.5, -2.0]], [[0, 1, 1]]) == {
        "mean": 0.25, "max": 0.5}


def test_a_sharded_sampler_completes_as_one_device_with_its_cache_split():
    model = build(CONFIGS["llama"](), rngs=nnx.Rngs(2))
    prompts = prompts_of(10, seed=2)
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    one = Sampler(model, slots=4, max_length=32).sample(prompts, params)
    plan = redray.Parallelism.of(data_axis=2, model_axis=2)
    sharded = Sampler(model, slots=4, max_length=32, parallelism=plan)
    spec = jax.tree.leaves(sharded.window.cache)[0].sharding.spec
    assert tuple(spec)[-4:-2] == (("data", "fsdp", "expert"), "model"), spec
    split = [x for x in jax.tree.leaves(sharded.state) if "model" in str(x.sharding.spec)]
    assert len(split) >= 4  # the layers' projections and MLPs at least
    two = sharded.sample(prompts, params)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(one, two))
    with pytest.raises(ValueError, match="slots=3 must be a multiple of the plan's "
                                         "data-parallel size \\(2\\)"):
        Sampler(model, slots=3, max_length=32, parallelism=plan)
    # a paged cache on a plan of model parallelism alone: the same tokens; a plan with
    # data-parallel replicas is refused, naming the way out
    paged = Sampler(model, slots=4, max_length=32, kv_cache="paged",
                    parallelism=redray.Parallelism.of(model_axis=4))
    three = paged.sample(prompts, params)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(one, three))
    with pytest.raises(ValueError, match="2 data-parallel ones.*kv_cache='window'"):
        Sampler(model, slots=4, max_length=32, kv_cache="paged", parallelism=plan)


def test_new_weights_reach_the_sampler_and_bad_requests_are_refused():
    config = CONFIGS["llama"]()
    first, second = build(config, rngs=nnx.Rngs(0)), build(config, rngs=nnx.Rngs(7))
    prompts = prompts_of(5, seed=3)
    sampler = Sampler(first, slots=2, max_length=32)
    before = sampler.sample(prompts, SamplingParams(8))
    sampler.update_weights(second)
    after = sampler.sample(prompts, SamplingParams(8))
    fresh = Sampler(second, slots=2, max_length=32).sample(prompts, SamplingParams(8))
    assert [c.tokens.tolist() for c in after] == [c.tokens.tolist() for c in fresh]
    assert [c.tokens.tolist() for c in after] != [c.tokens.tolist() for c in before]
    with pytest.raises(ValueError, match="prompt 1: 20 tokens \\(padded to 32\\) \\+ "
                                         "max_new_tokens=8 exceeds the Sampler's max_length=32"):
        sampler.sample([[7], [7] * 20], SamplingParams(8))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sampler.sample([[]], SamplingParams(8))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(0)
    t5 = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                               num_heads=2, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="encoder-decoder"):
        Sampler(build(t5, rngs=nnx.Rngs(0)), max_length=8)


def _equations(closed):
    """Every equation of a jaxpr and of the jaxprs inside it, each with whether it runs
    inside a while loop's body."""
    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            yield eqn, inside
            loop = eqn.primitive.name == "while"
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    sub = getattr(sub, "jaxpr", sub)
                    if isinstance(sub, jax.extend.core.Jaxpr):
                        yield from walk(sub, inside or loop)
    return walk(closed.jaxpr, False)


def _slices_in_loops(closed, shapes) -> list:
    """The equations inside a while loop's body that slice an operand of one of
    ``shapes``."""
    return [eqn for eqn, inside in _equations(closed)
            if inside and eqn.primitive.name in ("slice", "dynamic_slice", "gather", "squeeze")
            and any(getattr(v.aval, "shape", None) in shapes for v in eqn.invars)]


def _shapes(closed) -> set:
    """The shapes of every value a jaxpr (and the jaxprs inside it) computes."""
    return {tuple(v.aval.shape) for eqn, _ in _equations(closed) for v in eqn.outvars
            if hasattr(v.aval, "shape")}


def test_decoding_loops_read_stacked_layers_sliced_once_before_the_loop():
    """XLA does not hoist the slices of a loop's invariant stacked weights: ``generate``
    and the sampler's decoding round split them before their loops. Their prefill
    projects each prompt's last token only on the vocabulary."""
    model = build(CONFIGS["llama"](), rngs=nnx.Rngs(0))
    stacked = {x.shape for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param))}
    assert all(shape[0] == 2 for shape in stacked)  # the layer axis
    ids, mask = left_padded(prompts_of(3))
    looped = jax.make_jaxpr(lambda m, i, a: generate(m, i, a, max_new_tokens=4))(model, ids, mask)
    assert _slices_in_loops(looped, stacked) == []
    vocab = model.config.vocab_size
    assert (3, vocab) in _shapes(looped) and (3, ids.shape[1], vocab) not in _shapes(looped)
    sampler = Sampler(model, slots=4, max_length=32)
    from redray.post_training.slots import Slots
    rows = Slots(4, 0)
    layers = sampler._split_layers()  # once per sample call, outside the rounds
    assert not any(x.shape in stacked for x in jax.tree.leaves(layers))
    decode = sampler._decode_fn(3, (4, sampler.width), True)
    traced = jax.make_jaxpr(decode)(layers, sampler.window.cache, sampler.window.kv_valid,
                                    sampler._decode_inputs(rows, 5))
    assert _slices_in_loops(traced, stacked) == []
    prefill = sampler._prefill_fn((4, True, None), (16, sampler.width), True)
    sampler.window.t = 16
    filled = jax.make_jaxpr(prefill)(sampler.state, sampler.window.cache, sampler.window.kv_valid,
                                     sampler._prefill_inputs(
                                         np.ones((4, 16), np.int32), np.ones((4, 16), np.int32),
                                         np.arange(4, dtype=np.int32),
                                         np.arange(4, dtype=np.int32), rows))
    assert (4, 16, vocab) not in _shapes(filled) and (4, 1, vocab) in _shapes(filled)
    # what the check finds when a loop slices them (the body before the split)
    state = nnx.state(model)

    def per_step(s):
        def body(c):
            return c + nnx.merge(nnx.graphdef(model), s).layers.mlp.down_proj.kernel[...][1].sum()
        return jax.lax.while_loop(lambda c: c < 1, body, 0.0)
    assert len(_slices_in_loops(jax.make_jaxpr(per_step)(state), stacked)) >= 1


# ------------------------------------------------------------------ the losses
def test_token_logprobs_and_sft_loss_score_the_completion_only():
    model = build(CONFIGS["llama"](), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(6, 97, (3, 9)), jnp.int32)
    logits = np.asarray(model(ids), np.float64)
    logp = np.asarray(token_logprobs(model, ids))
    for b in range(3):
        for t in range(1, 9):
            row = logits[b, t - 1]
            expected = row[ids[b, t]] - (row.max() + math.log(np.exp(row - row.max()).sum()))
            assert abs(logp[b, t] - expected) < 1e-5
    assert (logp[:, 0] == 0).all()
    completion = np.zeros((3, 9), np.int32)
    completion[:, 4:] = 1
    expected = -np.mean(logp[:, 4:])
    assert abs(float(sft_loss(model, ids, completion)) - expected) < 1e-5
    everything = np.ones((3, 9), np.int32)
    assert abs(float(sft_loss(model, ids, everything)) - float(next_token_loss(model, ids))) < 1e-5


def test_dpo_loss_equals_its_formula():
    pc, pr = jnp.array([-3.0, -5.0]), jnp.array([-4.0, -2.0])
    rc, rr = jnp.array([-3.5, -4.0]), jnp.array([-3.0, -3.0])
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # margins: 0.5 * ((-3 + 3.5) - (-4 + 3)) = 0.75 and 0.5 * ((-5 + 4) - (-2 + 3)) = -1
    expected = np.mean([math.log(1 + math.exp(-0.75)), math.log(1 + math.exp(1.0))])
    assert abs(float(loss) - expected) < 1e-6
    assert float(metrics["accuracy"]) == 0.5 and abs(float(metrics["margin"]) + 0.125) < 1e-6
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    expected = np.mean([0.9 * math.log(1 + math.exp(-m)) + 0.1 * math.log(1 + math.exp(m))
                        for m in (0.75, -1.0)])
    assert abs(float(smoothed) - expected) < 1e-6
    token_logp = jnp.array([[0.0, -1.0, -2.0, -4.0]])
    assert float(sequence_logprobs(token_logp, jnp.array([[0, 0, 1, 1]]))[0]) == -6.0


def test_preference_pairs_pick_each_groups_best_and_worst():
    # a verifier's 0/1: the first right against the first wrong; a group all right or all
    # wrong gives no pair
    right = [0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert preference_pairs(right, 4).tolist() == [[1, 0]]
    assert preference_pairs(right, 2).tolist() == [[1, 0], [2, 3]]
    # a judge's graded score: the best against the worst, the first of each on ties
    assert preference_pairs([-3.0, 0.0, -9.0, -9.0, -9.0, 0.0], 3).tolist() == [[1, 2], [5, 3]]
    assert preference_pairs([2.0, 2.0, -1.0, 5.0, 5.0, 5.0], 3).tolist() == [[0, 2]]
    assert preference_pairs([1.0, 1.0], 2).shape == (0, 2)
    with pytest.raises(ValueError, match="groups of 4"):
        preference_pairs([1.0] * 6, 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        preference_pairs([1.0] * 6, 1)


def test_group_advantages_and_grpo_loss_equal_their_formulas():
    adv = np.asarray(group_advantages([1.0, 0.0, 0.0, 1.0, 2.0, 2.0], 3))
    first = np.array([1.0, 0.0, 0.0])
    np.testing.assert_allclose(adv[:3], (first - first.mean()) / (first.std() + 1e-6), rtol=1e-5)
    assert (adv[3] < 0) and adv[4] == adv[5] > 0
    np.testing.assert_allclose(group_advantages([3.0, 3.0], 2), [0.0, 0.0])
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0] * 6, 4)

    logp = jnp.log(jnp.array([[1.0, 0.5, 0.3, 0.2], [1.0, 0.9, 0.1, 0.4]]))
    old = jnp.log(jnp.array([[1.0, 0.4, 0.3, 0.5], [1.0, 0.5, 0.1, 0.4]]))
    ref = jnp.log(jnp.array([[1.0, 0.5, 0.6, 0.2], [1.0, 0.9, 0.2, 0.4]]))
    mask = jnp.array([[0, 1, 1, 1], [0, 1, 1, 0]])
    advantages = jnp.array([2.0, -1.0])
    loss, metrics = grpo_loss(logp, old, advantages, mask, clip=0.2)
    # ratios: row 0: 1.25 (clipped to 1.2 for a positive advantage), 1, 0.4 (min keeps
    # 0.4 * 2); row 1: 1.8 (min(-1.8, -1.2) = -1.8), 1
    row0 = np.mean([1.2 * 2, 1.0 * 2, 0.4 * 2])
    row1 = np.mean([-1.8, -1.0])
    assert abs(float(loss) + (row0 + row1) / 2) < 1e-5
    assert abs(float(metrics["clipped"]) - 3 / 5) < 1e-6
    token_loss, _ = grpo_loss(logp, old, advantages, mask, clip=0.2, average="token")
    assert abs(float(token_loss) + (3 * row0 + 2 * row1) / 5) < 1e-5
    # the KL estimator exp(r - p) - (r - p) - 1 per token, times the coefficient
    with_kl, metrics = grpo_loss(logp, old, advantages, mask, clip=0.2, reference_logprobs=ref,
                                 kl_coef=0.1)
    d = np.log([[0.5 / 0.5, 0.6 / 0.3, 0.2 / 0.2], [0.9 / 0.9, 0.2 / 0.1, 1.0]])
    kl = np.exp(d) - d - 1
    kl0, kl1 = kl[0].mean(), kl[1, :2].mean()
    assert abs(float(with_kl) - (-(row0 - 0.1 * kl0) - (row1 - 0.1 * kl1)) / 2) < 1e-5
    assert abs(float(metrics["kl"]) - kl[0].sum() / 5 - kl[1, :2].sum() / 5) < 1e-5
    # the gradient flows through the trained policy only, and is zero off the mask
    grad = jax.grad(lambda lp: grpo_loss(lp, old, advantages, mask)[0])(logp)
    assert float(jnp.abs(grad * (1 - mask)).max()) == 0.0
    of_old = jax.grad(lambda o: grpo_loss(logp, o, advantages, mask)[0])(old)
    assert float(jnp.abs(of_old).max()) == 0


def test_each_row_samples_with_its_own_temperature_top_k_and_top_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(np.tile(probs, (4, 1))), jnp.float32)
    temperature = jnp.array([0.0, 1.0, 1.0, 1.0])
    top_k = jnp.array([0, 2, 0, 0], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 0.6, 1.0])
    keys = jax.random.split(jax.random.key(0), 4000).reshape(1000, 4)
    draw = jax.jit(jax.vmap(lambda k: sample_rows(logits, k, temperature, top_k, top_p)[0]))
    tokens = np.asarray(draw(keys))  # (1000 draws, 4 rows)
    assert (tokens[:, 0] == 0).all()                      # greedy
    assert set(tokens[:, 1]) == {0, 1}                    # the 2 most likely
    assert set(tokens[:, 2]) == {0, 1}                    # 0.5 < 0.6: the second is needed
    counts = np.bincount(tokens[:, 3], minlength=4) / 1000
    np.testing.assert_allclose(counts, probs, atol=0.05)  # the model's distribution
    token, logprob = sample_rows(logits, keys[0], temperature, top_k, top_p)
    # each row's log-probability is the model's, before top-k and top-p
    np.testing.assert_allclose(np.exp(np.asarray(logprob)), probs[np.asarray(token)], rtol=1e-5)
