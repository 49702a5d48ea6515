"""The three-function contract: every mistake is caught early with an error naming the fix.

Each validation error is checked twice where it is natural: directly on the
``redray.functions`` function, and through the public ``Trainer``/``Predictor`` so the
test proves it is raised at ``init``/``fit`` on the first batch (or at the first
``predict``), before any training step or device state exists.

The end of the file trains both model kinds (NNX and Linen via ``LinenModel``) on a
learnable linear regression and checks the loss really goes down.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import redray
from tiny import Counting
from redray.functions import UserFunctions, UserFunctionError, check_batch, check_predict_output, \
    split_loss_output

D_IN = 4


# --------------------------------------------------------------------------- helpers

class Linear(nnx.Module):
    """y = x @ w + b, one output per example."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(D_IN, 1, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)[:, 0]


class LinenLinear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)[:, 0]


def make_examples(n: int, seed: int = 0) -> list[dict]:
    """A learnable task: y = x . w_true + 0.5 (noise-free)."""
    rng = np.random.default_rng(seed)
    w_true = np.array([1.5, -2.0, 0.5, 1.0], np.float32)
    out = []
    for i in range(n):
        x = rng.normal(size=D_IN).astype(np.float32)
        out.append({"id": i, "x": x, "y": np.float32(x @ w_true + 0.5)})
    return out


def collate(examples):
    return {"x": np.stack([e["x"] for e in examples]),
            "y": np.array([e["y"] for e in examples], np.float32),
            "id": np.array([e["id"] for e in examples], np.int32)}


def mse(model, batch, rng, train):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def predict(model, batch, rng):
    return {"id": batch["id"], "y": model(batch["x"])}


def trainer(collate_fn=collate, loss_fn=mse, predict_fn=predict, **kw):
    kw = {"batch_size": 8, "model_axis": 2, "progress": False, "log_every": 1, **kw}
    return redray.Trainer.of(lambda rngs: Linear(rngs), collate_fn, loss_fn, optax.adam(1e-2),
                          predict=predict_fn, **kw)


def m(*parts: str) -> str:
    """A regex matching the literal ``parts`` in order, anything in between."""
    return ".*".join(re.escape(p) for p in parts)


EXAMPLES = make_examples(32)


# --------------------------------------------------------------------------- collate

def test_collate_returning_list_instead_of_dict():
    with pytest.raises(UserFunctionError, match=m("collate returned list",
                                              "expected a non-empty dict of numpy arrays")):
        check_batch([np.zeros(3), np.zeros(3)])

    counted = Counting(lambda ex: [e["x"] for e in ex])
    t = trainer(counted)
    with pytest.raises(UserFunctionError, match=m("collate returned list", "dict of numpy arrays")):
        t.fit(EXAMPLES)
    assert counted.calls == 1
    assert t.state is None


def test_collate_returning_empty_dict():
    with pytest.raises(UserFunctionError, match=m("collate returned dict", "non-empty dict")):
        check_batch({})


def test_collate_value_is_python_list():
    with pytest.raises(UserFunctionError,
                       match=m("batch['y'] as a list", "return a numpy array", "np.array")):
        check_batch({"x": np.zeros((2, 3)), "y": [1.0, 2.0]})

    def bad(examples):
        return {"x": np.stack([e["x"] for e in examples]), "y": [e["y"] for e in examples]}

    counted = Counting(bad)
    t = trainer(counted)
    with pytest.raises(UserFunctionError, match=m("batch['y'] as a list", "return a numpy array")):
        t.fit(EXAMPLES)
    assert counted.calls == 1
    assert t.state is None


def test_collate_ragged_python_rows_mention_pad():
    tokens = [[1, 2], [3, 4, 5]]
    with pytest.raises(UserFunctionError, match=m("batch['tokens'] as a list",
                                                  "return a numpy array",
                                                  "different lengths [2, 3]", "pad")):
        check_batch({"tokens": tokens})

    def ragged(examples):
        return {"tokens": [list(range(1 + e["id"] % 3)) for e in examples]}

    t = trainer(ragged)
    with pytest.raises(UserFunctionError, match=m("batch['tokens']", "different lengths", "pad")):
        t.init(EXAMPLES)
    assert t.state is None


def test_collate_tuple_value_is_rejected_like_a_list():
    with pytest.raises(UserFunctionError, match=m("batch['x'] as a tuple", "return a numpy array")):
        check_batch({"x": (np.zeros(3), np.zeros(3))})


