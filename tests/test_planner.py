"""The planner: the cost model's parts (collectives read against XLA's compiled steps,
ring times, host spans), the pick on a small grid, pinned parts kept, an impossible
budget refused, and hardware that changes the pick."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from transformers import LlamaConfig, Qwen3Config

import redray
from redray.checkpoint import latest_meta
from redray.models import build, next_token_loss
from redray.planning.from_config import ConfigFacts, PlanError, choose_plan
from redray.sharding import collectives, flatten
from redray.planning.cost import (Parameter, StepCost, collective_levels, collective_seconds,
                                  host_spans, state_traffic, tensor_traffic)
from redray.planning.hardware import GB, PRESETS, Hardware, Link, ethernet, preset
from redray.planning.planner import _loses_on, candidates, rank
from redray.sharding.specs import trace_tree

SEQ = 32
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            tie_word_embeddings=False)
DATA = [{"ids": np.random.default_rng(i).integers(0, 256, SEQ + 1).astype(np.int32)}
        for i in range(16)]


def collate(examples):
    return {"ids": np.stack([e["ids"] for e in examples])}


def loss(model, batch, rng, train):
    return next_token_loss(model, batch["ids"], train=train)


def traffic_by_kind(traffic) -> dict:
    """kind -> bytes of the cost model's collectives, each times how often it runs."""
    out: dict = {}
    for c in traffic:
        out[c.kind] = out.get(c.kind, 0) + c.bytes * c.times
    return out


@pytest.mark.parametrize("axes,micro,scan", [
    (dict(model_axis=2, data_axis=2), None, False),
    (dict(model_axis=2, data_axis=2), 1, False),     # accumulation: 4 micro-batches
    (dict(model_axis=4, data_axis=1), None, False),
    (dict(fsdp_axis=4, data_axis=1), None, False),
    # scanned: each layer's slice gathered in the forward scan and again in the backward
    (dict(fsdp_axis=4, data_axis=1), None, True),
    (dict(fsdp_axis=2, model_axis=2, data_axis=1), None, False),  # activations on rows
    # accumulation: the gradient reduced in every micro-batch, inside the loop
    (dict(data_axis=4), 1, False),
    (dict(data_axis=4), 1, True),
])
def test_the_collectives_counted_are_those_xla_compiles(axes, micro, scan):
    """The cost model's collectives of a step (kinds, and bytes times how often each
    runs) against the compiled step's, each weighed by how often its computation runs
    (a loop's body by its trip count: the micro-batches' loop)."""
    from redray.sharding.tracing import unrolled_loops

    config = LlamaConfig(**TINY)
    t = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=scan), collate, loss,
                       optax.adam(1e-3), batch_size=8, micro_batch_size=micro, progress=False,
                       **axes)
    t.init(DATA)
    # the layers' scans unrolled: a layer's collectives apart from the others'
    with unrolled_loops():
        text = t.compiled_step().as_text()
    got = collectives.weighed_bytes(text)
    rt = t.runtime

    def forward(params, batch):
        return rt.apply(lambda m, b: loss(m, b, None, True), params, rt.abstract[1],
                        jax.random.key(0), batch)[0]

    traced_rows = 4
    trace = trace_tree(rt.abstract[0], forward,
                       ({"ids": jax.ShapeDtypeStruct((traced_rows, SEQ + 1), jnp.int32)},))
    paths, leaves, _ = flatten(rt.abstract[0])
    specs = jax.tree.leaves(rt.specs[0], is_leaf=lambda x: isinstance(x, P))
    params = [Parameter(tuple(x.shape), x.dtype.itemsize, tuple(s),
                        stacked=bool(trace.scanned.get(i)))
              for i, (x, s) in enumerate(zip(leaves, specs))]
    assert any(p.stacked for p in params) == scan
    shape = t.parallelism.shape
    accumulation = t.geometry.accumulation
    rows_split = axes.get("data_axis", 1) * axes.get("fsdp_axis", 1)
    assert accumulation == (1 if micro is None else 8 // rows_split)
    counted = (tensor_traffic(trace, params, shape, t.geometry.micro_batch_size / traced_rows,
                              4, recompute=False, accumulation=accumulation)
               + state_traffic(params, shape, 4, PRESETS["cpu"], accumulation=accumulation,
                               looped=True))
    by_kind = traffic_by_kind(counted)
    got = {k: v for k, v in got.items() if v}
    assert set(by_kind) == set(got), (by_kind, got)
    for kind, value in by_kind.items():
        # within 1%: the compiled step also reduces a few scalars (the loss, norms)
        assert value == pytest.approx(got[kind], rel=0.01), (kind, value, got[kind])


def test_fsdp_gathers_a_parameter_outside_the_layers_scan_once_before_the_micro_batches():
    """FSDP with accumulation: a parameter outside a layer scan (here every one: the
    layers unscanned) is gathered once a step, before the micro-batches' loop (XLA
    hoists the same gather out of it), as ``state_traffic(looped=True)`` counts it;
    counted in every micro-batch, the gathers would be twice the compiled step's. The
    token embedding may be the exception: XLA looks up its rows on the table's shards
    here, gathering the micro-batch's ids in the loop instead (small)."""
    config = LlamaConfig(**TINY)
    t = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=False), collate, loss,
                       optax.adam(1e-3), batch_size=8, micro_batch_size=1, progress=False,
                       fsdp_axis=2, data_axis=2)
    t.init(DATA)
    assert t.geometry.accumulation == 2
    found = collectives.counted(t.compiled_step().as_text())
    once = sum(c.bytes for c, times in found if c.kind == "all-gather" and times == 1)
    specs = jax.tree.leaves(t.runtime.specs[0], is_leaf=lambda x: isinstance(x, P))
    params = [Parameter(tuple(x.shape), x.dtype.itemsize, tuple(s))
              for x, s in zip(jax.tree.leaves(t.runtime.abstract[0]), specs)]
    counted = sum(c.bytes * c.times for c in state_traffic(
        params, t.parallelism.shape, 4, PRESETS["cpu"], accumulation=2, looped=True)
        if c.kind == "all-gather")
    table = TINY["vocab_size"] * TINY["hidden_size"] * 4
    assert counted - table <= once <= counted, (once, counted)


