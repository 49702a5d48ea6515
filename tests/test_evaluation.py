"""lm-evaluation-harness on redray's Predictor: log-likelihoods equal to transformers'
PyTorch model on the same tiny checkpoint, and two local tasks (multiple choice scored by
log-likelihood, generation scored by exact match) on a model-parallel plan scored as
transformers' outputs give. (A trained run scored on one device and on 2 hosts x 2
devices: tests/test_demo_finetune.py.)"""

import json
import os

import numpy as np
import pytest

from hf_tiny import gpt2_tokenizer, llama_folder

torch = pytest.importorskip("torch")
pytest.importorskip("lm_eval")

CHOICES = [  # question, choices, the index of the answer
    ("The capital of France is", [" Paris", " a cat", " blue"], 0),
    ("Two plus two makes", [" four", " Tuesday"], 0),
    ("Water is", [" wet", " a number", " loud", " made of paper"], 0),
    ("The sun rises in the", [" east", " fridge"], 1),
    ("Def f():", [" return", " banana"], 0),
    ("Once upon a", [" time", " chair", " seventeen"], 0),
]
PROMPTS = [("Say hi:", " hi"), ("Count: 1 2 3", " 4"), ("The opposite of up is", " down"),
           ("ABC", "D")]


def task_yaml(name, data, output, text, target, extra, metric) -> str:
    """One lm-eval task over a local JSON lines file."""
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output}
doc_to_text: "{{{{{text}}}}}"
doc_to_target: "{{{{{target}}}}}"
target_delimiter: ""
{extra}
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder) -> str:
    """The two tasks as lm-eval YAML over local JSON lines files; returns the folder."""
    folder.mkdir(exist_ok=True)
    with open(folder / "choice.jsonl", "w") as f:
        for question, choices, answer in CHOICES:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "echo.jsonl", "w") as f:
        for prompt, target in PROMPTS:
            f.write(json.dumps({"prompt": prompt, "target": target}) + "\n")
    (folder / "choice.yaml").write_text(task_yaml(
        "redray_choice", folder / "choice.jsonl", "multiple_choice", "question", "answer",
        'doc_to_choice: "{{choices}}"', "acc"))
    (folder / "echo.yaml").write_text(task_yaml(
        "redray_echo", folder / "echo.jsonl", "generate_until", "prompt", "target",
        'generation_kwargs: {until: ["\\n"], max_gen_toks: 4, do_sample: false}',
        "exact_match"))
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("tiny") / "llama", tokenizer=gpt2_tokenizer())


class Request:
    def __init__(self, *args):
        self.args = args


