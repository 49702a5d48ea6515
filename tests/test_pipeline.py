"""Pipeline parallelism: the stage axis, its pass, the GPipe schedule
(``redray/models/staged_layers.py``) equal to the unpipelined step, and the Trainer on it."""

from __future__ import annotations

import re
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from jax.sharding import PartitionSpec as P
from flax import nnx

import redray
from redray.engine.runtime import ModelRuntime
from redray.models import build, next_token_loss
from redray.models.staged_layers import flops_ratio
from redray.sharding.pipeline_schedules import merge_micro, split_micro
from redray.sharding import STAGE, Parallelism
from redray.sharding.plan import Plan
from redray.sharding.parallelism import (chunk_sizes, default_micro_batches, held_layers,
                                         hybrid_shapes, layer_order, layer_positions,
                                         reorder, pipeline_ticks)
from tiny import assert_trains_as_one_device

TINY = dict(vocab_size=64, num_hidden_layers=4)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **TINY, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=64, n_layer=4, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
}
ROWS, SEQ = 16, 8
IDS = np.random.default_rng(0).integers(0, 64, (ROWS, SEQ)).astype(np.int32)


def lm_loss(model, ids):
    logits = model(ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def loss_and_grads(config, remat, micro_rows=None, loss=None, repeats=1, **axes):
    loss = loss or lm_loss
    n = int(np.prod(list(axes.values()))) if axes else 1
    plan = Parallelism.of(**({"data_axis": 1} | axes)).build(jax.devices()[:n])
    runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs, scan=True, remat=remat), plan)
    runtime.derive(loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    runtime.use(Plan(plan, micro_rows=micro_rows, stage_repeats=repeats))
    params, extra = runtime.init()
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids: runtime.apply(loss, p, e, jax.random.key(0), ids)[0]))
    value, grads = step(params, extra, IDS)
    # circular repeats hold the stacked layers in the pipeline's order: back to theirs
    grads = runtime.reorder(grads, runtime.shardings[0], False)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)], runtime


_REFERENCE = {}


def reference(family, remat):
    if (family, remat) not in _REFERENCE:
        _REFERENCE[family, remat] = loss_and_grads(CONFIGS[family](), remat)[:2]
    return _REFERENCE[family, remat]


# every split without remat; with remat (inside the stages), the deepest pipeline and
# tensor parallelism inside the stages; circular repeats (2 x 2 chunks of one layer) on
# 2S micro-batches, with fsdp and remat, and on one (a group of S padded by a bubble)
SPLITS = [(dict(stage_axis=2), False, 1, 2), (dict(stage_axis=4), False, 1, 2),
          (dict(stage_axis=2, model_axis=2), False, 1, 2),
          (dict(stage_axis=2, fsdp_axis=2), False, 1, 2),
          (dict(stage_axis=4), "full", 1, 2), (dict(stage_axis=2, model_axis=2), "full", 1, 2),
          (dict(stage_axis=2, fsdp_axis=2), "full", 2, 2), (dict(stage_axis=2), False, 2, 0)]


