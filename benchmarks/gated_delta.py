"""Gated DeltaNet's training step against transformers' own PyTorch model, on this CPU.

``gated_delta/step_over_transformers_cpu``: transformers' ms per training step over
redray's (target >= 1.0: redray's step at least as fast), side by side in one run, the
same machine and threads (PyTorch on as many threads as the machine has cores, as
XLA:CPU uses).

The model is Qwen3.5-dense-shaped (``FULL``): hidden 1024, 8 layers (three Gated
DeltaNet layers to one gated full attention layer, twice), the linear layers with 16 key
and 16 value heads of 128 and a convolution of 4 tokens, the full ones with 8 query
heads and 2 key/value heads of 256, an MLP of 3584, a vocabulary of 4096 (the released
248,320 would make the step the LM head's), untied, float32. transformers 5.23's
``Qwen3_5ForCausalLM`` is built from that config with random weights and saved; both
sides load that checkpoint (redray's ``from_pretrained``, transformers'
``from_pretrained``). One row of 4096 tokens.

A step is what each framework's user runs: redray's ``Trainer.train_step`` on one
device (the next-token loss, AdamW); PyTorch's ``zero_grad``, the model's own
``labels=`` loss, ``backward`` and ``AdamW.step``. Without flash-linear-attention
(which needs a GPU), transformers runs its PyTorch chunked delta rule
(``torch_chunk_gated_delta_rule``) and its PyTorch causal convolution.

Each side runs in a process of its own (at 4096 tokens the two together exceed this
machine's 24 GiB): ``--rounds`` rounds, the two sides' order alternating, each process
one warm-up step then ``--steps`` timed ones; the medians of the steps' times, and each
process's peak resident memory.

    python benchmarks/gated_delta.py [--rounds 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, machine, parser, save, stats  # noqa: E402

COMMAND = "python benchmarks/gated_delta.py"
SIDES = ("redray", "transformers")
FULL = dict(vocab=4096, hidden=1024, layers=8, intermediate=3584, heads=8, kv_heads=2,
            head_dim=256, key_heads=16, value_heads=16, linear_dim=128, tokens=4096)
TINY = dict(vocab=128, hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2,
            head_dim=16, key_heads=2, value_heads=4, linear_dim=16, tokens=256)


def config(s: dict):
    from _lm import hybrid_config

    return hybrid_config(s["vocab"], s["hidden"], s["layers"], s["intermediate"], s["heads"],
                         s["kv_heads"], s["head_dim"], s["key_heads"], s["value_heads"],
                         s["linear_dim"], max_position_embeddings=s["tokens"])


def run_side(side: str, folder: str, s: dict, steps: int) -> dict:
    """One side's process: load ``folder``, one warm-up step, ``steps`` timed steps."""
    import resource

    import numpy as np

    ids = np.random.default_rng(0).integers(0, s["vocab"], (1, s["tokens"] + 1))
    lr, eps, decay = 1e-4, 1e-8, 0.01
    if side == "redray":
        import jax
        import optax

        import redray
        from redray.models import from_pretrained, next_token_loss

        def loss(model, batch, rng, train):
            return next_token_loss(model, batch["ids"], train=train)

        trainer = redray.Trainer.of(
            from_pretrained(folder), lambda rows: {"ids": np.stack([r["ids"] for r in rows])},
            loss, optax.adamw(lr, eps=eps, weight_decay=decay), batch_size=1,
            mesh=redray.make_mesh(devices=jax.devices()[:1]), progress=False)
        batch = {"ids": ids.astype(np.int32)}
        trainer.init([{"ids": ids[0].astype(np.int32)}])

        def step():
            jax.block_until_ready(trainer.train_step(batch))
    else:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count())
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, eps=eps, weight_decay=decay)
        # the model reads the same 4096 tokens on both sides (transformers shifts the
        # labels itself: 4095 predictions scored where redray scores 4096)
        inputs = torch.from_numpy(ids[:, :-1].astype(np.int64))

        def step():
            optimizer.zero_grad(set_to_none=True)
            hf(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
    step()  # compiled, warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"times": times, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = TINY if args.tiny else FULL
    if args.side:  # a side's own process: its times as the last line
        print(json.dumps(run_side(args.side, args.folder, s, args.steps)))
        return
    rounds = 1 if args.tiny else args.rounds

    import torch
    import transformers

    torch.manual_seed(0)
    times = {side: [] for side in SIDES}
    peak = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as folder:
        transformers.AutoModelForCausalLM.from_config(config(s)).float().save_pretrained(folder)
        for r in range(rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--side", side, "--folder",
                     folder, "--steps", str(args.steps)] + (["--tiny"] if args.tiny else []),
                    capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"the {side} side failed (exit {out.returncode}):\n"
                                     f"{out.stderr[-3000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                times[side] += got["times"]
                peak[side].append(got["peak_gb"])
                print(f"round {r} {side}: {[round(t, 2) for t in got['times']]} s, "
                      f"peak {got['peak_gb']:.1f} GB", flush=True)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    print(f"ms per step: redray {ms['redray']:.0f}, transformers {ms['transformers']:.0f}")
    save([figure(
        "gated_delta/step_over_transformers_cpu", ms["transformers"] / ms["redray"], "x",
        f"transformers {transformers.__version__}'s Qwen3_5ForCausalLM (PyTorch "
        f"{torch.__version__.split('+')[0]}, its chunked delta rule) on the same checkpoint, "
        f"tokens, optimizer and threads: ms per training step over redray's", ">= 1.0",
        COMMAND, ms=ms, seconds={k: stats(v) for k, v in times.items()},
        peak_resident_gb={k: max(v) for k, v in peak.items()}, model=s,
        threads=os.cpu_count(), machine=machine())], args.out)


if __name__ == "__main__":
    main()
