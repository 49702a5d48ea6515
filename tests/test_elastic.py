"""Elastic runs on a real multi-node Ray cluster on one machine: a node removed mid-run,
the run going on with the hosts left and a new plan, the node added back and taken at
the next checkpoint.

The scenario is ``benchmarks/elastic.py`` (run here ``--tiny``: one uninterrupted
reference run; ``test_benchmarks`` leaves this script to this test): a head without
CPUs and 3 nodes of one CPU each (a node holds one host), ``redray.fit`` with
``hosts=(2, 3)`` and the plan chosen for it, saving every 4 steps; the driver removes a
node once step 4 is saved and adds one once the group of 2 hosts trained 5 steps.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_elastic_run_goes_on_without_a_lost_node_and_grows_back(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "benchmarks/elastic.py", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (figure,) = json.loads(out.read_text())
    d = figure["detail"]
    # 3 hosts; 2 from the checkpoint of step 4 once the node was gone; 3 again from a
    # later checkpoint once it came back (the group of 2 saved step 8 before the node
    # returned, so it regrouped at 12)
    assert d["groups"] == [[3, 1], [2, 5], [3, 13]], d["groups"]
    assert d["resumed_from_step"] == 12 and d["last_group_steps"] == list(range(13, 25))
    assert d["logged_steps"] == list(range(1, 25))  # MLflow: each step once over 3 groups
    # the same data order as a run on 3 hosts throughout: the same losses, up to the
    # float32 rounding of the plans' different reductions (2 hosts: other shardings)
    reference = d["references"]["0"]
    for step, value in d["losses"].items():
        assert abs(value - reference[step]) <= 1e-4 * abs(reference[step]), (step, value)
    assert figure["value"] > 0 and d["seconds_to_grow"] > 0
