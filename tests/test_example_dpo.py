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
    tok = d.TOKENIZER

    def said(text, end=True):  # an answer's tokens, ended by the end-of-turn token
        return tok.encode(text, add_special_tokens=False) + ([d.EOT] if end else [])
    r = d.row(3745, d.answer(3745), said("83"), reference=(-1.5, -2.5))  # 37+45=82, 83
    head = list(d.prompt(3745))
    assert tok.decode(head) == "<|im_start|>user\n37+45=<|im_end|>\n<|im_start|>assistant\n"
    assert r["chosen"].tolist() == head + said("82") + [d.PAD]
    assert r["rejected"].tolist() == head + said("83") + [d.PAD]
    assert r["chosen_mask"].tolist() == r["rejected_mask"].tolist() == [0] * 14 + [1] * 3 + [0]
    assert r["reference"].tolist() == [-1.5, -2.5] and not r["warmup"]
    # the judge reads the decoded messages (None: cut before the end of turn)
    messages = d.messages([said("82"), said("79"), said("102"), said("82", end=False),
                           [d.EOT], said("8+"), said("8") + [d.PAD]], tok, d.STOP)
    assert messages == ["82", "79", "102", None, "", "8+", "8"]
    assert [d.judge(3745, m) for m in messages] == [0, -3, -20, -1000, -1000, -1000, -74]
    cut = d.row(3745, d.answer(3745), said("9999", end=False))  # cut at 4 tokens
    assert cut["rejected"].tolist() == head + said("9999", end=False)
    assert cut["rejected_mask"].tolist() == [0] * 14 + [1] * 4


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
        for i, chosen in enumerate(rows["chosen"]):  # the prompt, an answer, padding
            start = int(np.argmax(rows["chosen_mask"][i]))
            a, b = d.TOKENIZER.decode(chosen[:start]).split("\n")[1].split("=")[0].split("+")
            pair = int(a) * 100 + int(b)
            assert list(chosen[:start]) == d.prompt(pair)
            assert (rows["rejected"][i, :start] == chosen[:start]).all()
            keys = ("chosen", "rejected")
            assert all(rows[k + "_mask"][i, :start].sum() == 0 for k in keys)
            answers = d.messages([rows[k][i][rows[k + "_mask"][i] == 1] for k in keys],
                                 d.TOKENIZER, d.STOP)
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
