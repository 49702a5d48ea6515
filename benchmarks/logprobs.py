"""The sampler's log-probabilities against the trainer's recomputation of the same
tokens (``rl/logprob_mismatch_max/float32``, ``.../bfloat16``).

A policy-gradient ratio divides the trainer's probability of a sampled token by the
sampler's. Where the two disagree for the same weights (a dtype, a kernel, a cache
read in another order), the ratio is off by as much before any update: the mismatch
RL frameworks' users report most. Here: ``sampler.py``'s random LLaMA (hidden 256, 4
layers), 128 prompts of 16 to 32 tokens through 32 slots (refilled inside the decoding
loop), 8 to 64 new tokens each at temperature 1; each completion's tokens then scored
by ``token_logprobs`` (the trainer's forward pass over prompt and completion, at the
same temperature) and compared with ``Completion.logprobs``
(``redray.post_training.logprob_mismatch``: the mean and the largest absolute
difference over the completions' tokens). Once with float32 weights and computation,
once with bfloat16 (the weights cast, as an inference checkpoint holds them).

    python benchmarks/logprobs.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, machine, parser, save  # noqa: E402
from sampler import FULL, TINY, built, workload  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

COMMAND = "python benchmarks/logprobs.py"


def mismatch(s: dict, bf16: bool, slots: int) -> dict:
    """The mismatch of the sampler's log-probabilities with ``token_logprobs``'."""
    from redray.post_training import (Sampler, SamplingParams, logprob_mismatch,
                                      token_logprobs)

    _, model = built(s, bf16)
    prompts, lengths = workload(s, s["base"])
    lengths = [min(n, 8 * s["base"]) for n in lengths]
    width = max(map(len, prompts)) + max(lengths)
    sampler = Sampler(model, slots=slots, max_length=-(-width // 16) * 16, seed=7)
    done = sampler.sample(prompts, [SamplingParams(n, temperature=1.0) for n in lengths])
    ids = np.zeros((len(prompts), width), np.int32)
    mask, sampled = np.zeros(ids.shape), np.zeros(ids.shape)
    for i, (p, c) in enumerate(zip(prompts, done)):
        row = [*p, *c.tokens]
        ids[i, :len(row)] = row
        mask[i, len(p):len(row)] = 1
        sampled[i, len(p):len(row)] = c.logprobs
    recomputed = np.asarray(jax.jit(lambda m, x: token_logprobs(m, x, temperature=1.0))(
        model, ids))
    return dict(logprob_mismatch(sampled, recomputed, mask), tokens=int(mask.sum()),
                refilled_on_device=len(prompts) > slots)


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    s = dict(TINY if args.tiny else FULL, prompts=16 if args.tiny else 128)
    slots = 4 if args.tiny else 32
    out = []
    for dtype, bf16, target in (("float32", False, "<= 0.0001"), ("bfloat16", True, None)):
        found = mismatch(s, bf16, slots)
        print(f"{dtype}: mean {found['mean']:.3g}, max {found['max']:.3g} over "
              f"{found['tokens']} tokens")
        out.append(figure(
            f"rl/logprob_mismatch_max/{dtype}", found["max"], "nats",
            f"Sampler's log-probability of each sampled token against token_logprobs' "
            f"recomputation, {dtype}, the largest absolute difference", target, COMMAND,
            **found, slots=slots, prompts=s["prompts"], backend=jax.default_backend(),
            machine=machine()))
    save(out, args.out)


if __name__ == "__main__":
    main()
