"""The XLA flags redray sets on GPU hosts: known to this XLA (an unknown flag aborts the
process at start), and overridden by the user's own XLA_FLAGS."""

import os
import subprocess
import sys

from redray.cluster.launch import GPU_XLA_FLAGS, gpu_xla_flags


def test_every_gpu_flag_is_one_this_xla_knows():
    # XLA parses every backend's flags at start, whatever the device: a CPU process
    # fails the same way a GPU one would on a misspelled or removed flag
    env = dict(os.environ, XLA_FLAGS=gpu_xla_flags(""), JAX_PLATFORMS="cpu")
    program = "import jax; jax.numpy.ones(1).block_until_ready()"
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_enable_latency_hiding_schedular=true")  # the control
    done = subprocess.run([sys.executable, "-c", program], env=bad, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "Unknown flag" in done.stderr


def test_the_users_flags_win():
    merged = gpu_xla_flags("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d")
    flags = merged.split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert flags[-1] == "--xla_dump_to=/tmp/d"
    assert len(flags) == len(GPU_XLA_FLAGS) + 1
