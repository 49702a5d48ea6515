"""Context parallelism: one sequence split over the context axis (redray/models/context.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from redray.engine.runtime import ModelRuntime
from redray.models import build, context, next_token_loss
from redray.models.families import FAMILIES
from redray.sharding import Parallelism
from redray.planning.cost import context_method
from redray.planning.hardware import preset
from tiny import assert_trains_as_one_device, memory_case

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=64, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(  # LLaMA with a sliding window
        vocab_size=64, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5),
    "mixtral": lambda: transformers.MixtralConfig(  # experts: each token its own route
        vocab_size=64, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2),
    # Gated DeltaNet beside gated full attention: the linear layers pass their state and
    # convolution inputs across the axis (eps 1e-2: see test_linear_attention's plans)
    "qwen3_next": lambda: transformers.AutoConfig.for_model(
        "qwen3_next", **(FAMILIES["qwen3_next"].tiny | dict(vocab_size=64)), rms_norm_eps=1e-2),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
}
ROWS, SEQ = 4, 32  # the model sees 31 tokens: padded to whole zigzag chunks inside
IDS = np.random.default_rng(0).integers(0, 64, (ROWS, SEQ)).astype(np.int32)


def packed_segments(rows: int, seq: int, seed: int = 1) -> np.ndarray:
    """Rows of 2-4 documents of random lengths, the last tokens padding (segment 0)."""
    rs = np.random.default_rng(seed)
    out = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = np.sort(rs.choice(np.arange(3, seq - 3), rs.integers(1, 4), replace=False))
        ends = [*cuts, seq - rs.integers(0, 4)]
        start = 0
        for doc, end in enumerate(ends, 1):
            out[r, start:end] = doc
            start = end
    return out


SEGMENTS = packed_segments(ROWS, SEQ)


def causal_loss(model, ids, segments):
    return next_token_loss(model, ids)


def packed_loss(model, ids, segments):
    return next_token_loss(model, ids, segments, chunk=16)


LOSSES = {"causal": causal_loss, "packed": packed_loss}


def loss_and_grads(family, loss, method=None, **axes):
    n = int(np.prod(list(axes.values()))) if axes else 1
    plan = Parallelism.of(**({"data_axis": 1} | axes)).build(jax.devices()[:n])
    runtime = ModelRuntime(lambda rngs: build(CONFIGS[family](), rngs=rngs, scan=True), plan)
    abstract = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32)
    runtime.derive(loss, abstract, abstract)
    params, extra = runtime.init()
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids, seg: runtime.apply(loss, p, e, jax.random.key(0), ids, seg)[0]))
    old = os.environ.get("REDRAY_CONTEXT_ATTENTION")
    os.environ["REDRAY_CONTEXT_ATTENTION"] = method or "auto"
    try:
        compiled = step.lower(params, extra, IDS, SEGMENTS).compile()
    finally:
        if old is None:
            del os.environ["REDRAY_CONTEXT_ATTENTION"]
        else:
            os.environ["REDRAY_CONTEXT_ATTENTION"] = old
    value, grads = compiled(params, extra, IDS, SEGMENTS)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)], compiled.as_text()


_REFERENCE = {}


def reference(family, kind):
    if (family, kind) not in _REFERENCE:
        _REFERENCE[family, kind] = loss_and_grads(family, LOSSES[kind])[:2]
    return _REFERENCE[family, kind]


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * float(np.max(np.abs(w))))


# every model and mask by a ring of 4 and a gather over 2; LLaMA's causal case by both
# on both
CASES = [(f, k, c, m) for f, k in (("llama", "causal"), ("gpt2", "causal"), ("llama", "packed"),
                                   ("gpt2", "packed"), ("mistral", "causal"))
         for c, m in ((4, "ring"), (2, "all_gather"))] + \
    [("llama", "causal", 2, "ring"), ("llama", "causal", 4, "all_gather"),
     ("mixtral", "packed", 4, "ring"), ("qwen3_next", "packed", 4, "ring"),
     ("qwen3_next", "causal", 2, "all_gather")]


@pytest.mark.parametrize("family,kind,ways,method", CASES,
                         ids=[f"{f}-{k}-context{c}-{m}" for f, k, c, m in CASES])
def test_context_parallel_loss_and_gradients_equal_one_device(family, kind, ways, method):
    """The loss and every gradient with the sequence split 2 and 4 ways, by a ring and by
    an all-gather, equal the unsplit sequence's (float32, 1e-5 relative): causal, packed
    rows (segments, padding, the chunked loss) and a sliding window (Mistral's, 5 keys:
    it crosses the 4-token chunks); 31 tokens, padded inside to whole chunks."""
    got = loss_and_grads(family, LOSSES[kind], method, context_axis=ways)
    assert_same(got, reference(family, kind))
    hlo = got[2]
    if method == "ring":  # keys and values go round: a permute per step and layer
        assert "collective-permute" in hlo
    else:
        assert "all-gather" in hlo


TWO_HOSTS = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from redray.processes.jax_runtime import join_jax
join_jax({address!r}, 2, int(sys.argv[1]))
import jax
import test_context as t
from redray.sharding import Parallelism
assert jax.process_count() == 2 and len(jax.local_devices()) == 2
import warnings
with warnings.catch_warnings(record=True) as said:  # a context axis may cross hosts
    warnings.simplefilter("always")
    mesh = Parallelism.of(data_axis=1, context_axis=4).build(jax.devices()).mesh
assert not [w for w in said if "larger than a host" in str(w.message)], said
ring = [d.process_index for d in mesh.devices.reshape(-1)]
assert ring == [0, 0, 1, 1], ring  # 2 of the ring's devices on each host
value, grads, hlo = t.loss_and_grads("llama", t.packed_loss, "ring", context_axis=4)
assert "collective-permute" in hlo
if jax.process_index() == 0:
    np.savez(sys.argv[2], value, *grads)
"""