def test_collate_ragged_object_array_mentions_pad():
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = [1, 2], [3, 4, 5]
    with pytest.raises(UserFunctionError,
                       match=m("batch['tokens']", "dtype object", "pad every row", "np.pad")):
        check_batch({"tokens": ragged})

    def object_rows(examples):
        rows = np.empty(len(examples), dtype=object)
        for i, e in enumerate(examples):
            rows[i] = list(range(1 + e["id"] % 3))
        return {"x": np.stack([e["x"] for e in examples]), "tokens": rows}

    t = trainer(object_rows)
    with pytest.raises(UserFunctionError, match=m("batch['tokens']", "dtype object", "pad")):
        t.fit(EXAMPLES)
    assert t.state is None


def test_collate_scalar_value_needs_batch_dimension():
    with pytest.raises(UserFunctionError,
                       match=m("batch['weight'] as a scalar", "leading batch dimension")):
        check_batch({"x": np.zeros((2, 3)), "weight": np.array(1.0)})

    def with_scalar(examples):
        return {**collate(examples), "weight": np.array(1.0, np.float32)}

    t = trainer(with_scalar)
    with pytest.raises(UserFunctionError,
                       match=m("batch['weight'] as a scalar", "batch dimension")):
        t.fit(EXAMPLES)
    assert t.state is None


def test_collate_dropping_rows_in_training_names_collate_and_the_fix():
    # Fine on the first batch (init checks it), short later: caught at the batch where it
    # happens, not deep inside the placement of the global array.
    calls = []

    def drops_rows_later(examples):
        calls.append(len(examples))
        return collate(examples if len(calls) < 3 else examples[:-1])

    t = trainer(drops_rows_later)
    with pytest.raises(UserFunctionError, match=m("collate was given 8 examples",
                                              "returned a batch of 7 rows",
                                              "exactly one row per example")):
        t.fit(EXAMPLES)
    assert len(calls) >= 3


def test_collate_non_array_value_names_key():
    # A Python number is neither a list nor an array: the key and the batch-major fix.
    with pytest.raises(UserFunctionError,
                       match=m("batch['n'] of type int", "one row per example", "np.full")):
        check_batch({"x": np.zeros((2, 3)), "n": 2})


def test_collate_batch_dimensions_differ_lists_keys_and_sizes():
    with pytest.raises(UserFunctionError, match=m("batch (first) dimensions differ",
                                              "x: 8", "y: 7", "one row per example")):
        check_batch({"x": np.zeros((8, 3)), "y": np.zeros(7)})

    def short_labels(examples):
        b = collate(examples)
        b["y"] = b["y"][:-1]
        return b

    counted = Counting(short_labels)
    t = trainer(counted)
    with pytest.raises(UserFunctionError, match=m("dimensions differ", "x: 8", "y: 7")):
        t.fit(EXAMPLES)
    assert counted.calls == 1
    assert t.state is None


def test_collate_non_string_key():
    with pytest.raises(UserFunctionError, match=m("non-string key 0", "use str keys")):
        check_batch({0: np.zeros(3)})

    t = trainer(lambda ex: {0: np.stack([e["x"] for e in ex])})
    with pytest.raises(UserFunctionError, match=m("non-string key 0", "use str keys")):
        t.fit(EXAMPLES)
    assert t.state is None


def test_check_batch_converts_jax_arrays_and_keeps_numpy():
    out = check_batch({"x": jnp.ones((2, 3)), "y": np.zeros(2, np.int32)}, n_examples=2)
    assert set(out) == {"x", "y"}
    assert all(isinstance(v, np.ndarray) for v in out.values())
    np.testing.assert_array_equal(out["x"], np.ones((2, 3), np.float32))


def test_check_batch_rows_must_match_examples():
    with pytest.raises(UserFunctionError, match=m("given 8 examples", "batch of 7 rows",
                                              "exactly one row per example")):
        check_batch({"x": np.zeros((7, 3))}, n_examples=8)

    # Through the Predictor (which maps outputs back to inputs one to one).
    def drops_one(examples):
        return collate(examples[:-1])

    p = redray.Predictor(lambda rngs: Linear(rngs), drops_one, predict, batch_size=8,
                         model_axis=2)
    with pytest.raises(UserFunctionError, match=m("given 8 examples", "batch of 7 rows")):
        p.predict(EXAMPLES)