def test_gpipe_stages_gather_their_fsdp_layers_once_a_step():
    """FSDP inside GPipe's stages: the compiled step (its ticks unrolled) gathers each
    stacked parameter once, before the ticks, and the head once, whatever the
    micro-batches; the cost model's count (``gathered_once``, one pass) is its bytes.
    Counted per tick, as 1F1B gathers (each tick's chunk twice, the head at each), it
    would be 8.6x."""
    from redray.sharding.tracing import unrolled_loops
    from redray.sharding.parallelism import pipeline_ticks

    config = LlamaConfig(**{**TINY, "tie_word_embeddings": True})
    t = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True), collate, loss,
                       optax.adam(1e-3), batch_size=8, micro_batch_size=1, progress=False,
                       stage_axis=2, fsdp_axis=2, data_axis=1)
    t.init(DATA)
    with unrolled_loops():
        text = t.compiled_step().as_text()
    got = collectives.summarize(collectives.collectives(text))["all-gather"]["bytes"]
    rt = t.runtime
    specs = jax.tree.leaves(rt.specs[0], is_leaf=lambda x: isinstance(x, P))
    params = [Parameter(tuple(x.shape), x.dtype.itemsize, tuple(s),
                        stacked=bool(s) and s[0] == "stage")
              for x, s in zip(jax.tree.leaves(rt.held[0]), specs)]
    assert sum(p.stacked for p in params) >= 4

    def gathered(traffic):
        return sum(c.bytes * c.times for c in traffic if c.kind == "all-gather")

    shape = t.parallelism.shape
    once = gathered(state_traffic(params, shape, 4, PRESETS["cpu"], gathered_once=True))
    assert once == pytest.approx(got, rel=0.01)
    ticks = pipeline_ticks(2, t.geometry.accumulation)[1]
    per_tick = gathered(state_traffic(params, shape, 4, PRESETS["cpu"], accumulation=ticks))
    assert per_tick > 8 * got, per_tick / got


def test_1f1b_gathers_a_stage_once_and_reduces_its_gradients_once():
    """1F1B on a plan that splits the rows (here FSDP 2) runs a stage's chunks on each
    device's own rows (``pipeline_schedules.Local``): the compiled step gathers each
    stacked parameter once, before the ticks (what ``state_traffic(gathered_once=True,
    reduced_once=True)`` counts), and nothing of the stacked layers at the ticks, where
    XLA had gathered a chunk twice and all-reduced its gradient at every tick (4.6 MB
    gathered and 2.4 MB reduced, counted per tick, against 0.43 MB and 0.60 MB now).
    A chunk's forward keeps what its backward reads (``_Kept``): the step's FLOPs are
    1.04 of the same model's on FSDP 4 without stages, where the backward's recomputed
    forward had made them 1.25."""
    from redray.sharding.pipeline_schedules import one_f_one_b_table

    config = LlamaConfig(**{**TINY, "num_hidden_layers": 4})
    t = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True), collate, loss,
                       optax.adam(1e-3), batch_size=8, micro_batch_size=1, progress=False,
                       stage_axis=2, fsdp_axis=2, data_axis=1, pipeline_schedule="1f1b")
    t.init(DATA)
    compiled = t.compiled_step()
    found = collectives.counted(compiled.as_text())
    flat = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True), collate, loss,
                             optax.adam(1e-3), batch_size=8, micro_batch_size=1,
                             progress=False, fsdp_axis=4, data_axis=1)
    flat.init(DATA)
    flops = [c.cost_analysis()["flops"] for c in (compiled, flat.compiled_step())]
    assert flops[0] <= 1.1 * flops[1], flops
    rt = t.runtime
    specs = jax.tree.leaves(rt.specs[0], is_leaf=lambda x: isinstance(x, P))
    params = [Parameter(tuple(x.shape), x.dtype.itemsize, tuple(s),
                        stacked=bool(s) and s[0] == "stage")
              for x, s in zip(jax.tree.leaves(rt.held[0]), specs)]
    ticks = one_f_one_b_table(2, t.geometry.accumulation).passes
    counted = state_traffic(params, t.parallelism.shape, 4, PRESETS["cpu"], recompute=True,
                            accumulation=ticks, gathered_once=True, reduced_once=True)
    stacked = [c for c in counted if c.what.startswith("FSDP: a stage's")]
    assert {c.times for c in stacked} == {1}
    once = sum(c.bytes for c, times in found if c.kind == "all-gather" and times == 1)
    assert once == pytest.approx(sum(c.bytes for c in stacked if c.kind == "all-gather"),
                                 rel=0.01)
    # at the ticks only what is not stacked (the head's share) is gathered
    head = sum(math.prod(p.shape) * 4 for p in params if not p.stacked and len(p.shape) > 1)
    at_ticks = sum(c.bytes for c, times in found if c.kind == "all-gather" and times > 1)
    assert at_ticks <= head, (at_ticks, head)


