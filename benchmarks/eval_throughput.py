"""lm-evaluation-harness log-likelihood requests per second: redray's model
(``redray.evaluation.RedrayLM``) against the harness's own Hugging Face backend (HFLM,
transformers' PyTorch model) on the same CPU, the same checkpoint and the same requests
(``eval/loglikelihood_over_hf``).

The checkpoint: a random LLaMA written by transformers (hidden 256, 4 layers, GPT-2's
tokenizer and vocabulary). The requests: contexts of 200 to 800 characters cut from
CPython's documentation (``pydoc_data.topics``), each with a continuation of its next
one to five words, as a multiple-choice task sends them. Both backends get the same
batch size; redray's compiles one program per padded length first (a warm-up call, not
timed; the harness's model needs none). Rounds alternate the two; the figure is the
ratio of the medians. The largest difference between the two backends' log-likelihoods
is reported beside it.

    python benchmarks/eval_throughput.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, machine, parser, repeat, save, simulate_devices, stats  # noqa: E402

simulate_devices(1)

import numpy as np  # noqa: E402

COMMAND = "python benchmarks/eval_throughput.py"


class Request:
    def __init__(self, *args):
        self.args = args


def requests(count: int, seed: int = 0) -> list[Request]:
    """(context, continuation) pairs from CPython's documentation."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics.values()).split())
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start = int(rng.integers(0, len(text) - 2000))
        cut = start + int(rng.integers(200, 800))
        words = text[cut:].split(" ")[1:1 + int(rng.integers(1, 6))]
        out.append(Request(text[start:cut], " " + " ".join(words)))
    return out


def checkpoint(folder: str) -> str:
    """The random LLaMA with GPT-2's tokenizer, written by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from redray.models import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(hf=True)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main(argv=None) -> None:
    import tempfile

    args = parser(__doc__).parse_args(argv)
    count, batch, rounds = (16, 8, 1) if args.tiny else (256, 16, 5)
    work = requests(count)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint(folder)
        from lm_eval.models.huggingface import HFLM

        from redray.evaluation import _source, lm_class

        factory, params, extra, tokenizer, _, _ = _source(None, folder, None, None)
        ours = lm_class()(factory, tokenizer, params=params, extra=extra, batch_size=batch,
                          max_length=512)
        hf = HFLM(pretrained=folder, device="cpu", batch_size=batch, dtype="float32")
        mine = ours.loglikelihood(work)  # compiles its programs
        theirs = hf.loglikelihood(work)
        difference = max(abs(a[0] - b[0]) for a, b in zip(mine, theirs))
        greedy_same = sum(a[1] == b[1] for a, b in zip(mine, theirs)) / len(work)
        timed = {"redray": [], "hf": []}
        for _ in range(rounds):  # alternating, so both see the same machine
            timed["redray"] += repeat(lambda: ours.loglikelihood(work), 1, warmup=0)
            timed["hf"] += repeat(lambda: hf.loglikelihood(work), 1, warmup=0)
    rate = {k: count / stats(v)["median"] for k, v in timed.items()}
    ratio = rate["redray"] / rate["hf"]
    print(f"redray {rate['redray']:.1f} requests/s, HF backend {rate['hf']:.1f}: {ratio:.2f}x; "
          f"largest log-likelihood difference {difference:.2g}")
    save([figure(
        "eval/loglikelihood_over_hf", ratio, "x",
        "log-likelihood requests per second through lm-eval's Hugging Face backend (HFLM, "
        "transformers' PyTorch model) on the same CPU, checkpoint, requests and batch size",
        ">= 2", COMMAND, requests=count, batch_size=batch, rounds=rounds,
        redray_requests_per_s=rate["redray"], hf_requests_per_s=rate["hf"],
        redray_s=stats(timed["redray"]), hf_s=stats(timed["hf"]),
        largest_loglikelihood_difference=difference, same_greedy=greedy_same,
        machine=machine())], args.out)


if __name__ == "__main__":
    main()
