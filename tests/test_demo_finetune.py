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

    # `redray eval` on the trained run: two local lm-eval tasks, on one device and on 2
    # hosts x 2 devices with the model split over 2; the same scores, and every
    # log-likelihood transformers' on the exported checkpoint
    from test_evaluation import CHOICES, torch_logprob, write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    scores = {}
    for plan, flags in [("one", []), ("split", ["--hosts", "2", "--devices-per-host", "2",
                                                 "--model-axis", "2"])]:
        done = subprocess.run(
            [sys.executable, "-m", "redray.cli", "eval", "ft", "--storage",
             str(tmp_path / "runs"), "--tasks", "redray_choice,redray_echo", "--include-path",
             tasks, "--batch-size", "4", "--samples", str(tmp_path / f"{plan}.jsonl"), *flags],
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        lines = [line.split() for line in done.stdout.splitlines()]
        scores[plan] = {(row[0], row[1]): float(row[2]) for row in lines
                        if len(row) == 3 and row[0].startswith("redray_")}
    assert scores["one"] == scores["split"] and ("redray_choice", "acc") in scores["one"]
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    for plan in ("one", "split"):
        rows = [json.loads(line) for line in open(tmp_path / f"{plan}.jsonl")]
        for row in (r for r in rows if r["task"] == "redray_choice"):
            question, choices, _ = CHOICES[row["doc_id"]]
            context = tokenizer.encode(question)
            for choice, response in zip(choices, row["responses"]):
                whole = tokenizer.encode(question + choice)
                expected = torch_logprob(tuned, context, whole[len(context):])[0]
                assert abs(response[0][0] - expected) <= 1e-4, (plan, question, choice)
    # the scores in the run's MLflow run, at its last step (logged by each eval)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    logged = client.get_metric_history(run.info.run_id, "eval/redray_choice/acc")
    assert [m.step for m in logged] == [8, 8]
    assert [m.value for m in logged] == pytest.approx([scores["one"]["redray_choice", "acc"]] * 2,
                                                      abs=1e-4)  # the table's 4 decimals
