"""The training and evaluation steps as plain functions, without a Trainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.engine.state import TrainState, counters
from redray.engine.steps import (eval_step, microbatched, model_gradients, model_loss,
                                 train_step)
from redray.sharding import make_mesh

X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
BATCH = {"x": X, "y": X @ np.array([1.0, -2.0, 0.5], np.float32)}
PARAMS = {"w": jnp.zeros(3, jnp.float32)}
SEEN_TRAIN = []


def apply(fn, params, extra, rng, batch):
    """The model is its parameters: a linear map."""
    return fn(params, batch), extra


def loss(model, batch, rng, train):
    SEEN_TRAIN.append(train)
    error = batch["x"] @ model["w"] - batch["y"]
    return jnp.mean(error ** 2), {"mae": jnp.mean(jnp.abs(error))}


def state(optimizer):
    step, rng, nonfinite_step = counters(0)
    return TrainState(step=step, rng=rng, params=PARAMS, extra={},
                      opt_state=optimizer.init(PARAMS), nonfinite_step=nonfinite_step)


def plain_loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def test_train_step_is_one_optimizer_update_of_the_users_loss():
    tx = optax.sgd(0.1)
    gradients = model_gradients(model_loss(apply, loss))
    step = jax.jit(functools.partial(train_step, gradients=gradients, optimizer=tx))
    start = state(tx)
    new, metrics = step(start, BATCH)
    want = PARAMS["w"] - 0.1 * jax.grad(plain_loss)(PARAMS["w"], BATCH)
    np.testing.assert_allclose(new.params["w"], want, rtol=1e-6)
    assert int(new.step) == 1
    np.testing.assert_array_equal(jax.random.key_data(new.rng),
                                  jax.random.key_data(jax.random.split(start.rng)[0]))
    assert set(metrics) == {"loss", "grad_norm", "mae"}
    assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
    np.testing.assert_allclose(metrics["loss"], plain_loss(PARAMS["w"], BATCH), rtol=1e-6)


def test_micro_batches_average_to_the_whole_batch_gradient():
    gradients = model_gradients(model_loss(apply, loss))
    assert microbatched(gradients, 1, 16, None, ["mae"]) is gradients
    mesh = make_mesh(data_axis=4)
    accumulated = microbatched(gradients, 4, 4, NamedSharding(mesh, P(None, ("data", "fsdp"))),
                               ["mae"])
    key = jax.random.key(1)
    whole = jax.jit(gradients)(PARAMS, None, {}, BATCH, key)
    parts = jax.jit(accumulated)(PARAMS, None, {}, BATCH, key)
    np.testing.assert_allclose(parts[0], whole[0], rtol=1e-6)          # loss
    np.testing.assert_allclose(parts[3]["w"], whole[3]["w"], rtol=1e-5)  # gradient
    assert set(parts[1]) == {"mae"}


def test_micro_batches_of_unequal_weight_average_to_the_whole_batchs_mean_per_unit():
    """A loss that gives its weight (the tokens it averages over, as next_token_loss's
    metrics do): micro-batches holding 1 to 4 of them each make the update's loss,
    gradient and metric the mean over every unit of the batch, not of the micro-batch
    means; counts are summed."""
    mask = (np.arange(16) % 4 < np.repeat([1, 2, 3, 4], 4)).astype(np.float32)
    batch = dict(BATCH, m=mask)

    def masked(model, b, rng, train):
        error = (b["x"] @ model["w"] - b["y"]) ** 2
        n = b["m"].sum()
        return (error * b["m"]).sum() / n, {"mse": (error * b["m"]).sum() / n, "weight": n,
                                            "tokens": n}

    gradients = model_gradients(model_loss(apply, masked))
    mesh = make_mesh(data_axis=4)
    accumulated = microbatched(gradients, 4, 4, NamedSharding(mesh, P(None, ("data", "fsdp"))),
                               ["mse", "weight", "tokens"])
    w = jnp.asarray([0.3, -0.1, 0.2], jnp.float32)
    key = jax.random.key(1)
    whole = jax.jit(gradients)(dict(w=w), None, {}, batch, key)
    parts = jax.jit(accumulated)(dict(w=w), None, {}, batch, key)
    np.testing.assert_allclose(parts[0], whole[0], rtol=1e-6)
    np.testing.assert_allclose(parts[3]["w"], whole[3]["w"], rtol=1e-5)
    np.testing.assert_allclose(parts[1]["mse"], whole[1]["mse"], rtol=1e-6)
    assert float(parts[1]["tokens"]) == float(parts[1]["weight"]) == mask.sum()
    # the micro-batches' plain mean differs: the test can tell the two apart
    means = [float(jax.jit(gradients)(dict(w=w), None, {}, {k: v[a::4] for k, v in batch.items()},
                                      key)[0]) for a in range(4)]
    assert abs(np.mean(means) - float(whole[0])) > 1e-3


def test_a_custom_grad_fn_gets_the_users_loss_as_a_function_of_params():
    calls = []

    def grad_fn(loss_fn, params, batch, rng):
        (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
        calls.append(sorted(metrics))
        return value, metrics, jax.tree.map(lambda g: 2 * g, grads)

    plain = model_gradients(model_loss(apply, loss))
    custom = model_gradients(model_loss(apply, loss), grad_fn)
    key = jax.random.key(0)
    _, _, _, want = plain(PARAMS, None, {}, BATCH, key)
    _, _, extra, got = custom(PARAMS, None, {"kept": 1}, BATCH, key)
    np.testing.assert_allclose(got["w"], 2 * want["w"], rtol=1e-6)
    assert calls == [["mae"]] and extra == {"kept": 1}


def test_eval_step_runs_the_loss_in_eval_mode():
    SEEN_TRAIN.clear()
    out = eval_step(PARAMS, {}, BATCH, jax.random.key(0), apply=apply, loss=loss)
    assert SEEN_TRAIN == [False]
    assert set(out) == {"loss", "mae", "weight"} and out["loss"].dtype == jnp.float32
    assert float(out["weight"]) == len(BATCH["y"])  # no weight from the loss: its rows


def poisoned(batch):
    """The batch with a NaN label: its loss and gradient are NaN."""
    return {**batch, "y": np.where(np.arange(len(batch["y"])) == 3, np.nan, batch["y"])}


def run_steps(policy, batches):
    tx = optax.adam(0.1)
    step = jax.jit(functools.partial(train_step, gradients=model_gradients(model_loss(apply, loss)),
                                     optimizer=tx, on_nonfinite=policy))
    current, seen = state(tx), []
    for batch in batches:
        current, metrics = step(current, batch)
        seen.append(jax.device_get(metrics))
    return current, seen


def test_a_nonfinite_step_never_reaches_the_state_and_is_recorded_once():
    good = [BATCH, {**BATCH, "x": BATCH["x"][::-1], "y": BATCH["y"][::-1]}]
    clean, _ = run_steps("stop", good[:1])
    # stop: the first non-finite step is recorded; from then on no update is applied
    stopped, metrics = run_steps("stop", [BATCH, poisoned(BATCH), good[1]])
    assert int(stopped.nonfinite_step) == 2 and int(stopped.step) == 3
    assert np.isnan(metrics[1]["loss"])
    np.testing.assert_array_equal(stopped.params["w"], clean.params["w"])
    np.testing.assert_array_equal(stopped.opt_state[0].mu["w"], clean.opt_state[0].mu["w"])
    # skip: exactly the run without that batch (the optimizer's count included)
    skipped, metrics = run_steps("skip", [BATCH, poisoned(BATCH), good[1]])
    without, _ = run_steps("skip", good)
    assert int(skipped.nonfinite_step) == 0
    assert [m["skipped"] for m in metrics] == [0.0, 1.0, 0.0]
    np.testing.assert_array_equal(skipped.params["w"], without.params["w"])
    assert int(skipped.opt_state[0].count) == 2
    # no policy: the NaN spreads into the parameters (what the guard prevents)
    unguarded, _ = run_steps(None, [BATCH, poisoned(BATCH)])
    assert np.isnan(np.asarray(unguarded.params["w"])).all()
