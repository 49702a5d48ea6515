"""Gated DeltaNet's training step against transformers' own PyTorch model, on this CPU.

``gated_delta/step_over_transformers_cpu``: transformers' ms per training step over
redray's (target >= 1.0: redray's step at least as fast), side by side in one process,
the same machine and threads (PyTorch on as many threads as the machine has cores, as
XLA:CPU uses).

The model is Qwen3.5-dense-shaped (``FULL``): hidden 1024, 8 layers (three Gated
DeltaNet layers to one gated full attention layer, twice), the linear layers with 16 key
and 16 value heads of 128 and a convolution of 4 tokens, the full ones with 8 query
heads and 2 key/value heads of 256, an MLP of 3584, a vocabulary of 4096 (the released
248,320 would make the step the LM head's), untied, float32. transformers 5.23's
``Qwen3_5ForCausalLM`` is built from that config with random weights and saved;
redray loads the same checkpoint (``from_pretrained``). One row of 4096 tokens.

A step is what each framework's user runs: redray's ``Trainer.train_step`` on one
device (the next-token loss, AdamW); PyTorch's ``zero_grad``, the model's own
``labels=`` loss, ``backward`` and ``AdamW.step``. Without flash-linear-attention
(which needs a GPU), transformers runs its PyTorch chunked delta rule
(``torch_chunk_gated_delta_rule``) and its PyTorch causal convolution. One warm-up step
each, then ``--rounds`` rounds alternating the two frameworks' order, ``--steps`` steps
each; the medians of the steps' times.

    python benchmarks/gated_delta.py [--rounds 3] [--steps 2]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, machine, parser, save, stats  # noqa: E402

COMMAND = "python benchmarks/gated_delta.py"
FULL = dict(vocab=4096, hidden=1024, layers=8, intermediate=3584, heads=8, kv_heads=2,
            head_dim=256, key_heads=16, value_heads=16, linear_dim=128, tokens=4096)
TINY = dict(vocab=128, hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2,
            head_dim=16, key_heads=2, value_heads=4, linear_dim=16, tokens=256)


def config(s: dict):
    from _lm import hybrid_config

    return hybrid_config(s["vocab"], s["hidden"], s["layers"], s["intermediate"], s["heads"],
                         s["kv_heads"], s["head_dim"], s["key_heads"], s["value_heads"],
                         s["linear_dim"], max_position_embeddings=s["tokens"])


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
    args = ap.parse_args(argv)
    s = TINY if args.tiny else FULL
    rounds = 1 if args.tiny else args.rounds

    import jax
    import numpy as np
    import optax
    import torch
    import transformers

    import redray
    from redray.models import from_pretrained, next_token_loss

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config(s)).float().train()
    ids = np.random.default_rng(0).integers(0, s["vocab"], (1, s["tokens"] + 1))
    lr, eps, decay = 1e-4, 1e-8, 0.01
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model = from_pretrained(folder)

    def loss(model, batch, rng, train):
        return next_token_loss(model, batch["ids"], train=train)

    trainer = redray.Trainer(
        model, lambda rows: {"ids": np.stack([r["ids"] for r in rows])}, loss,
        optax.adamw(lr, eps=eps, weight_decay=decay), batch_size=1,
        mesh=redray.make_mesh(devices=jax.devices()[:1]), progress=False)
    batch = {"ids": ids.astype(np.int32)}
    trainer.init([{"ids": ids[0].astype(np.int32)}])
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, eps=eps, weight_decay=decay)
    # the model reads the same 4096 tokens on both sides (transformers shifts the labels
    # itself: 4095 predictions scored where redray scores 4096)
    inputs = torch.from_numpy(ids[:, :-1].astype(np.int64))

    def redray_step():
        jax.block_until_ready(trainer.train_step(batch))

    def torch_step():
        optimizer.zero_grad(set_to_none=True)
        hf(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()

    sides = {"redray": redray_step, "transformers": torch_step}
    for step in sides.values():  # compiled, warm
        step()
    times = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            for _ in range(args.steps):
                start = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - start)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    per_round = [t / r for t, r in zip(times["transformers"], times["redray"])]
    print(f"ms per step: redray {ms['redray']:.0f}, transformers {ms['transformers']:.0f}")
    save([figure(
        "gated_delta/step_over_transformers_cpu", ms["transformers"] / ms["redray"], "x",
        f"transformers {transformers.__version__}'s Qwen3_5ForCausalLM (PyTorch "
        f"{torch.__version__.split('+')[0]}, its chunked delta rule) on the same checkpoint, "
        f"tokens, optimizer and threads: ms per training step over redray's", ">= 1.0",
        COMMAND, ms=ms, seconds={k: stats(v) for k, v in times.items()},
        ratio_per_step=stats(per_round), model=s, threads=os.cpu_count(),
        torch_threads=torch.get_num_threads(), machine=machine())], args.out)


if __name__ == "__main__":
    main()