def test_pipeline_functions_must_be_callable():
    with pytest.raises(UserFunctionError, match="collate must be a function"):
        UserFunctions(None, mse)
    with pytest.raises(UserFunctionError, match="loss must be a function"):
        UserFunctions(collate, "mse")
    with pytest.raises(UserFunctionError, match="predict must be a function or None"):
        UserFunctions(collate, mse, predict=3)


# --------------------------------------------------------------------------- loss

def test_loss_not_reduced_names_shape_and_mean():
    with pytest.raises(UserFunctionError, match=m("shape (8,)", "expected a scalar", ".mean()")):
        split_loss_output(jnp.zeros(8))

    def per_example(model, batch, rng, train):
        return (model(batch["x"]) - batch["y"]) ** 2

    t = trainer(loss_fn=per_example)
    with pytest.raises(UserFunctionError, match=m("loss returned shape (8,)", ".mean()")):
        t.init(EXAMPLES)
    assert t.state is None


def test_loss_tuple_with_non_dict_metrics():
    with pytest.raises(UserFunctionError,
                       match=m("loss returned a tuple of 2 items",
                               "(scalar, dict of scalar metrics)")):
        split_loss_output((jnp.float32(1.0), jnp.float32(2.0)))
    with pytest.raises(UserFunctionError, match=m("tuple of 3 items", "dict of scalar metrics")):
        split_loss_output((jnp.float32(1.0), {}, {}))

    def with_list(model, batch, rng, train):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err ** 2), [jnp.mean(jnp.abs(err))]

    t = trainer(loss_fn=with_list)
    with pytest.raises(UserFunctionError, match=m("tuple of 2 items", "dict of scalar metrics")):
        t.fit(EXAMPLES)
    assert t.state is None


def test_loss_metric_not_scalar_names_metric():
    with pytest.raises(UserFunctionError,
                       match=m("metric 'err' has shape (8,)", "expected a scalar", ".mean()")):
        split_loss_output((jnp.float32(1.0), {"ok": jnp.float32(0.0), "err": jnp.zeros(8)}))

    def vector_metric(model, batch, rng, train):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err ** 2), {"abs_err": jnp.abs(err)}

    t = trainer(loss_fn=vector_metric)
    with pytest.raises(UserFunctionError, match=m("metric 'abs_err' has shape (8,)", ".mean()")):
        t.init(EXAMPLES)
    assert t.state is None


def test_loss_int_dtype_rejected():
    with pytest.raises(UserFunctionError, match=m("dtype int32", "floating-point scalar")):
        split_loss_output(jnp.int32(3))

    def count_loss(model, batch, rng, train):
        return jnp.sum(model(batch["x"]) > batch["y"])

    t = trainer(loss_fn=count_loss)
    with pytest.raises(UserFunctionError, match=m("loss returned dtype int32", "floating-point")):
        t.init(EXAMPLES)
    assert t.state is None


def test_loss_not_an_array():
    with pytest.raises(UserFunctionError, match=m("loss returned str", "expected a scalar array")):
        split_loss_output("0.5")


def test_split_loss_output_valid():
    value, metrics = split_loss_output(jnp.float32(2.0))
    assert float(value) == 2.0 and metrics == {}
    value, metrics = split_loss_output((jnp.float32(2.0), {"acc": jnp.float32(0.25)}))
    assert float(value) == 2.0 and set(metrics) == {"acc"}
    assert float(metrics["acc"]) == 0.25
    # Abstract values (what the Trainer checks at init) work the same way.
    abstract = jax.ShapeDtypeStruct((), jnp.float32)
    value, metrics = split_loss_output((abstract, {"acc": abstract}))
    assert value is abstract and metrics == {"acc": abstract}


def test_split_loss_output_accepts_python_number_metric():
    # A Python number is a scalar; the current message ("has shape (), expected a
    # scalar") contradicts itself. See test_python_number_metric_trains.
    _, metrics = split_loss_output((jnp.float32(1.0), {"n": 8}))
    assert float(metrics["n"]) == 8.0