@pytest.mark.parametrize("axes,remat,repeats,per_stage", SPLITS,
                         ids=["stage2", "stage4", "stage2_model2", "stage2_fsdp2",
                              "stage4_remat", "stage2_model2_remat",
                              "stage2_fsdp2_circular2_remat", "stage2_circular2_one_micro"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_pipelined_step_equals_the_unpipelined_step(family, axes, remat, repeats, per_stage):
    expected, expected_grads = reference(family, remat)
    dp = axes.get("fsdp_axis", 1)
    # per_stage micro-batches per stage (0: one micro-batch in all)
    micro_rows = ROWS // (per_stage * axes["stage_axis"]) if per_stage else ROWS
    value, grads, runtime = loss_and_grads(CONFIGS[family](), remat, micro_rows,
                                           repeats=repeats, **axes)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    for got, want in zip(grads, expected_grads):  # relative to each gradient's largest entry
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), family
    # the stacked layers are split over the stages, the rest is whole over them
    specs = jax.tree.leaves(runtime.specs[0],
                            is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    shapes = [a.shape for a in jax.tree.leaves(runtime.abstract[0])]
    staged = [s[0] == STAGE.name for s in specs if len(s)]
    assert any(staged) and sum(x[0] == 4 for x in shapes) == sum(staged)
    assert micro_rows % dp == 0


UNEQUAL = [("llama", dict(stage_axis=2), 1, False), ("llama", dict(stage_axis=4), 1, False),
           ("llama", dict(stage_axis=2, fsdp_axis=2), 2, "full"),
           ("gpt2", dict(stage_axis=2, model_axis=2), 1, False)]


@pytest.mark.parametrize("family,axes,repeats,remat", UNEQUAL,
                         ids=["llama-s2", "llama-s4", "llama-s2-fsdp2-r2-remat", "gpt2-s2-model2"])
def test_stages_of_unequal_layer_counts_equal_the_unpipelined_step(family, axes, repeats, remat):
    """5 layers over 2 stages (3 and 2), over 4 (2, 1, 1, 1) and over 2 x 2 chunks: the
    plan holds the layer axis padded to a multiple of the chunks (pads: identity layers
    of zeros), the loss and every gradient those of the unpipelined step."""
    config = CONFIGS[family]()
    setattr(config, "num_hidden_layers" if family == "llama" else "n_layer", 5)
    expected, expected_grads = loss_and_grads(config, remat)[:2]
    value, grads, runtime = loss_and_grads(config, remat, ROWS // 4, repeats=repeats, **axes)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), family
    held = held_layers(5, axes["stage_axis"], repeats)
    assert runtime.stacked_layers == (5,) and held > 5
    assert {a.shape[0] for a in jax.tree.leaves(runtime.held[0])} >= {held}
    assert 5 not in {a.shape[0] for a in jax.tree.leaves(runtime.held[0])}


@pytest.mark.parametrize("layers,repeats", [(4, 1), (4, 2), (5, 1)],
                         ids=["as-they-are", "circular", "unequal"])
def test_a_given_model_is_placed_on_the_plan_s_shardings_and_read_back(layers, repeats):
    """``place`` (a built model's arrays, a Predictor's given parameters): the stacked
    arrays end on the plan's stage split, in its held form (padded, reordered) or as
    they are where it holds them so; ``bound`` reads them back as they were given."""
    config = CONFIGS["llama"]()
    config.num_hidden_layers = layers
    plan = Parallelism.of(stage_axis=2, data_axis=1).build(jax.devices()[:2])
    runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs, scan=True), plan)
    runtime.derive(lm_loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    runtime.use(Plan(plan, micro_rows=ROWS // 4, stage_repeats=repeats))
    given = jax.device_get(runtime.adapter.init(runtime.init_key))
    params, extra = runtime.place(*given)
    for got, want, held in zip(jax.tree.leaves(params), jax.tree.leaves(runtime.shardings[0]),
                               jax.tree.leaves(runtime.held[0]), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim) and got.shape == held.shape
    back = nnx.state(runtime.bound(params, extra), nnx.Param)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(given[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unequal_chunks_hold_consecutive_layers_and_at_most_one_pad_each():
    # LLaMA 3.1 405B's 126 layers over 16 stages: 14 stages of 8, the last two of 7
    assert chunk_sizes(126, 16) == [8] * 14 + [7] * 2
    order = layer_order(126, 16, 1)
    assert len(order) == 128 and sorted(order[order < 126]) == list(range(126))
    assert (order.reshape(16, 8)[-2:, -1] == 126).all()
    # 5 layers over 2 stages x 2 repeats: chunks of 2, 1, 1, 1; stage 0 runs chunks 0
    # and 2, stage 1 chunks 1 and 3 (a pad: 5)
    assert layer_order(5, 2, 2).tolist() == [0, 1, 3, 5, 2, 5, 4, 5]
    assert layer_positions(5, 2, 2).tolist() == [0, 1, 4, 2, 6]


def test_micro_batches_keep_the_batch_split_and_come_back_in_order():
    x = np.arange(24)
    parts = np.asarray(split_micro(jnp.asarray(x), 3, 2))
    # 2 shards of 12 rows over the batch axes; micro-batch m takes part m of each
    assert parts.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 16, 17, 18, 19],
                              [8, 9, 10, 11, 20, 21, 22, 23]]
    assert np.asarray(merge_micro(jnp.asarray(parts), 2)).tolist() == x.tolist()


def test_the_schedule_formula():
    # all the work in the layers: a stage's share stretched by the bubble
    assert flops_ratio(4, 8, 1.0) == pytest.approx(11 / 32)
    assert flops_ratio(1, 1, 0.7) == pytest.approx(1.0)
    assert flops_ratio(2, 2, 0.0) == pytest.approx(0.5)  # the head split over the stages
    # circular: 8 x 2 items of a quarter-stage's work, 3 ticks of bubble
    assert flops_ratio(4, 8, 1.0, repeats=2) == pytest.approx(19 / 64)
    # 6 micro-batches go round in 2 groups of 4: 2 of the 8 slots are bubbles
    assert pipeline_ticks(4, 6, 2) == (8, 19) and pipeline_ticks(4, 6, 1) == (6, 9)


def test_circular_repeats_hold_each_stage_s_chunks_in_its_block():
    # 8 layers, 2 stages, 2 repeats: chunks of 2, chunk c on stage c mod 2; stage 0's
    # block (the first 4 positions) holds chunks 0 and 2, stage 1's chunks 1 and 3
    assert layer_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert layer_order(8, 4, 1).tolist() == list(range(8))
    # the stacked arrays (split over stage) move to that order and back; the rest stays
    plan = Parallelism.of(stage_axis=2, data_axis=1).build(jax.devices()[:2])
    stacked, whole = (jax.sharding.NamedSharding(plan.mesh, P(*s)) for s in (("stage",), ()))
    tree = {"layers": jnp.arange(8.0), "head": jnp.arange(8.0)}
    moved = reorder(tree, {"layers": stacked, "head": whole}, 2, 2, True)
    assert moved["layers"].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert moved["head"].tolist() == list(range(8))
    back = reorder(moved, {"layers": stacked, "head": whole}, 2, 2, False)
    assert back["layers"].tolist() == list(range(8))


def test_default_micro_batches_leave_a_small_bubble():
    assert default_micro_batches(64, 1) == 1
    assert default_micro_batches(64, 2) == 8 and default_micro_batches(64, 4) == 16
    assert default_micro_batches(12, 2) == 12  # no divisor from 8 to 12 but 12 itself
    plan = Parallelism.of(stage_axis=2).build()
    assert plan.geometry(32).accumulation == 8 and plan.geometry(32).micro_batch_size == 2


def test_stages_cross_hosts_first():
    # 2 hosts of 4 devices: stage 2 x data 4 puts the stages across the hosts, the data
    # axis inside them (AXES order: stage, data, fsdp, expert, context, model)
    across, inside = hybrid_shapes((2, 4, 1, 1, 1, 1), 2, 4)
    assert across == (2, 1, 1, 1, 1, 1) and inside == (1, 4, 1, 1, 1, 1)
    # and fsdp stays inside while stages cross
    across, inside = hybrid_shapes((2, 1, 4, 1, 1, 1), 2, 4)
    assert across == (2, 1, 1, 1, 1, 1)


def test_stages_need_scanned_layers_and_one_a_chunk():
    config = CONFIGS["llama"]()
    with pytest.raises(ValueError, match="stage_axis=2 needs the layers stacked and scanned"):
        plan = Parallelism.of(stage_axis=2, data_axis=1).build(jax.devices()[:2])
        runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs, scan=False), plan)
        runtime.derive(lm_loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="stage_axis=4 is more than the model's 3 layers"):
        loss_and_grads(config, False, 4, stage_axis=4)
    with pytest.raises(ValueError, match="stage_axis=2 x stage_repeats=2 = 4 chunks is more "
                                         "than the model's 3 layers"):
        loss_and_grads(config, False, 4, repeats=2, stage_axis=2)
    with pytest.raises(ValueError, match="stage_repeats=2 needs pipeline stages"):
        redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True),
                       lambda ex: {"ids": np.stack(ex)}, lambda m, b, r, t: lm_loss(m, b["ids"]),
                       optax.sgd(0.1), batch_size=4, data_axis="auto", stage_repeats=2,
                       progress=False).init(list(IDS[:4]))


