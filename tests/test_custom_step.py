"""Training only some parameters (``trainable=``) and custom gradient steps (``grad_fn=``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redray
from redray.engine.hooks import Hook
from redray.engine.model import split_trainable
from tiny import TinyLM, assert_same, lm_collate, lm_loss, token_data

DATA = token_data(64)
OPTIONS = dict(batch_size=8, model_axis=2, progress=False, log_every=1)


def trainer(**kw):
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                          **{**OPTIONS, **kw})


def leaves_by_path(params):
    from redray.sharding import flatten

    paths, leaves, _ = flatten(params)
    return {p: np.asarray(jax.device_get(x)) for p, x in zip(paths, leaves)}


def test_only_trainable_parameters_change_and_hold_optimizer_state():
    t = trainer(trainable=r"^(fc1|fc2)/")
    t.init(DATA)
    before = leaves_by_path(t.state.whole_params)
    history = t.fit(DATA, epochs=2)
    after = leaves_by_path(t.state.whole_params)
    assert history[-1]["loss"] < history[0]["loss"]
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed == {"fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"}
    # Adam's two moments for the 4 trained arrays only, plus its step count
    assert len(jax.tree.leaves(t.state.opt_state)) == 2 * 4 + 1
    assert t.describe()["trainable_parameters"] == sum(before[p].size for p in changed)


def test_trainable_checkpoint_holds_only_the_trained_parameters(tmp_path):
    t = trainer(trainable=r"^fc", checkpoint=str(tmp_path))
    t.fit(DATA, epochs=1)
    stored = tmp_path / "8" / "model"
    assert stored.is_dir()
    # load_params puts the trained parameters back on the model's own base weights
    params, _ = redray.load_params(str(tmp_path), lambda rngs: TinyLM(rngs))
    got, want = leaves_by_path(params), leaves_by_path(t.state.whole_params)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    meta = redray.checkpoint.latest_meta(str(tmp_path))
    assert meta["trainable"] == r"^fc"

    resumed = trainer(trainable=r"^fc", checkpoint=str(tmp_path))
    resumed.init(DATA)
    assert resumed.step == 8
    assert_same(resumed.state.params, t.state.params)
    with pytest.raises(redray.CheckpointMismatch, match=r"trainable='\^fc'.*trainable=None"):
        trainer(checkpoint=str(tmp_path)).init(DATA)


def test_trainable_that_matches_nothing_names_the_paths():
    with pytest.raises(ValueError, match=r"matches no parameter.*'fc1/kernel'"):
        trainer(trainable="lora_").init(DATA)


def test_default_shaped_grad_fn_trains_like_the_default():
    def plain(loss_fn, params, batch, rng):
        (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)
        return value, metrics, grads

    want = [r["loss"] for r in trainer().fit(DATA, epochs=1)]
    got = [r["loss"] for r in trainer(grad_fn=plain).fit(DATA, epochs=1)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def per_example_clipped(clip):
    """Per-example gradients, each clipped to norm ``clip``, averaged (DP-SGD sans noise)."""
    def grad_fn(loss_fn, params, batch, rng):
        def one(example):
            single = jax.tree.map(lambda x: x[None], example)
            (value, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, single, rng)
            return value, metrics, g

        values, metrics, grads = jax.vmap(one)(batch)
        norms = jax.vmap(optax.tree.norm)(grads)
        scale = jnp.minimum(1.0, clip / (norms + 1e-12))
        grads = jax.tree.map(lambda g: jnp.tensordot(scale, g, 1) / len(scale), grads)
        return values.mean(), jax.tree.map(jnp.mean, metrics), grads
    return grad_fn


def test_per_example_grad_fn_equals_batch_gradient_without_clipping():
    # a mean loss's gradient is the mean of the per-example gradients
    t = trainer(grad_fn=per_example_clipped(1e9), micro_batch_size=1)
    want = trainer(micro_batch_size=1).fit(DATA, epochs=1)
    got = t.fit(DATA, epochs=1)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want],
                               rtol=1e-4)


def test_clipping_grad_fn_bounds_the_gradient_norm():
    history = trainer(grad_fn=per_example_clipped(0.01)).fit(DATA, epochs=1)
    assert max(r["grad_norm"] for r in history) <= 0.01 * (1 + 1e-5)


def test_grad_fn_with_wrong_output_is_named_with_the_fix():
    with pytest.raises(redray.UserFunctionError, match="return \\(loss, metrics, grads\\)"):
        trainer(grad_fn=lambda loss_fn, p, b, r: loss_fn(p, b, r)).init(DATA)
    with pytest.raises(redray.UserFunctionError, match="do not match the trained parameters"):
        trainer(grad_fn=lambda loss_fn, p, b, r: (*loss_fn(p, b, r), {"x": jnp.ones(3)})
                ).init(DATA)
    with pytest.raises(TypeError, match="grad_fn must be a function"):
        trainer(grad_fn="dp")


def test_log_reports_own_metrics_at_the_current_step():
    seen = []

    class Seen(Hook):
        def on_log(self, run, row):
            seen.append(row)

    t = trainer(hooks=[Seen()])
    t.fit(DATA, epochs=1)
    row = t.log({"return": np.float32(3.5)})
    assert row == {"step": 8, "return": 3.5} and seen[-1] == row


def test_split_and_merge_round_trip():
    from flax import nnx

    from redray.engine.model import merge_trainable

    _, params, _ = nnx.split(TinyLM(nnx.Rngs(0)), nnx.Param, ...)
    trained, frozen = split_trainable(params, "fc")
    assert len(jax.tree.leaves(trained)) == 4
    assert (len(jax.tree.leaves(trained)) + len(jax.tree.leaves(frozen))
            == len(jax.tree.leaves(params)))
    assert_same(merge_trainable(trained, frozen), params)


def test_compiled_step_is_the_program_fit_runs():
    t = trainer()
    t.init(DATA)
    compiled = t.compiled_step()
    assert "all-reduce" in compiled.as_text()  # model_axis=2: tensor-parallel collectives
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    history = t.fit(DATA, epochs=1)  # the same jitted function, already lowered for it
    assert len(t.program.jitted) == 1 and np.isfinite(history[-1]["loss"])
