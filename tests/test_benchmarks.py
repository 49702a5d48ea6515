"""Every benchmark script runs at a tiny size and writes valid result objects (marked
``bench``: ``make bench-check`` runs them, ``make test`` leaves them out); the report
turns results into BENCHMARKS.md's table. (No timing is asserted anywhere.)"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import KEYS, figure, met  # noqa: E402
from report import END, START, render  # noqa: E402
from run_all import scripts  # noqa: E402


def check(fig):
    assert set(KEYS) <= set(fig), fig
    assert isinstance(fig["value"], float) and fig["value"] == fig["value"], fig  # not NaN
    assert all(isinstance(fig[k], str) and fig[k] for k in ("name", "reference", "command"))
    assert fig["command"].startswith(("python benchmarks/", "make ")), fig
    assert fig["target"] is None or met(fig) in (True, False), fig


# The scripts that start a Ray cluster of their own (the others run in one process, so
# `make bench-check` runs them two at a time).
STARTS_RAY = {"fsdp_torch.py", "hosts.py", "input_pipeline.py", "planner.py", "startup.py",
              "post_training_examples.py", "streaming.py", "weight_sync.py"}


@pytest.mark.slow
@pytest.mark.bench
# run_all skips the GPU benchmarks; their --tiny runs work on any backend
# (elastic.py's tiny run is test_elastic's scenario: run there, checked in detail)
@pytest.mark.parametrize("script", [
    pytest.param(s, marks=[pytest.mark.ray] if s in STARTS_RAY else [])
    for s in [s for s in scripts() if s != "elastic.py"]
    + ["gpu_mfu.py", "gpu_attention.py", "gpu_sampler.py"]])
def test_benchmark_runs_tiny_and_writes_valid_figures(script, tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures, f"{script} wrote no figure"
    for fig in figures:
        check(fig)


def test_the_scripts_said_to_run_without_ray_never_start_it():
    """A script left out of STARTS_RAY runs beside other tests: it must not start Ray
    (which sizes itself to the machine's cores)."""
    for script in set(scripts()) - STARTS_RAY - {"elastic.py"}:
        with open(os.path.join(ROOT, "benchmarks", script)) as f:
            source = f.read()
        starts = re.search(r"\bimport ray\b|ray\.init|redray\.(fit|run)\(|hosts=\d", source)
        assert not starts, f"benchmarks/{script} seems to start Ray: add it to STARTS_RAY"


def test_targets_and_the_generated_table():
    good = figure("overhead", 1.01, "x", "hand-written jax.jit step", "<= 1.03",
                  "python benchmarks/overhead.py")
    bad = figure("fsdp", 0.8, "x", "PyTorch FSDP", ">= 1.0", "python benchmarks/fsdp.py")
    assert met(good) is True and met(bad) is False
    assert met(figure("hosts", 0.5, "x", "1 host", None, "python benchmarks/hosts.py")) is None
    within = [figure("plan", v, "x", "compiled", "0.8-1.25", "python m.py")
              for v in (0.79, 1.0, 1.3)]
    assert [met(f) for f in within] == [False, True, False]
    text = render(f"# B\n\nintro\n{START}\nold\n{END}\nnotes\n", [bad, good])
    assert text.startswith("# B\n\nintro\n") and text.endswith("\nnotes\n")
    assert "| fsdp | 0.8000 x | >= 1.0 | **no** |" in text and "| overhead | 1.0100 x |" in text
    lines = figure("lines_of_code/lm", 92, "lines", "redco: 113", "<= 113", "python x.py")
    assert "| lines_of_code/lm | 92 lines | <= 113 | yes |" in render(f"{START}\n{END}", [lines])
    assert "old" not in text
    with pytest.raises(ValueError, match="markers"):
        render("no markers", [good])
