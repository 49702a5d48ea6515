"""GPU: the continuous-batching sampler against redray's ``generate`` and transformers'
``generate`` on one GPU (``gpu_sampler/...``), on ``sampler.py``'s workload.

The workload is ``sampler.py``'s: 64 prompts of 16 to 32 tokens, completions of 8 to
128 tokens spread evenly on a log scale (``--base`` sets the shortest), greedy, all 64
in flight (``--slots``). It runs with two models, one after the other:

- ``small``: ``sampler.py``'s float32 LLaMA (hidden 256, 4 layers). This is the CPU
  figure's model moved to the GPU, where each decoding step costs its kernel launches
  more than its arithmetic;
- ``1b``: TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 query and 4 key/value heads,
  vocabulary 32000), with bfloat16 weights and computation, as an inference checkpoint
  is served. A step reads 2.2 GB of weights, so its time hardly depends on the number of
  rows.

Samplers built otherwise (``--variants``: ``;``-separated lists of ``Sampler``
keyword arguments; by default one checking after every step and one narrowing its
batch as rows end, the CPU's defaults) run in the same rounds; their ratios to ``generate``
are in the figures' detail. transformers' ``generate`` runs on the same GPU with its
static cache and no ``torch.compile``, which is how its documentation's plain call
runs. ``run_all.py`` skips ``gpu_*`` scripts. ``--tiny`` runs tiny models on any
backend (CPU included) to check the script; its figures measure nothing.

    python benchmarks/gpu_sampler.py [--rounds 5] [--base 8] [--slots 64] [--sizes small,1b]
                                     [--variants "check_every=1;narrow=true"] [--prompts 256]

With ``--prompts`` above ``--slots`` (``--prompts 256``: ``sampler.py``'s refill
workload), the reference decodes static batches of ``--slots`` prompts, each to its own
longest completion, and the sampler refills its slots; the detail holds each Sampler's
compiled calls and reads of device values per completion (``round_trips_per_completion``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser, save  # noqa: E402
from sampler import FULL, TINY, figures, measure  # noqa: E402

COMMAND = "python benchmarks/gpu_sampler.py"
SIZES = {  # (model and workload, bfloat16)
    "small": (FULL, False),
    "1b": (dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4,
                prompts=64, base=8), True),
}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--base", type=int, help="the shortest completion (default: 8 tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="small,1b")
    ap.add_argument("--variants", default="check_every=1;narrow=true")
    ap.add_argument("--prompts", type=int, help="requests (default: 64, as many as slots; "
                    "more: the refill workload, figures ..._refills_SIZE)")
    args = ap.parse_args(argv)
    variants = {v: dict(map(keyword, v.split(","))) for v in args.variants.split(";") if v}
    out = []
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size!r} (known: {', '.join(SIZES)})")
        s, bf16 = SIZES[size]
        s = TINY if args.tiny else s
        slots = min(args.slots, s["prompts"])
        s = dict(s, prompts=args.prompts or s["prompts"])
        per_s, detail = measure(s, args.base or s["base"], slots,
                                1 if args.tiny else args.rounds, bf16=bf16,
                                variants=variants)
        refills = s["prompts"] > slots
        command = COMMAND + (f" --prompts {s['prompts']}" if refills else "")
        out += figures("gpu_sampler", ("_refills" if refills else "") + f"_{size}", per_s,
                       detail | dict(size=size), command,
                       ">= 2" if refills and size == "1b" else None)
        save(out, args.out)  # each size's figures kept as soon as they exist


def keyword(text: str) -> tuple[str, object]:
    """``"name=value"`` -> (name, value as an int, a bool or else a string:
    ``kv_cache=paged``)."""
    name, _, value = text.partition("=")
    low = value.strip().lower()
    if low in ("true", "false"):
        return name.strip(), low == "true"
    return name.strip(), int(value) if low.lstrip("-").isdigit() else value.strip()


if __name__ == "__main__":
    main()
