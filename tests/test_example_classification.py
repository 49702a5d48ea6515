"""examples/classification end to end on 2 simulated hosts: the test accuracy the
Predictor measures rises far above chance, and the same command again finds the run done."""

import pytest

from example_runs import run_example

TRAIN_IMAGES = 1437  # 80% of scikit-learn's 1,797 digits


@pytest.mark.slow
@pytest.mark.ray
def test_digits_accuracy_rises_then_the_run_is_complete(tmp_path):
    command = ["--epochs", "3", "--storage", str(tmp_path), "--name", "digits"]
    out, numbers = run_example("classification", *command)
    assert numbers["step"] == 3 * (TRAIN_IMAGES // 32)
    assert numbers["accuracy_after"] >= 0.85  # ten classes: chance is 0.1; measured 0.94
    assert numbers["loss_after"] < numbers["loss_before"] / 3  # measured 2.33 -> 0.38
    assert f"checkpoint:    {tmp_path}/digits/checkpoints/{numbers['step']}" in out
    out, numbers = run_example("classification", *command)
    assert numbers is None and f"already complete at step {3 * (TRAIN_IMAGES // 32)}" in out