@pytest.mark.parametrize("stages,micro", [(2, 1), (4, 2)])
def test_gpipe_passes_and_reductions_counted_are_those_xla_compiles(stages, micro):
    """GPipe's traffic on a data-parallel plan, weighed by how often each collective
    runs, against the compiled step's: three passes of a slot a tick (the rotation's
    backward passes it twice), the output's passes forward and back, the first stage's
    input gradients; the stacked layers' gradients reduced at every tick (inside the
    ticks' loop), the embeddings' and the head's once. Counted as before (two passes a
    tick, the stage's gradients reduced once after the ticks), the reductions were
    under half the compiled step's."""
    from redray.planning.cost import stage_traffic
    from redray.sharding.parallelism import pipeline_ticks

    config = LlamaConfig(**{**TINY, "num_hidden_layers": 4})
    t = redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=True), collate, loss,
                       optax.adam(1e-3), batch_size=8, micro_batch_size=micro,
                       progress=False, stage_axis=stages, data_axis=4 // stages)
    t.init(DATA)
    got = collectives.weighed_bytes(t.compiled_step().as_text())
    rt = t.runtime
    specs = jax.tree.leaves(rt.specs[0], is_leaf=lambda x: isinstance(x, P))
    paths = flatten(rt.abstract[0])[0]
    # the input embedding, untied: only looked up
    params = [Parameter(tuple(x.shape), x.dtype.itemsize, tuple(s),
                        stacked=bool(s) and s[0] == "stage", lookup="embed" in path)
              for x, s, path in zip(jax.tree.leaves(rt.held[0]), specs, paths)]
    assert sum(p.lookup for p in params) == 1
    shape = t.parallelism.shape
    m = t.geometry.accumulation
    ticks = pipeline_ticks(stages, m)[1]
    counted = (stage_traffic(shape, micro, SEQ, TINY["hidden_size"], 4, m, gpipe=True)
               + state_traffic(params, shape, 4, PRESETS["cpu"], accumulation=ticks,
                               gathered_once=True))
    by_kind = traffic_by_kind(counted)
    # (the compiled step also gathers the RNG's key bits: a few bytes)
    assert set(by_kind) == {k for k, v in got.items() if v > 1024}, (by_kind, got)
    for kind, value in by_kind.items():
        # within 2%: the compiled step also reduces a few scalars (the loss, norms)
        assert value == pytest.approx(got[kind], rel=0.02), (kind, value, got[kind])


def test_ring_collectives_cost_their_steps_on_the_link_they_cross():
    hw = Hardware("test", 1e12, 1e12, 1e9, 4, intra=Link(100.0, 1.0), inter=Link(10.0, 5.0))
    # inside a host: 2 (n - 1) / n of the bytes at 100 B/s and 2 (n - 1) latencies
    assert collective_seconds("all-reduce", 400, 4, 1, hw) == pytest.approx(
        2 * 3 / 4 * 400 / 100 + 2 * 3 * 1.0)
    assert collective_seconds("all-gather", 400, 4, 1, hw) == pytest.approx(
        3 / 4 * 400 / 100 + 3 * 1.0)
    # across 2 hosts: within each host, then a quarter of the bytes between them
    inside = 2 * 3 / 4 * 400 / 100 + 2 * 3 * 1.0
    assert collective_seconds("all-reduce", 400, 4, 2, hw) == pytest.approx(
        inside + 2 * 1 / 2 * 100 / 10 + 2 * 1 * 5.0)
    assert collective_seconds("all-reduce", 400, 1, 1, hw) == 0.0


def test_an_all_to_all_sends_all_but_a_device_own_share_over_the_link_it_crosses():
    hw = Hardware("test", 1e12, 1e12, 1e9, 4, intra=Link(100.0, 1.0), inter=Link(10.0, 5.0))
    assert collective_seconds("all-to-all", 400, 4, 1, hw) == pytest.approx(
        3 / 4 * 400 / 100 + 3 * 1.0)
    # 2 hosts x 2: a quarter stays, a quarter goes to the host's other device, half leaves
    assert collective_seconds("all-to-all", 400, 2, 2, hw) == pytest.approx(
        1 / 4 * 400 / 100 + 1.0 + 1 / 2 * 400 / 10 + 5.0)


def test_a_collective_across_slices_pays_the_data_centre_network_for_its_share():
    hw = Hardware("test", 1e12, 1e12, 1e9, 4, intra=Link(100.0, 1.0), inter=Link(100.0, 1.0),
                  dcn=Link(10.0, 5.0), slice_devices=8)
    # 8 devices: 4 of a host x 2 hosts of one slice, or 4 x 2 slices of one host each
    inside = 2 * 3 / 4 * 400 / 100 + 2 * 3 * 1.0
    in_a_slice = collective_seconds("all-reduce", 400, 4, 2, hw)
    assert in_a_slice == pytest.approx(inside + 2 * 1 / 2 * 100 / 100 + 2 * 1.0)
    across = collective_seconds("all-reduce", 400, 4, 1, hw, slices=2)
    assert across == pytest.approx(inside + 2 * 1 / 2 * 100 / 10 + 2 * 5.0)
    assert across > in_a_slice
    # what each level carries: the ring across slices on a device's quarter of the buffer
    levels = collective_levels("all-reduce", 400, 4, 2, 2, hw)
    assert [sent for sent, _ in levels] == pytest.approx([600, 100, 50])
    # an all-to-all sends half its buffer to the other slice, a point-to-point pass all of
    # it over the slowest link it crosses
    assert collective_levels("all-to-all", 400, 1, 1, 2, hw)[2] == pytest.approx(
        (200, 200 / 10 + 5.0))
    assert collective_seconds("collective-permute", 400, 1, 2, hw, slices=2) == 400 / 10 + 5.0


