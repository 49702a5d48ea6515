"""examples/dpo's loop at a tiny size, in this process (the loop ``redray.run`` runs on a
host): its rows hold what the loss reads, its pairs are the model's own answers ranked by
the judge, and a run killed in its first DPO epoch (an exception after an optimizer
step: the work since the last checkpoint lost) and started again trains exactly as one
that never stopped: the pairs and the reference's log-probabilities, made once when the
warm-up ends, come back from the run's folder, not from the model the run resumes with."""

import jax
import numpy as np
import pytest

from example_runs import Killed, example_module, run_loop

TINY = ["--warmup", "2", "--prompts", "256"]


def run(module, monkeypatch, folder, epochs, kill_at=None):
    return run_loop(module, "dpo", [*TINY, "--epochs", str(epochs)], folder, monkeypatch,
                    kill_at)


def saved_pairs(module, folder):
    """The run's pairs.npy: its held-out and training pairs, each stacked field by field."""
    saved = np.load(folder / "pairs.npy", allow_pickle=True).item()
    return {name: module.collate(rows) for name, rows in saved.items()}


def test_a_row_is_a_prompt_with_two_answers_masked_and_the_judge_ranks_answers():
    d = example_module("dpo")
    r = d.row(3745, d.answer(3745), [8, 3, d.EOS], reference=(-1.5, -2.5))  # 37+45=82, 83
    head = [d.BOS, 3, 7, 10, 4, 5, 11]
    assert r["chosen"].tolist() == head + [8, 2, d.EOS, d.PAD, d.PAD]
    assert r["rejected"].tolist() == head + [8, 3, d.EOS, d.PAD, d.PAD]
    assert r["chosen_mask"].tolist() == r["rejected_mask"].tolist() == [0] * 7 + [1] * 3 + [0] * 2
    assert r["reference"].tolist() == [-1.5, -2.5] and not r["warmup"]
    assert d.judge(3745, [8, 2, d.EOS]) == 0 and d.judge(3745, [7, 9, d.EOS]) == -3
    assert d.judge(3745, [1, 0, 2, d.EOS]) == -20
    for unreadable in ([8, 2], [d.EOS], [8, 10, d.EOS], [8, d.EOS, d.PAD], []):
        assert d.judge(3745, unreadable) == -1000
    odd = d.row(3745, d.answer(3745), [8, d.PAD, d.EOS])  # a sampled PAD counts as answer
    assert odd["rejected_mask"].tolist() == [0] * 7 + [1] * 3 + [0] * 2
    cut = d.row(3745, d.answer(3745), [9, 9, 9, 9])  # a sampled answer cut at 4 tokens
    assert cut["rejected"].tolist() == head + [9, 9, 9, 9, d.PAD]
    assert cut["rejected_mask"].tolist() == [0] * 7 + [1] * 4 + [0]


@pytest.mark.slow
def test_a_killed_run_resumes_exactly_with_its_saved_pairs(tmp_path, monkeypatch):
    d = example_module("dpo")
    whole, trainer, whole_log = run(d, monkeypatch, tmp_path / "whole", epochs=3)
    assert whole == {"first_epoch": 0, "step": 10}  # (2 warm-up + 3 DPO epochs) x 2 updates
    accuracy = [row["preference_accuracy"] for row in whole_log if "preference_accuracy" in row]
    assert len(accuracy) == 4 and all(0 <= a <= 1 for a in accuracy)
    pairs = saved_pairs(d, tmp_path / "whole")
    for rows in pairs.values():  # two of the model's answers, the judge's better one chosen
        assert len(rows["chosen"]) > 0
        for i, chosen in enumerate(rows["chosen"]):  # BOS a+b= answer, padded
            a, b = "".join(d.CHARS[t] for t in chosen if t < len(d.CHARS)).split("=")[0].split("+")
            start, pair = len(a) + len(b) + 3, int(a) * 100 + int(b)
            assert (rows["rejected"][i, :start] == chosen[:start]).all()
            keys = ("chosen", "rejected")
            assert all(rows[k + "_mask"][i, :start].sum() == 0 for k in keys)
            answers = [rows[k][i][rows[k + "_mask"][i] == 1].tolist() for k in keys]
            assert d.judge(pair, answers[0]) > d.judge(pair, answers[1])
    params = jax.device_get(trainer.state.params)

    # killed after the first update of the second DPO epoch (step 7 of 10)
    with pytest.raises(Killed):
        run(d, monkeypatch, tmp_path / "stopped", epochs=3, kill_at=7)
    stopped = saved_pairs(d, tmp_path / "stopped")
    for name in pairs:
        jax.tree.map(np.testing.assert_array_equal, stopped[name], pairs[name])
    again, resumed, again_log = run(d, monkeypatch, tmp_path / "stopped", epochs=3)
    assert again == {"first_epoch": 3, "step": 10}  # from the checkpoint of step 6
    assert again_log == whole_log[-len(again_log):]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params), params)