def torch_logprob(model, context, continuation):
    """transformers' summed log-probability of ``continuation`` tokens after ``context``
    tokens, and whether each is its greedy choice."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    rows = logp[len(context) - 1:len(context) - 1 + len(continuation)]
    value = sum(rows[j, t].item() for j, t in enumerate(continuation))
    return value, all(rows[j].argmax().item() == t for j, t in enumerate(continuation))


def test_log_likelihoods_equal_transformers_on_a_model_split_over_two_devices(checkpoint):
    from transformers import AutoModelForCausalLM

    from redray.evaluation import _source, lm_class

    factory, params, extra, tokenizer, _, _ = _source(None, checkpoint, None, None)
    lm = lm_class()(factory, tokenizer, params=params, extra=extra, batch_size=4,
                    max_length=128, model_axis=2)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    requests = [Request(q, c) for q, choices, _ in CHOICES for c in choices] + \
        [Request("", "A text without a context."), Request("Ends in spaces  ", "x")]
    got = lm.loglikelihood(requests)
    for request, (value, greedy) in zip(requests, got):
        context, continuation = lm._encode_pair(*request.args)
        expected, expected_greedy = torch_logprob(hf, context, continuation)
        assert value == pytest.approx(expected, abs=1e-4), request.args
        assert greedy == expected_greedy
    # the rolling log-likelihood of a text: its every token after a leading end-of-text
    text = "A longer text, scored as a whole by the rolling windows of the harness."
    tokens = tokenizer.encode(text)
    (rolled,) = lm.loglikelihood_rolling([Request(text)])
    assert rolled == pytest.approx(torch_logprob(hf, [tokenizer.eos_token_id], tokens)[0],
                                   abs=1e-4)


def test_two_local_tasks_score_as_transformers_outputs_give(
        checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import redray

    tasks = write_tasks(tmp_path / "tasks")
    samples = str(tmp_path / "samples.jsonl")
    split = redray.evaluate_tasks(["redray_choice", "redray_echo"], model=checkpoint,
                                  include_path=tasks, batch_size=4, model_axis=2,
                                  samples=samples)
    assert set(split) == {"redray_choice", "redray_echo"}

    hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    encode = lambda text: tokenizer.encode(text)  # noqa: E731
    # multiple choice: the choice transformers gives the highest log-likelihood
    right = [int(np.argmax([torch_logprob(hf, encode(q), encode(q + c)[len(encode(q)):])[0]
                            for c in choices]) == answer) for q, choices, answer in CHOICES]
    assert split["redray_choice"]["acc"] == pytest.approx(np.mean(right))
    # generation: transformers' greedy continuation, cut at the stop string
    matches = []
    for prompt, target in PROMPTS:
        ids = torch.tensor([encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=4, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:]).split("\n")[0]
        matches.append(float(text == target))
    assert split["redray_echo"]["exact_match"] == pytest.approx(np.mean(matches))
    # every example written out, each log-likelihood as transformers computes it
    rows = [json.loads(line) for line in open(samples)]
    assert len(rows) == len(CHOICES) + len(PROMPTS)
    for row in (r for r in rows if r["task"] == "redray_choice"):
        question, choices, _ = CHOICES[row["doc_id"]]
        for choice, response in zip(choices, row["responses"]):
            context = encode(question)
            expected = torch_logprob(hf, context, encode(question + choice)[len(context):])[0]
            assert response[0][0] == pytest.approx(expected, abs=1e-4)


def test_a_run_and_a_model_are_one_or_the_other(tmp_path):
    import redray

    with pytest.raises(ValueError, match="give one of run="):
        redray.evaluate_tasks(["x"])
    with pytest.raises(FileNotFoundError, match="no model config at"):
        redray.evaluate_tasks(["x"], run=str(tmp_path))
    assert os.path.isdir(tmp_path)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
          "{% if not loop.last or m['role'] != 'assistant' or add_generation_prompt %}"
          "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_redray_eval_with_the_chat_template_scores_as_lm_evals_own_model(tmp_path):
    """``redray eval --apply-chat-template`` (few-shot examples as turns, lm-eval's
    default with a template) on the two local tasks of an instruct checkpoint (a ChatML
    template, its end of turn the tokenizer's EOS): the scores, and every request the
    harness made, are those of lm-eval's own Hugging Face model with
    ``apply_chat_template=True`` on the same folder."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from redray.cli import main

    tokenizer = gpt2_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.chat_template = "<|im_end|>", CHATML
    folder = llama_folder(tmp_path / "instruct", tokenizer=tokenizer)
    tasks = write_tasks(tmp_path / "tasks")
    samples = str(tmp_path / "samples.jsonl")
    assert main(["eval", "--model", folder, "--tasks", "redray_choice,redray_echo",
                 "--include-path", tasks, "--num-fewshot", "1", "--apply-chat-template",
                 "--samples", samples, "--batch-size", "4", "--no-track"]) == 0
    ours = {}
    for line in open(samples):
        row = json.loads(line)
        ours[(row["task"], row["doc_id"])] = row
    theirs = lm_eval.simple_evaluate(
        model=HFLM(pretrained=folder, batch_size=4, device="cpu"),
        tasks=["redray_choice", "redray_echo"], task_manager=TaskManager(include_path=tasks),
        num_fewshot=1, apply_chat_template=True, log_samples=True, bootstrap_iters=0)
    for task, rows in theirs["samples"].items():
        for row in rows:
            mine = ours[(task, row["doc_id"])]
            # the same rendered requests: the template, the few-shot turns, the question
            assert [list(a)[:1] for a in mine["arguments"]] == \
                [[a[0]] for a in row["arguments"]]
            assert "<|im_start|>assistant\n" in row["arguments"][0][0]
            if task == "redray_choice":
                for (value, greedy), (want, want_greedy) in zip(
                        [r[0] for r in mine["responses"]], [r[0] for r in row["resps"]]):
                    assert value == pytest.approx(want, abs=1e-4) and greedy == want_greedy
            else:
                assert mine["responses"][0][0] == row["resps"][0][0]