def test_one_slice_costs_what_it_cost_before_slices():
    # the numbers of the two-level cost model (commit 492a7a3), to the last bit
    hw = preset("h100")
    expected = {"all-reduce": (0.003958888916111111, 0.007332222272777777,
                               0.012252222307777777),
                "all-gather": (0.0019794444580555556, 0.0036661111363888886,
                               0.006126111153888889),
                "all-to-all": (0.0019794444580555556, 0.014036481579351853,
                               0.010570555629444445),
                "collective-permute": (0.0022272222377777776, 0.02001000014,
                                       0.02001000014)}
    for kind, seconds in expected.items():
        assert tuple(collective_seconds(kind, 1e9 + 7, i, a, hw)
                     for i, a in ((8, 1), (8, 3), (2, 2))) == seconds, kind
    # a preset with a data-centre network (TPU v5e's) on one slice: the planner's numbers
    # as they were
    facts = ConfigFacts("smollm3-3b", 256, "bfloat16", scan=False)
    ranking = rank(facts, 8, 2, 8, preset("tpu-v5e"))
    assert ranking.best.plan.brief() == "data=1 x fsdp=4 x model=2, micro 2, remat none"
    assert ranking.best.cost.seconds == 0.10677718343747976
    assert ranking.best.cost.levels[2] == (0.0, 0.0)
    # a saved hardware of two levels reads back as one slice
    old = {k: v for k, v in PRESETS["tpu-v5e"].to_dict().items()
           if k not in ("slice_devices", "dcn")}
    assert Hardware.from_dict(old).slices(64) == 1


def test_slices_hold_whole_hosts_and_fsdp_crosses_them_where_pinned():
    v5p = preset("tpu-v5p").in_slices(2, 32)
    assert (v5p.slice_devices, v5p.slices(32)) == (16, 2)
    with pytest.raises(ValueError, match="multiple of 2 x 4 = 8"):
        preset("tpu-v5p").in_slices(2, 12)
    # FSDP may cross slices where nothing else fits, or where pinned
    pinned = candidates(32, 8, 32, ("none",), {"fsdp_axis": 32, "micro_batch_size": 1},
                        slices=2)
    assert pinned and host_spans(pinned[0].shape, 8, 2)["fsdp"] == (4, 4, 2)


def test_host_spans_follow_the_hybrid_mesh():
    # (inside a host, hosts of a slice, slices): one slice unless said
    one = {"stage": (1, 1, 1), "expert": (1, 1, 1), "context": (1, 1, 1)}
    spans = host_spans({"data": 2, "fsdp": 2, "model": 2}, hosts=2)
    assert spans == {**one, "data": (1, 2, 1), "fsdp": (2, 1, 1), "model": (2, 1, 1)}
    spans = host_spans({"data": 1, "fsdp": 8, "model": 4}, hosts=4)  # fsdp 2 inside each host
    assert spans == {**one, "data": (1, 1, 1), "fsdp": (2, 4, 1), "model": (4, 1, 1)}
    spans = host_spans({"data": 2, "fsdp": 1, "expert": 4, "model": 2}, hosts=2)
    assert spans == {**one, "data": (1, 2, 1), "fsdp": (1, 1, 1), "expert": (4, 1, 1),
                     "model": (2, 1, 1)}
    # stages cross the hosts before the data axis does
    spans = host_spans({"stage": 2, "data": 2, "fsdp": 2}, hosts=2)
    assert spans["stage"] == (1, 2, 1) and spans["data"] == (2, 1, 1)
    assert host_spans({"data": 4, "fsdp": 1, "model": 1}, hosts=1)["data"] == (4, 1, 1)
    # the data axis crosses slices before stages do, FSDP inside a slice as far as it fits
    spans = host_spans({"stage": 2, "data": 2, "fsdp": 4}, hosts=4, slices=2)
    assert spans["data"] == (1, 1, 2) and spans["stage"] == (1, 2, 1)
    assert spans["fsdp"] == (4, 1, 1)
    spans = host_spans({"data": 1, "fsdp": 16}, hosts=4, slices=2)
    assert spans["fsdp"] == (4, 2, 2)


def test_the_grid_keeps_the_model_axis_inside_a_host_and_what_is_pinned():
    grid = candidates(8, 2, 16, ("none", "full"))
    assert grid and all(c.parallelism.sizes["model_axis"] <= 4 for c in grid)
    assert {c.remat for c in grid} == {"none", "full"}
    pinned = candidates(8, 2, 16, ("none", "full"),
                        {"model_axis": 2, "micro_batch_size": 1, "remat": "full"})
    assert pinned and all(c.parallelism.sizes["model_axis"] == 2
                          and c.geometry.micro_batch_size == 1 and c.remat == "full"
                          for c in pinned)
    assert {c.shape["data"] * c.shape["fsdp"] for c in pinned} == {4}
    rows = candidates(8, 1, 16, ("none",), {"micro_rows": 8})
    assert all(c.geometry.micro_batch_size * c.shape["data"] * c.shape["fsdp"] == 8 for c in rows)


