"""Pipeline parallelism, read from XLA's compiled steps: the schedule's FLOPs against its
formula (``pipeline/flops_over_unpipelined``), the bytes that cross hosts against
FSDP's (``pipeline/cross_host_bytes_over_fsdp``), and 1F1B's memory against GPipe's.

Both compile a LLaMA-shaped model's training step (loss and gradients, float32,
``redray.models.build(..., scan=True)``) through redray's model runtime, the way a
Trainer does, with the scans unrolled (``tracing.unrolled_loops``: XLA's cost
analysis and its collectives list count a loop's body once, whatever its trip count).

FLOPs: the pipelined step on 4 stages (4 simulated devices) over M micro-batches of one
example, once round the stages (GPipe) and twice (circular repeats, 8 chunks of one
layer), against the same step on 1 device without stages; the schedule's formula
(``redray.models.staged_layers.flops_ratio``) is ``share (P R + S - 1) / (M R S) + (1 -
share) / S`` (``P``: M rounded up to a multiple of S with repeats, else M), with
``share`` the stacked layers' part of the unpipelined FLOPs (read from the compiled
steps at L and L/2 layers).

Bytes across hosts: 8 simulated devices as 2 hosts of 4 (devices 0-3 and 4-7, the mesh
laid out as ``Parallelism.build`` lays out 2 hosts). The pipelined plan is stage 2 x
fsdp 4 (the stages across the hosts, FSDP inside each), against fsdp 8 (the 2-host
FSDP plan), same model and batch. The figure counts the bytes the busiest device moves
across hosts (``collectives.across_hosts``): a collective-permute's buffer where the
device sends it to the other host, any other collective's result where the device's
group spans both hosts. The prediction beside it is
the cost model's (``cost.stage_traffic`` and ``cost.state_traffic``, which sums the
gradients of the parameters the stages hold whole over ``stage``).

Memory: 1F1B's temporary bytes (XLA's memory analysis of the compiled step) over
GPipe's, the Trainer's compiled steps (``pipeline_schedule="1f1b"`` and the default),
4 stages, 8 and 16 micro-batches (``pipeline/temp_bytes_1f1b_over_gpipe``), and what
one more micro-batch adds to each (``pipeline/bytes_per_micro_batch_1f1b_over_gpipe``);
GPipe without remat, and with full remat in the details (1F1B recomputes a stage's
forward in its backward, as much as full remat does).

    python benchmarks/pipeline.py
"""

import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

COMMAND = "python benchmarks/pipeline.py"
FULL = dict(vocab=512, hidden=128, intermediate=256, layers=8, heads=4, seq=64)
TINY = dict(vocab=64, hidden=32, intermediate=64, layers=8, heads=4, seq=8)


def config(s: dict, layers: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                       intermediate_size=s["intermediate"], num_hidden_layers=layers or s["layers"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                       tie_word_embeddings=False)


def loss(model, ids, train: bool = False):
    logits = model(ids[:, :-1], train=train).astype(jnp.float32)
    labels = ids[:, 1:]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1).mean()


def compiled_step(cfg, plan, rows: int, seq: int, micro_rows=None, repeats: int = 1,
                  remat=False, unrolled: bool = True, train: bool = False):
    """(compiled loss-and-gradient step, runtime) of ``cfg``'s scanned model on ``plan``
    (its scans unrolled, or, with ``unrolled=False``, loops as a Trainer compiles them)."""
    from redray.engine.runtime import ModelRuntime
    from redray.models import build
    from redray.sharding.tracing import unrolled_loops
    from redray.sharding.plan import Plan

    runtime = ModelRuntime(lambda rngs: build(cfg, rngs=rngs, scan=True, remat=remat), plan)
    batch = jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)
    fn = functools.partial(loss, train=train)
    runtime.derive(fn, batch)
    runtime.use(Plan(plan, micro_rows=micro_rows, stage_repeats=repeats))
    params, extra = runtime.abstract
    step = jax.jit(jax.value_and_grad(
        lambda p, e, ids: runtime.apply(fn, p, e, jax.random.key(0), ids)[0]),
        in_shardings=(*runtime.shardings, plan.batch_sharding()))
    if not unrolled:
        return step.lower(params, extra, batch).compile(), runtime
    with unrolled_loops():
        return step.lower(params, extra, batch).compile(), runtime


