"""fit as a loop of steps plus hooks: the events, their cadence, and trainer scopes."""

import optax
import pytest

import redray
from redray.engine.hooks import Adoption, Hook, Position, trainer_scope
from tiny import TinyLM, lm_collate, lm_loss, token_data

DATA = token_data(40)  # 5 steps per epoch at batch 8


class Events(Hook):
    def __init__(self):
        self.seen = []

    def on_init(self, run):
        self.seen.append(("init", run.step))

    def on_epoch_start(self, run, epoch, batch):
        self.seen.append(("start", epoch, batch))

    def on_step(self, run, info):
        self.seen.append(("step", info.step, info.position.epoch, info.position.batch,
                          info.last_of_epoch))

    def on_log(self, run, row):
        self.seen.append(("log", row["step"], "eval_loss" in row))

    def on_epoch_end(self, run, end):
        self.seen.append(("end", end.epoch, end.step, end.complete))

    def on_checkpoint(self, run, step, path, meta):
        self.seen.append(("checkpoint", step, meta["epoch"], meta["batch"], meta["epoch_done"],
                          "eval_loss" in meta["metrics"]))

    def on_fit_end(self, run):
        self.seen.append(("fit_end", run.step))


def trainer(**kw):
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                          batch_size=8, progress=False, **kw)


def test_fit_sends_every_event_in_order_with_each_hooks_cadence(tmp_path):
    events = Events()
    t = trainer(log_every=2, hooks=[events],
                checkpoint=redray.CheckpointConfig(str(tmp_path), save_every=4))
    t.fit(DATA, epochs=2, max_steps=7, eval_data=DATA[:8])
    steps = [e for e in events.seen if e[0] == "step"]
    assert steps == [("step", s, 0 if s <= 5 else 1, s if s <= 5 else s - 5, s == 5)
                     for s in range(1, 8)]
    assert events.seen[0] == ("init", 0) and events.seen[-1] == ("fit_end", 7)
    assert [e for e in events.seen if e[0] == "start"] == [("start", 0, 0), ("start", 1, 0)]
    # windows of 2 steps, cut at the epoch's last step and at the budget's end
    assert [e[1] for e in events.seen if e[0] == "log" and not e[2]] == [2, 4, 5, 7]
    assert [e[1:] for e in events.seen if e[0] == "end"] == [(0, 5, True), (1, 7, False)]
    # the epoch's end: its last window, then the evaluation, then (fit's hooks run before
    # the Trainer's own) the epoch's checkpoint, which records the evaluation's metrics
    logs = [e for e in events.seen if e[0] in ("log", "end")]
    assert logs[logs.index(("end", 0, 5, True)) - 2:][:3] == [
        ("log", 5, False), ("log", 5, True), ("end", 0, 5, True)]
    # save_every=4, the epoch's end (done with the epoch) and the budget's end (inside
    # epoch 1, after its evaluation); each reported once complete
    assert [e[1:] for e in events.seen if e[0] == "checkpoint"] == [
        (4, 0, 4, False, False), (5, 0, 5, True, True), (7, 1, 2, False, True)]


def test_a_resumed_fit_starts_its_epoch_at_the_saved_position(tmp_path):
    trainer(checkpoint=str(tmp_path)).fit(DATA, epochs=2, max_steps=7)
    events = Events()
    resumed = trainer(checkpoint=str(tmp_path), hooks=[events])
    resumed.init(DATA)
    assert resumed.position == Position(epoch=1, batch=2, epoch_done=False)
    resumed.fit(DATA, epochs=2)
    assert [e for e in events.seen if e[0] == "start"] == [("start", 1, 2)]
    assert [e[1] for e in events.seen if e[0] == "step"] == [8, 9, 10]


def test_position_says_where_training_continues():
    assert Position(2, 3, False).resume_point() == (2, 3)
    assert Position(2, 5, True).resume_point() == (3, 0)
    assert Position().resume_point() == (0, 0)


def test_a_hook_gets_the_run_read_only():
    class Writes(Hook):
        def on_step(self, run, info):
            self.seen = (type(run).__name__, run.step, run.position.batch, run.batch_size)
            run.step = 0

    hook = Writes()
    with pytest.raises(AttributeError, match="writes nothing to it .it set 'step'"):
        trainer(hooks=[hook]).fit(DATA, epochs=1, max_steps=2)
    assert hook.seen == ("RunView", 1, 1, 8)


def test_a_trainer_made_inside_a_scope_is_adopted_and_one_outside_is_not(tmp_path):
    events = Events()

    class Run:
        def __init__(self):
            self.adopted = []

        def adopt(self, trainer, default_checkpoint):
            self.adopted.append(default_checkpoint)
            return Adoption(checkpoint=redray.CheckpointConfig(str(tmp_path)),
                            config={"run": "x", "lr": 1}, hooks=[events])

    run = Run()
    with trainer_scope(run):
        inside = trainer(config={"lr": 2})
        given = trainer(checkpoint=False)
    outside = trainer()
    assert run.adopted == [True, False]
    assert inside.checkpoint_config.directory == str(tmp_path)
    assert inside.config == {"run": "x", "lr": 2}  # the Trainer's own settings win
    assert events in inside.hooks and outside.hooks == [] and outside.config == {}
    assert given.checkpoint_config.directory == str(tmp_path)  # what the scope decided


def test_a_hook_must_be_a_hook():
    with pytest.raises(TypeError, match="must be a redray.Hook"):
        trainer(hooks=[print])


def test_a_log_window_weighs_its_steps_by_the_losss_weight():
    import numpy as np

    from redray.engine.fit_hooks import LogWindow
    from redray.engine.hooks import StepInfo

    class Rows:
        learning_rate, batch_size, tokens_per_example = None, 8, 0

        def __init__(self):
            self.rows = []

        def record(self, row):
            self.rows.append(row)

    def step(i, loss, weight=None):
        metrics = {"loss": np.float32(loss)}
        if weight is not None:
            metrics["weight"] = np.float32(weight)
        return StepInfo(i, Position(0, i), metrics, False)

    weighed, plain = Rows(), Rows()
    window = LogWindow(2)
    window.on_step(weighed, step(1, 1.0, weight=10))
    window.on_step(weighed, step(2, 4.0, weight=30))
    assert weighed.rows[0]["loss"] == pytest.approx((1 * 10 + 4 * 30) / 40)
    assert "weight" not in weighed.rows[0]
    window = LogWindow(2)
    window.on_step(plain, step(1, 1.0))
    window.on_step(plain, step(2, 4.0))
    assert plain.rows[0]["loss"] == pytest.approx(2.5)
