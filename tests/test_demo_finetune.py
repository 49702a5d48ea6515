"""The demo's `--model HF_FOLDER`: fine-tunes a local Hugging Face LLaMA checkpoint (with
its own tokenizer) on 2 simulated hosts, starting from its weights, and the trained run
exports back to transformers."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_tiny import ROOT, demo_module, gpt2_tokenizer, llama_folder

torch = pytest.importorskip("torch")


def perplexity(model, rows, batch: int = 16) -> float:
    """transformers' own perplexity of a causal LM over packed rows, each document run
    alone, aggregated as Trainer.evaluate does: next-token losses averaged inside each
    batch of rows, batches weighted by their rows."""
    total = 0.0
    for start in range(0, len(rows), batch):
        chunk, loss, count = rows[start:start + batch], 0.0, 0
        for row in chunk:
            ids, segments = np.asarray(row["ids"]), np.asarray(row["segment_ids"])
            for s in np.unique(segments[segments > 0]):
                doc = torch.tensor(ids[segments == s][None], dtype=torch.long)
                if doc.shape[1] < 2:
                    continue
                with torch.no_grad():
                    logits = model(doc[:, :-1]).logits
                loss += torch.nn.functional.cross_entropy(
                    logits.transpose(1, 2), doc[:, 1:], reduction="sum").item()
                count += doc.shape[1] - 1
        total += loss / count * len(chunk)
    return math.exp(total / len(rows))


@pytest.mark.slow
@pytest.mark.ray
def test_fine_tuning_a_local_checkpoint_lowers_its_perplexity_and_exports(tmp_path, local_ray):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = llama_folder(tmp_path / "tiny-llama", tokenizer=gpt2_tokenizer())
    assert AutoTokenizer.from_pretrained(folder)("def f")["input_ids"] == [4299, 277]  # GPT-2's
    done = subprocess.run(
        [sys.executable, "examples/language_modeling/train.py", "--model", folder,
         "--steps", "8", "--storage", str(tmp_path / "runs"), "--name", "ft"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    numbers = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert numbers["step"] == 8
    assert numbers["perplexity_after"] < numbers["perplexity_before"]
    # Training started from the checkpoint's weights: its eval perplexity at step 0 is
    # what transformers computes for the untouched checkpoint on the same packed rows.
    _, stream, _ = demo_module().corpus(str(tmp_path / "runs" / "ft" / "data"), 64, folder)
    (evaluation,) = list(stream.in_order(10_000))
    start = AutoModelForCausalLM.from_pretrained(folder)
    np.testing.assert_allclose(numbers["perplexity_before"], perplexity(start, evaluation),
                               rtol=1e-4)

    exported = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "redray.cli", "export", "ft", "--storage",
                           str(tmp_path / "runs"), "--to", str(exported)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned, info = AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # the export names its transformers class and ships the run's tokenizer
    assert json.loads((exported / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(str(exported))("def f")["input_ids"] == [4299, 277]
    np.testing.assert_allclose(perplexity(tuned, evaluation), numbers["perplexity_after"],
                               rtol=1e-4)
