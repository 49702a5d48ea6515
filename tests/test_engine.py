"""Trainer on 4 simulated CPU devices: sharded training equals one device."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import redray
from tiny import TinyLM, lm_collate, lm_loss, token_data

DATA = token_data(160)
STEPS = 20


def make_trainer(optimizer=None, **kw):
    kw.setdefault("batch_size", 8)
    return redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss,
                          optimizer or optax.adam(1e-2), progress=False, log_every=1, **kw)


def losses(trainer, steps=STEPS):
    history = trainer.fit(DATA, epochs=10, max_steps=steps)
    return np.array([row["loss"] for row in history])


@pytest.fixture(scope="module")
def one_device():
    return losses(make_trainer(mesh=redray.make_mesh(devices=jax.devices()[:1])))


@pytest.mark.parametrize("axes", [dict(model_axis=2, data_axis=2), dict(fsdp_axis=4, data_axis=1),
                                  dict(model_axis=2, fsdp_axis=2, data_axis=1)])
def test_sharded_training_matches_one_device(one_device, axes):
    sharded = losses(make_trainer(**axes))
    assert len(sharded) == STEPS
    np.testing.assert_allclose(sharded, one_device, rtol=1e-5)
    assert sharded[-1] < 0.7 * sharded[0]  # it learns


@pytest.mark.parametrize("axes", [dict(model_axis=2, data_axis=2), dict(fsdp_axis=4, data_axis=1)])
def test_accumulation_matches_large_batch(one_device, axes):
    # batch 8 over 2 data-parallel devices with 2 per device: 2 micro-batches per update
    accumulated = losses(make_trainer(micro_batch_size=8 // 2 // 2 if axes.get("model_axis") else 1,
                                      **axes))
    np.testing.assert_allclose(accumulated, one_device, rtol=1e-5)


def test_accumulation_on_one_device_matches(one_device):
    acc = losses(make_trainer(mesh=redray.make_mesh(devices=jax.devices()[:1]), micro_batch_size=2))
    np.testing.assert_allclose(acc, one_device, rtol=1e-5)


def test_schedule_counts_optimizer_updates_not_micro_batches():
    schedule = optax.linear_schedule(1.0, 0.0, 100)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    # 4 micro-batches per update
    t = make_trainer(tx, model_axis=2, micro_batch_size=1, learning_rate=schedule)
    assert t.geometry.accumulation == 4
    history = t.fit(DATA, epochs=1, max_steps=7)
    assert int(t.state.step) == 7
    # The rate of the 7th update (count 6); counting micro-batches would give schedule(27).
    assert float(t.state.opt_state.hyperparams["learning_rate"]) == pytest.approx(schedule(6))
    assert [row["learning_rate"] for row in history] == pytest.approx(
        [float(schedule(i)) for i in range(7)])


def test_parameters_are_created_sharded():
    t = make_trainer(model_axis=2, fsdp_axis=2, data_axis=1)
    t.init(DATA)
    params = t.state.params
    q = params["q"]["kernel"][...]
    assert q.sharding.spec == P("fsdp", "model")
    assert {s.data.shape for s in q.addressable_shards} == {(16, 16)}
    emb = params["wte"]["embedding"][...]
    assert emb.sharding.spec == P("model", "fsdp")
    mu = t.state.opt_state[0].mu["q"]["kernel"][...]
    assert mu.sharding.spec == q.sharding.spec  # optimizer state follows its parameter
    plan = t.placement()
    assert "q/kernel" in plan and "('fsdp', 'model')" in plan


def test_user_rule_overrides_automatic_spec():
    t = make_trainer(model_axis=2, rules=[(r"^q/kernel$", P("model", None))])
    t.init(DATA)
    assert t.state.params["q"]["kernel"][...].sharding.spec == P("model", None)
    assert t.state.params["k"]["kernel"][...].sharding.spec == P(None, "model")


def test_mixed_precision_keeps_float32_parameters(one_device):
    t = make_trainer(model_axis=2, compute_dtype=jnp.bfloat16)
    bf16 = losses(t, steps=5)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(t.state.params))
    np.testing.assert_allclose(bf16, one_device[:5], rtol=5e-2)  # bf16 compute, not fp32
    assert not np.allclose(bf16, one_device[:5], rtol=1e-6)


def test_metrics_are_logged_every_n_steps():
    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       batch_size=8, model_axis=2, log_every=4, progress=False)
    history = t.fit(DATA, epochs=1, max_steps=10)
    assert [row["step"] for row in history] == [4, 8, 10]
    assert {"loss", "accuracy", "grad_norm", "steps_per_s", "examples_per_s"} <= set(history[0])


def test_evaluate_covers_every_example_once():
    t = make_trainer(model_axis=2, eval_batch_size=8)
    t.fit(DATA, epochs=1, max_steps=3)
    examples = DATA[:21]  # 2 full batches and a remainder of 5 (not divisible by 2)
    result = t.evaluate(examples)
    model = t.model
    per_example = [float(lm_loss(model, lm_collate([e]), None, False)[0]) for e in examples]
    assert result["loss"] == pytest.approx(np.mean(per_example), rel=1e-5)


def masked_loss(model, batch, rng, train):
    """Cross-entropy over the real tokens only (``real`` marks them), with their count as
    the batch's weight."""
    logits = model(batch["ids"][:, :-1], train=train)
    labels, real = batch["ids"][:, 1:], batch["real"][:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (logits.argmax(-1) == labels) & real
    n = real.sum()
    return (ce * real).sum() / n, {"accuracy": correct.sum() / n, "weight": n}


def masked_collate(examples):
    ids = np.stack([e["ids"] for e in examples])
    lengths = np.array([e["length"] for e in examples])
    return {"ids": ids, "real": np.arange(ids.shape[1])[None] < lengths[:, None]}


def test_evaluate_weighs_batches_by_the_weight_the_loss_gives():
    # batches holding 2 to 16 real tokens per example: the token-level mean is not the
    # mean of batch means
    data = [{**e, "length": 2 + 14 * (i // 8 % 2) if i < 16 else 16}
            for i, e in enumerate(DATA[:21])]
    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), masked_collate, masked_loss, optax.adam(1e-2),
                       batch_size=8, model_axis=2, progress=False, log_every=2)
    history = t.fit(data[:16], epochs=1)
    result = t.evaluate(data)
    model = t.model
    ces, hits, tokens = [], [], 0
    for e in data:
        batch = masked_collate([e])
        logits = model(batch["ids"][:, :-1])
        labels, real = batch["ids"][:, 1:], batch["real"][:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        ces.append(float((ce * real).sum()))
        hits.append(float(((logits.argmax(-1) == labels) & real).sum()))
        tokens += int(real.sum())
    assert result["loss"] == pytest.approx(sum(ces) / tokens, rel=1e-5)
    assert result["accuracy"] == pytest.approx(sum(hits) / tokens, rel=1e-5)
    assert "weight" not in result
    # a batch mean of means would weigh a 2-token example like a 16-token one
    per_example = [c / (e["length"] - 1) for c, e in zip(ces, data)]
    assert abs(result["loss"] - np.mean(per_example)) > 1e-3
    # the log window weighs its steps the same way, and does not log the weight itself
    assert "weight" not in history[0] and np.isfinite(history[0]["loss"])


class BNNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x, train):
        return self.out(nnx.relu(self.bn(self.fc(x), use_running_average=not train)))[:, 0]


def test_model_state_besides_parameters_is_updated():
    rs = np.random.default_rng(0)
    data = [{"x": rs.normal(2.0, 1.0, 8).astype(np.float32), "y": np.float32(rs.normal())}
            for _ in range(64)]

    def collate(ex):
        return {"x": np.stack([e["x"] for e in ex]), "y": np.array([e["y"] for e in ex])}

    def loss(model, batch, rng, train):
        return ((model(batch["x"], train) - batch["y"]) ** 2).mean()

    t = redray.Trainer.of(lambda rngs: BNNet(rngs), collate, loss, optax.adam(1e-2), batch_size=16,
                       model_axis=2, progress=False)
    t.fit(data, epochs=1)
    mean = np.asarray(t.state.extra["bn"]["mean"][...])
    assert np.all(mean != 0.0)  # the running mean moved away from its zero init
    assert t.placement().count("bn/") == 4


def test_dropout_runs_in_train_only():
    t = redray.Trainer.of(lambda rngs: TinyLM(rngs, dropout=0.5), lm_collate, lm_loss,
                       optax.adam(1e-3), batch_size=8, model_axis=2, progress=False)
    t.init(DATA)
    batch = lm_collate(DATA[:8])
    a = float(t.evaluate(DATA[:8])["loss"])
    b = float(t.evaluate(DATA[:8])["loss"])
    assert a == b  # deterministic in eval
    m1 = float(t.train_step(batch)["loss"])
    assert m1 != pytest.approx(a, rel=1e-6)  # dropout changed the training forward


def test_fit_runs_eval_loss_and_predict_metric_each_epoch():
    from tiny import lm_predict

    def metric(examples, predictions):
        hits = [np.mean(p[:-1] == e["ids"][1:]) for e, p in zip(examples, predictions)]
        return {"next_token_accuracy": float(np.mean(hits))}

    t = redray.Trainer.of(lambda rngs: TinyLM(rngs), lm_collate, lm_loss, optax.adam(1e-2),
                       predict=lm_predict, batch_size=8, model_axis=2, progress=False)
    history = t.fit(DATA[:64], epochs=2, eval_data=DATA[64:83], eval_metric=metric,
                    eval_at_start=True)
    evals = [row for row in history if "eval_loss" in row]
    assert [(row["step"], row["epoch"]) for row in evals] == [(0, 0), (8, 0), (16, 1)]
    for row in evals:  # the evaluation before training has the Predictor's metric too
        assert {"eval_loss", "eval_accuracy", "eval_next_token_accuracy"} <= set(row)
        # eval accuracy from the loss and from the Predictor measure the same thing
        assert row["eval_next_token_accuracy"] == pytest.approx(row["eval_accuracy"], rel=1e-5)
    assert evals[2]["eval_loss"] < evals[1]["eval_loss"] < evals[0]["eval_loss"]


def test_evaluate_before_fit_with_fewer_examples_than_a_batch():
    t = make_trainer(model_axis=2)
    assert np.isfinite(t.evaluate(DATA[:3])["loss"])
    with pytest.raises(ValueError, match="fewer than batch_size=8"):
        t.fit(DATA[:5])
    with pytest.raises(ValueError, match="eval_metric needs eval_data and a predict function"):
        t.fit(DATA, eval_data=DATA[:8], eval_metric=lambda examples, predictions: {})


def test_many_steps_between_metric_fetches_do_not_deadlock_cpu_collectives(tmp_path):
    # XLA:CPU deadlocks when ~32+ programs with collectives queue up on 2 cores (the
    # launch pool fills with one device's launches); fit bounds what is in flight. Run
    # in a subprocess: the deadlock ends in an abort that would take pytest down too.
    script = tmp_path / "long_window.py"
    script.write_text(
        "import optax, redray\n"
        "from tiny import TinyLM, lm_collate, lm_loss, token_data\n"
        "t = redray.Trainer.of(lambda rngs: TinyLM(rngs, dim=16), lm_collate, lm_loss,\n"
        "                   optax.adam(1e-3), batch_size=8, model_axis=2, log_every=200,\n"
        "                   progress=False, prefetch=0)\n"
        "print(len(t.fit(token_data(8 * 200, seq=8), epochs=1)))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ,
                                            "PYTHONPATH": os.path.dirname(__file__)})
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]
