"""The training and evaluation steps, as plain functions of arrays.

Nothing here knows about Trainers, meshes or hosts: ``Trainer`` binds these functions
to the user's model, loss and optimizer and jits them once, with shardings and
donation. They can be called, jitted and tested on their own.

A gradient function has the signature
``(params, frozen, extra, batch, rng) -> (loss, metrics, new extra, grads)``:
``model_gradients`` makes one from the user's loss (or custom ``grad_fn``), and
``microbatched`` turns one into gradient accumulation over micro-batches.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from redray.engine.model import merge_trainable
from redray.engine.state import TrainState
from redray.functions import COUNTS, WEIGHT, split_loss_output


def model_loss(apply: Callable, loss: Callable, train: bool = True) -> Callable:
    """``(params, frozen, extra, batch, rng) -> (loss, (metrics, new extra))``.

    Args:
      apply: ``apply(fn, params, extra, rng, *args) -> (fn(model, *args), new extra)``:
        runs ``fn`` on the user's model bound to ``params`` (``ModelRuntime.apply``).
      loss: the user's ``loss(model, batch, rng, train)``.
      train: what ``loss`` is told.
    """
    def loss_of(params, frozen, extra, batch, rng):
        whole = params if frozen is None else merge_trainable(params, frozen)
        out, new_extra = apply(lambda m, b: loss(m, b, rng, train), whole, extra, rng, batch)
        value, metrics = split_loss_output(out)
        return value, (metrics, new_extra)

    return loss_of


def user_loss_fn(loss_of: Callable, frozen, extra) -> Callable:
    """What a custom ``grad_fn`` gets: ``loss_fn(params, batch, rng) -> (loss, metrics)``."""
    def loss_fn(params, batch, rng):
        value, (metrics, _) = loss_of(params, frozen, extra, batch, rng)
        return value, metrics

    return loss_fn


def model_gradients(loss_of: Callable, grad_fn: Callable | None = None) -> Callable:
    """A gradient function of one (micro-)batch: ``jax.value_and_grad`` of ``loss_of``,
    or the user's ``grad_fn(loss_fn, params, batch, rng) -> (loss, metrics, grads)``
    (the model's other state is then left as it was)."""
    def gradients(params, frozen, extra, batch, rng):
        if grad_fn is None:
            (value, (metrics, extra)), grads = jax.value_and_grad(loss_of, has_aux=True)(
                params, frozen, extra, batch, rng)
            return value, metrics, extra, grads
        value, metrics, grads = grad_fn(user_loss_fn(loss_of, frozen, extra), params, batch, rng)
        return value, metrics, extra, grads

    return gradients


def microbatched(gradients: Callable, accum: int, micro_rows: int, micro_sharding,
                 metric_names) -> Callable:
    """``gradients`` over ``accum`` micro-batches of a batch, averaged, in one ``scan``.

    Row ``m * accum + a`` of the batch goes to micro-batch ``a``: every micro-batch keeps
    the batch's split over devices, so no data moves between devices. Micro-batch ``a``
    gets ``fold_in(rng, a)``; the model's other state threads through them in order.

    A loss with a ``WEIGHT`` metric (the tokens it averages over, say) is averaged by
    it: each micro-batch's loss, metrics and gradients weigh its weight, so a mean over
    tokens is the mean over every token of the update, however the micro-batches hold
    them (``combine``). Without one, each micro-batch weighs the same.

    Args:
      gradients: a gradient function of one micro-batch.
      accum: micro-batches per batch (1: ``gradients`` itself).
      micro_rows: rows of one micro-batch over all devices.
      micro_sharding: the sharding of the (accum, micro_rows, ...) stack.
      metric_names: the names of the loss's metrics.
    """
    if accum == 1:
        return gradients

    def accumulated(params, frozen, extra, batch, rng):
        micro = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x.reshape(micro_rows, accum, *x.shape[1:]).swapaxes(0, 1), micro_sharding),
            batch)

        def body(carry, xs):
            g_sum, v_sum, m_sum, extra = carry
            mb, i = xs
            v, m, extra, g = gradients(params, frozen, extra, mb, jax.random.fold_in(rng, i))
            w = weight_of(m)
            g_sum = jax.tree.map(lambda a, b: a + b * w, g_sum, g)
            v, m = weighed(v, m)
            m_sum = {k: m_sum[k] + jnp.asarray(m[k], jnp.float32) for k in m_sum}
            return (g_sum, v_sum + v, m_sum, extra), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        m_zero = {k: jnp.zeros((), jnp.float32) for k in metric_names}
        (g_sum, v_sum, m_sum, extra), _ = jax.lax.scan(
            body, (zeros, jnp.zeros((), jnp.float32), m_zero, extra), (micro, jnp.arange(accum)))
        value, metrics, grads = combine(v_sum, m_sum, g_sum, accum)
        return value, metrics, extra, grads

    return accumulated


