"""A NaN loss in the middle of training, under each policy of ``Trainer.of(on_nonfinite=...)``:
one process, 4 simulated devices, real Orbax checkpoints.

One example of the data is poisoned: any batch holding it has a NaN loss. Its step is
known from the epoch order, so every test knows where the NaN comes.
"""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redray
from redray import CheckpointConfig, NonFiniteError, load_params
from redray.engine.loop import epoch_order
from tiny import TinyLM, assert_same, lm_collate, lm_loss, token_data

DATA = token_data(96)  # 12 steps per epoch at batch 8
SEED = 3


def poisoned_at(step):
    """The data with the first example of ``step``'s batch (epoch 0) poisoned."""
    order = epoch_order(len(DATA), SEED, 0)
    bad = int(order[(step - 1) * 8])
    return [{**e, "bad": np.int32(i == bad)} for i, e in enumerate(DATA)]


def collate(examples):
    return {**lm_collate(examples), "bad": np.array([e["bad"] for e in examples])}


def loss(model, batch, rng, train):
    value, metrics = lm_loss(model, batch, rng, train)
    return value * jnp.where(batch["bad"].any(), jnp.nan, 1.0), metrics


def trainer(directory=None, **kw):
    options = dict(batch_size=8, model_axis=2, log_every=1, progress=False, seed=SEED)
    options.update(kw)
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), collate, loss, optax.adam(1e-2),
                          checkpoint=directory, **options)


def saved_steps(directory):
    return sorted(int(os.path.basename(p)) for p in glob.glob(f"{directory}/*")
                  if os.path.basename(p).isdigit())


def assert_finite(params):
    for leaf in jax.tree.leaves(params):
        assert np.isfinite(np.asarray(leaf)).all()


def test_stop_names_the_step_and_batch_and_saves_nothing_past_it(tmp_path):
    directory = str(tmp_path / "ckpt")
    # saves every 2 steps, reads the flag every 5: the save at step 8 finds the NaN of 7
    t = trainer(CheckpointConfig(directory, save_every=2, keep=10), log_every=5)
    with pytest.raises(NonFiniteError) as err:
        t.fit(poisoned_at(7), epochs=2)
    text = str(err.value)
    assert "step 7 (epoch 0, batch 7 of 12) gave a non-finite loss (nan)" in text
    assert f"{directory}/6" in text and "on_nonfinite='skip'" in text
    assert saved_steps(directory) == [2, 4, 6]
    for step in saved_steps(directory):
        assert_finite(load_params(directory, lambda rngs: TinyLM(rngs), step=step)[0])
    # the in-memory state stayed at the last finite step, too
    assert_finite(t.state.params)


def test_skip_leaves_the_update_out_and_trains_on(tmp_path):
    t = trainer(on_nonfinite="skip", log_every=4)
    history = t.fit(poisoned_at(7), epochs=1)
    assert_finite(t.state.params)
    assert t.step == 12
    skipped = {row["step"]: row["skipped"] for row in history if "skipped" in row}
    assert skipped == {4: 0.0, 8: 0.25, 12: 0.0}  # one of the window's 4 steps


def test_rollback_returns_to_the_checkpoint_and_goes_on_after_the_batch(tmp_path):
    directory = str(tmp_path / "ckpt")
    t = trainer(CheckpointConfig(directory, save_every=3, keep=10), on_nonfinite="rollback")
    history = t.fit(poisoned_at(8), epochs=1)
    assert {"step": 8, "rolled_back_to_step": 6} in history
    # steps keep counting, never reused: 7 was logged before the rollback, 8 failed
    assert [r["step"] for r in history if "loss" in r] == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12]
    # the state is exactly: batches 1-6, then 9-12 (7 was dropped with the NaN of 8)
    reference = trainer()
    order = epoch_order(len(DATA), SEED, 0)
    data = poisoned_at(8)
    reference.init(data)
    for i in [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]:
        reference.train_step(collate([data[j] for j in order[i * 8:(i + 1) * 8]]))
    assert_same(t.state.params, reference.state.params)
    assert_same(t.state.opt_state, reference.state.opt_state)
    assert saved_steps(directory)[-1] == 12


def test_rollback_without_a_checkpoint_stops(tmp_path):
    t = trainer(on_nonfinite="rollback", log_every=3)
    with pytest.raises(NonFiniteError, match="step 2 .*no checkpoint was written"):
        t.fit(poisoned_at(2), epochs=1)


def test_a_custom_loop_hears_of_it_at_its_next_log():
    t = trainer()
    data = poisoned_at(1)
    t.init(data)
    order = epoch_order(len(DATA), SEED, 0)
    t.train_step(collate([data[j] for j in order[:8]]))
    with pytest.raises(NonFiniteError, match="step 1 gave a non-finite loss or gradient norm"):
        t.log({"reward": 1.0})


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="on_nonfinite='ignore': use one of 'stop', 'skip'"):
        trainer(on_nonfinite="ignore")