def test_python_number_metric_trains():
    """Metrics like the batch size are plain Python numbers inside the traced loss.

    Trainer.init validates the loss under jax.eval_shape (which turns them into
    arrays) and accepts it, so the train step must accept it too, or init must
    reject it: it may not pass init and then fail inside the first step.
    """
    def with_count(model, batch, rng, train):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err ** 2), {"n": batch["x"].shape[0]}

    t = trainer(loss_fn=with_count)
    history = t.fit(EXAMPLES, max_steps=2)
    assert [row["n"] for row in history] == [8.0, 8.0]


# --------------------------------------------------------------------------- predict

def test_predict_reduced_over_batch_names_output_and_size():
    with pytest.raises(UserFunctionError, match=m("predict returned its output with shape ()",
                                              "batch of 8", "(8, ...)",
                                              "don't reduce over the batch")):
        check_predict_output(jax.ShapeDtypeStruct((), jnp.float32), 8)

    def mean_pred(model, batch, rng):
        return model(batch["x"]).mean()

    counted = Counting(collate)
    p = redray.Predictor(lambda rngs: Linear(rngs), counted, mean_pred, batch_size=8,
                         model_axis=2)
    with pytest.raises(UserFunctionError, match=m("its output with shape ()", "batch of 8",
                                              "(8, ...)")):
        p.predict(EXAMPLES)
    assert counted.calls == 1


def test_predict_dict_leaf_without_batch_dim_names_leaf():
    out = {"logits": jax.ShapeDtypeStruct((8, 3), jnp.float32),
           "score": jax.ShapeDtypeStruct((), jnp.float32)}
    with pytest.raises(UserFunctionError, match=m("['score'] with shape ()", "batch of 8",
                                              "(8, ...)")):
        check_predict_output(out, 8)

    def partial(model, batch, rng):
        y = model(batch["x"])
        return {"y": y, "mean": y.mean(keepdims=True)}

    p = redray.Predictor(lambda rngs: Linear(rngs), collate, partial, batch_size=8,
                         model_axis=2)
    with pytest.raises(UserFunctionError, match=m("['mean'] with shape (1,)", "batch of 8",
                                              "(8, ...)")):
        p.predict(EXAMPLES[:3])


def test_predict_error_through_trainer_predictor():
    t = trainer(predict_fn=lambda model, batch, rng: {"total": model(batch["x"]).sum()})
    t.fit(EXAMPLES, max_steps=1)
    with pytest.raises(UserFunctionError, match=m("['total'] with shape ()", "batch of 8")):
        t.predictor(batch_size=8).predict(EXAMPLES)


def test_predict_output_empty():
    with pytest.raises(UserFunctionError, match="predict returned no arrays"):
        check_predict_output({}, 8)


def test_check_predict_output_valid():
    check_predict_output({"a": jnp.zeros((4, 2)), "b": [jnp.zeros(4)]}, 4)


def test_trainer_without_predict_has_no_predictor():
    t = trainer(predict_fn=None)
    t.init(EXAMPLES)
    with pytest.raises(UserFunctionError, match="pass predict=... to Trainer"):
        t.predictor()


# --------------------------------------------------------------------------- config

def test_batch_size_not_divisible_by_data_parallel_size():
    with pytest.raises(ValueError, match=m("batch_size=6", "4 data-parallel devices",
                                           "use a multiple of 4")):
        trainer(batch_size=6, model_axis=1)
    with pytest.raises(ValueError, match=m("batch_size=6", "multiple of the 4 data-parallel")):
        redray.Predictor(lambda rngs: Linear(rngs), collate, predict, batch_size=6,
                         data_axis=4)


def test_micro_batch_size_not_dividing():
    # model_axis=2 leaves 2 data-parallel devices; 8 is not a multiple of 3 x 2.
    with pytest.raises(ValueError, match=m("batch_size=8", "micro_batch_size=3",
                                           "2 data-parallel devices = 6",
                                           "whole micro-batches")):
        trainer(batch_size=8, micro_batch_size=3)


def test_model_axis_must_divide_devices():
    with pytest.raises(ValueError, match=m("model_axis=3 does not divide the 4 devices",
                                           "1, 2, 4")):
        trainer(model_axis=3)


