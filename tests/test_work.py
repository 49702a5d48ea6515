"""The planner's count of a step's work (redray/planning/work.py) against XLA's compiled
programs, and the cost model's layer-by-layer overlap against hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import pytest

from redray.models.attention import AttentionCall, AttentionMask
from redray.planning.cost import Traffic, exposed_seconds
from redray.planning.hardware import Hardware, Link
from redray.planning.work import Work, compiled_work, config_work, traced_work


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_matmul_flops_and_bytes_of_a_compiled_program():
    """Every dot's FLOPs (forward and the input's gradient), and the bytes of every other
    kernel: what XLA's own cost analysis counts for the dots, and for a program of no
    dot, its bytes."""
    a, b = jnp.ones((64, 32)), jnp.ones((32, 16))
    grad = jax.grad(lambda a, b: jnp.tanh(a @ b).sum())
    flops, _ = compiled_work(_compiled(grad, a, b).as_text())
    assert flops == 2 * (2 * 64 * 32 * 16)
    plain = _compiled(lambda x: jnp.tanh(x) * 2 + 1, a)
    _, memory = compiled_work(plain.as_text())
    assert memory == plain.cost_analysis()["bytes accessed"] == 2 * a.size * 4


def test_a_loop_counts_its_body_by_its_trip_count():
    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))

    def body(h, _):
        return jnp.tanh(h @ w), None

    looped = _compiled(lambda x: jax.lax.scan(body, x, None, length=5)[0], x)
    flops, _ = compiled_work(looped.as_text())
    assert flops == 5 * 2 * 8 * 16 * 16


def test_attention_calls_count_the_pairs_a_kernel_computes():
    q = jnp.ones((2, 8, 4, 16))
    k = jnp.ones((2, 8, 2, 16))
    mask = AttentionMask(kv_valid=jnp.ones((2, 8), bool), q_slots=jnp.arange(8))
    causal = AttentionCall.of(q, k, mask)
    assert causal.pairs == 8 * 9 / 2  # the lower triangle, diagonal included
    assert causal.flops == 4 * 2 * 4 * 16 * causal.pairs
    assert causal.dense_flops == 4 * 2 * 4 * 16 * 64
    window = AttentionCall.of(q, k, mask.windowed(3))
    assert window.pairs == sum(min(i + 1, 3) for i in range(8))
    both = AttentionCall.of(q, k, mask.replace(causal=False))
    assert both.pairs == 64


@pytest.fixture(scope="module")
def tiny_llama():
    from redray.models.hub import family
    from redray.planning.from_config import resolve_config

    config = resolve_config(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256,
                                 tie_word_embeddings=False))
    return family("llama"), config


def test_a_models_work_per_layer_and_rest(tiny_llama):
    """One layer's matmuls are its projections' 6 x parameters x tokens; the rest is the
    head's; attention is each layer's causal triangle; the layers' memory-bound bytes
    are counted at the compute dtype's size."""
    fam, config = tiny_llama
    seq = 32
    counted = config_work(fam, config, seq)
    h, i, kv = 64, 128, 2 * 16
    layer_params = h * h * 2 + h * kv * 2 + 3 * h * i
    assert counted.step.layer.matmul == pytest.approx(6 * layer_params * seq, rel=1e-9)
    assert counted.step.rest.matmul == pytest.approx(6 * h * 256 * seq, rel=1e-9)
    assert counted.forward.layer.matmul == pytest.approx(2 * layer_params * seq, rel=1e-9)
    pairs = seq * (seq + 1) / 2
    assert counted.step.layer.attention == pytest.approx(3.5 * 4 * 4 * 16 * pairs)
    assert counted.forward.layer.attention == pytest.approx(4 * 4 * 16 * pairs)
    assert counted.step.layers == 3
    halved = config_work(fam, config, seq, "bfloat16")
    assert halved.step.layer.memory == pytest.approx(counted.step.layer.memory / 2)
    # the layer's bytes are of the order of its activations, many times over
    assert 10 * seq * h * 4 < counted.step.layer.memory < 1000 * seq * h * 4
    # the heads' and the MLP's inner widths' share, which a model axis divides
    assert 0.3 * counted.step.layer.memory < counted.step.layer.split_memory \
        < counted.step.layer.memory
    assert counted.step.rest.split_memory == 0.0
    dots, full = counted.under("dots"), counted.under("full")
    assert dots.layer.matmul == counted.step.layer.matmul
    assert full.layer.matmul == counted.step.layer.matmul + counted.forward.layer.matmul
    assert dots.layer.memory == full.layer.memory > counted.step.layer.memory


def test_a_family_without_split_fields_counts_its_memory_whole():
    from redray.models.hub import family
    from redray.planning.from_config import resolve_config

    config = resolve_config(dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4,
                                 vocab_size=128, n_positions=64))
    counted = config_work(family("gpt2"), config, 16)
    assert counted.step.layer.memory > 0 and counted.step.layer.split_memory == 0.0