@pytest.fixture(scope="module")
def tiny_facts():
    return ConfigFacts(LlamaConfig(**TINY), SEQ)


def test_the_pick_is_the_fastest_plan_that_fits(tiny_facts):
    from redray.planning.planner import rank

    hw = dataclasses.replace(PRESETS["cpu"], device_memory=64 * (1 << 20))
    ranking = rank(tiny_facts, 8, 2, 16, hw)
    assert ranking.ranked and all(s.fits for s in ranking.ranked)
    assert all(s.memory["total"] <= ranking.budget for s in ranking.ranked)
    times = [s.cost.seconds for s in ranking.ranked]
    assert times == sorted(times) and ranking.best.cost.seconds == min(times)
    assert all(s.memory["total"] > ranking.budget for s in ranking.over)
    assert "runner-up" in ranking.why() and "plan:" in ranking.why()


def test_pinned_parts_are_kept_and_an_impossible_budget_names_the_smallest_plan():
    hw = dataclasses.replace(PRESETS["cpu"], device_memory=64 * (1 << 20))
    ranking = choose_plan(LlamaConfig(**TINY), 8, 2, 16, SEQ, hw, model_axis=2, remat="full")
    assert all(s.plan.shape["model"] == 2 and s.plan.remat == "full"
               for s in ranking.ranked + ranking.over)
    tiny = dataclasses.replace(hw, device_memory=64 * 1024)
    with pytest.raises(PlanError, match=r"no plan fits .* per device .* the smallest, .*"
                                        r"holds .*Use more devices"):
        choose_plan(LlamaConfig(**TINY), 8, 2, 16, SEQ, tiny)
    with pytest.raises(PlanError, match="no plan of 8 devices"):
        choose_plan(LlamaConfig(**TINY), 8, 2, 16, SEQ, hw, model_axis=3)


def test_a_model_with_dropout_is_planned_from_its_config():
    """GPT-2's config has dropout: its key counts advance inside the traced gradient
    (they raised flax's TraceContextError in the FLOPs' and the work's traces)."""
    config = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=128,
                  n_positions=64, resid_pdrop=0.1)
    ranking = choose_plan(config, 4, 1, 8, 16, preset("h100"), compute_dtype="bfloat16")
    assert ranking.best.cost.compute > 0 and ranking.best.cost.memory > 0


def test_the_published_runs_pinned_reproduce_their_configurations():
    """benchmarks/planner_published.py's runs, pinned: the plans costed are the
    published ones' (axis sizes, sequences per GPU per pass), and the prediction is
    read in the published figure's unit (MaxText's FLOPs per token)."""
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "planner_published.py")
    spec = importlib.util.spec_from_file_location("planner_published", path)
    published = importlib.util.module_from_spec(spec)
    sys.modules["planner_published"] = published  # its dataclasses look it up
    spec.loader.exec_module(published)
    runs = {r.name.split(",")[0]: r for r in published.RUNS}
    maxtext = published.predict(runs["MaxText Llama-2-7B"], own=False)
    assert maxtext["plan"] == "data=1 x fsdp=8 x model=1, micro 4, remat dots"
    assert maxtext["predicted"] == pytest.approx(
        maxtext["predicted_tokens_per_s_per_gpu"]
        * published.flops_per_token(published.LLAMA2_7B, 4096) / 1e12)
    # 6 x 6.61e9 matmul parameters + 6 x 32 layers x 4096 x 4096 per token
    assert published.flops_per_token(published.LLAMA2_7B, 4096) == pytest.approx(
        6 * (32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 4096 * 32000)
        + 6 * 32 * 4096 * 4096)
    assert runs["MaxText Llama-3.1-70B"].pinned["fsdp_axis"] == 256


def test_no_plan_names_the_constraint_that_left_none():
    """A batch no split takes: the refusal names the data-parallel size the batch must be
    a multiple of and the stage counts above the layers, not the pinned sizes. (Unpinned,
    one sequence on 8 devices of 2 hosts is split over a context axis instead.)"""
    hw = dataclasses.replace(PRESETS["cpu"], device_memory=1 << 30)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 3})
    shape = choose_plan(config, 8, 2, 1, SEQ, hw, scan=True).best.plan.shape
    assert shape["data"] * shape["fsdp"] == 1 and shape["context"] >= 2, shape
    from redray.planning.planner import rank

    with pytest.raises(ValueError) as e:  # whole sequences; 3 layers: 4 stages are more
        rank(ConfigFacts(config, SEQ, scan=True), 8, 2, 1, hw, pinned={"context_axis": 1})
    text = str(e.value)
    assert "takes a batch of 1" in text and "does not divide the batch" in text
    assert "the smallest, 2, would take a batch that is a multiple of 2" in text
    assert "needs one of the model's 3 stacked layers ([4, 8] stages are more: use at most " \
        "3)" in text
    assert "pinned axis sizes do not split" not in text
    with pytest.raises(PlanError, match="the pinned axis sizes do not split the devices"):
        choose_plan(config, 8, 2, 16, SEQ, hw, model_axis=3)


