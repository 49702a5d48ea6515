"""examples/quickstart: the three functions in one process, the plan chosen, no Ray."""

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
    # the plan the planner chose, why, and the sharding it implies
    assert re.search(r"plan: data=\d x fsdp=\d x model=\d, micro \d+", out), out[-2000:]
    assert re.search(r"mesh data=\d x fsdp=\d x model=\d \(4 devices\)", out), out[-2000:]