def test_built_nnx_module_is_the_starting_point():
    built = Linear(nnx.Rngs(7))
    start = np.asarray(built.dense.kernel[...]).copy()
    t = redray.Trainer.of(built, collate, mse, optax.adam(1e-2), batch_size=8, model_axis=2,
                       progress=False)
    t.init(EXAMPLES)
    np.testing.assert_array_equal(np.asarray(t.state.params["dense"]["kernel"][...]), start)
    first = t.evaluate(EXAMPLES)["loss"]
    t.fit(EXAMPLES, epochs=3)
    assert t.evaluate(EXAMPLES)["loss"] < first
    # the user's copy is untouched
    np.testing.assert_array_equal(np.asarray(built.dense.kernel[...]), start)


def test_bare_linen_module():
    with pytest.raises(TypeError, match=m("bare Linen module", "redray.LinenModel(module")):
        redray.Trainer.of(LinenLinear(), collate, mse, optax.adam(1e-3), batch_size=8,
                       progress=False)
    with pytest.raises(TypeError, match="LinenModel"):
        redray.Predictor(LinenLinear(), collate, predict, batch_size=8)


def test_factory_returning_non_module():
    with pytest.raises(TypeError, match=m("factory returned", "flax.nnx.Module",
                                          "redray.LinenModel")):
        redray.Trainer.of(lambda rngs: LinenLinear(), collate, mse, optax.adam(1e-3), batch_size=8,
                       progress=False)


def test_linen_model_wraps_only_linen():
    with pytest.raises(TypeError, match="LinenModel wraps a flax.linen.Module"):
        redray.LinenModel(Linear(nnx.Rngs(0)), jnp.zeros((1, D_IN)))


def test_optimizer_must_be_optax():
    # A common slip: the optimizer's constructor instead of an optimizer.
    with pytest.raises(TypeError, match=m("optax.GradientTransformation", "optax.adamw(1e-3)",
                                          "got function")):
        redray.Trainer.of(lambda rngs: Linear(rngs), collate, mse, optax.adam, batch_size=8,
                       progress=False)


def test_fewer_examples_than_batch():
    t = trainer()
    with pytest.raises(ValueError, match=m("3 training examples", "batch_size=8")):
        t.fit(EXAMPLES[:3])


# --------------------------------------------------------------------------- training

def test_loss_with_metrics_trains_and_logs_metrics():
    def loss_with_metrics(model, batch, rng, train):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "max_err": jnp.max(err ** 2)}

    t = trainer(loss_fn=loss_with_metrics)
    history = t.fit(EXAMPLES, epochs=2)
    assert len(history) == 2 * len(EXAMPLES) // 8  # log_every=1: one row per step
    assert [row["step"] for row in history] == list(range(1, 9))
    for row in history:
        assert {"loss", "mae", "max_err", "grad_norm"} <= set(row)
        assert all(np.isfinite(row[k]) for k in ("loss", "mae", "max_err"))
        assert row["max_err"] >= row["loss"]  # max of squares >= their mean
        assert row["mae"] ** 2 <= row["loss"] + 1e-6  # Jensen: mean|e|^2 <= mean e^2
    ev = t.evaluate(EXAMPLES)
    assert set(ev) == {"loss", "mae", "max_err"}


def _regression_losses(model, examples, model_kw=None):
    t = redray.Trainer.of(model, collate, mse, optax.adam(5e-2), batch_size=8, model_axis=2,
                       progress=False, log_every=1, seed=0)
    first = t.evaluate(examples)["loss"]
    history = t.fit(examples, epochs=8)
    last = t.evaluate(examples)["loss"]
    return t, first, history, last


def test_nnx_model_learns_linear_regression():
    examples = make_examples(64)
    t, first, history, last = _regression_losses(lambda rngs: Linear(rngs), examples)
    assert len(history) == 64
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert last < 0.5 * first
    assert last < 0.05 * first
    # The trained model is the user's NNX module.
    model = t.model
    assert isinstance(model, Linear)
    x = np.stack([e["x"] for e in examples])
    y = np.array([e["y"] for e in examples])
    np.testing.assert_allclose(float(np.mean((np.asarray(model(x)) - y) ** 2)), last, rtol=1e-4)


def test_linen_model_learns_linear_regression():
    examples = make_examples(64)
    t, first, history, last = _regression_losses(
        redray.LinenModel(LinenLinear(), jnp.zeros((1, D_IN))), examples)
    assert len(history) == 64
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert last < 0.5 * first
    assert last < 0.05 * first
    assert set(t.state.params) == {"Dense_0"}
    assert t.state.params["Dense_0"]["kernel"].shape == (D_IN, 1)