def test_an_ethernet_cluster_gets_another_plan_than_an_infiniband_one():
    # the layers as a list: no pipeline stages (test_pipeline has the planner's stages)
    infiniband = choose_plan("llama-7b", 64, 8, 256, 4096, preset("h100"),
                             compute_dtype="bfloat16", scan=False)
    over_ethernet = choose_plan("llama-7b", 64, 8, 256, 4096, ethernet(PRESETS["h100"]),
                                compute_dtype="bfloat16", scan=False)
    assert infiniband.best.plan != over_ethernet.best.plan
    # over Ethernet the gradient and FSDP traffic is what the step waits for
    assert over_ethernet.best.cost.exposed > over_ethernet.best.cost.compute / 2
    # over InfiniBand the layers' compute hides it but the first layer's gather and
    # the last one's reduction (redray.planning.cost.exposed_seconds)
    assert 0 < infiniband.best.cost.exposed < infiniband.best.cost.compute / 20
    assert ethernet(PRESETS["h100"]).inter.bandwidth == pytest.approx(100 / 8 * GB / 8)


def test_presets_name_their_sources():
    for name, hw in PRESETS.items():
        assert hw.source and hw.peak_flops >= hw.matmul_flops, name
        assert Hardware.from_dict(hw.to_dict()) == hw, name  # as a plan keeps it
    assert preset("a100+ethernet").name == "A100 80GB SXM over 100 Gb/s Ethernet"
    with pytest.raises(ValueError, match="unknown hardware 'v100'.*h100"):
        preset("v100")


def test_a_trainer_with_plan_auto_runs_the_planners_pick():
    config = LlamaConfig(**TINY)
    options = dict(batch_size=8, progress=False, log_every=1)

    def make(**kw):
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs), collate, loss,
                              optax.adam(1e-3), **options, **kw)

    auto = make(plan="auto", hardware="cpu", model_axis=2)
    auto.init(DATA)
    best = auto.plan_ranking.best.plan
    assert auto.parallelism.shape == best.shape and best.shape["model"] == 2  # pinned: kept
    assert auto.geometry.micro_batch_size == best.geometry.micro_batch_size
    assert auto.describe()["planner"]["chosen"] == best.brief()
    assert auto.describe()["planner"]["hardware"] == "CPU (simulated devices)"
    assert auto.plan.hardware == PRESETS["cpu"].to_dict()  # what its own choices weigh on
    # the plan it chose is the plan given by hand: the same steps
    shape = best.shape
    by_hand = make(data_axis=shape["data"], fsdp_axis=shape["fsdp"], model_axis=shape["model"],
                   micro_batch_size=best.geometry.micro_batch_size)
    assert [r["loss"] for r in auto.fit(DATA, epochs=1)] == \
        [r["loss"] for r in by_hand.fit(DATA, epochs=1)]
    with pytest.raises(ValueError, match="plan='auto' or a mesh"):
        make(plan="auto", mesh=redray.make_mesh())


def test_a_resumed_run_keeps_its_plan_on_the_same_devices_and_replans_on_others(tmp_path):
    config = LlamaConfig(**TINY)

    def make(**kw):
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs), collate, loss,
                              optax.adam(1e-3), progress=False, log_every=1,
                              **{"batch_size": 8, "checkpoint": str(tmp_path), **kw})

    first = make(hardware="cpu")
    first.fit(DATA, epochs=1)
    chosen = first.plan_ranking.best.plan
    # resumed with the same devices, batch and hardware: no planning, the same plan
    # (the planner's pick follows timings, and another plan would round differently)
    again = make(hardware="cpu")
    again.init(DATA)
    assert again.resumed_from["step"] == first.step and again.plan_ranking is None
    assert again.plan == first.plan  # every part, the hardware numbers it weighs on too
    assert again.parallelism.shape == chosen.shape
    assert again.geometry.micro_batch_size == chosen.geometry.micro_batch_size
    # the plan the checkpoint wrote, given back: that plan, nothing planned
    pinned = make(plan=latest_meta(str(tmp_path))["plan"])
    assert pinned.plan == first.plan and pinned.plan_ranking is None
    shape = chosen.shape  # the uninterrupted run, on that plan given by hand
    whole = make(checkpoint=None, data_axis=shape["data"], fsdp_axis=shape["fsdp"],
                 model_axis=shape["model"], micro_batch_size=chosen.geometry.micro_batch_size)
    resumed = [r["loss"] for r in pinned.fit(DATA, epochs=2) if "loss" in r]
    assert resumed and resumed == [r["loss"] for r in whole.fit(DATA, epochs=2)
                                   if "loss" in r and r["epoch"] == 1]
    # a given plan's checkpoint holds it too, and a run given it back resumes on it
    meta = latest_meta(str(tmp_path))
    assert meta["plan"] == pinned.plan.to_dict() and meta["plan_choice"] is None
    given = make(plan=meta["plan"])
    given.init(DATA)
    assert given.resumed_from["step"] == pinned.step and given.plan == pinned.plan
    # another batch (or other devices, other pins, other hardware): planned again
    other = make(hardware="cpu", batch_size=4)
    other.init(DATA)
    assert other.plan_ranking is not None


def test_the_probe_measures_this_runtime_and_keeps_its_numbers(tmp_path):
    from redray.planning.probe import cluster_key, probe

    measured = probe(str(tmp_path))
    assert measured.matmul_flops > 0 and measured.intra.bandwidth > 0
    # an elementwise kernel's bytes: at least 100 MB/s, at most a memory bus's 10 TB/s
    assert 1e8 < measured.memory_bandwidth < 1e13
    assert measured.devices_per_host == jax.local_device_count()
    assert measured.overlap == 0.0 and not measured.reduce_scatter  # XLA:CPU
    kept = tmp_path / f"{cluster_key()}.json"
    assert kept.exists() and "4-devices-1-hosts" in kept.name
    assert probe(str(tmp_path)) == measured  # read back, not measured again


