"""``redray.Schedule``: a learning rate over the run's budget, continued when it grows."""

import warnings

import numpy as np
import optax
import pytest

import redray
from redray.engine.schedule import Schedule, describe
from tiny import TinyLM, assert_same, lm_collate, lm_loss, token_data

DATA = token_data(96)  # 12 steps per epoch at batch 8


def values(schedule, steps):
    return np.array([float(schedule(t)) for t in steps])


def test_one_budget_is_the_usual_warmup_then_cosine():
    ours = Schedule(3e-3, warmup=5, steps=40)
    theirs = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 40)
    np.testing.assert_allclose(values(ours, range(45)), values(theirs, range(45)),
                               rtol=1e-5, atol=1e-9)
    linear = Schedule(1.0, warmup=0.25, decay="linear", end=0.1, steps=20)
    np.testing.assert_allclose(values(linear, [0, 5, 20]), [0.0, 1.0, 0.1], rtol=1e-6)


def test_a_grown_budget_continues_from_where_the_run_stands():
    schedule = Schedule(1.0, warmup=4)
    first = schedule.with_budget(20, 0)
    assert first == schedule.with_budget(20, 7, [[0, 20, None]])  # same budget: unchanged
    schedule.segments = first
    before = values(schedule, range(21))
    schedule.segments = schedule.with_budget(40, 20, schedule.as_meta())
    after = values(schedule, range(41))
    np.testing.assert_array_equal(after[:21], before)  # the past is what it was
    # continuous at the resume step, then the 40-step shape once the warmup length passed
    single = Schedule(1.0, warmup=4, steps=40)
    np.testing.assert_allclose(after[24:], values(single, range(24, 41)), rtol=1e-6)
    # what optax's schedules do instead: the 40-step curve at step 20, from the 20-step end
    sawtooth = float(optax.warmup_cosine_decay_schedule(0.0, 1.0, 4, 40)(20)) - before[20]
    assert sawtooth > 0.4 and after[20] == pytest.approx(before[20])
    # reached over the warmup length: no step moves by more than a third of that jump
    assert np.abs(np.diff(after[19:25])).max() < sawtooth / 3


def test_no_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="has no budget yet.*learning_rate="):
        Schedule(1e-3)(0)
    with pytest.raises(ValueError, match="decay='step'"):
        Schedule(1e-3, decay="step")


def trainer(directory, schedule, **kw):
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(schedule),
                          batch_size=8, model_axis=2, log_every=1, progress=False, seed=1,
                          learning_rate=schedule, checkpoint=directory, **kw)


def test_resuming_with_a_larger_budget_trains_as_one_run_growing_its_budget(tmp_path):
    # a run stopped at its budget and resumed with a larger one (a new process would
    # build a new Schedule object: so does this test) ...
    first = trainer(str(tmp_path / "a"), Schedule(1e-2, warmup=2))
    first.fit(DATA, epochs=2, max_steps=6)
    resumed_schedule = Schedule(1e-2, warmup=2)
    resumed = trainer(str(tmp_path / "a"), resumed_schedule)
    rows = resumed.fit(DATA, epochs=2, max_steps=12)
    # ... equals one Trainer whose budget grew between two fit calls, bit for bit
    straight = trainer(str(tmp_path / "b"), Schedule(1e-2, warmup=2))
    straight.fit(DATA, epochs=2, max_steps=6)
    straight_rows = straight.fit(DATA, epochs=2, max_steps=12)
    assert_same(resumed.state.params, straight.state.params)
    lr = {r["step"]: r["learning_rate"] for r in rows if "learning_rate" in r}
    assert lr == {r["step"]: r["learning_rate"] for r in straight_rows if "learning_rate" in r}
    assert [s.budget for s in resumed_schedule.segments] == [6, 12]
    # continuous: the first update after the resume uses the rate the run ended with
    assert lr[7] == pytest.approx(float(Schedule(1e-2, warmup=2, steps=6)(6)), abs=1e-9)
    assert "budget 12 from step 6" in describe(resumed_schedule)


def test_a_plain_schedule_function_warns_when_the_budget_changes(tmp_path):
    first = trainer(str(tmp_path / "c"), optax.cosine_decay_schedule(1e-2, 6))
    first.fit(DATA, epochs=2, max_steps=6)
    again = trainer(str(tmp_path / "c"), optax.cosine_decay_schedule(1e-2, 12))
    with pytest.warns(UserWarning, match="budget changed from 6 to 12 steps at step 6.*Schedule"):
        again.fit(DATA, epochs=2, max_steps=12)
    same = trainer(str(tmp_path / "c"), optax.cosine_decay_schedule(1e-2, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.fit(DATA, epochs=2, max_steps=12)  # complete, same budget: nothing to say


def test_descriptions_are_readable():
    assert describe(3e-4) == "0.0003"
    assert describe(Schedule(1e-3, warmup=10, steps=100)) == (
        "Schedule(peak=0.001, warmup=10 steps, decay=cosine, end=0) over 100 steps")
    text = describe(optax.cosine_decay_schedule(1.0, 8), budget=8)
    assert "0x" not in text and "step 0: 1" in text and "step 8: 0" in text
