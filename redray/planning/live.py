"""The plan of a Trainer's own model on this runtime's devices (``plan="auto"``):
the planner's ranking of its facts (``redray.engine.facts.RuntimeFacts``) on the live,
probed hardware, with the model's pass timed there.

On the live devices the gradient is timed, every device at once on its own copy of the
first batch's rows, at micro-batches of 1 and 2 examples (``model_timing``): the
planner's compute time is then this model's, not a matmul's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.planning.cost import ModelTiming
from redray.planning.hardware import Hardware
from redray.planning.memory import nbytes
from redray.planning.planner import Ranking, rank


def choose(facts, batch_size: int, hardware: Hardware, pinned: dict,
           rules=(), cache: str | None = None, steps: int | None = None,
           timed: bool | None = None) -> Ranking:
    """The ranked plans of ``facts`` (``redray.engine.facts.RuntimeFacts``) on every
    device of this runtime (``rank``); on the live devices (``hardware.live``), with the
    model's pass timed there (kept in the folder ``cache``, where given:
    ``model_timing``).

    ``timed``: True times the pass, False does not; None (default) times it unless the
    run is too short to pay for it: ``steps`` steps at the untimed pick's predicted step
    under ``TIMED_RUN_S`` (the timing itself takes seconds: compiling and running the
    pass twice). Untimed, the plans are costed on the probed hardware's rates and the
    ranking says so (``Ranking.untimed``). Process 0 decides for every host."""
    args = (jax.device_count(), jax.process_count(), batch_size, hardware, pinned, rules)
    if not hardware.live or facts.timing is not None or timed is False:
        ranking = rank(facts, *args)
        if hardware.live and facts.timing is None:
            ranking = dataclasses.replace(ranking, untimed="plan_timing=False")
        return ranking
    if timed is None and steps is not None:
        from redray.processes.jax_runtime import from_process_zero

        untimed = rank(facts, *args)
        run_s = steps * untimed.best.cost.seconds
        if from_process_zero(np.array(float(run_s < TIMED_RUN_S))) > 0.5:
            return dataclasses.replace(untimed, untimed=(
                f"a run of {steps} steps, {run_s:.1f} s predicted, is shorter than the "
                f"{TIMED_RUN_S:.0f} s that timing the pass pays for; plan_timing=True "
                "times it"))
    facts.timing = model_timing(facts, hardware, cache)
    return rank(facts, *args)


# A run whose steps are predicted (untimed) to take less than this many seconds is
# planned without timing the model's pass (``choose``).
TIMED_RUN_S = 30.0


# The micro-batches (examples per device) the pass is timed at; a plan's are
# interpolated (or extrapolated) on the line through them.
TIMED_ROWS = (1, 2)
# The timing needs the parameters and their gradients whole on every device, beside a
# pass's activations: it is skipped (the hardware's matmul rate used) for a model whose
# parameters and gradients take more than this share of a device's memory.
TIMED_SHARE = 0.6
# Parameter elements per device the update is timed on.
UPDATE_ELEMENTS = 1 << 20


def model_timing(facts, hardware: Hardware,
                 cache: str | None = None) -> ModelTiming | None:
    """The model's gradient timed on every device at once (each on its own rows of the
    first batch, the parameters whole, no collectives), at ``TIMED_ROWS`` examples:
    ``fixed + rows * per_example`` (median of ``probe.REPEATS`` runs each). Process 0's
    numbers for every host. None for a model too large to hold whole on a device, or a
    pass that does not run as one program per device.

    ``cache``: a folder (the probe's) where the seconds are kept per cluster and per
    program timed (a digest of the programs as lowered, their constants left out: the
    model, the loss, the batch's shapes, the optimizer; a sweep over learning rates
    times them once), so a new run of the same model and loss there plans without
    compiling and timing them again (7 s of a tiny run's start on 2 cores). Process 0
    reads and writes it; every host gets its numbers."""
    from redray.planning.probe import _grid, cluster_key
    from redray.processes.jax_runtime import from_process_zero

    params_abs, extra_abs = facts.abstract
    model_bytes = sum(nbytes(x.shape, x.dtype) for x in jax.tree.leaves(params_abs))
    if 2 * model_bytes > TIMED_SHARE * hardware.device_memory:
        return None
    mesh = _grid()
    rows_spec = P(("hosts", "local"))
    whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, rows_spec)
    devices = mesh.devices.size
    loss_of = facts.unplanned_loss()  # no plan: no activation constraints in shard_map
    rng = jax.random.key(0)

    def local(params, extra, batch):
        grads = jax.grad(lambda p: loss_of(p, extra, batch, rng))(params)
        total = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        return jnp.reshape(total, (1,))

    def batch_of(count: int, abstract: bool = False) -> dict:
        return _timed_batch(facts.sample, count, devices, rows, abstract)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), rows_spec),
                                out_specs=rows_spec, check_vma=False))
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                          (params_abs, extra_abs))
    try:  # lowered once: what the digest reads and, untimed before, what is compiled
        lowered = [run.lower(*placed, batch_of(r, abstract=True)) for r in TIMED_ROWS]
        update = _update_program(facts.optimizer, mesh, rows_spec)
        lowered.append(update.lower(*[jax.ShapeDtypeStruct(
            (devices * UPDATE_ELEMENTS,), jnp.float32, sharding=rows)] * 2))
    except Exception:  # noqa: BLE001 - not traceable now (a schedule with no budget yet):
        lowered = None  # the planner uses the hardware's matmul rate
    path = None
    if cache is not None and lowered is not None:
        path = os.path.join(cache, "timings", f"{cluster_key()}-{_digest(lowered)}.json")
    kept = _kept_seconds(path)  # process 0's: every host measures, or none
    hit, *kept = from_process_zero(np.array([kept is not None, *(kept or [0.0] * 3)],
                                            np.float64)).tolist()
    if hit:
        seconds = kept
    elif lowered is None:
        seconds = [0.0, 0.0, 0.0]
    else:
        seconds = _time_programs(lowered, (params_abs, extra_abs), whole, rows, batch_of)
    t_few, t_many, update_s = from_process_zero(np.array(seconds, np.float64)).tolist()
    if not hit and t_few > 0 and path is not None and jax.process_index() == 0:
        _keep_seconds(path, [t_few, t_many, update_s])
    if not t_few > 0:
        return None
    flops = facts.flops("none")
    fixed, per_example = timed_line(t_few, t_many, flops / hardware.matmul_flops)
    return ModelTiming(fixed, per_example, flops, update_s)


def _timed_batch(sample: dict, count: int, devices: int, rows: NamedSharding,
                 abstract: bool = False) -> dict:
    """``count`` rows of ``sample`` (the first batch's) on every device, split over
    ``rows``: placed, or their shapes only (``abstract``)."""
    out = {}
    for key, value in sample.items():
        value = np.asarray(value)
        whole_rows = np.concatenate([np.resize(value, (count, *value.shape[1:]))] * devices)
        out[key] = jax.ShapeDtypeStruct(whole_rows.shape, value.dtype, sharding=rows) \
            if abstract else jax.make_array_from_callback(
                whole_rows.shape, rows, lambda idx, w=whole_rows: w[idx])
    return out


def _time_programs(lowered: list, abstract, whole: NamedSharding, rows: NamedSharding,
                   batch_of) -> list[float]:
    """``model_timing``'s programs compiled and timed: [the pass at each of
    ``TIMED_ROWS``, the update per element]; zeros where one fails (the planner then
    uses the hardware's matmul rate)."""
    from redray.planning.probe import _timed, ones

    devices = rows.mesh.devices.size
    try:
        *passes, step = [program.compile() for program in lowered]
        params, extra = jax.jit(lambda: jax.tree.map(_filled, abstract), out_shardings=whole)()
        seconds = [_timed(p, params, extra, batch_of(r)) for p, r in zip(passes, TIMED_ROWS)]
        vector = ones((devices * UPDATE_ELEMENTS,), jnp.float32, rows)
        seconds.append(_timed(step, vector, vector) / UPDATE_ELEMENTS)
    except Exception:  # noqa: BLE001 - the planner then uses the hardware's matmul rate
        seconds = [0.0, 0.0, 0.0]
    return seconds


# A constant in a lowered program (``dense<1.000000e-03>``: a learning rate, a norm's
# epsilon): what it computes with, not how long it takes.
CONSTANT = re.compile(r"dense<[^>]*>")


def _digest(lowered: list) -> str:
    """The programs timed, as a digest of their StableHLO without their constants."""
    import hashlib

    digest = hashlib.sha256()
    for program in lowered:
        digest.update(CONSTANT.sub("dense<#>", program.as_text()).encode())
    return digest.hexdigest()[:20]


def _kept_seconds(path: str | None) -> list | None:
    """The seconds kept at ``path`` (read on process 0 only), or None."""
    if path is None or jax.process_index() != 0 or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            seconds = json.load(f)["seconds"]
        return [float(s) for s in seconds] if len(seconds) == 3 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep_seconds(path: str, seconds: list) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"seconds": seconds, "rows": list(TIMED_ROWS),
                       "elements": UPDATE_ELEMENTS}, f)
        os.replace(path + ".tmp", path)
    except OSError:  # a cache that cannot be written: the next run times again
        pass


def timed_line(t_few: float, t_many: float, at_matmul_rate: float) -> tuple[float, float]:
    """(fixed, per_example) of the line through the passes timed at ``TIMED_ROWS``.

    Where the larger pass was not the slower one (the timer's noise above what the extra
    rows cost: a tiny model, a loaded machine), the rows' cost is below what the timing
    can see: each example is charged its FLOPs at the matmul rate (``at_matmul_rate``
    seconds) and the rest of the faster pass is the micro-batch's own. Charging all of it
    per example instead made a micro-batch cost nothing: accumulation was free, and a
    MAML run on a loaded machine chose micro-batches of 1 (32 per step, 50x slower).
    """
    (few, many) = TIMED_ROWS
    per_example = (t_many - t_few) / (many - few)
    if per_example <= 0:
        per_example = min(at_matmul_rate, min(t_few, t_many) / many)
    return max(0.0, min(t_few, t_many) - few * per_example), per_example


def _update_program(optimizer, mesh, spec):
    """A step's update on ``UPDATE_ELEMENTS`` parameters per device, every device at
    once (params, grads -> a sum): the gradient's norm, ``optimizer.update``, the new
    parameters, and the non-finite guard's select of them and of the optimizer state
    (as ``train_step`` runs them)."""
    import optax

    def local(params, grads):
        state = optimizer.init(params)
        updates, new_state = optimizer.update(grads, state, params)
        finite = jnp.isfinite(optax.tree.norm(grads))
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                            (optax.apply_updates(params, updates), new_state), (params, state))
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(kept)
                   if jnp.issubdtype(x.dtype, jnp.inexact)).reshape(1)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                                 check_vma=False))


def _filled(x):
    """A value of ``x``'s shape and dtype for timing (keys: fresh keys)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), x.shape) if x.shape else jax.random.key(0)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.full(x.shape, 0.01, x.dtype)
    return jnp.zeros(x.shape, x.dtype)
