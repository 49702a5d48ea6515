"""Elastic runs on a real multi-node Ray cluster on one machine, over a streamed corpus:
a node removed mid-run, or dying without warning (host 0's, host 1's during a
checkpoint save; host 2's in the full benchmark), and the run going on with the hosts
left and a new plan; a node added back taken at the next checkpoint.

The scenarios are ``benchmarks/elastic.py``'s (run here ``--tiny``: one uninterrupted
reference run; ``test_benchmarks`` leaves this script to this test): a head without
CPUs and 4 nodes of one CPU each (a node holds one host; 3 hosts and the CPU kept free
for Ray Data's reads take them all), ``redray.fit`` with ``hosts=(2, 3)``,
``model_axis=2`` and the run's plan, saving every 4 steps.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 32


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic") / "results.json"
    done = subprocess.run([sys.executable, "benchmarks/elastic.py", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(out.read_text())}
    return figures, figures["elastic/seconds_to_continue"]["detail"]


def same_losses_after_the_change(run, reference):
    # the same data order as a run on 3 hosts throughout: the same losses, up to the
    # float32 rounding of the plans' different reductions (2 hosts: other shardings)
    first = run["groups"][1][1]
    for step in range(first, STEPS + 1):
        value = run["losses"][str(step)]
        assert abs(value - reference[str(step)]) <= 1e-4 * abs(reference[str(step)]), \
            (step, value)


def test_an_elastic_run_goes_on_without_a_lost_node_and_grows_back(elastic):
    figures, d = elastic
    run = d["runs"]["graceful"]
    # 3 hosts; 2 from the checkpoint of step 4 once the node was gone; 3 again from a
    # later checkpoint once it came back (the group of 2 saved step 8 before the node
    # returned, so it regrouped at 12)
    assert run["groups"] == [[3, 1], [2, 5], [3, 13]], run["groups"]
    assert run["resumed_from_step"] == 12
    assert run["last_group_steps"] == list(range(13, STEPS + 1))
    assert run["logged_steps"] == list(range(1, STEPS + 1))  # MLflow: each step once
    same_losses_after_the_change(run, d["references"]["0"])
    assert figures["elastic/seconds_to_continue"]["value"] > 0 and run["seconds_to_grow"] > 0


# (``death-2``, host 2's node, is the full benchmark's: ``--tiny`` leaves it out)
@pytest.mark.parametrize("name,host,resumed", [("death-0", 0, 8), ("death-save", 1, 4)])
def test_an_elastic_run_goes_on_when_a_node_dies_without_warning(elastic, name, host,
                                                                  resumed):
    """The node of host ``host`` killed mid-run (``death-save``: while the checkpoint of
    step 8 was being written): the run finishes every step on the 2 hosts the 3 nodes
    left hold beside Ray Data's CPU, with no node added back, from the newest complete
    checkpoint; each step once on MLflow; the driver names the host whose node died
    and says what the new group is."""
    _, d = elastic
    run = d["runs"][name]
    assert run["groups"] == [[3, 1], [2, resumed + 1]], run["groups"]
    assert run["resumed_from_step"] == resumed
    assert run["last_group_steps"] == list(range(resumed + 1, STEPS + 1))
    assert run["logged_steps"] == list(range(1, STEPS + 1))
    same_losses_after_the_change(run, d["references"]["0"])
    # no checkpoint left unreadable, none half-written (a save's folder appears complete)
    assert run["checkpoints"] and all(v is True for v in run["checkpoints"].values()), \
        run["checkpoints"]
    said = "\n".join(run["driver_said"])
    assert f"host {host}'s node" in said and "left the cluster" in said, said
    assert ("a group of 2 host(s) (the run takes 2 to 3): the most the cluster places now, "
            "2 host(s) of {'CPU': 1} and 1 CPU free beside them for Ray Data's reads") in said
    assert "restarting the run from its last checkpoint (1 of max_failures=3)" in said
    if name == "death-save":
        assert run["step_8_complete_at_death"] is False  # it died during that save
