"""examples/dpo's loop at a tiny size, in this process (the loop ``redray.run`` runs on a
host): its rows hold what the loss reads, and a run killed in its first DPO epoch (an
exception after an optimizer step: the work since the last checkpoint lost) and
started again trains exactly as one that never stopped: the reference's
log-probabilities, computed once when the warm-up ends, come back from the run's
folder, not from the model the run resumes with."""

import jax
import numpy as np
import pytest

from example_runs import Killed, example_module, run_loop

TINY = ["--warmup", "2", "--pairs", "256"]


def run(module, monkeypatch, folder, epochs, kill_at=None):
    return run_loop(module, "dpo", [*TINY, "--epochs", str(epochs)], folder, monkeypatch,
                    kill_at)


def test_a_row_is_a_prompt_with_its_right_sum_and_a_near_miss():
    d = example_module("dpo")
    r = d.row(3745, 83, reference=(-1.5, -2.5))  # 37 + 45 = 82, against 83
    head = [d.BOS, 3, 7, 10, 4, 5, 11]
    assert r["chosen"].tolist() == head + [8, 2, d.EOS, d.PAD, d.PAD]
    assert r["rejected"].tolist() == head + [8, 3, d.EOS, d.PAD, d.PAD]
    assert r["chosen_mask"].tolist() == r["rejected_mask"].tolist() == [0] * 7 + [1] * 3 + [0] * 2
    assert r["reference"].tolist() == [-1.5, -2.5] and not r["warmup"]
    misses = d.near_misses(np.random.default_rng(0), np.array([3745, 1, 9999]))
    assert all(m != t and abs(m - t) in (1, 10) for m, t in zip(misses, [82, 1, 198]))
    assert d.near_misses(np.random.default_rng(0), np.zeros(64, int)).min() > 0  # 0+0


@pytest.mark.slow
def test_a_killed_run_resumes_exactly_with_its_saved_reference(tmp_path, monkeypatch):
    d = example_module("dpo")
    whole, trainer, whole_log = run(d, monkeypatch, tmp_path / "whole", epochs=3)
    assert whole == {"first_epoch": 0, "step": 10}  # (2 warm-up + 3 DPO epochs) x 2 updates
    accuracy = [row["preference_accuracy"] for row in whole_log if "preference_accuracy" in row]
    assert len(accuracy) == 4 and all(0 <= a <= 1 for a in accuracy)
    params = jax.device_get(trainer.state.params)

    # killed after the first update of the second DPO epoch (step 7 of 10)
    with pytest.raises(Killed):
        run(d, monkeypatch, tmp_path / "stopped", epochs=3, kill_at=7)
    np.testing.assert_array_equal(np.load(tmp_path / "stopped" / "reference.npy"),
                                  np.load(tmp_path / "whole" / "reference.npy"))
    again, resumed, again_log = run(d, monkeypatch, tmp_path / "stopped", epochs=3)
    assert again == {"first_epoch": 3, "step": 10}  # from the checkpoint of step 6
    assert again_log == whole_log[-len(again_log):]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params), params)
