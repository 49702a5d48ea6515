"""examples/classification end to end on 2 simulated hosts: the test accuracy the
Predictor measures rises far above chance. (A run already complete: on a cluster,
tests/test_resume_cluster.py; the summary that says so, tests/test_flags.py.)"""

import pytest

from example_runs import run_example

TRAIN_IMAGES = 1437  # 80% of scikit-learn's 1,797 digits


@pytest.mark.slow
@pytest.mark.ray
def test_digits_accuracy_rises(tmp_path):
    command = ["--epochs", "3", "--storage", str(tmp_path), "--name", "digits"]
    out, numbers = run_example("classification", *command)
    assert numbers["step"] == 3 * (TRAIN_IMAGES // 32)
    assert numbers["accuracy_after"] >= 0.85  # ten classes: chance is 0.1; measured 0.94
    assert numbers["loss_after"] < numbers["loss_before"] / 3  # measured 2.33 -> 0.38
    assert f"checkpoint:    {tmp_path}/digits/checkpoints/{numbers['step']}" in out
