"""Checkpoints in one process (4 simulated devices): exact resume, fallback past an
unreadable checkpoint, retention of the best, parameters-only loading, clear refusals.
The multi-host cases (SIGKILL, resubmission, resharding across host counts) are in
test_resume_cluster.py."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import redray
from redray import CheckpointConfig, CheckpointMismatch, load_model, load_params
from tiny import TinyLM, assert_same, lm_collate, lm_loss, lm_predict, token_data

DATA = token_data(96)  # 12 steps per epoch at batch 8


def dropout_model(rngs):
    return TinyLM(rngs, dropout=0.2)  # the RNG stream matters: resume must restore it


def trainer(directory=None, model=dropout_model, **kw):
    options = dict(batch_size=8, model_axis=2, log_every=1, progress=False, seed=3)
    options.update(kw)
    return redray.Trainer.of(model, lm_collate, lm_loss, optax.adam(1e-2), lm_predict,
                          checkpoint=directory, **options)


def losses(history):
    return {row["step"]: row["loss"] for row in history if "loss" in row}


@pytest.fixture(scope="module")
def reference():
    t = trainer()
    history = t.fit(DATA, epochs=2)
    return losses(history), jax.device_get(t.state.params)


def test_resuming_mid_epoch_continues_bitwise_exactly(tmp_path, reference):
    expected, params = reference
    config = CheckpointConfig(str(tmp_path), save_every=5)
    first = trainer(config)
    first.fit(DATA, epochs=2, max_steps=7)  # stops inside epoch 0
    assert first.checkpointer.steps() == [5, 7]
    second = trainer(config)
    history = second.fit(DATA, epochs=2)
    meta = second.resumed_from
    assert (meta["step"], meta["epoch"], meta["batch"], meta["epoch_done"]) == (7, 0, 7, False)
    assert losses(history) == {s: v for s, v in expected.items() if s > 7}
    assert_same(second.state.params, params)
    # a step-12 epoch checkpoint, save_every's 15 and 20, the end (24); the last 3 stay
    assert second.checkpointer.steps() == [15, 20, 24]


def test_an_unreadable_latest_checkpoint_is_set_aside_and_the_previous_used(tmp_path, caplog):
    config = CheckpointConfig(str(tmp_path), save_every=4)
    first = trainer(config)
    first.fit(DATA, max_steps=8)
    assert first.checkpointer.steps() == [4, 8]
    # the optimizer state's data file, as written last by the merge of all hosts' parts
    largest = max(glob.glob(f"{tmp_path}/8/train/d/*"), key=os.path.getsize)
    with open(largest, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(largest) // 2)
    second = trainer(config)
    with caplog.at_level(logging.WARNING, logger="redray.checkpoint"):
        second.init(DATA)
    assert second.resumed_from["step"] == 4
    assert f"{tmp_path}/8" in caplog.text and "cannot be restored" in caplog.text
    aside = glob.glob(f"{tmp_path}/8.unreadable-*")
    assert len(aside) == 1 and os.path.exists(os.path.join(aside[0], os.path.relpath(
        largest, f"{tmp_path}/8")))  # moved, nothing deleted
    second.fit(DATA, max_steps=8)  # and step 8 is written again, cleanly
    assert second.checkpointer.steps() == [4, 8]


def test_the_best_checkpoint_outlives_the_last_n(tmp_path):
    # eval loss falls while training, so "max" makes the oldest epoch the best one
    config = CheckpointConfig(str(tmp_path), keep=1, best_metric="eval_loss", best_mode="max")
    t = trainer(config)
    history = t.fit(DATA[:64], epochs=3, eval_data=DATA[64:])
    evals = {row["step"]: row["eval_loss"] for row in history if "eval_loss" in row}
    worst = max(evals, key=evals.get)
    assert worst == 8 and t.checkpointer.steps() == [8, 24]
    best, _ = load_params(str(tmp_path), dropout_model, best="max:eval_loss")
    latest, _ = load_params(str(tmp_path), dropout_model)
    assert_same(latest, t.state.params)
    assert not np.array_equal(np.asarray(jax.tree.leaves(best)[0]),
                              np.asarray(jax.tree.leaves(latest)[0]))


def test_load_params_is_one_call_for_prediction_and_fine_tuning(tmp_path):
    t = trainer(str(tmp_path))
    t.fit(DATA, max_steps=6)
    expected = t.predictor().predict(DATA[:10])
    params, extra = load_params(f"{tmp_path}/6", dropout_model)  # a single checkpoint
    predictor = redray.Predictor(dropout_model, lm_collate, lm_predict, params=params,
                                 extra=extra, batch_size=8)
    assert [p.tolist() for p in predictor.predict(DATA[:10])] == [p.tolist() for p in expected]
    module = load_model(str(tmp_path), dropout_model)
    assert_same(jax.tree.leaves(nnx_params(module)), jax.tree.leaves(t.state.params))
    fine = trainer(None, model=module)  # fine-tuning starts from the trained weights
    fine.init(DATA)
    assert_same(fine.state.params, t.state.params)


def nnx_params(module):
    from flax import nnx
    return nnx.state(module, nnx.Param)


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, ids, train=False):
        x = nn.Embed(64, 16)(ids)
        x = nn.BatchNorm(use_running_average=True)(x)
        return nn.Dense(64)(nn.Dropout(0.1, deterministic=not train)(x))


def test_a_linen_model_with_batch_stats_resumes_exactly(tmp_path):
    model = redray.LinenModel(LinenLM(), jnp.zeros((1, 15), jnp.int32))
    reference = trainer(model=model, model_axis=1)
    expected = losses(reference.fit(DATA, max_steps=10))
    trainer(str(tmp_path), model=model, model_axis=1).fit(DATA, max_steps=4)
    resumed = trainer(str(tmp_path), model=model, model_axis=1)
    assert losses(resumed.fit(DATA, max_steps=10)) == {s: v for s, v in expected.items() if s > 4}
    assert_same(resumed.state, reference.state)
    params, extra = load_params(str(tmp_path), model)
    assert set(extra) == {"batch_stats"}
    assert_same(params, reference.state.params)


def test_resuming_on_other_data_is_refused(tmp_path):
    trainer(str(tmp_path)).fit(DATA, max_steps=3)
    with pytest.raises(CheckpointMismatch, match=r"examples: checkpoint 96, now 80.*new run"):
        trainer(str(tmp_path)).fit(DATA[:80], max_steps=6)
    with pytest.raises(CheckpointMismatch, match=r"seed: checkpoint 3, now 4"):
        trainer(str(tmp_path), seed=4).fit(DATA, max_steps=6)
    fresh = trainer(CheckpointConfig(str(tmp_path), resume=False))
    fresh.fit(DATA[:80], max_steps=1)  # resume=False starts over (and keeps the old steps)
    assert fresh.resumed_from is None


def test_checkpoint_settings_are_checked():
    with pytest.raises(ValueError, match="save_every=0"):
        CheckpointConfig("/tmp/x", save_every=0)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointConfig("/tmp/x", keep=0)
    with pytest.raises(ValueError, match="best_mode='lowest'.*'min' or 'max'"):
        CheckpointConfig("/tmp/x", best_mode="lowest")
    with pytest.raises(TypeError, match="CheckpointConfig"):
        trainer(checkpoint := 5)  # noqa: F841
    with pytest.raises(ValueError, match="best_metric='eval_loss' needs eval_data"):
        trainer(CheckpointConfig("/tmp/x", best_metric="eval_loss")).fit(DATA, max_steps=1)


def test_an_unknown_best_metric_names_the_available_ones(tmp_path):
    t = trainer(CheckpointConfig(str(tmp_path), best_metric="eval_acc"))
    with pytest.raises(ValueError, match=r"'eval_acc' is not among.*'eval_accuracy', 'eval_loss'"):
        t.fit(DATA[:64], epochs=1, eval_data=DATA[64:])


def test_load_params_explains_a_wrong_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_params(str(tmp_path), dropout_model)
    with pytest.raises(FileNotFoundError, match="no checkpoints at"):
        load_params(str(tmp_path / "missing"), dropout_model)


def truncate_largest(folder):
    largest = max(glob.glob(f"{folder}/d/*"), key=os.path.getsize)
    with open(largest, "r+b") as f:  # a write cut short
        f.truncate(os.path.getsize(largest) // 2)


def test_load_params_skips_a_damaged_newest_checkpoint_and_says_which(tmp_path, caplog):
    t = trainer(CheckpointConfig(str(tmp_path), save_every=4))
    t.fit(DATA, max_steps=8)
    step4, _ = load_params(str(tmp_path), dropout_model, step=4)
    truncate_largest(f"{tmp_path}/8/model")
    with caplog.at_level(logging.WARNING, logger="redray.checkpoint"):
        params, _ = load_params(str(tmp_path), dropout_model)
    assert_same(params, step4)
    assert f"checkpoint {tmp_path}/8 cannot be restored (" in caplog.text
    assert f"loading {tmp_path}/4, the newest readable one" in caplog.text
    assert os.path.isdir(f"{tmp_path}/8") and not glob.glob(f"{tmp_path}/8.*")  # read only
    with pytest.raises(CheckpointMismatch, match=r"checkpoint .*/8 could not be restored into "
                       r"this model .*damaged.*load another \(step=\.\.\., of \[4\]\)"):
        load_params(str(tmp_path), dropout_model, step=8)
    # another model's sizes: Orbax alone would restore the stored shapes silently
    with pytest.raises(CheckpointMismatch, match=r"checkpoint .*/4 holds params.fc1.bias with "
                       r"shape \(128,\), this model's is \(192,\): pass the model the run "
                       r"trained"):
        load_params(str(tmp_path), lambda rngs: TinyLM(rngs, dim=48))
    truncate_largest(f"{tmp_path}/4/model")
    with pytest.raises(CheckpointMismatch, match=r"no checkpoint in .* could be restored into "
                       r"this model: the newest, .*/8, fails with .*, and the 1 older ones fail "
                       r"too \(the oldest, .*/4, with .*\): pass the model the run trained"):
        load_params(str(tmp_path), dropout_model)


def test_a_malformed_meta_is_unreadable_and_numeric_junk_is_skipped(tmp_path, caplog):
    import json

    from redray.checkpoint import latest_meta

    t = trainer(CheckpointConfig(str(tmp_path), save_every=4))
    t.fit(DATA, max_steps=8)
    meta_file = f"{tmp_path}/8/meta/metadata"
    meta = json.load(open(meta_file))
    del meta["epoch"]  # valid JSON, not a checkpoint's meta
    json.dump(meta, open(meta_file, "w"))
    os.makedirs(f"{tmp_path}/30")  # numeric folders that are no checkpoints
    os.makedirs(f"{tmp_path}/31")
    open(f"{tmp_path}/31/notes.txt", "w").close()
    open(f"{tmp_path}/32", "w").close()
    with caplog.at_level(logging.WARNING, logger="redray.checkpoint"):
        resumed = trainer(CheckpointConfig(str(tmp_path), save_every=4))
        resumed.init(DATA)
    assert resumed.resumed_from["step"] == 4
    assert "its meta has no 'epoch'" in caplog.text
    assert len(glob.glob(f"{tmp_path}/8.unreadable-*")) == 1
    assert latest_meta(str(tmp_path))["step"] == 4  # what `redray runs` shows, the junk skipped
    assert os.path.isdir(f"{tmp_path}/30") and os.path.isfile(f"{tmp_path}/31/notes.txt")
    assert os.path.isfile(f"{tmp_path}/32") and not glob.glob(f"{tmp_path}/3?.unreadable-*")
    json.dump({**meta, "epoch": 0, "batch": "7"}, open(f"{tmp_path}/4/meta/metadata", "w"))
    with caplog.at_level(logging.WARNING, logger="redray.checkpoint"):
        again = trainer(CheckpointConfig(str(tmp_path), save_every=4))
        again.init(DATA)
    assert again.resumed_from is None  # nothing readable: a fresh start, nothing lost
    assert "its meta's 'batch' is '7', not of type int" in caplog.text


def test_a_checkpoint_of_listed_layers_resumes_in_a_scanned_model_and_back(tmp_path):
    # a run that turns scan=True on (for pipeline stages, say) keeps its checkpoints:
    # the parameters and the optimizer state are stacked or unstacked on restore
    from transformers import LlamaConfig

    from redray.models import build

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16)
    data = token_data(16, seq=12)

    def trainer(scan, folder):
        return redray.Trainer.of(lambda rngs: build(config, rngs=rngs, scan=scan), lm_collate,
                              lm_loss, optax.adam(1e-2), batch_size=4, progress=False,
                              log_every=1, checkpoint=str(tmp_path / folder))

    whole = [r["loss"] for r in trainer(False, "whole").fit(data, epochs=3)]
    first = [r["loss"] for r in trainer(False, "run").fit(data, epochs=1)]
    scanned = trainer(True, "run")
    second = [r["loss"] for r in scanned.fit(data, epochs=2)]
    assert scanned.resumed_from is not None
    third = [r["loss"] for r in trainer(False, "run").fit(data, epochs=3)]
    np.testing.assert_allclose(first + second + third, whole, rtol=1e-5)


def test_layer_moves_pair_listed_and_stacked_arrays_or_refuse():
    from redray.checkpoint import layer_moves

    listed = {"p/layers/0/w": (3, 4), "p/layers/1/w": (3, 4), "p/embed": (8, 3)}
    stacked = {"p/layers/w": (2, 3, 4), "p/embed": (8, 3)}
    assert layer_moves(listed, stacked) == {"p/layers/w": ("stack", ["p/layers/0/w",
                                                                      "p/layers/1/w"])}
    assert layer_moves(stacked, listed) == {"p/layers/0/w": ("slice", "p/layers/w", 0),
                                            "p/layers/1/w": ("slice", "p/layers/w", 1)}
    # another depth, another width, an array the model lacks: another model's
    assert layer_moves(listed, {**stacked, "p/layers/w": (3, 3, 4)}) is None
    assert layer_moves(listed, {**stacked, "p/layers/w": (2, 3, 5)}) is None
    assert layer_moves({**listed, "p/head": (3, 8)}, stacked) is None
    assert layer_moves({**stacked, "p/layers/w": (3, 3, 4)}, listed) is None
