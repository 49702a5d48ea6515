"""What a user sees when their code fails on one host: a script run as a user runs it.

The user's traceback must be the last thing printed, once; not Ray's worker-group error
(which suggests the OOM killer), nor the other host's "Fatal Python error: Aborted".
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax, optax, redray
    from tiny import TinyLM, lm_collate, lm_loss, token_data

    def collate(examples):
        if jax.process_index() == 1 and len(examples) == 4:  # a training batch on host 1
            raise RuntimeError("collate exploded on host 1")
        return lm_collate(examples)

    redray.fit(lambda rngs: TinyLM(rngs), collate, lm_loss, optax.adam(1e-2),
               train_data=token_data(48), epochs=1, hosts=2, devices_per_host=2,
               batch_size=8, model_axis=2, storage_path={storage!r}, progress=False)
""")


def test_a_failing_host_shows_the_users_traceback_last_and_once(tmp_path):
    script = tmp_path / "train.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests, storage=str(tmp_path / "runs")))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert out.count("RuntimeError: collate exploded on host 1") == 1, out
    tail = done.stderr.rstrip().splitlines()
    assert tail[-1] == "RuntimeError: collate exploded on host 1", out
    assert "host 1 failed" in done.stderr, out
    # the user's frame is there, redray's machinery between host entry and collate is not
    assert 'in collate' in done.stderr and "worker.py" not in done.stderr.split("host 1 failed")[1]
    for noise in ("Fatal Python error", "OOM", "out of memory", "WorkerGroupError",
                  "TrainingFailedError"):
        assert noise not in out, (noise, out)