def test_a_ring_across_two_hosts_equals_one_device(tmp_path):
    """A context axis of 4 over 2 processes of 2 CPU devices (one jax.distributed
    runtime over gloo, no Ray): the ring crosses the hosts (its collective-permutes go
    between processes), and the loss and every gradient of packed rows equal one
    device's, as on one host."""
    import re
    import subprocess
    import sys

    from redray.processes.jax_runtime import served_at

    script = tmp_path / "host.py"
    script.write_text(TWO_HOSTS.format(tests=os.path.dirname(os.path.abspath(__file__)),
                                       address=served_at("127.0.0.1")))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2")
    out = tmp_path / "grads.npz"
    hosts = [subprocess.Popen([sys.executable, str(script), str(rank), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        said = [h.communicate(timeout=300)[0] for h in hosts]
    finally:
        for h in hosts:
            h.kill()
    assert [h.returncode for h in hosts] == [0, 0], "\n".join(x[-3000:] for x in said)
    with np.load(out) as saved:
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert_same((float(got[0]), got[1:]), reference("llama", "packed"))


def one_f_one_b_loss_and_grads(family, kind, method, **axes):
    """One step's loss and gradients by the 1F1B schedule (2 micro-batches of 2 rows) on
    ``axes`` with a stage axis, or on one device without one; packed rows by the chunked
    loss weighed by its tokens (``metrics=True``: the micro-batches weighed as the batch)."""
    from redray.engine.one_f_one_b import one_f_one_b_gradients
    from redray.sharding.plan import Plan

    n = int(np.prod(list(axes.values()))) if axes else 1
    plan = Parallelism.of(**({"data_axis": 1} | axes)).build(jax.devices()[:n])
    runtime = ModelRuntime(lambda rngs: build(CONFIGS[family](), rngs=rngs, scan=True), plan)

    def loss(model, batch, rng, train):
        if kind == "packed":
            return next_token_loss(model, batch["ids"], batch["segments"], chunk=16,
                                   metrics=True)
        return next_token_loss(model, batch["ids"])

    abstract = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32)
    runtime.derive(lambda m, b: loss(m, b, None, True), {"ids": abstract, "segments": abstract})
    batch = {"ids": IDS, "segments": SEGMENTS}
    os.environ["REDRAY_CONTEXT_ATTENTION"] = method
    if axes:
        runtime.use(Plan(plan, micro_rows=2, pipeline_schedule="1f1b"))
        params, extra = runtime.init()
        value, _, _, grads = jax.jit(one_f_one_b_gradients(runtime, loss))(
            params, None, extra, batch, jax.random.key(0))
    else:
        params, extra = runtime.init()
        value, grads = jax.jit(jax.value_and_grad(lambda p: jax.tree.leaves(runtime.apply(
            lambda m, b: loss(m, b, None, True), p, extra, jax.random.key(0), batch)[0])[0]))(
            params)
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]


EIGHT_DEVICES = """
import json, sys
sys.path.insert(0, "tests")
import test_context as t
from redray.sharding.pipeline_schedules import runs_on_own_rows
axes = dict(stage_axis=2, context_axis=2, data_axis=2)
assert runs_on_own_rows({"data": 2, "context": 2})
gaps = {}
for family, kind, method in [("llama", "packed", "ring"), ("qwen3_next", "packed", "all_gather"),
                             ("mixtral", "causal", "ring")]:
    want = t.one_f_one_b_loss_and_grads(family, kind, method)
    got = t.one_f_one_b_loss_and_grads(family, kind, method, **axes)
    gaps[family] = [abs(got[0] - want[0]) / abs(want[0]),
                    max(float(abs(a - b).max() / abs(b).max()) for a, b in zip(got[1], want[1]))]
print(json.dumps(gaps))
"""


def test_1f1b_on_each_devices_own_rows_splits_a_sequence_as_one_device():
    """1F1B on stage 2 x context 2 x data 2 (8 devices, a process of its own), each
    stage's chunks run on each device's own rows (``pipeline_schedules.Local``) with the
    sequence's ring or gather inside: one step's loss and every gradient as one device's
    (1e-5), for packed LLaMA rows through a chunked loss (whose padding XLA moves with a
    collective-permute among every device: the tail runs on every stage, or the stages
    that skip it wait for ever), Qwen3-Next's Gated DeltaNet passing its state (its
    convolution kernel handed to the nested ``shard_map``, not closed over) and
    Mixtral's experts (their ``shard_map`` manual over the axes not manual yet)."""
    import json
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    # no persistent compilation cache: its programs are of no other process's use
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(g <= 1e-5 for pair in gaps.values() for g in pair), gaps


@pytest.mark.parametrize("family,ways", [("llama", 4), ("gpt2", 2)])
def test_the_ring_through_a_fused_kernels_contract_equals_one_device(monkeypatch, family,
                                                                     ways):
    """The ring with cuDNN's block kernels' contract (a block's output and log-sum-exp;
    a block's gradients from the merged output and log-sum-exp), computed here by
    ``ReferenceBlocks`` in plain JAX where no GPU is: the loss and every gradient equal
    the unsplit sequence's. Plain causal rows take it; packed rows keep the blockwise
    kernel (their blocks are not causal or whole)."""
    used = []
    decide = context.ring_blocks

    def on_a_gpu(q, mask, softcap):  # the decision a bf16 model on a GPU gets
        from redray.models.attention import Target

        monkeypatch.setattr(Target, "live", classmethod(lambda cls: cls("gpu", True)))
        try:
            kernel = decide(q.astype(jnp.bfloat16), mask, softcap)
        finally:
            monkeypatch.undo()
        used.append(kernel)
        return "reference" if kernel == "cudnn" else kernel

    with monkeypatch.context() as patch:
        patch.setitem(context.BLOCK_KERNELS, "reference", context.ReferenceBlocks())
        patch.setattr(context, "ring_blocks", on_a_gpu)
        got = loss_and_grads(family, causal_loss, "ring", context_axis=ways)
        packed = loss_and_grads(family, packed_loss, "ring", context_axis=ways)
    assert used and set(used) == {"cudnn", "flash"}, used  # causal rows, packed ones
    assert_same(got, reference(family, "causal"))
    assert_same(packed, reference(family, "packed"))
    assert "collective-permute" in got[2]


@pytest.mark.parametrize("family,axes", [("llama", dict(context_axis=2, model_axis=2)),
                                         ("gpt2", dict(context_axis=2, fsdp_axis=2)),
                                         ("llama", dict(data_axis=2, context_axis=2))],
                         ids=["llama-context2-model2", "gpt2-context2-fsdp2",
                              "llama-data2-context2"])
def test_context_composes_with_the_other_axes(family, axes):
    """Context parallelism beside tensor parallelism, FSDP and data parallelism: the same
    loss and gradients as one device."""
    assert_same(loss_and_grads(family, causal_loss, "ring", **axes), reference(family, "causal"))


def test_zigzag_layout_and_its_inverse():
    """Device i holds chunks i and 2C-1-i; ``from_zigzag`` puts a split sequence back in
    order (each of its two routes a permutation)."""
    order = context.zigzag_order(16, 4)
    np.testing.assert_array_equal(order.reshape(8, 2)[:, 0] // 2, [0, 7, 1, 6, 2, 5, 3, 4])
    for ways in (2, 3, 4, 8):
        for route in context._chunk_routes(ways):
            assert sorted(d for _, d in route) == list(range(ways))
    plan = Parallelism.of(data_axis=1, context_axis=4).build(jax.devices()[:4])
    x = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3)
    back = jax.jit(lambda a: context.from_zigzag(context.to_zigzag(a, 4), plan.mesh, 4))(x)
    np.testing.assert_array_equal(np.asarray(back), x)


def test_the_cost_model_picks_the_ring_where_its_transfers_hide():
    """On H100s a 32k sequence over 4 devices: each ring step's half block outlasts its
    transfer, and the ring skips half the blocks: the ring. 4k over 8: the steps would
    wait for their transfers, which the gather hides behind the layer before: the
    gather. On XLA:CPU nothing hides a collective: the ring, which computes less."""
    h100, cpu = preset("h100"), preset("cpu")
    assert context_method(1, 32768, 4, 32, 8, 128, 2, h100) == "ring"
    assert context_method(1, 4096, 8, 32, 8, 128, 2, h100) == "all_gather"
    assert context_method(1, 512, 8, 32, 8, 128, 4, cpu) == "ring"


def test_context_refuses_what_it_does_not_split():
    config = transformers.GPT2Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4,
                                     n_positions=64, attn_pdrop=0.1)
    plan = Parallelism.of(data_axis=1, context_axis=2).build(jax.devices()[:2])
    runtime = ModelRuntime(lambda rngs: build(config, rngs=rngs, scan=True), plan)

    def loss(model, ids):
        return next_token_loss(model, ids, train=True)

    runtime.derive(loss, jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32))
    params, extra = runtime.init()
    with pytest.raises(ValueError, match="attention dropout.*context_axis"):
        runtime.apply(loss, params, extra, jax.random.key(0), IDS)


