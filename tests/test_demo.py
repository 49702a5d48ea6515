"""`make demo` end to end (reduced steps): trains on 2 simulated hosts, tracks, checkpoints,
then a second run with more steps resumes. What the user sees is checked too: by default
a few lines (the run's own messages and progress), no traceback, no warning, nothing of
Ray's worker stream; `--verbose` (the second run) shows all of it. (A run already
complete says so: tests/test_example_classification.py, on another example.)"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo(*args, make=False):
    if make:
        command = ["make", "-s", "demo", f"DEMO_ARGS={' '.join(args)}"]
    else:
        command = [sys.executable, "examples/language_modeling/train.py", *args]
    env = {k: v for k, v in os.environ.items() if k != "REDRAY_VERBOSE"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, done.stderr


def quiet_console(out: str, err: str) -> list[str]:
    """The lines a run showed, checked to be the quiet default's."""
    lines = (out + err).splitlines()
    assert not [x for x in lines if "Traceback" in x or "Warning" in x or "WARNING" in x], lines
    # nothing came through Ray's stream of the workers' output ("(RayTrainWorker pid=..)")
    assert not [x for x in lines if "pid=" in x or x.startswith("(raylet)")], lines
    return lines


@pytest.mark.slow
@pytest.mark.ray
def test_make_demo_trains_then_resumes(tmp_path):
    common = ["--size", "tiny", "--storage", str(tmp_path), "--name", "demo"]
    out, err = demo("--steps", "6", *common, make=True)
    console = quiet_console(out, err)
    # 2 data lines, the plan chosen (and why), the mesh, 2 evaluations, 1 progress line
    # (log_every=10 > 6 steps), the perplexities (3 lines) and the summary (4)
    assert len(console) == 14, console
    assert [x for x in console if x.startswith("step 6/6 (100%) | epoch 0 | loss ")], console
    assert console[2].startswith("plan: data=") and "runner-up" in console[2], console
    assert "tokens/s | ETA 0s" in out and console[3].startswith("redray: 2 host(s)")
    numbers = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert numbers["step"] == 6
    assert numbers["perplexity_after"] < numbers["perplexity_before"]
    assert f"checkpoint:    {tmp_path}/demo/checkpoints/6" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in out
    assert os.path.exists(tmp_path / "mlflow.db")

    out, err = demo("--steps", "8", *common, "--verbose")
    # verbose: the workers' stream is back, set-up chatter included
    assert "(RayTrainWorker pid=" in out + err and "JAX distributed service" in out + err
    assert "resumed from " in out + err  # host 0's line, through the workers' stream
    numbers = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert numbers["step"] == 8  # resumed from step 6: the perplexity "before" is step 6's
    assert "at step 6 ->" in out

    # the trained run, as Hugging Face safetensors that transformers loads
    exported = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "redray.cli", "export", "demo", "--storage",
                           str(tmp_path), "--to", str(exported)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from redray import load_params
    from redray.models import build, load_config

    config = load_config(str(exported))
    params, _ = load_params(str(tmp_path / "demo"), lambda rngs: build(config, rngs=rngs))
    import jax
    import numpy as np

    embed = model.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(embed, np.asarray(jax.tree.leaves(params["embed_tokens"])[0]))