def test_why_names_the_part_the_runner_up_loses_on_or_the_tie_break():
    best = StepCost(compute=1.0, tensor=0.0, gradients=0.5, exposed=0.0, overhead=0.01,
                    traffic=())
    slower = dataclasses.replace(best, tensor=0.2)
    assert _loses_on(best, slower) == "more tensor-parallel traffic: +200 ms"
    # the same predicted step, more traffic under the compute: the sort's next key
    hidden = dataclasses.replace(best, gradients=0.8)
    assert _loses_on(best, hidden) == ("as fast predicted, with more traffic for the compute "
                                       "to hide: +300 ms")
    assert _loses_on(best, best) == "as fast predicted, with no less traffic and more memory"
    assert _loses_on(best, best, 1, 4) == ("as fast predicted, with no less traffic and 4 "
                                           "micro-batches a step, not 1")


def test_a_pass_timed_faster_with_more_rows_still_charges_each_micro_batch(tiny_facts):
    from redray.planning.live import timed_line
    from redray.planning.cost import ModelTiming
    from redray.planning.planner import rank

    assert timed_line(0.010, 0.012, 1e-6) == pytest.approx((0.008, 0.002))  # a clean line
    # the noise above the second row's cost (2 rows timed faster than 1): each example
    # costs its FLOPs at the matmul rate, the rest of the faster pass is the micro-batch's
    assert timed_line(0.010, 0.009, 1e-4) == pytest.approx((0.009 - 1e-4, 1e-4))
    # a matmul rate slower than the pass itself: at most half of the faster pass per row
    assert timed_line(0.010, 0.009, 1.0) == pytest.approx((0.0045, 0.0045))
    # planned with such a timing, the fewest micro-batches that fit win (charged nothing
    # per micro-batch, the tie went to the least memory: micro-batches of 1)
    hw = dataclasses.replace(PRESETS["cpu"], device_memory=64 * (1 << 20))
    flops = tiny_facts.flops("none")
    for t_few, t_many in ((0.010, 0.009), (0.010, 0.010)):
        fixed, per_example = timed_line(t_few, t_many, flops / hw.matmul_flops)
        tiny_facts.timing = ModelTiming(fixed, per_example, flops)
        try:
            ranking = rank(tiny_facts, 4, 1, 32, hw, {"data_axis": 4})
        finally:
            tiny_facts.timing = None
        assert ranking.best.accumulation == 1, ranking.table()
        assert ranking.best.plan.geometry.micro_batch_size == 8


def test_on_the_live_devices_the_model_is_timed_and_its_time_is_the_compute():
    from redray.planning.cost import ModelTiming

    config = LlamaConfig(**TINY)
    make = lambda **kw: redray.Trainer.of(lambda rngs: build(config, rngs=rngs), collate,  # noqa: E731
                                       loss, optax.adam(1e-3), batch_size=8, progress=False,
                                       checkpoint=False, **kw)
    live = make()  # no axis size: planned, on the probed devices
    live.init(DATA)
    timing = live.plan_ranking.timing
    assert isinstance(timing, ModelTiming) and timing.per_example > 0 and timing.fixed >= 0
    assert timing.flops_per_example > 0 and timing.update_per_element > 0
    elements = sum(x.size for x in jax.tree.leaves(live.runtime.abstract[0]))
    devices = jax.device_count()
    for scored in live.plan_ranking.ranked:
        shape = scored.plan.shape
        divided = timing.flops_per_example * 8 / devices * timing.seconds_per_flop
        if shape["model"] == 1 and shape.get("stage", 1) == 1:
            # nothing left whole: the FLOPs divide over the devices
            assert scored.cost.compute == pytest.approx(divided)
        elif shape["model"] == 1:  # stages: the layers' share stretched by the bubble
            assert scored.cost.compute > divided
        # every device updates what it holds, and each micro-batch's per-parameter work
        # is its share: all of it when only the batch is split
        held = elements / (shape["fsdp"] * shape["model"])
        assert scored.cost.overhead <= scored.accumulation * timing.fixed * (1 + 1e-9)
        if shape["fsdp"] * shape["model"] > 1 and timing.fixed > 0:
            assert scored.cost.overhead < 0.9 * scored.accumulation * timing.fixed
        if shape["data"] == devices:
            assert scored.cost.update == pytest.approx(held * timing.update_per_element)
            assert scored.cost.overhead == pytest.approx(scored.accumulation * timing.fixed)
        assert scored.cost.update <= elements * timing.update_per_element * (1 + 1e-9)
    assert live.describe()["planner"]["timed_example_ms"] == pytest.approx(
        timing.per_example * 1e3)
    on_paper = make(plan="auto", hardware="cpu")  # a preset: nothing is timed
    on_paper.init(DATA)
    assert on_paper.plan_ranking.timing is None