@pytest.mark.parametrize("layers,axes", [
    (2, dict(stage_axis=2, context_axis=2)),
    (4, dict(stage_axis=2, context_axis=2, stage_repeats=2)),
    (2, dict(stage_axis=2, context_axis=2, pipeline_schedule="1f1b", micro_batch_size=1)),
    (5, dict(stage_axis=2, context_axis=2, stage_repeats=2, pipeline_schedule="1f1b",
             micro_batch_size=1))],
    ids=["stage2-context2", "stage2-circular2-context2", "1f1b-stage2-context2",
         "1f1b-5-layers-stage2-interleaved2-context2"])
def test_pipeline_stages_split_a_sequence_over_the_context_axis(layers, axes):
    """Pipeline stages with the sequence split over a context axis: GPipe's, plain and
    circular (the ring runs inside the stages' ``vmap``, its hidden states passed split
    over the axis), and 1F1B's, plain and interleaved over 5 layers' unequal chunks (the
    ring inside 1F1B's ``shard_map``, manual over the context axis alone; every stage
    runs a tick's forward, backward and tail where any does, since the ring's exchanges
    span the stages): the losses of 3 steps and the parameters after them are one
    device's."""
    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    config = CONFIGS["llama"]()
    config.num_hidden_layers = layers
    assert_trains_as_one_device(config, loss, SEQ, **axes)