@pytest.mark.parametrize("layers,repeats", [(4, 2), (5, 1)], ids=["circular", "unequal"])
def test_a_trainer_on_stages_trains_as_one_device_and_its_checkpoint_loads_without(
        tmp_path, layers, repeats):
    """On a circular plan (2 repeats), and on stages of unequal layer counts (5 layers
    over 2 stages, then over 4): the Trainer's path is GPipe's plus the reorder of the
    stacked arrays at the checkpoint's edges (pads dropped), so this covers both
    (GPipe's steps are checked exactly above)."""
    config = CONFIGS["llama"]()
    config.num_hidden_layers = layers
    data = [{"ids": row} for row in np.random.default_rng(1).integers(0, 64, (32, SEQ))]

    def loss(model, batch, rng, train):
        return lm_loss(model, batch["ids"])

    def trainer(name, **kw):
        # momentum: optimizer state that follows the stacked parameters' order too
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True),
                              lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss,
                              optax.sgd(0.5, momentum=0.5), batch_size=8, progress=False,
                              log_every=1, checkpoint=redray.CheckpointConfig(
                                  str(tmp_path / name), save_every=2), **kw)

    one = [r["loss"] for r in trainer("one", mesh=redray.make_mesh(
        devices=jax.devices()[:1])).fit(data, epochs=1)]
    staged = trainer("staged", stage_axis=2, data_axis=2, micro_batch_size=1,
                     stage_repeats=repeats)
    first = [r["loss"] for r in staged.fit(data, epochs=1, max_steps=2)]
    assert staged.describe()["accumulation_steps"] == 4  # 4 pipeline micro-batches
    assert staged.describe().get("stage_repeats", 1) == repeats
    np.testing.assert_allclose(first, one[:2], rtol=1e-5)
    # the same parameter tree: a run without stages resumes from the pipelined
    # checkpoint, and a pipelined run from its checkpoint in turn
    plain = trainer("staged", data_axis=4)
    plain.init(data)
    # the model a user reads holds the layers in their own order, whatever the plan
    for got, want in zip(jax.tree.leaves(nnx.state(staged.model, nnx.Param)),
                         jax.tree.leaves(nnx.state(plain.model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    middle = [r["loss"] for r in plain.fit(data, epochs=1, max_steps=3)]
    again = trainer("staged", stage_axis=4 // repeats, micro_batch_size=2,
                    stage_repeats=repeats)
    last = [r["loss"] for r in again.fit(data, epochs=1)]
    assert plain.resumed_from is not None and again.resumed_from is not None
    np.testing.assert_allclose(first + middle + last, one, rtol=1e-5)
    assert len(one) == 4


def test_the_planner_puts_stages_across_a_slow_link_and_not_a_fast_one():
    from redray.planning.from_config import ConfigFacts
    from redray.planning.cost import host_spans
    from redray.planning.hardware import PRESETS, ethernet, preset
    from redray.planning.planner import rank

    facts = ConfigFacts("llama-7b", 4096, "bfloat16", scan=True)
    over_infiniband = rank(facts, 16, 2, 64, preset("h100"))
    assert over_infiniband.best.plan.shape["stage"] == 1
    over_ethernet = rank(facts, 16, 2, 64, ethernet(PRESETS["h100"], 25))
    best = over_ethernet.best
    assert best.plan.shape["stage"] == 2 and best.cost.pipeline > 0
    assert host_spans(best.plan.shape, 2)["stage"] == (1, 2, 1)  # across the hosts
    # what it saves: FSDP's traffic over the slow link, which the compute cannot hide
    unstaged = next(s for s in over_ethernet.ranked if s.plan.shape["stage"] == 1)
    assert best.cost.exposed < unstaged.cost.exposed / 10
    # the pipeline's memory: every micro-batch's activations and the buffers
    assert best.memory["parts"]["pipeline_buffers"] > 0


def test_the_planner_weighs_1f1b_beside_gpipe_and_takes_it_where_gpipe_does_not_fit():
    """Every plan with stages is tried with both schedules. 1F1B's layers cost what GPipe's
    do (its chunks keep their activations: no forward again) and its activations are the
    chunk passes it keeps at once, each one micro-batch's share of a stage; recomputing each
    chunk, a forward more for one chunk's at a time: LLaMA-7B on 2 hosts over 25 Gb/s
    Ethernet, 16 GB per device, the pick is a 1F1B plan whose GPipe twin does not fit."""
    import dataclasses

    from redray.planning.from_config import ConfigFacts
    from redray.planning.hardware import PRESETS, ethernet
    from redray.planning.cost import work_seconds
    from redray.planning.planner import rank

    facts = ConfigFacts("llama-7b", 4096, "bfloat16", scan=True)
    assert facts.one_f_one_b
    small = dataclasses.replace(ethernet(PRESETS["h100"], 25), device_memory=16e9)
    ranking = rank(facts, 16, 2, 64, small)
    best = ranking.best
    assert best.plan.pipeline_schedule == "1f1b" and best.plan.shape["stage"] == 2
    twin = next(s for s in ranking.over if s.plan == dataclasses.replace(
        best.plan, pipeline_schedule="gpipe", stage_recompute=False))
    assert twin.memory["total"] > best.memory["total"]
    assert twin.memory["parts"]["activations"] > 4 * best.memory["parts"]["activations"]
    # no forward again: the compute GPipe's twin is charged (remat none)
    every = ranking.ranked + ranking.over
    one = next(s for s in every if s.plan.pipeline_schedule == "1f1b"
               and s.plan.remat == "none" and s.plan.shape["model"] == 1
               and s.plan.stage_repeats == 1 and not s.plan.stage_recompute)
    gpipe = next(s for s in every if s.plan == dataclasses.replace(
        one.plan, pipeline_schedule="gpipe"))
    counted = facts.work()
    stages, micro = one.plan.shape["stage"], one.accumulation
    assert one.cost.compute == pytest.approx(gpipe.cost.compute, rel=1e-9)
    # recomputing each chunk (Plan.stage_recompute): its forward once more, at every
    # tick, for one chunk's activations at a time
    again = next(s for s in every if s.plan == dataclasses.replace(one.plan,
                                                                   stage_recompute=True))
    ticks = (micro + stages - 1) / micro  # M + S - 1 ticks, M of them real
    assert again.cost.compute - one.cost.compute == pytest.approx(
        work_seconds(counted.forward.layer, small) * counted.step.layers * 64 / 16 * ticks,
        rel=1e-9)
    assert again.memory["parts"]["activations"] < one.memory["parts"]["activations"]
    # interleaved (repeats): the bubble (S - 1) / (M R) of the layers' work, for R times
    # the passes between the stages
    twice = next(s for s in every if s.plan == dataclasses.replace(one.plan, stage_repeats=2))
    layers = work_seconds(counted.step.layer, small) * counted.step.layers * 64 / 16
    assert one.cost.compute - twice.cost.compute == pytest.approx(
        layers * (stages - 1) / micro * (1 - 1 / 2), rel=1e-9)
    assert twice.cost.pipeline > one.cost.pipeline
    # pinned, or a model it cannot cut (an encoder-decoder): GPipe only
    pinned = rank(facts, 16, 2, 64, ethernet(PRESETS["h100"]), {"pipeline_schedule": "gpipe"})
    assert {s.plan.pipeline_schedule for s in pinned.ranked + pinned.over} == {"gpipe"}
    assert not ConfigFacts("t5-11b", 512, "bfloat16", scan=True).one_f_one_b


OTHER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    # per-layer inputs (each layer's window and rotary table) split with the stages
    "gemma3": lambda: transformers.Gemma3TextConfig(**OTHER, head_dim=8, sliding_window=4),
    # a mixture of experts: its shard_map inside the stages
    "mixtral": lambda: transformers.MixtralConfig(**OTHER, num_local_experts=4,
                                                  num_experts_per_tok=2),
    # an encoder-decoder: both stacks pipelined, the encoder's output split with the rows
    "t5": lambda: transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, num_heads=4,
                                        d_ff=64, num_layers=4, num_decoder_layers=4,
                                        decoder_start_token_id=0, dropout_rate=0.0),
}


def t5_loss(model, ids):
    """A sequence-to-sequence loss: the ids in, the ids out."""
    logits = model(ids[:, 1:], decoder_input_ids=ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_pipeline_exactly(family):
    loss = t5_loss if family == "t5" else lm_loss
    expected, expected_grads, _ = loss_and_grads(FAMILIES[family](), False, loss=loss)
    value, grads, _ = loss_and_grads(FAMILIES[family](), False, ROWS // 4, loss, stage_axis=2)
    assert abs(value - expected) <= 1e-5 * abs(expected)
    for got, want in zip(grads, expected_grads):
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), family


DATA2, MODEL2, FSDP2 = dict(data_axis=2), dict(model_axis=2), dict(fsdp_axis=2, data_axis=1)


@pytest.mark.parametrize("layers,repeats,schedule,axes", [
    (4, 1, "gpipe", DATA2), (4, 2, "gpipe", DATA2), (4, 1, "1f1b", DATA2),
    (5, 1, "gpipe", DATA2), (4, 1, "gpipe", MODEL2), (4, 1, "1f1b", MODEL2),
    (4, 1, "gpipe", FSDP2)],
    ids=["gpipe", "circular", "1f1b", "unequal", "gpipe-model2", "1f1b-model2",
         "gpipe-fsdp2"])
def test_the_memory_plan_of_a_pipelined_step_is_checked_against_the_compiled_step(
        layers, repeats, schedule, axes):
    """``plan_model``'s count of a pipelined step (every tick's activations kept,
    ``pipelined_parts``) within 0.8-1.25 of XLA's compiled peak on CPU, GPipe's and the
    circular one's (whose ticks keep no copy of their chunk of the parameters), on 5
    layers over 2 stages (3 and 2: the held pad counted, in the parameters and the
    ticks' activations), with tensor parallelism inside the stages (the slots'
    features split over the model axis, GPipe's and 1F1B's: half the buffers), and
    with FSDP inside GPipe's stages (a stage's layers held gathered, and their
    gradients, for the whole step: 0.79 of the peak when counted as 2 layers)."""
    from redray.planning.memory import StepShape
    from redray.planning.from_config import plan_model

    from tiny import memory_case

    config, data, collate, loss = memory_case(layers, 16)
    trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True), collate, loss,
                             optax.adamw(1e-3), batch_size=16, micro_batch_size=1,
                             progress=False, stage_axis=2, stage_repeats=repeats,
                             pipeline_schedule=schedule, **axes)
    trainer.init(data)
    peak = trainer.memory(device_gib=1)["compiled"]["peak"]
    planned = plan_model(config, 4, stage_axis=2, **axes,
                         step=StepShape(batch_size=16, seq_len=64,
                                        micro_batch_size=axes.get("data_axis", 1)
                                        * axes.get("fsdp_axis", 1),
                                        stage_repeats=repeats, pipeline_schedule=schedule))
    assert planned["memory"]["parts"]["pipeline_buffers"] > 0
    assert 0.8 <= planned["memory"]["total"] / peak <= 1.25, (planned["memory"], peak)
    # the Trainer's own count holds the pad too: the same parameters and activations
    counted = trainer.memory(device_gib=1)["parts"]
    for part in ("parameters", "activations"):
        assert counted[part] == pytest.approx(planned["memory"]["parts"][part], rel=0.1), part


