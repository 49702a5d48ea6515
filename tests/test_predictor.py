"""The Predictor: one output per input, in input order, on any mesh, with given params.

Every prediction carries its input's ``id`` through ``predict`` and is compared with
a plain NumPy forward pass of the same parameters on that single example, so a
dropped, duplicated, reordered or padded row, or a wrong parameter shard, shows up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import redray
from tiny import Counting

D_IN, HIDDEN, D_OUT = 4, 16, 3
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- models

class MLP(nnx.Module):
    """4 -> 16 -> 3; with model_axis=2 the hidden layer is split (column, then row)."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
        self.b = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN, name="a")(x)
        return nn.Dense(D_OUT, name="b")(jnp.tanh(h))


def nnx_factory(rngs):
    return MLP(rngs)


def linen_model():
    return redray.LinenModel(LinenMLP(), jnp.zeros((1, D_IN), jnp.float32))


def pure(params) -> dict:
    """Host numpy copy of params (NNX State or Linen dict) as nested dicts."""
    params = jax.device_get(params)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    return jax.tree.map(np.asarray, params)


def reference(params: dict, x: np.ndarray) -> np.ndarray:
    """The model on ONE example, in float64 NumPy on the host (no mesh, no JAX)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    h = np.tanh(x.astype(np.float64) @ p["a"]["kernel"] + p["a"]["bias"])
    return h @ p["b"]["kernel"] + p["b"]["bias"]


# --------------------------------------------------------------------------- pipeline

def make_examples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
    out = []
    for i in range(n):
        x = rng.normal(size=D_IN).astype(np.float32)
        # ids that are not positions, so an output can't match its input by accident
        out.append({"id": 1000 + 7 * i, "x": x, "y": (x @ w).astype(np.float32)})
    return out


def collate(examples):
    return {"x": np.stack([e["x"] for e in examples]),
            "y": np.stack([e["y"] for e in examples]),
            "id": np.array([e["id"] for e in examples], np.int32)}


def loss(model, batch, rng, train):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def predict(model, batch, rng):
    return {"id": batch["id"], "y": model(batch["x"])}


def check_outputs(outputs, examples, params):
    """One output per example, in order, each equal to the single-example reference."""
    assert isinstance(outputs, list)
    assert len(outputs) == len(examples)
    assert [int(o["id"]) for o in outputs] == [e["id"] for e in examples]
    for out, ex in zip(outputs, examples):
        assert set(out) == {"id", "y"}
        assert isinstance(out["y"], np.ndarray) and out["y"].shape == (D_OUT,)
        assert np.asarray(out["id"]).shape == ()
        np.testing.assert_allclose(out["y"], reference(params, ex["x"]), rtol=RTOL, atol=ATOL)


def assert_same_predictions(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert int(x["id"]) == int(y["id"])
        np.testing.assert_allclose(x["y"], y["y"], rtol=RTOL, atol=ATOL)


def model_sharded(params) -> bool:
    """Whether some parameter is actually split over the 'model' axis."""
    return any("model" in jax.tree.leaves(tuple(leaf.sharding.spec))
               for leaf in jax.tree.leaves(params))


EXAMPLES = make_examples(21)


@pytest.fixture(scope="module")
def trained():
    """A trainer on model_axis=2 after a few steps (params differ from init)."""
    t = redray.Trainer.of(nnx_factory, collate, loss, optax.adam(5e-2), predict=predict,
                       batch_size=8, model_axis=2, progress=False, log_every=1, seed=0)
    t.init(EXAMPLES)
    init_params = pure(t.state.params)
    t.fit(make_examples(32, seed=1), epochs=2)
    return t, init_params


@pytest.fixture(scope="module")
def fresh_tp_predictor():
    """A freshly initialized Predictor on model_axis=2, shared across input sizes."""
    counted = Counting(collate)
    return redray.Predictor(nnx_factory, counted, predict, batch_size=8, model_axis=2), counted


# --------------------------------------------------------------------------- order / coverage

@pytest.mark.parametrize("n", [1, 7, 8, 9, 21])
def test_every_input_exactly_once_in_order(fresh_tp_predictor, n):
    p, counted = fresh_tp_predictor
    examples = EXAMPLES[:n]
    before = counted.calls
    outputs = p.predict(examples)
    assert counted.calls - before == math.ceil(n / 8)  # one collate per (padded) batch
    check_outputs(outputs, examples, pure(p.params))
    assert model_sharded(p.params)


def test_reordered_input_gives_reordered_output(fresh_tp_predictor):
    p, _ = fresh_tp_predictor
    order = np.random.default_rng(3).permutation(len(EXAMPLES))
    shuffled = [EXAMPLES[i] for i in order]
    straight = p.predict(EXAMPLES)
    outputs = p.predict(shuffled)
    check_outputs(outputs, shuffled, pure(p.params))
    assert_same_predictions(outputs, [straight[i] for i in order])


def test_duplicates_and_single_device_batch():
    # batch_size 4 on data_axis=4: one row per device; repeated inputs stay repeated.
    examples = [EXAMPLES[0], EXAMPLES[0], EXAMPLES[5], EXAMPLES[0], EXAMPLES[5]]
    p = redray.Predictor(nnx_factory, collate, predict, batch_size=4, data_axis=4)
    check_outputs(p.predict(examples), examples, pure(p.params))


def test_empty_input_returns_empty_list():
    counted = Counting(collate)
    p = redray.Predictor(nnx_factory, counted, predict, batch_size=8, model_axis=2)
    assert p.predict([]) == []
    assert counted.calls == 0
    # and it still works afterwards
    check_outputs(p.predict(EXAMPLES[:3]), EXAMPLES[:3], pure(p.params))


def test_accepts_any_sequence_and_nested_outputs():
    def nested(model, batch, rng):
        y = model(batch["x"])
        return {"id": batch["id"], "y": y, "parts": (y[:, 0], {"argmax": jnp.argmax(y, -1)})}

    p = redray.Predictor(nnx_factory, collate, nested, batch_size=8, model_axis=2)
    outputs = p.predict(tuple(EXAMPLES[:9]))
    params = pure(p.params)
    assert len(outputs) == 9
    for out, ex in zip(outputs, EXAMPLES[:9]):
        ref = reference(params, ex["x"])
        assert int(out["id"]) == ex["id"]
        first, rest = out["parts"]
        np.testing.assert_allclose(first, ref[0], rtol=RTOL, atol=ATOL)
        assert int(rest["argmax"]) == int(np.argmax(ref))


# --------------------------------------------------------------------------- meshes

def test_predictions_equal_across_meshes(trained):
    t, _ = trained
    params, extra = t.state.params, t.state.extra
    assert model_sharded(params)
    host = pure(params)

    single = redray.Predictor(nnx_factory, collate, predict, params=params, extra=extra,
                              batch_size=8, mesh=redray.make_mesh(devices=jax.devices()[:1]))
    base = single.predict(EXAMPLES)
    assert all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree.leaves(single.params))
    check_outputs(base, EXAMPLES, host)

    for axes in ({"model_axis": 2}, {"data_axis": 4}, {"model_axis": 4}, {"fsdp_axis": 4}):
        p = redray.Predictor(nnx_factory, collate, predict, params=params, extra=extra,
                             batch_size=8, **axes)
        out = p.predict(EXAMPLES)
        assert_same_predictions(out, base)
        check_outputs(out, EXAMPLES, host)
        if axes.get("model_axis", 1) > 1:
            assert model_sharded(p.params), axes


def test_given_params_are_not_replaced_by_init(trained):
    t, init_params = trained
    trained_params = pure(t.state.params)
    # training moved the parameters: the comparison below can tell them apart
    diff = max(np.abs(trained_params[k]["kernel"] - init_params[k]["kernel"]).max()
               for k in ("a", "b"))
    assert diff > 1e-2
    p = redray.Predictor(nnx_factory, collate, predict, params=t.state.params,
                         extra=t.state.extra, batch_size=8, model_axis=2)
    check_outputs(p.predict(EXAMPLES), EXAMPLES, trained_params)


def test_fresh_predictor_matches_trainer_init_with_same_seed(trained):
    _, init_params = trained
    p = redray.Predictor(nnx_factory, collate, predict, batch_size=8, model_axis=2, seed=0)
    check_outputs(p.predict(EXAMPLES), EXAMPLES, init_params)


# --------------------------------------------------------------------------- trainer.predictor

def test_trainer_predictor_uses_trained_params(trained):
    t, init_params = trained
    outputs = t.predictor(batch_size=8).predict(EXAMPLES)
    check_outputs(outputs, EXAMPLES, pure(t.state.params))

    # the same as calling the trained model (the user's NNX module) directly
    direct = np.asarray(t.model(np.stack([e["x"] for e in EXAMPLES])))
    np.testing.assert_allclose(np.stack([o["y"] for o in outputs]), direct, rtol=RTOL, atol=ATOL)

    # and not what the untrained (same seed) parameters give
    fresh = redray.Predictor(nnx_factory, collate, predict, batch_size=8, model_axis=2, seed=0)
    fresh_y = np.stack([o["y"] for o in fresh.predict(EXAMPLES)])
    assert np.abs(fresh_y - direct).max() > 1e-2


def test_trainer_predictor_default_and_other_batch_sizes(trained):
    t, _ = trained
    host = pure(t.state.params)
    for batch_size in (None, 2, 16):
        check_outputs(t.predictor(batch_size=batch_size).predict(EXAMPLES[:11]), EXAMPLES[:11],
                      host)


def test_predictor_survives_further_training():
    """A predictor taken from a trainer keeps working after the trainer trains on.

    The train step donates its state, so a predictor holding the trainer's arrays
    would predict from deleted buffers (a segfault on CPU). It must instead use the
    trainer's latest parameters.
    """
    t = redray.Trainer.of(nnx_factory, collate, loss, optax.adam(5e-2), predict=predict,
                       batch_size=8, model_axis=2, progress=False, log_every=1)
    train = make_examples(16, seed=2)
    t.fit(train, max_steps=1)
    p = t.predictor(batch_size=8)
    before = p.predict(EXAMPLES[:5])
    check_outputs(before, EXAMPLES[:5], pure(t.state.params))
    t.fit(train, epochs=1)
    after = p.predict(EXAMPLES[:5])
    check_outputs(after, EXAMPLES[:5], pure(t.state.params))
    assert not np.allclose(np.stack([o["y"] for o in after]), np.stack([o["y"] for o in before]))


# --------------------------------------------------------------------------- Linen

def test_linen_fresh_predictor_in_order():
    p = redray.Predictor(linen_model(), collate, predict, batch_size=8, model_axis=2)
    outputs = p.predict(EXAMPLES)
    params = pure(p.params)
    assert set(params) == {"a", "b"}
    check_outputs(outputs, EXAMPLES, params)
    assert model_sharded(p.params)


def test_linen_trained_params_across_meshes():
    t = redray.Trainer.of(linen_model(), collate, loss, optax.adam(5e-2), predict=predict,
                       batch_size=8, model_axis=2, progress=False, log_every=1)
    t.init(EXAMPLES)
    init_params = pure(t.state.params)
    t.fit(make_examples(32, seed=1), epochs=2)
    host = pure(t.state.params)
    assert max(np.abs(host[k]["kernel"] - init_params[k]["kernel"]).max()
               for k in ("a", "b")) > 1e-2

    via_trainer = t.predictor().predict(EXAMPLES)
    check_outputs(via_trainer, EXAMPLES, host)
    single = redray.Predictor(linen_model(), collate, predict, params=t.state.params,
                              extra=t.state.extra, batch_size=8,
                              mesh=redray.make_mesh(devices=jax.devices()[:1]))
    assert_same_predictions(single.predict(EXAMPLES), via_trainer)
    spread = redray.Predictor(linen_model(), collate, predict, params=t.state.params,
                              batch_size=4, data_axis=4)
    assert_same_predictions(spread.predict(EXAMPLES), via_trainer)


# --------------------------------------------------------------------------- model state

class BNModel(nnx.Module):
    """A model with non-parameter state (batch statistics) in ``extra``."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D_IN, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def bn_predict(model, batch, rng):
    return model(batch["x"])