def test_the_rings_keys_and_values_are_a_devices_share_of_the_heads():
    """On context 2 x model 2 each device runs the ring on its own key/value heads (the
    rules split whole groups over the model axis): the bytes the compiled step passes
    round the ring (the collective-permutes in the layers' loop) are what the cost
    model counts for the device's share, half of the whole heads' (counted whole until
    issue 88: the Llama 3 131k row's keys and values at 8 times their size)."""
    from redray.planning.cost import context_traffic
    from redray.planning.from_config import ConfigFacts
    from redray.planning.planner import kv_split
    from redray.sharding import collectives

    shape = {"context": 2, "model": 2}
    hlo = loss_and_grads("llama", causal_loss, "ring", context_axis=2, model_axis=2)[2]
    layers = CONFIGS["llama"]().num_hidden_layers
    ring = sum(c.bytes * times for c, times in collectives.counted(hlo)
               if c.kind == "collective-permute" and times == layers)
    facts = ConfigFacts(CONFIGS["llama"](), SEQ)
    assert kv_split(facts, shape) == 2
    counted = context_traffic(shape, ROWS, SEQ, facts.kv_width // kv_split(facts, shape),
                              32, layers, 4, 1)
    assert ring == sum(t.bytes * t.times for t in counted if "keys" in t.what)


