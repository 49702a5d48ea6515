"""examples/lora end to end on 2 simulated hosts: a base LM is pretrained, LoRA adapters
alone learn new text (the perplexity falls), the checkpoint holds the adapters and
nothing else, and the merged Hugging Face export computes what the adapted model did."""

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "lora", "train.py")


def example():
    spec = importlib.util.spec_from_file_location("lora_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stored_params(checkpoint):
    """"/"-joined path -> shape of every parameter array in a checkpoint, read by Orbax."""
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(f"{checkpoint}/model").item_metadata.tree
    return {"/".join(str(k.key) for k in path[:-1]): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}


@pytest.mark.slow
@pytest.mark.ray
def test_adapters_alone_learn_are_saved_and_merge_into_a_hf_checkpoint(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "30", "--base-steps", "30",
                           "--storage", str(tmp_path), "--export", str(merged)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert got["step"] == 30
    # measured: 94 -> 54 after 30 adapter updates on a 30-step base
    assert got["perplexity_after"] < 0.75 * got["perplexity_before"]

    saved = stored_params(tmp_path / "lora" / "checkpoints" / "30")
    assert saved and all(path.rsplit("/", 1)[1] in ("lora_a", "lora_b") for path in saved)
    assert sum(math.prod(shape) for shape in saved.values()) == got["trained_parameters"]
    assert got["trained_parameters"] < 0.05 * got["parameters"]
    assert got["checkpoint_bytes"] < got["model_bytes"] / 10
    # the base run, trained in full, saved every weight
    assert "embed_tokens/embedding" in stored_params(tmp_path / "lora-base" / "checkpoints" / "30")

    # transformers' own LLaMA on the merged export gives the adapted model's perplexity
    hf = LlamaForCausalLM.from_pretrained(str(merged)).eval()
    assert not [k for k in hf.state_dict() if "lora" in k]
    assert len(glob.glob(str(merged / "*.safetensors"))) == 1
    _, (_, held_out), _ = example().texts(64)
    ids = torch.tensor(np.stack([e["ids"] for e in held_out]), dtype=torch.long)
    with torch.no_grad():
        logits = hf(ids[:, :-1]).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    assert math.exp(nll.item()) == pytest.approx(got["perplexity_after"], rel=1e-4)