def test_given_extra_is_used():
    base = redray.Predictor(BNModel, collate, bn_predict, batch_size=8)
    base_out = np.stack(base.predict(EXAMPLES[:8]))
    new_stats = {"mean": np.full(8, 0.5, np.float32), "var": np.full(8, 4.0, np.float32)}
    stats = jax.tree_util.tree_map_with_path(
        lambda path, a: new_stats[jax.tree_util.keystr(path).split("'")[-2]],
        jax.device_get(base.extra))
    assert set(nnx.to_pure_dict(stats)["bn"]) == {"mean", "var"}
    p = redray.Predictor(BNModel, collate, bn_predict, params=base.params, extra=stats,
                         batch_size=8, model_axis=2)
    out = np.stack(p.predict(EXAMPLES[:8]))
    # BatchNorm with scale 1, bias 0: (h - 0.5) / sqrt(4 + eps) vs h / sqrt(1 + eps)
    eps = 1e-5
    h = base_out * np.sqrt(1 + eps)
    np.testing.assert_allclose(out, (h - 0.5) / np.sqrt(4 + eps), rtol=1e-4, atol=1e-5)


def test_params_without_extra_use_fresh_model_state():
    """The docstring: "params, extra: ... None initializes fresh ones".

    Giving trained params but no extra must not invent batch statistics: a BatchNorm
    with fresh state (mean 0, var 1) is the identity up to eps here, while the current
    zero fill (var 0) divides by sqrt(eps) and scales outputs ~316x.
    """
    base = redray.Predictor(BNModel, collate, bn_predict, batch_size=8)
    expected = np.stack(base.predict(EXAMPLES[:8]))
    p = redray.Predictor(BNModel, collate, bn_predict, params=base.params, batch_size=8)
    np.testing.assert_allclose(np.stack(p.predict(EXAMPLES[:8])), expected, rtol=1e-4,
                               atol=1e-5)


def test_sampling_predict_gets_a_new_rng_each_call_unless_given():
    from tiny import TinyLM, lm_collate, lm_loss, token_data

    data = token_data(16)

    def sample(model, batch, rng):
        return jax.random.uniform(rng, (batch["ids"].shape[0],))

    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       predict=sample, batch_size=8, progress=False)
    t.init(data)
    assert t.predictor() is t.predictor()  # one compiled predictor per batch size
    first, second = (np.stack(t.predictor().predict(data[:8])) for _ in range(2))
    assert not np.allclose(first, second)
    key = jax.random.key(7)
    again = [np.stack(t.predictor().predict(data[:8], rng=key)) for _ in range(2)]
    np.testing.assert_array_equal(*again)