# ------------------------------------------------------------------ 1F1B
@pytest.mark.parametrize("family,axes,micro,repeats", [
    ("llama", dict(stage_axis=2), 4, 1), ("llama", dict(stage_axis=4), 6, 1),
    ("gpt2", dict(stage_axis=2, fsdp_axis=2), 3, 1), ("llama", dict(stage_axis=2), 4, 2),
    ("gpt2", dict(stage_axis=2, fsdp_axis=2), 3, 2)],
    ids=["llama-s2", "llama-s4", "gpt2-s2-fsdp2", "llama-s2-r2", "gpt2-s2-fsdp2-r2"])
def test_one_f_one_b_equals_the_unpipelined_gradient(family, axes, micro, repeats):
    """The 1F1B schedule's loss and gradients (the stages' layers, the tail's parameters,
    and through the first stage's inputs the embeddings) equal JAX's gradient of the
    same micro-batch losses without a pipeline: 4 micro-batches on 2 stages (the ring of
    3 inputs wraps), 6 on 4 (fewer than the ring's 7 slots), FSDP inside the stages;
    interleaved (2 chunks a stage, held in ``layer_order``), with micro-batches that
    fill their groups of 2 and with a last group of 1."""
    from pipeline_pieces import decoder_pieces

    pieces = decoder_pieces(CONFIGS[family](), IDS[:ROWS // micro * micro], micro)
    expected, expected_grads = jax.jit(jax.value_and_grad(pieces.reference))(pieces.params)
    plan = Parallelism.of(data_axis=1, **axes).build(
        jax.devices()[:int(np.prod(list(axes.values())))])
    value, grads = jax.jit(lambda p: pieces.one_f_one_b(p, plan.mesh, repeats))(pieces.params)
    assert abs(float(value) - float(expected)) <= 1e-5 * abs(float(expected))
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=1e-5 * float(np.max(np.abs(want))) + 1e-12,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_one_f_one_b_schedule_holds_2s_minus_1_inputs_whatever_the_micro_batches():
    from redray.sharding.pipeline_schedules import one_f_one_b_schedule

    assert one_f_one_b_schedule(4, 8) == (14, 7)
    assert one_f_one_b_schedule(4, 64) == (70, 7)
    assert one_f_one_b_schedule(1, 5) == (5, 1)
    # the lifetimes the ring must hold: stage s keeps micro-batch m from tick m + s to
    # tick m + 2 (S - 1) - s; at no tick more than 2 S - 1 are held by any stage
    for S in (2, 3, 4):
        M = 3 * S
        held = max(sum(m + s <= t <= m + 2 * (S - 1) - s for m in range(M))
                   for s in range(S) for t in range(M + 2 * (S - 1)))
        assert held == one_f_one_b_schedule(S, M)[1]


@pytest.mark.parametrize("S,M,R", [(4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 7, 2),
                                   (8, 16, 4)])
def test_the_interleaved_schedule_keeps_every_dependency_and_megatrons_bubble(S, M, R):
    """The table ``one_f_one_b`` runs, read back: every chunk's forward and backward of
    every micro-batch once, each after what it needs (the previous chunk's forward, the
    next chunk's backward; the last chunk's backward from the tick of its forward), the
    slots read where they were filled; the length Megatron-LM's interleaved schedule
    has where S divides M (a bubble of (S - 1) / (M R)), and its inputs held: 2 (S - 1)
    + (R - 1) S + 1; the chunk passes whose activations a stage keeps at once, from
    forward to backward (2 S - 1 on the first stage without repeats: a micro-batch goes
    one stage a tick both ways, where Megatron-LM's 1F1B, its forward a third of a tick,
    keeps S)."""
    from redray.sharding.pipeline_schedules import one_f_one_b_table

    schedule = one_f_one_b_table(S, M, R)
    col = schedule.column
    f_at, b_at, f_slot, b_slot, f_kept, b_kept = {}, {}, {}, {}, {}, {}
    for t in range(schedule.ticks):
        for s in range(S):
            if col("forward")[t, s]:
                key = (int(col("f_repeat")[t, s]) * S + s, int(col("f_micro")[t, s]))
                assert key not in f_at
                f_at[key], f_slot[key] = t, int(col("f_slot")[t, s])
                f_kept[key] = int(col("f_kept")[t, s])
            if col("backward")[t, s]:
                key = (int(col("b_repeat")[t, s]) * S + s, int(col("b_micro")[t, s]))
                assert key not in b_at
                b_at[key], b_slot[key] = t, int(col("b_slot")[t, s])
                b_kept[key] = int(col("b_kept")[t, s])
    every = {(v, m) for v in range(S * R) for m in range(M)}
    assert set(f_at) == set(b_at) == every
    for v, m in every:
        assert v == 0 or f_at[(v - 1, m)] < f_at[(v, m)]
        assert (f_at[(v, m)] <= b_at[(v, m)] if v == S * R - 1
                else b_at[(v + 1, m)] < b_at[(v, m)])
        assert b_slot[(v, m)] == f_slot[(v, m)]  # the input kept to its backward
        assert b_kept[(v, m)] == f_kept[(v, m)] < schedule.kept_slots
        if v:  # it arrived at the start of the tick after the previous chunk's forward
            assert col("store")[f_at[(v - 1, m)] + 1, v % S] == f_slot[(v, m)]
    # no slot is filled again while its input waits for its backward
    for s in range(S):
        mine = [(f_at[(v - 1, m)] + 1 if v else f_at[(v, m)], b_at[(v, m)], f_slot[(v, m)])
                for v, m in every if v % S == s]
        kept = [(f_at[(v, m)], b_at[(v, m)], f_kept[(v, m)]) for v, m in every if v % S == s]
        for held in (mine, kept):
            for a in held:
                for b in held:
                    assert a is b or a[2] != b[2] or a[1] < b[0] or b[1] < a[0]
    in_flight = max(sum(f_at[k] <= t <= b_at[k] for k in every if k[0] % S == s)
                    for s in range(S) for t in range(schedule.ticks))
    assert schedule.kept_slots == in_flight
    if M % S == 0:
        assert schedule.passes == M * R + S - 1
        assert schedule.slots == 2 * (S - 1) + (R - 1) * S + 1
        if R == 1:
            assert schedule.kept_slots == 2 * S - 1


@pytest.mark.parametrize("family,axes,layers", [
    ("llama", dict(stage_axis=2, data_axis=2), 4), ("gpt2", dict(stage_axis=2, fsdp_axis=2), 4),
    ("llama", dict(stage_axis=2, data_axis=2, stage_repeats=2), 5),
    ("llama", dict(stage_axis=2, model_axis=2), 4)],
    ids=["llama-s2-data2", "gpt2-s2-fsdp2", "llama-5-layers-s2-r2-data2", "llama-s2-model2"])
def test_a_trainer_on_1f1b_trains_as_one_device(family, axes, layers):
    """``pipeline_schedule="1f1b"``: the user's loss cut at the stacked layers, each
    micro-batch's loss weighed by the tokens it learns (a mask that keeps a different number
    in each row: the loss gives its count as its weight); the losses of 3 steps and the
    parameters after them those of one device, whose loss is the mean over every kept token
    of the batch (a chunked loss: where the rows are split, its padding moves by a
    collective-permute among every device, so every stage runs the tail where the last does,
    or the others would wait for ever); interleaved too (``stage_repeats=2``: the parameters
    held in ``layer_order``, the checkpointed ones in the layers' own), on 5 layers over 4
    chunks (one of 2 layers, three of 1 and a pad); with tensor parallelism inside the
    stages, the slots held and passed split over the model axis."""
    def loss(model, batch, rng, train):
        value, counted = next_token_loss(model, batch["ids"], loss_mask=batch["ids"] % 3 != 0,
                                         metrics=True, chunk=16)
        return value, {"twice": 2 * value, **counted}

    config = CONFIGS[family]()
    setattr(config, "num_hidden_layers" if family == "llama" else "n_layer", layers)
    history, expected = assert_trains_as_one_device(
        config, loss, SEQ, micro_batch_size=1, pipeline_schedule="1f1b", **axes)
    np.testing.assert_allclose([r["twice"] for r in history], 2 * np.array(expected), rtol=1e-5)


def test_1f1b_refuses_what_it_does_not_run_yet():
    make = lambda rngs: build(CONFIGS["llama"](), rngs=rngs, scan=True)  # noqa: E731
    common = dict(collate=lambda ex: {"ids": np.stack(ex)}, optimizer=optax.sgd(0.1),
                  batch_size=4, progress=False, stage_axis=2, data_axis=2)
    ids_loss = lambda m, b, r, t: lm_loss(m, b["ids"])  # noqa: E731
    with pytest.raises(ValueError, match="pipeline_schedule='zigzag': use one of 'gpipe', '1f1b'"):
        redray.Trainer.of(make, loss=ids_loss, pipeline_schedule="zigzag", **common)
    # an encoder-decoder runs two stacks of layers: refused when the step is traced
    t5 = redray.Trainer.of(lambda rngs: build(FAMILIES["t5"](), rngs=rngs, scan=True),
                        loss=lambda m, b, r, t: t5_loss(m, b["ids"]), pipeline_schedule="1f1b",
                        micro_batch_size=1, **common)
    with pytest.raises(ValueError, match="one stack of layers; this one runs several"):
        t5.fit(list(IDS[:8]), epochs=1, max_steps=1)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_1f1b_with_dropout_gives_the_gradient_of_its_own_loss(recompute):
    """Dropout inside the stages, each chunk's activations kept from its forward to its
    backward, or its forward recomputed there (``Plan(stage_recompute=True)``), which
    must draw the same masks (the keys salted by the step and the micro-batch,
    ``one_f_one_b.salted``). The gradient then agrees with the loss's central difference
    along it; another step's RNG draws other masks (another loss)."""
    from redray.engine.one_f_one_b import one_f_one_b_gradients

    config = transformers.GPT2Config(vocab_size=64, n_layer=4, n_embd=32, n_head=4,
                                      n_positions=64, resid_pdrop=0.2, embd_pdrop=0.2,
                                      attn_pdrop=0.2, bos_token_id=1, eos_token_id=2)
    plan = Parallelism.of(stage_axis=2, data_axis=2).build(jax.devices()[:4])
    runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs, scan=True), plan)

    def loss(model, ids, rng, train):
        logits = model(ids[:, :-1], train=train).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    runtime.derive(lambda m, ids: loss(m, ids, None, True),
                   jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    runtime.use(Plan(plan, micro_rows=4, pipeline_schedule="1f1b", stage_recompute=recompute))
    params, extra = runtime.init()
    gradients = jax.jit(one_f_one_b_gradients(runtime, loss))
    rng = jax.random.key(3)
    value, _, _, grads = gradients(params, None, extra, IDS, rng)
    norm = float(optax.tree.norm(grads))
    eps = 1e-2

    def at(t):
        moved = jax.tree.map(lambda p, g: p + t * g / norm, params, grads)
        return float(gradients(moved, None, extra, IDS, rng)[0])

    slope = (at(eps) - at(-eps)) / (2 * eps)
    assert abs(slope - norm) <= 0.02 * norm, (slope, norm)
    other = float(gradients(params, None, extra, IDS, jax.random.key(4))[0])
    assert abs(other - float(value)) > 1e-3, (other, float(value))


def test_an_automatic_plan_takes_the_schedule_it_chose():
    """``plan="auto"`` with the stages and the schedule pinned: the planner's pick
    carries the schedule and the Trainer runs it."""
    config = CONFIGS["llama"]()
    data = [{"ids": row} for row in IDS]
    trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True),
                             lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
                             lambda m, b, r, t: lm_loss(m, b["ids"]), optax.sgd(0.1),
                             batch_size=8, progress=False, plan="auto", stage_axis=2,
                             pipeline_schedule="1f1b", hardware="cpu")
    history = trainer.fit(data, epochs=1, max_steps=1)
    assert trainer.plan_ranking.best.plan.pipeline_schedule == "1f1b"
    assert trainer.runtime.pipeline_schedule == "1f1b" and np.isfinite(history[0]["loss"])
    assert "1f1b" in trainer.plan_ranking.why()


