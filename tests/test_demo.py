"""`make demo` end to end (reduced steps): trains on 2 simulated hosts, tracks, checkpoints,
then a second run says the run is complete and a third with more steps resumes."""

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
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.ray
def test_make_demo_trains_then_says_complete_then_resumes(tmp_path):
    common = ["--size", "tiny", "--storage", str(tmp_path), "--name", "demo"]
    out = demo("--steps", "6", *common, make=True)
    numbers = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert numbers["step"] == 6
    assert numbers["perplexity_after"] < numbers["perplexity_before"]
    assert f"checkpoint:    {tmp_path}/demo/checkpoints/6" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in out
    assert os.path.exists(tmp_path / "mlflow.db")

    assert "already complete at step 6" in demo("--steps", "6", *common)
    out = demo("--steps", "8", *common)
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