def test_the_stand_in_keeps_every_projections_gradient(tiny_llama):
    """With attention counted apart, the keys' and values' projections still get a
    gradient (their matmuls stay in the compiled backward pass)."""
    from redray.planning.memory import _abstract_loss

    fam, config = tiny_llama
    loss, params, extra, inputs = _abstract_loss(fam, config, 1, 16, "none", None, None,
                                                 scan=False)
    work = traced_work(jax.grad(loss), params, extra, inputs)
    forward = traced_work(loss, params, extra, inputs, backward=False)
    assert work.matmul == pytest.approx(3 * forward.matmul, rel=1e-9)


HW = Hardware("test", 1e12, 1e12, 1e9, 8, intra=Link(1e9, 0.0), inter=Link(1e9, 0.0))


def _gather(nbytes, phase="both", layer=True, times=2):
    return Traffic("all-gather", nbytes, ("fsdp",), times, "gather", False, phase, layer)


SPANS = {"fsdp": (2, 1, 1)}  # two devices in a host (of one slice): a ring moves half the buffer


def test_overlap_hides_a_layers_gather_behind_the_layer_before():
    """4 layers, 1 s of layer compute each (1/3 forward), a gather of 0.25 s per layer
    and pass, a reduction of 0.25 s: only the first gather and the last reduction show."""
    gather = _gather(4 * 0.5e9)  # 4 layers x 0.25 s x 2 passes: 2 s on this link
    reduce = Traffic("reduce-scatter", 4 * 0.5e9, ("fsdp",), 1, "reduce", False,
                     "backward", True)
    shown = exposed_seconds([gather, reduce], SPANS, HW, layers_s=4.0, rest_s=0.0,
                            forward=1 / 3, count=4, ticks=1, stacked=True)
    assert shown == pytest.approx(0.25 + 0.25)


def test_overlap_shows_what_exceeds_a_layers_compute():
    """The same with each forward gather 1 s beside a forward of 1/3 s: the first whole,
    each other's 2/3 s past the forward (the backward's 1 s + 0.25 s beside 2/3 s: 7/12
    s past it), the last reduction."""
    gather = _gather(4 * 2e9)  # 1 s per layer and pass
    reduce = Traffic("reduce-scatter", 4 * 0.5e9, ("fsdp",), 1, "reduce", False,
                     "backward", True)
    shown = exposed_seconds([gather, reduce], SPANS, HW, layers_s=4.0, rest_s=0.0,
                            forward=1 / 3, count=4, ticks=1, stacked=True)
    assert shown == pytest.approx(1.0 + 0.25 + 3 * (2 / 3 + 7 / 12))


def test_a_data_parallel_reduction_hides_layer_by_layer_but_after_an_accumulation_loop():
    """In a scanned stack each layer's gradient is all-reduced in the backward loop's
    body (checked on XLA's program in test_the_partitioner_reduces_a_scanned_layers_
    gradient_in_the_loop): only the last layer's shows; after an accumulation loop the
    whole reduction does."""
    dp = Traffic("all-reduce", 1e9, ("data",), 1, "dp", False, "step", True)
    spans = {"data": (2, 1, 1)}
    seconds = 2 * 0.5  # an all-reduce: reduce-scatter and all-gather of half each
    for stacked in (True, False):
        assert exposed_seconds([dp], spans, HW, 10.0, 1.0, 1 / 3, 4, 1, stacked) == \
            pytest.approx(seconds / 4)
        assert exposed_seconds([dp], spans, HW, 10.0, 1.0, 1 / 3, 4, 2, stacked) == \
            pytest.approx(seconds)


def test_the_partitioner_reduces_a_scanned_layers_gradient_in_the_loop():
    """What the overlap above takes: on a data-parallel mesh, the gradient of a scanned
    stack's weights is all-reduced inside the backward loop's body, layer by layer."""
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(devices, ("data",))

    def loss(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    grad = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P()),
                                                 NamedSharding(mesh, P("data"))),
                   out_shardings=NamedSharding(mesh, P()))
    hlo = grad.lower(jnp.ones((4, 32, 32)), jnp.ones((8, 32))).compile().as_text()
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    current, where = None, []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header:
            current = header.group(1)
        if "all-reduce(" in line or "all-reduce-start(" in line:
            where.append(current)
    assert where and all(c in bodies for c in where), (where, bodies)


def test_on_cpu_nothing_hides():
    cpu = Hardware("cpu", 1e12, 1e12, 1e9, 8, intra=Link(1e9, 0.0), inter=Link(1e9, 0.0),
                   overlap=0.0)
    gather = _gather(4 * 0.5e9)
    assert exposed_seconds([gather], SPANS, cpu, 4.0, 0.0, 1 / 3, 4, 1, True) == \
        pytest.approx(2.0)


def test_work_arithmetic():
    w = Work(1.0, 2.0, 3.0, 4.0)
    assert (w + w) * 0.5 == w
    assert (w - w) == Work()
    assert math.isclose((w * 3).memory, 12.0)