def test_the_planner_costs_a_context_axis_it_is_given():
    """``rank`` with a pinned context axis: every plan splits the sequence (those with
    stages by GPipe, each tick's chunk running the ring, or by 1F1B, each of its chunk
    passes running it, and again in a recomputed forward), the ring's passes are in the
    predicted step, and a device's activations are those of its share of the tokens
    (the memory model's trace of the ring's blockwise attention, 1/context of each
    sequence)."""
    from redray.sharding.parallelism import pipeline_ticks
    from redray.sharding.pipeline_schedules import one_f_one_b_table
    from redray.planning.from_config import ConfigFacts
    from redray.planning.planner import rank

    facts = ConfigFacts(CONFIGS["llama"](), 1024)
    h100 = preset("h100")
    split = rank(facts, 8, 1, 8, h100, pinned={"context_axis": 4})
    assert split.ranked and all(p.plan.shape["context"] == 4 for p in split.ranked)
    staged = [p for p in split.ranked if p.plan.shape["stage"] > 1]
    assert {p.plan.pipeline_schedule for p in staged} == {"gpipe", "1f1b"}
    for p in staged:  # 2 layers over 2 stages: a stage's layer, at every tick, C - 1 passes
        micro, repeats = p.plan.geometry.accumulation, p.plan.stage_repeats
        ticks = pipeline_ticks(2, micro, repeats)[1] if p.plan.pipeline_schedule == "gpipe" \
            else one_f_one_b_table(2, micro, repeats).passes * (
                1.5 if p.plan.stage_recompute else 1)
        ring = next(t for t in p.cost.traffic if t.what.startswith("context: keys"))
        assert ring.times == pytest.approx(2 * 3 * -(-2 // (2 * repeats)) * ticks)
    whole = rank(facts, 8, 1, 8, h100)
    assert all(p.plan.shape["context"] == 1 for p in whole.ranked)  # never unasked
    for plan in split.ranked:
        ring = [t for t in plan.cost.traffic if t.what.startswith("context:")]
        assert len(ring) == 3 and plan.cost.context > 0
        # the gradients are summed over the context axis too
        assert any(t.what.startswith("data parallel") and "context" in t.axes
                   for t in plan.cost.traffic)
    # the same examples per device and model axis, whole sequences against quarters of
    # them: a quarter of the tokens' bytes (what holds no token counts whole), and less
    # where the whole sequence's attention would keep its scores (under 2048 keys)

    def key(p):  # (stages hold a share of the layers' activations at each tick)
        stages = p.plan.shape["stage"]
        return (p.plan.geometry.micro_batch_size, p.plan.shape["model"], stages,
                p.plan.geometry.accumulation if stages > 1 else 0, p.plan.remat)

    rows = {key(p): p.memory["parts"]["activations"] for p in whole.ranked}
    quarters = {key(p): p.memory["parts"]["activations"] for p in split.ranked}
    assert rows.keys() & quarters.keys()
    for k in rows.keys() & quarters.keys():
        assert 0 < quarters[k] <= 0.4 * rows[k], (k, quarters[k], rows[k])


def test_the_planner_weighs_a_context_axis_where_sequences_are_fewer_than_devices():
    """Two sequences on 8 devices: fewer sequences than devices, so the planner weighs
    context axes beside the others by their time, and keeps whole sequences where they
    are faster; on devices too small for a whole sequence's activations and too large
    for nothing, it takes a context axis."""
    import dataclasses

    from redray.planning.from_config import ConfigFacts
    from redray.planning.planner import MARGIN, NoPlanFits, rank

    facts = ConfigFacts(CONFIGS["llama"](), 4096)
    h100 = preset("h100")
    weighed = rank(facts, 8, 1, 2, h100)
    assert any(p.plan.shape["context"] > 1 for p in weighed.ranked)
    assert weighed.best.plan.shape["context"] == 1  # the ring's passes cost more here
    best_split = min((p for p in weighed.ranked if p.plan.shape["context"] > 1),
                     key=lambda p: p.cost.seconds)
    assert best_split.cost.context > 0 and best_split.cost.seconds > weighed.best.cost.seconds
    smallest_whole = min(p.memory["total"] for p in weighed.ranked
                         if p.plan.shape["context"] == 1)
    split = rank(facts, 8, 1, 2, h100, pinned={"context_axis": 4})
    smallest_split = min(p.memory["total"] for p in split.ranked)
    assert smallest_split < smallest_whole
    small = dataclasses.replace(
        h100, device_memory=(smallest_split + smallest_whole) / 2 / (1 - MARGIN))
    chosen = rank(facts, 8, 1, 2, small).best
    assert chosen.plan.shape["context"] > 1 and chosen.fits
    with pytest.raises(NoPlanFits):  # pinned whole: the planner does not override a pin
        rank(facts, 8, 1, 2, small, pinned={"context_axis": 1})


def test_the_memory_plan_of_a_context_step_is_checked_against_the_compiled_step():
    """``plan_model``'s count (from the config) and ``Trainer.memory``'s (the built
    model under its ring) agree at context 4, at context 2 x model 2 and at stage 2 x
    context 2, and their ratio to XLA's compiled peak is within 0.05 of the same ratio
    for the data-parallel plan (with stages: stage 2 x data 2) with as many tokens per
    device: the context axis adds nothing the model misses."""
    import optax

    import redray
    from redray.planning.memory import StepShape
    from redray.planning.from_config import plan_model

    config, data, collate, loss = memory_case(2, 8)
    ratios = {}
    for axes in (dict(data_axis=4), dict(context_axis=4), dict(context_axis=2, model_axis=2),
                 dict(stage_axis=2, data_axis=2), dict(stage_axis=2, context_axis=2)):
        trainer = redray.Trainer.of(lambda rngs: build(config, rngs=rngs), collate, loss,
                                 optax.adamw(1e-3), batch_size=8, progress=False, **axes)
        trainer.init(data)
        measured = trainer.memory(device_gib=1)
        geometry = trainer.plan.geometry  # (stages: the Trainer's micro-batches, all rows)
        micro = geometry.micro_batch_size * geometry.data_parallel
        planned = plan_model(config, 4, step=StepShape(batch_size=8, seq_len=64,
                                                       micro_batch_size=micro),
                             **axes)["memory"]
        acts = planned["parts"]["activations"]
        assert acts == pytest.approx(measured["parts"]["activations"], rel=0.01), axes
        ratios[tuple(axes)] = planned["total"] / measured["compiled"]["peak"]
    for axes, ratio in ratios.items():
        reference = ("stage_axis", "data_axis") if "stage_axis" in axes else ("data_axis",)
        assert abs(ratio - ratios[reference]) <= 0.05, ratios


def test_a_trainer_with_a_context_axis_trains_as_one_device():
    """``Trainer.of(context_axis=2, data_axis=2)``: the losses of 3 steps and the parameters
    after them those of one device."""
    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    assert_trains_as_one_device(CONFIGS["llama"](), loss, SEQ, context_axis=2, data_axis=2)


def generated(family, **axes):
    """Greedy continuations of left-padded prompts (their last 8 tokens new) and the
    compiled program, on the plan ``axes`` give."""
    from redray.models import generate

    n = int(np.prod(list(axes.values()))) if axes else 1
    plan = Parallelism.of(**({"data_axis": 1} | axes)).build(jax.devices()[:n])
    runtime = ModelRuntime(lambda rngs: build(CONFIGS[family](), rngs=rngs, scan=True), plan)
    mask = (np.arange(SEQ)[None] >= np.array([0, 3, 7, 12])[:, None]).astype(np.int32)

    def continue_(model, ids, mask):
        return generate(model, ids, mask, max_new_tokens=8, eos_token_id=-1)

    abstract = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32)
    runtime.derive(continue_, abstract, abstract)
    params, extra = runtime.init()
    compiled = jax.jit(lambda p, e, ids, m: runtime.apply(
        continue_, p, e, jax.random.key(0), ids, m)[0]).lower(params, extra, IDS, mask).compile()
    return np.asarray(compiled(params, extra, IDS, mask)), compiled.as_text()


@pytest.mark.parametrize("family,axes", [("llama", dict(context_axis=4)),
                                         ("gpt2", dict(context_axis=2, model_axis=2)),
                                         ("mixtral", dict(context_axis=2, expert_axis=2)),
                                         ("qwen3_next", dict(context_axis=2))],
                         ids=["llama-context4", "gpt2-context2-model2",
                              "mixtral-context2-expert2", "qwen3_next-context2"])
def test_a_prompt_prefilled_over_the_context_axis_generates_as_one_device(family, axes):
    """``generate`` on a context plan: the prompt's prefill is split over the axis (the
    ring fills the KV cache, put back in the tokens' order), the decoding reads it;
    left-padded prompts of 31 tokens (padded inside to whole chunks) continue greedily
    with the tokens one device gives."""
    want, _ = generated(family)
    got, hlo = generated(family, **axes)
    np.testing.assert_array_equal(got, want)
    assert "collective-permute" in hlo  # the ring's passes, and the cache's reorder


def test_the_plans_context_attention_reaches_the_layers_and_the_variable_overrides_it(
        monkeypatch):
    """A plan pinned to a way across the context axis (``Plan.context_attention``) is what
    the ring's layers take, whatever kernel its blocks would run;
    ``REDRAY_CONTEXT_ATTENTION`` overrides it."""
    from redray.models.context import method
    from redray.sharding.tracing import traced

    monkeypatch.delenv("REDRAY_CONTEXT_ATTENTION", raising=False)
    assert method() == "auto"
    with traced(context_attention="all_gather"):
        assert method() == "all_gather"
        monkeypatch.setenv("REDRAY_CONTEXT_ATTENTION", "ring")
        assert method() == "ring"