def test_an_automatic_plan_takes_the_circular_repeats_it_chose():
    """The planner tries GPipe's circular form (every repeat count up to MAX_REPEATS
    whose chunks divide a stage's layers): here pinned, the pick carries it and the
    Trainer runs it, with the loss of the plan without stages."""
    config = CONFIGS["llama"]()
    data = [{"ids": row} for row in IDS]

    def trainer(**plan):
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True),
                              lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
                              lambda m, b, r, t: lm_loss(m, b["ids"]), optax.sgd(0.1),
                              batch_size=8, progress=False, hardware="cpu", seed=0, **plan)

    circular = trainer(plan="auto", stage_axis=2, stage_repeats=2)
    history = circular.fit(data, epochs=1, max_steps=1)
    best = circular.plan_ranking.best.plan
    assert best.stage_repeats == 2 and circular.runtime.stage_repeats == 2
    assert "circular x 2" in best.brief()
    plain = trainer(data_axis=4)
    np.testing.assert_allclose(history[0]["loss"],
                               plain.fit(data, epochs=1, max_steps=1)[0]["loss"], rtol=1e-5)


def test_the_planner_weighs_circular_repeats_against_the_bubble():
    """With stages pinned and nothing else, GPipe's plans come with every repeat count
    whose chunks divide a stage's layers: the bubble's share of the layers' compute
    falls with the repeats ((P R + S - 1) / (M R) ticks of work), the passes between
    stages grow with them."""
    import dataclasses

    from redray.planning.from_config import ConfigFacts
    from redray.planning.hardware import PRESETS
    from redray.planning.planner import rank

    facts = ConfigFacts("llama-7b", 1024, "bfloat16", scan=True)
    big = dataclasses.replace(PRESETS["h100"], device_memory=1e12)
    ranking = rank(facts, 16, 2, 32, big, {"stage_axis": 4, "data_axis": 4, "fsdp_axis": 1,
                                           "micro_batch_size": 2, "remat": "dots",
                                           "pipeline_schedule": "gpipe"})
    by_repeats = {s.plan.stage_repeats: s for s in ranking.ranked}
    assert sorted(by_repeats) == [1, 2, 4, 8]  # 32 layers / 4 stages: 8 a stage
    computes = [by_repeats[r].cost.compute for r in (1, 2, 4, 8)]
    passes = [by_repeats[r].cost.pipeline for r in (1, 2, 4, 8)]
    assert computes == sorted(computes, reverse=True) and passes == sorted(passes)
    # 4 micro-batches over 4 stages: the layers' work stretches by (4 R + 3) / (4 R):
    # 7/4, 11/8, 19/16, 35/32; the rest of the compute stays
    stretch = [(4 * r + 3) / (4 * r) for r in (1, 2, 4, 8)]
    assert (computes[0] - computes[1]) / (computes[1] - computes[2]) == pytest.approx(
        (stretch[0] - stretch[1]) / (stretch[1] - stretch[2]), rel=1e-9)


