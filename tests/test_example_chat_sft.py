"""examples/chat_sft: a tiny transformers checkpoint with a ChatML template fine-tuned on
the shipped conversations, the loss on the assistant's turns only; the held-out
assistant-token loss falls, and the exported folder, served by transformers'
text-generation pipeline, answers a held-out question with the tokens redray's sampler
gives (both stop on the end-of-turn token its generation_config.json names)."""

import json
import os
import subprocess
import sys

import pytest

from hf_tiny import ROOT, gpt2_tokenizer, llama_folder



@pytest.mark.slow
@pytest.mark.ray
def test_chat_fine_tuning_learns_the_answers_and_transformers_serves_the_export(tmp_path,
                                                                                local_ray):
    import transformers

    import redray.models as rm
    from redray.data import chat
    from redray.post_training import Sampler, SamplingParams

    tokenizer = gpt2_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = chat.CHATML
    folder = llama_folder(tmp_path / "instruct", tokenizer=tokenizer)
    runs = str(tmp_path / "runs")
    done = subprocess.run(
        [sys.executable, "examples/chat_sft/train.py", "--model", folder, "--steps", "12",
         "--hosts", "1", "--storage", runs, "--name", "chat"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    numbers = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert numbers["step"] == 12 and numbers["loss_after"] < numbers["loss_before"]

    exported = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "redray.cli", "export", "chat", "--storage",
                           runs, "--to", str(exported)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = transformers.GenerationConfig.from_pretrained(str(exported))
    assert end in ([generation.eos_token_id] if isinstance(generation.eos_token_id, int)
                   else generation.eos_token_id)

    with open(os.path.join(ROOT, "examples", "chat_sft", "conversations.jsonl")) as f:
        held_out = json.loads(f.readlines()[5])["messages"]  # every tenth from the 6th
    question = held_out[:[m["role"] for m in held_out].index("assistant")]
    served = transformers.pipeline("text-generation", model=str(exported), device="cpu")
    answer = served(question, max_new_tokens=12, do_sample=False, return_tensors=True)
    theirs = list(answer[0]["generated_token_ids"])
    prompt = chat.render_prompt(question, served.tokenizer)
    assert theirs[:len(prompt)] == prompt  # the pipeline renders the prompt as redray does
    sampler = Sampler(rm.from_pretrained(str(exported)), slots=4, max_length=64)
    (ours,) = sampler.sample([prompt], SamplingParams(max_new_tokens=12))
    assert list(ours.tokens) == theirs[len(prompt):]
