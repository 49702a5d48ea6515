"""Quickstart: a small causal language model, tensor-parallel on simulated CPU devices.

Trains a byte-level transformer on real English text that ships with CPython
(``pydoc_data.topics``), on 4 simulated CPU devices with the plan redray's planner
chooses (``--model-axis`` / ``--fsdp-axis`` pin one), and prints the plan, the sharding
and the eval perplexity before and after. Runs in about a minute on a 2-core laptop; no
download.

    python examples/quickstart/train.py [--steps 150] [--model-axis 2] [--devices 4]
"""

import argparse
import os
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="optimizer updates")
    ap.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    ap.add_argument("--model-axis", type=int, help="tensor-parallel size (default: planned)")
    ap.add_argument("--fsdp-axis", type=int, help="parameter-sharding size (default: planned)")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (bytes)")
    return ap.parse_args()


args = parse()
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (devices are configured above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402

import redray  # noqa: E402


class Block(nnx.Module):
    def __init__(self, dim, heads, rngs):
        self.heads = heads
        self.ln1, self.ln2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.LinearGeneral(dim, (3, heads, dim // heads), use_bias=False, rngs=rngs)
        self.o = nnx.LinearGeneral((heads, dim // heads), dim, axis=(-2, -1), use_bias=False,
                                   rngs=rngs)
        self.gate = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.moveaxis(self.qkv(self.ln1(x)), 2, 0)
        t = x.shape[1]
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        x = x + self.o(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v))
        h = self.ln2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class ByteLM(nnx.Module):
    def __init__(self, rngs, dim=128, heads=4, layers=2, seq=64):
        self.embed = nnx.Embed(256, dim, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
        self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def collate(examples):
    return {"ids": np.stack([np.frombuffer(e.encode("latin-1"), np.uint8) for e in examples]
                            ).astype(np.int32)}


def loss(model, batch, rng, train):
    logits = model(batch["ids"][:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def main():
    text = "\n".join(topics[k] for k in sorted(topics)).encode("latin1", "replace").decode("latin1")
    n = len(text) // args.seq
    chunks = [text[i * args.seq:(i + 1) * args.seq] for i in range(n)]
    train, evals = chunks[: int(n * 0.95)], chunks[int(n * 0.95):][:256]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, args.steps)
    trainer = redray.Trainer.of(
        lambda rngs: ByteLM(rngs, seq=args.seq), collate, loss, optax.adamw(schedule),
        batch_size=args.batch_size, model_axis=args.model_axis, fsdp_axis=args.fsdp_axis,
        learning_rate=schedule, log_every=10)
    trainer.init(train)
    print(trainer.placement())
    before = trainer.evaluate(evals)["loss"]
    print(f"eval perplexity before: {np.exp(before):.2f} (bytes)")
    trainer.fit(train, epochs=1, max_steps=args.steps)
    after = trainer.evaluate(evals)["loss"]
    print(f"eval perplexity after {args.steps} steps: {np.exp(after):.2f} (bytes)")
    return 0 if after < before else 1


if __name__ == "__main__":
    sys.exit(main())