def weight_of(metrics) -> jax.Array:
    """A micro-batch's weight: its loss's ``WEIGHT`` metric, else 1."""
    return jax.lax.stop_gradient(jnp.asarray(metrics.get(WEIGHT, 1.0), jnp.float32))


def weighed(value, metrics) -> tuple:
    """A micro-batch's loss and metrics times its weight (``weight_of``), to be summed
    over the micro-batches and divided once (``combine``); counts (``COUNTS``, and the
    weight itself) as they are, to be summed."""
    w = weight_of(metrics)
    return value * w, {k: v if k in COUNTS or k == WEIGHT else v * w
                       for k, v in metrics.items()}


def combine(value_sum, metric_sums: dict, grad_sums, micro: int) -> tuple:
    """The update's loss, metrics and gradients from the sums of ``micro`` micro-batches'
    weighed ones (``weighed``; gradients times ``weight_of``): divided by the total
    weight (the summed ``WEIGHT``; ``micro`` without one), counts left summed."""
    total = metric_sums[WEIGHT] if WEIGHT in metric_sums else jnp.float32(micro)
    total = jnp.maximum(total, 1e-30)  # no weight at all: every sum is 0, and stays 0
    metrics = {k: v if k in COUNTS or k == WEIGHT else v / total
               for k, v in metric_sums.items()}
    return value_sum / total, metrics, jax.tree.map(lambda g: g / total, grad_sums)


NONFINITE_POLICIES = ("stop", "skip", "rollback")


def check_step_arguments(optimizer, grad_fn, on_nonfinite: str) -> None:
    """The Trainer's arguments of the step: an optax optimizer, a callable ``grad_fn``
    (or None), a known non-finite policy."""
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite={on_nonfinite!r}: use one of "
                         f"{', '.join(map(repr, NONFINITE_POLICIES))}")
    if grad_fn is not None and not callable(grad_fn):
        raise TypeError(f"grad_fn must be a function (loss_fn, params, batch, rng) -> "
                        f"(loss, metrics, grads), got {grad_fn!r}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation "
                        f"(e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}")


def train_step(state: TrainState, batch, *, gradients: Callable,
               optimizer: optax.GradientTransformation,
               on_nonfinite: str | None = "stop",
               after_update: Callable | None = None) -> tuple[TrainState, dict]:
    """One optimizer update on ``batch``; returns the new state and the step's metrics
    (``loss``, ``grad_norm`` and the loss's own, as float32 scalars).

    A step whose loss or gradient norm is not finite never reaches the parameters, the
    optimizer state or the model's other state (they are selected, on the devices,
    between the update and the state before it):

    - ``"stop"`` and ``"rollback"``: the state's ``nonfinite_step`` records the first
      such step and from then on no update is applied, so the state stays at the last
      finite one until the host reads the flag (on the log cadence, before a save) and
      stops or rolls back.
    - ``"skip"``: that update is left out and training goes on; the metric ``skipped``
      is 1 for it (0 otherwise).
    - ``None``: no check (the reference the guard's cost is measured against).

    ``after_update(params, extra) -> (extra, metrics)`` runs on the updated parameters
    (``ModelRuntime.after_update``: a router's bias update), its metrics logged with the
    step's; a non-finite step keeps the state before it there too.
    """
    rng, step_rng = jax.random.split(state.rng)
    value, metrics, extra, grads = gradients(state.params, state.frozen, state.extra, batch,
                                             step_rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    step = state.step + 1
    out = {"loss": value.astype(jnp.float32), "grad_norm": grad_norm}
    out.update({k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()})
    if after_update is not None:
        extra, settled = after_update(params, extra)
        out.update(settled)
    nonfinite_step = state.nonfinite_step
    if on_nonfinite is not None:
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        if on_nonfinite == "skip":
            keep = finite
            out["skipped"] = 1.0 - finite.astype(jnp.float32)
        else:
            nonfinite_step = jnp.where((nonfinite_step == 0) & ~finite, step, nonfinite_step)
            keep = nonfinite_step == 0
        params, opt_state, extra = jax.tree.map(
            lambda new, old: jnp.where(keep, new, old),
            (params, opt_state, extra), (state.params, state.opt_state, state.extra))
    return state.replace(step=step, rng=rng, params=params, extra=extra, opt_state=opt_state,
                         nonfinite_step=nonfinite_step), out


def eval_step(params, extra, batch, rng, *, apply: Callable, loss: Callable) -> dict:
    """The loss and its metrics (float32 scalars) of one batch, ``train=False``, and the
    batch's ``WEIGHT``: the loss's own if it gives one, else the batch's rows."""
    value, (metrics, _) = model_loss(apply, loss, train=False)(params, None, extra, batch, rng)
    rows = jax.tree.leaves(batch)[0].shape[0]
    return {"loss": value.astype(jnp.float32),
            **{k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()},
            WEIGHT: jnp.asarray(metrics.get(WEIGHT, rows), jnp.float32)}
