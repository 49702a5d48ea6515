"""examples/grpo's loop at a tiny size, in this process (the loop ``redray.run`` runs on a
host): the rows it trains on line up with what the sampler drew, and a run killed in
the middle of an iteration and started again trains exactly as one that never stopped
(each iteration's prompts and samples are keyed by its number; the Trainer restores
its state). The kill is an exception raised after an optimizer step, the work since the
last checkpoint lost, as a killed process loses it (tests/test_resume_cluster.py kills
the processes of hosts mid-epoch)."""

import jax
import numpy as np
import pytest

from example_runs import Killed, example_module, run_loop
from redray.models.generate import special_tokens

TINY = ["--warmup", "2", "--prompts", "4", "--group", "4"]


def example():
    return example_module("grpo")


def run(module, monkeypatch, folder, iterations, kill_at=None):
    return run_loop(module, "grpo", [*TINY, "--iterations", str(iterations)], folder,
                    monkeypatch, kill_at)


def test_prompts_are_conversations_and_rows_follow_the_samples():
    g = example()
    pair = 3745  # 37 + 45
    tok = g.TOKENIZER
    # the user's turn through the chat template, with the assistant's opening
    assert tok.decode(g.prompt(pair)) == \
        "<|im_start|>user\n37+45=<|im_end|>\n<|im_start|>assistant\n"
    head, two = g.prompt(pair), tok.encode("82", add_special_tokens=False)
    assert len(head) == 14 and g.answer(pair) == [*two, g.EOT]
    # the end of turn is the generation config's, not the config's EOS: the sampler stops there
    config = g.model(None).config
    assert config.eos_token_id == g.PAD and config.generation["eos_token_id"] == g.STOP
    assert list(special_tokens(config, None, None)[0]) == [g.EOT, g.PAD]
    # the reward reads the decoded message; one cut before its end of turn is None
    said = g.messages([g.answer(pair), two, tok.encode("83") + [g.EOT]], tok, g.STOP)
    assert said == ["82", None, "83"]
    assert [g.reward(pair, m) for m in said] == [1.0, 0.0, 0.0]
    wrong = tok.encode("83", add_special_tokens=False) + [g.EOT]
    r = g.row(pair, wrong, [-0.5, -1.0, -0.25], advantage=-2.0)
    assert r["ids"].tolist() == [*head, *wrong, g.PAD] and len(r["ids"]) == g.LENGTH
    # the completion's tokens, and the sampler's log-probabilities at their positions
    assert r["completion"].tolist() == [0] * 14 + [1] * 3 + [0]
    assert r["old_logp"][14:17].tolist() == [-0.5, -1.0, -0.25] and r["old_logp"][:14].sum() == 0
    assert not r["warmup"] and r["advantage"] == -2.0
    assert g.row(pair, g.answer(pair))["warmup"]
    longest = len(g.prompt(9999)) + len(g.answer(9999))  # 99+99=198
    assert longest == g.LENGTH


@pytest.mark.slow
def test_a_run_killed_mid_iteration_resumes_exactly(tmp_path, monkeypatch):
    g = example()
    whole, trainer, whole_log = run(g, monkeypatch, tmp_path / "whole", iterations=3)
    assert whole == {"first_epoch": 0, "step": 5}  # 2 warm-up epochs + 3 iterations
    rewards = [row["reward"] for row in whole_log if "reward" in row]
    held_out = [row["heldout_accuracy"] for row in whole_log if "heldout_accuracy" in row]
    assert len(rewards) == 3 and len(held_out) == 4  # before each iteration, and at the end
    assert all(0 <= r <= 1 for r in rewards + held_out)
    # the sampler's log-probabilities against the trainer's, float32 on the same weights
    gaps = [row["logprob_mismatch_max"] for row in whole_log if "logprob_mismatch_max" in row]
    assert len(gaps) == 3 and all(0 <= g <= 1e-4 for g in gaps), gaps
    params = jax.device_get(trainer.state.params)

    # killed in the middle of the second iteration: its samples drawn, its update done,
    # its checkpoint not written
    with pytest.raises(Killed):
        run(g, monkeypatch, tmp_path / "stopped", iterations=3, kill_at=4)
    again, resumed, again_log = run(g, monkeypatch, tmp_path / "stopped", iterations=3)
    assert again == {"first_epoch": 3, "step": 5}  # from the checkpoint of step 3
    assert again_log == whole_log[-len(again_log):]  # the same samples and rewards
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params), params)


@pytest.mark.slow
def test_the_kl_penalty_scores_samples_on_the_warmup_model_and_resumes(tmp_path,
                                                                       monkeypatch):
    """--kl: every GRPO row carries its tokens' log-probabilities under the model as the
    warm-up left it, the same whatever the iteration (on its first, the policy's own);
    the frozen model is kept in the run's folder, so a run killed mid-iteration resumes
    to the same parameters."""
    g = example()
    # a reward that varies within groups at this size, so that the policy moves
    monkeypatch.setattr(g, "reward", lambda pair, message: float(sum(map(ord, message or "?")) % 2))
    batches, collate = {}, g.collate

    def recording(examples):  # an iteration's rows, as the Trainer collates them
        if "reference" in examples[0]:
            batches.setdefault(examples[0]["reference"].tobytes(), collate(examples))
        return collate(examples)
    monkeypatch.setattr(g, "collate", recording)
    args = [*TINY, "--iterations", "3", "--kl", "0.5"]
    _, whole, _ = run_loop(g, "grpo", args, tmp_path / "whole", monkeypatch)
    assert (tmp_path / "whole" / "warmup.npz").exists()
    firsts = list(batches.values())
    assert len(firsts) == 3 and all((b["kl"] == 0.5).all() for b in firsts)
    on = firsts[0]["completion"] > 0
    # the first iteration: the warm-up model is the policy (its recomputed ratio's base)
    np.testing.assert_array_equal(firsts[0]["reference"][on], firsts[0]["old_logp"][on])
    assert not np.array_equal(firsts[2]["reference"][on], firsts[2]["old_logp"][on])
    params = jax.device_get(whole.state.params)
    with pytest.raises(Killed):
        run_loop(g, "grpo", args, tmp_path / "stopped", monkeypatch, kill_at=4)
    _, resumed, _ = run_loop(g, "grpo", args, tmp_path / "stopped", monkeypatch)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params), params)