def test_a_run_too_short_to_pay_for_timing_is_planned_on_the_probed_rates(monkeypatch):
    from redray.planning import live

    config = LlamaConfig(**TINY)
    make = lambda **kw: redray.Trainer.of(lambda rngs: build(config, rngs=rngs), collate,  # noqa: E731
                                       loss, optax.adam(1e-3), batch_size=8, progress=False,
                                       checkpoint=False, **kw)
    short = make()
    short.fit(DATA, max_steps=2)
    ranking = short.plan_ranking
    assert ranking.timing is None and "a run of 2 steps" in ranking.untimed, ranking.untimed
    assert "the model's pass not timed" in ranking.why() and "plan_timing=True" in ranking.why()
    assert short.step == 2
    # the same two steps against a threshold well under their predicted time: timed
    monkeypatch.setattr(live, "TIMED_RUN_S", 2 * ranking.best.cost.seconds / 3)
    longer = make()
    longer.fit(DATA, max_steps=2)
    assert longer.plan_ranking.timing is not None and longer.plan_ranking.untimed is None
    assert "not timed" not in longer.plan_ranking.why()
    # what the user says wins either way
    never = make(plan_timing=False)
    never.fit(DATA, max_steps=2)
    assert never.plan_ranking.timing is None and never.plan_ranking.untimed == "plan_timing=False"
    monkeypatch.setattr(live, "TIMED_RUN_S", 1e9)
    always = make(plan_timing=True)
    always.fit(DATA, max_steps=2)
    assert always.plan_ranking.timing is not None
    with pytest.raises(ValueError, match="plan_timing='yes'"):
        make(plan_timing="yes")


def test_a_model_timed_once_is_read_back_until_its_programs_change(tmp_path, monkeypatch):
    from redray.planning import probe
    from redray.engine.facts import RuntimeFacts
    from redray.planning.live import model_timing
    from redray.engine.runtime import ModelRuntime

    config = LlamaConfig(**TINY)
    runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs), None)
    hardware = probe.probe(str(tmp_path))
    timed = []
    monkeypatch.setattr(probe, "_timed", lambda fn, *a, **k: timed.append(fn) or 1e-3 * len(timed))

    def facts(loss_fn, optimizer):
        return RuntimeFacts(runtime, loss_fn, optimizer, collate(DATA[:8]), None, SEQ)

    first = model_timing(facts(loss, optax.adam(1e-3)), hardware, str(tmp_path))
    assert len(timed) == 3  # the pass at 1 and 2 rows, the update
    kept = list((tmp_path / "timings").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith(probe.cluster_key())
    again = model_timing(facts(loss, optax.adam(1e-3)), hardware, str(tmp_path))
    assert len(timed) == 3 and again == first  # read back: nothing compiled or timed
    # another learning rate: the same programs, but for a constant: read back
    model_timing(facts(loss, optax.adam(3e-4)), hardware, str(tmp_path))
    assert len(timed) == 3
    # another loss, or another optimizer, is another program: timed again, kept beside
    model_timing(facts(lambda m, b, r, t: 2 * loss(m, b, r, t), optax.adam(1e-3)), hardware,
                 str(tmp_path))
    model_timing(facts(loss, optax.sgd(1e-3)), hardware, str(tmp_path))
    assert len(timed) == 9 and len(list((tmp_path / "timings").iterdir())) == 3


def test_layers_the_model_axis_leaves_whole_cost_their_whole_flops(tiny_facts):
    hw = dataclasses.replace(PRESETS["cpu"], device_memory=1 << 30)
    split = choose_plan(LlamaConfig(**TINY), 4, 1, 8, SEQ, hw, model_axis=4, micro_batch_size=2)
    # 4 heads over 8 devices: attention is left whole, its matmuls run whole on each
    whole = choose_plan(LlamaConfig(**TINY), 8, 1, 8, SEQ, hw, model_axis=8, micro_batch_size=1)
    # on CPU (no fused kernel, no memory bandwidth given) the matmuls and attention's
    # every pair at the matmul rate (redray.planning.work)
    total = tiny_facts.work().step.total
    per_example = total.matmul + total.dense_attention
    assert split.best.cost.compute == pytest.approx(per_example * 8 / 4 / hw.matmul_flops)
    assert whole.best.cost.compute > 1.5 * per_example * 8 / 8 / hw.matmul_flops


def test_a_qwen3_config_is_planned():
    # Qwen3's explicit head_dim (24, not 64 / 4) and per-head query/key norms
    config = Qwen3Config(**TINY, head_dim=24)
    hw = dataclasses.replace(PRESETS["cpu"], device_memory=64 * (1 << 20))
    ranking = choose_plan(config, 8, 2, 16, SEQ, hw, model_axis=2, remat="full")
    assert ranking.ranked and ranking.best.plan.shape["model"] == 2


def test_a_plan_for_fused_attention_counts_no_attention_scores():
    """Planned for a GPU or TPU (fused attention: inputs, output and softmax statistics
    kept for the backward pass), a step's activations hold no (queries x keys) scores;
    planned for this CPU (XLA's attention at this length) they hold each layer's."""
    import dataclasses

    from redray.planning.memory import config_activation_bytes

    seq, heads = 512, 4
    gpu = ConfigFacts(LlamaConfig(**TINY), seq, fused_attention=preset("h100").fused_attention)
    cpu = ConfigFacts(LlamaConfig(**TINY), seq, fused_attention=preset("cpu").fused_attention)
    assert gpu.fused_attention and not cpu.fused_attention and preset("tpu-v5e").fused_attention

    def saved(facts):
        step = dataclasses.replace(facts.step, batch_size=1, remat="none")
        return config_activation_bytes(facts.fam, facts.config, step, 1, 1, set(), None, 1,
                                facts.fused_attention)["saved"]

    scores = TINY["num_hidden_layers"] * heads * seq * seq * 4  # float32, every layer
    assert saved(cpu) - saved(gpu) >= scores, (saved(cpu), saved(gpu), scores)
    assert saved(gpu) < scores  # and nothing of their size left
