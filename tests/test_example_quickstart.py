"""examples/quickstart: the three functions in one process, tensor-parallel, no Ray."""

import re

import pytest

from example_runs import run_example


@pytest.mark.slow
def test_quickstart_perplexity_falls():
    # the script exits non-zero unless the eval loss fell; run_example asserts exit 0
    out, _ = run_example("quickstart", "--steps", "30")
    before = float(re.search(r"perplexity before: ([\d.]+)", out).group(1))
    after = float(re.search(r"perplexity after 30 steps: ([\d.]+)", out).group(1))
    assert after < 0.8 * before, out[-2000:]
    assert "mesh data=2 x fsdp=1 x model=2 (4 devices)" in out  # the sharding plan