def flops_figures(s: dict, stages: int, micros, repeats=(1, 2)) -> list[dict]:
    from redray.models.staged_layers import flops_ratio
    from redray.sharding import Parallelism

    one = Parallelism.of(data_axis=1).build(jax.devices()[:1])
    staged = Parallelism.of(stage_axis=stages, data_axis=1).build(jax.devices()[:stages])

    def flops(cfg, plan, rows, micro_rows=None, r=1):
        compiled = compiled_step(cfg, plan, rows, s["seq"], micro_rows, r)[0]
        return compiled.cost_analysis()["flops"]

    whole, half = (flops(config(s, n), one, 4) for n in (s["layers"], s["layers"] // 2))
    share = 2 * (whole - half) / whole  # the stacked layers' part of the FLOPs
    out = []
    for micro in micros:
        unpipelined = flops(config(s), one, micro)
        for r in repeats:
            measured = flops(config(s), staged, micro, 1, r) / unpipelined
            formula = flops_ratio(stages, micro, share, r)
            out.append(figure(
                f"pipeline/flops_over_unpipelined/s{stages}_m{micro}"
                + (f"_r{r}" if r > 1 else ""), measured, "x",
                "the same step on 1 device (XLA cost analysis, per device)",
                f"{formula - 0.02:.4f}-{formula + 0.02:.4f}", COMMAND,
                formula=formula, layer_share=share, difference=measured - formula,
                stages=stages, micro_batches=micro, repeats=r, model=s))
    return out


def hybrid_mesh(sizes: dict, hosts: int):
    """A mesh of ``sizes`` (axis name -> size, the others 1) on 8 simulated devices as
    ``hosts`` hosts of consecutive devices, laid out as ``Parallelism.build`` lays out
    hosts."""
    from jax.sharding import Mesh

    from redray.sharding.parallelism import AXES, hybrid_shapes

    shape = tuple(sizes.get(a.name, 1) for a in AXES)
    devices = np.array(jax.devices()[:math.prod(shape)], dtype=object)
    across, inside = hybrid_shapes(shape, hosts, len(devices) // hosts)
    grid = devices.reshape(*across, *inside)
    n = len(shape)
    grid = grid.transpose([k for i in range(n) for k in (i, n + i)]).reshape(shape)
    return Mesh(grid, tuple(a.name for a in AXES))


def cross_host(compiled, mesh, hosts: int) -> tuple[int, dict]:
    """The bytes the busiest device sends across hosts in a step, and by kind."""
    from redray.sharding.collectives import across_hosts, collectives

    local = mesh.devices.size // hosts
    host_of = [d.id // local for d in mesh.devices.flat]
    found = collectives(compiled.as_text())
    per_device = [across_hosts(c, host_of) for c in found]
    busiest = max(range(len(host_of)), key=lambda d: sum(b[d] for b in per_device))
    kinds: dict = {}
    for c, b in zip(found, per_device):
        if b[busiest]:
            kinds[c.kind] = kinds.get(c.kind, 0) + b[busiest]
    return sum(b[busiest] for b in per_device), kinds


def bytes_figure(s: dict, rows: int, micro_rows: int) -> dict:
    from redray.sharding import Parallelism
    from redray.planning.cost import Parameter, host_spans, stage_traffic, state_traffic
    from redray.planning.hardware import PRESETS

    hosts = 2
    pipe_mesh = hybrid_mesh(dict(stage=2, fsdp=4), hosts)
    fsdp_mesh = hybrid_mesh(dict(fsdp=8), hosts)
    seq = s["seq"]
    measured, predicted, stacked = {}, {}, None
    for name, mesh, micro in (("pipelined", pipe_mesh, micro_rows), ("fsdp", fsdp_mesh, None)):
        plan = Parallelism.of(mesh=mesh)
        compiled, runtime = compiled_step(config(s), plan, rows, seq, micro)
        measured[name] = cross_host(compiled, mesh, hosts)
        shape = dict(mesh.shape)
        spans_ = host_spans(shape, hosts)
        leaves = jax.tree.leaves(runtime.abstract[0])
        specs = jax.tree.leaves(runtime.specs[0],
                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        if stacked is None:  # the stacked layers: what the pipelined plan splits over stage
            stacked = [bool(p) and "stage" in str(p[0]) for p in specs]
        params = [Parameter(tuple(a.shape), 4, tuple(p), stacked=k)
                  for a, p, k in zip(leaves, specs, stacked)]
        crossing = lambda t: any(spans_[a][1] > 1 for a in t.axes)  # noqa: E731
        traffic = state_traffic(params, shape, 4, PRESETS["cpu"], False, 1)
        if name == "pipelined":
            dp = shape["data"] * shape["fsdp"]
            micro_batches = rows // micro
            traffic += stage_traffic(shape, micro // dp, seq, s["hidden"], 4, micro_batches)
        predicted[name] = sum(t.bytes * t.times for t in traffic if crossing(t))
    ratio = measured["pipelined"][0] / measured["fsdp"][0]
    formula = predicted["pipelined"] / predicted["fsdp"]
    return figure("pipeline/cross_host_bytes_over_fsdp", ratio, "x",
                  "fsdp 8 over the same 2 hosts (bytes per step whose collectives span "
                  "hosts, compiled step)", None, COMMAND,
                  predicted=formula, measured_bytes={k: v[0] for k, v in measured.items()},
                  measured_kinds={k: v[1] for k, v in measured.items()},
                  predicted_bytes=predicted, rows=rows, micro_batches=rows // micro_rows,
                  plans={"pipelined": "stage=2 (across hosts) x fsdp=4",
                         "fsdp": "fsdp=8"}, model=s)


def memory_figures(s: dict, stages: int, micros) -> list[dict]:
    """1F1B's temporary bytes over GPipe's: XLA's memory analysis of a Trainer's
    compiled training step (``trainer.memory()["compiled"]["temporaries"]``: what is
    neither an argument nor an output, i.e. the activations kept for the backward pass
    and the buffers), ``stages`` stages over M micro-batches of one row, adamw. GPipe
    keeps every tick's activations (``remat=False``) or every tick's layer inputs
    (``remat="full"``, its least memory); 1F1B (``pipeline_schedule="1f1b"``) keeps at
    most ``2 S - 1`` stage inputs and as many chunks' activations, from a chunk's forward
    to its backward (until issue 88's work it recomputed a chunk's forward in its
    backward instead)."""
    import optax

    import redray
    from redray.models import build
    from redray.sharding import Parallelism
    from redray.sharding.pipeline_schedules import one_f_one_b_schedule

    plan = Parallelism.of(stage_axis=stages, data_axis=1).build(jax.devices()[:stages])
    rng = np.random.default_rng(0)
    temp = {}
    for micro in micros:
        data = [{"ids": r} for r in rng.integers(0, s["vocab"], (micro, s["seq"] + 1),
                                                 dtype=np.int32)]
        for name, remat, schedule in (("1f1b", False, "1f1b"), ("gpipe", False, "gpipe"),
                                      ("gpipe_remat_full", "full", "gpipe")):
            trainer = redray.Trainer.of(
                lambda rngs, remat=remat: build(config(s), rngs=rngs, scan=True, remat=remat),
                lambda e: {"ids": np.stack([x["ids"] for x in e])},
                lambda model, batch, rng, train: loss(model, batch["ids"], train),
                optax.adamw(1e-3), batch_size=micro, micro_batch_size=1, progress=False,
                plan=plan, pipeline_schedule=schedule)
            trainer.init(data)
            temp[name, micro] = trainer.memory()["compiled"]["temporaries"]
    out = []
    for micro in micros:
        ticks, slots = one_f_one_b_schedule(stages, micro)
        out.append(figure(
            f"pipeline/temp_bytes_1f1b_over_gpipe/s{stages}_m{micro}",
            temp["1f1b", micro] / temp["gpipe", micro], "x",
            "GPipe's Trainer step without remat (XLA memory analysis: temporary bytes per "
            "device)", "< 1", COMMAND,
            temp_bytes={k: v for (k, m), v in temp.items() if m == micro},
            over_gpipe_remat_full=temp["1f1b", micro] / temp["gpipe_remat_full", micro],
            ring_slots=slots, ticks=ticks, stages=stages, micro_batches=micro, model=s))
    if len(micros) > 1:  # what one more micro-batch costs each schedule
        lo, hi = micros[0], micros[-1]
        growth = {k: (temp[k, hi] - temp[k, lo]) / (hi - lo)
                  for k in ("1f1b", "gpipe", "gpipe_remat_full")}
        out.append(figure(
            f"pipeline/bytes_per_micro_batch_1f1b_over_gpipe/s{stages}",
            growth["1f1b"] / growth["gpipe"], "x",
            f"GPipe's (temporary bytes per added micro-batch, {lo} to {hi})", "< 1",
            COMMAND, bytes_per_micro_batch=growth,
            over_gpipe_remat_full=growth["1f1b"] / growth["gpipe_remat_full"], model=s))
    return out


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    s = TINY if args.tiny else FULL
    figures = flops_figures(s, 4, (8,) if args.tiny else (8, 16))
    figures.append(bytes_figure(s, 8 if args.tiny else 16, 4 if args.tiny else 4))
    figures += memory_figures(s, 4, (8,) if args.tiny else (8, 16))
    save(figures, args.out)


if __name__ == "__main__":
    main()