def test_gpipe_passes_its_slots_split_over_the_model_axis():
    """With tensor parallelism inside the stages, GPipe holds and passes a slot's
    features split over the model axis (Megatron's sequence parallelism between the
    stages): every collective-permute of the compiled step carries half the hidden
    width, and the cost model counts the passes at that size with the gathers beside."""
    from redray.planning.cost import stage_traffic

    plan = Parallelism.of(stage_axis=2, model_axis=2, data_axis=1).build(jax.devices()[:4])
    runtime = ModelRuntime(lambda rngs: build(CONFIGS["llama"](), rngs=rngs, scan=True), plan)
    runtime.derive(lm_loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    runtime.use(Plan(plan, micro_rows=ROWS // 4))
    params, extra = runtime.init()
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids: runtime.apply(lm_loss, p, e, jax.random.key(0), ids)[0]))
    text = step.lower(params, extra, IDS).compile().as_text()
    widths = [int(m) for m in re.findall(r"f32\[[\d,]*?(\d+)\]\S* collective-permute\(", text)]
    assert widths and set(widths) == {16}, widths  # hidden 32 over model 2
    split = stage_traffic(dict(plan.shape), 1, SEQ, 32, 4, 4, split=2)
    whole = stage_traffic(dict(plan.shape), 1, SEQ, 32, 4, 4)
    assert split[0].bytes * 2 == whole[0].bytes
    assert [t.kind for t in split[-2:]] == ["all-gather", "reduce-scatter"]


def test_tensor_parallel_layers_stay_split_inside_the_stages():
    """A stage's layers on the model axis compute on their shards (all-reduces, as
    without stages): no weight is gathered whole over it, which pinning the stacked
    weights to the stage split alone made XLA do before the loop (the layers then ran
    unsplit on every device: 1.1-4x the predicted step on CPU, docs/performance/planner.md)."""
    from redray.sharding.collectives import collectives, summarize

    _, _, runtime = loss_and_grads(CONFIGS["llama"](), False, ROWS // 4, stage_axis=2,
                                   model_axis=2)
    params, extra = runtime.init()
    step = jax.jit(jax.grad(lambda p, e, ids: runtime.apply(
        lm_loss, p, e, jax.random.key(0), ids)[0]))
    found = collectives(step.lower(params, extra, IDS).compile().as_text())
    # a stage's share of a stacked weight, whole: 2 of the 4 layers
    chunks = {(2, *a.shape[1:]) for a in jax.tree.leaves(params) if a.shape[:1] == (4,)}
    gathered = [c.shapes for c in found if c.kind == "all-gather"
                and any(tuple(dims) in chunks for _, dims in c.shapes)]
    assert not gathered, gathered
    counts = summarize(found)
    assert counts["all-reduce"]["count"] > 0 and counts["collective-permute"]["count"] > 0
